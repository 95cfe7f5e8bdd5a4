// Store: one optimizer instance of one rank, kept on local NVMe.
//
// A store is a directory:
//   <path>/IDENTITY          format version, uuid, job, name, chunk size, data dirs (JSON;
//                            a data dir inside <path> is recorded relative to it)
//   <path>/LOCK              flock'ed by the one process that has it open read-write;
//                            holds that process's pid (named in the Busy error)
//   <path>/index/            RocksDB: tensors, generations, snapshots, chunk maps,
//                            checksums, lifetime counters
//   <path>/leases/           reader leases (one small file per lease) + .lock
//   <path>/COMMITTED         the newest acknowledged generation (two checksummed slots)
//   <path>/RETAINED          the generations GC keeps (checksummed; rewritten under the
//                            exclusive lease flock around each GC batch and at open)
//   <data_dir>/<uuid>.chunks preallocated data file per data directory (default
//                            data dir: <path>/data); chunks striped across dirs
//   <data_dir>/<uuid>.owner  the store directory that writes that data file (path,
//                            dev/ino) and the data file's own identity (dev/ino/birth)
//
// Copies and moves. A store directory whose data dirs lie inside it (the
// default) can be copied (`cp -a`, while no writer has it open) and moved: the
// copy is a separate store that writes only its own data files. A store with
// an external data dir (given at Create, e.g. a second NVMe drive) can be
// moved within its file system, but a copy of its directory would share the
// external data file: Open of the copy is refused (kFailedPrecondition, or
// kBusy while the original is open), saying how to make an independent copy
// (a checkpoint copied from the mount, imported with optstate-restore). Two
// processes can never write one data file: the writer flocks each of its data
// files while it has the store open, and refuses a data file whose owner
// record names another store directory for the very same file (same inode and
// birth time), or that has more than one hard link. Stores written by older
// versions (absolute data dirs) keep working and are rewritten relative at the
// first read-write open; one whose recorded data dir lies inside another store
// directory, with no copy of it here, is refused.
//
// Model. A virtual tensor (one parameter shard) has `numel` elements in each of
// its named fields (the optimizer uses main, exp_avg, exp_avg_sq; fp32). Each
// field is cut into chunks of chunk_size_bytes (a multiple of 2 MiB); the last
// may be partial. A chunk never written reads as zeros with no I/O.
//
// Generations (copy-on-write). Writes go to a fresh extent (a chunk-size slot in
// a data file), never over one a committed generation, snapshot or reader lease
// still references. Commit() makes the new extents durable (fdatasync), then
// publishes the new chunk versions, per-group and per-tensor step counts,
// hyperparameters and the step number in one synced RocksDB WriteBatch. After
// a crash at any instant Open() yields the last committed generation bit-exact; the extents of
// the uncommitted one are free again (free space is derived from the index at
// Open, never stored). A failed fsync poisons the store until reopen.
//
// Snapshots pin a committed generation by name (O(1)). GC frees every extent
// that no retained generation (the latest `retained_generations`), snapshot or
// lease can see. Disk use in steady state <= 2x live + snapshot-unique bytes +
// the preallocation step.
//
// Readers. OpenReadOnly() opens the index as a RocksDB secondary instance: it
// never takes LOCK, works while a trainer has the store open (CatchUp() follows
// it) and after the trainer died; the secondary instance's directory is
// /tmp/optstate-secondary-<pid>-..., flock'ed while its reader lives, and the
// next read-only open of any store removes those of readers that died.
// OpenGeneration() returns a GenerationView that
// holds a lease on that generation: while it lives, the writer's GC keeps every
// extent it references. A lease file is made under a shared flock on
// leases/.lock and, under the same flock, checked against RETAINED; GC lists
// leases and writes RETAINED under the exclusive flock, so a generation is
// either leased before GC looks or already gone from RETAINED when the reader
// checks (then the reader retries with the newer latest). A lease is alive
// exactly as long as its reader holds the flock of its lease file: the kernel
// drops it when the reader's process ends, however it ends (SIGKILL, a zombie
// not yet waited for, another pid namespace), and GC removes every lease file
// it can lock. Open (read-write) runs GC, so the space that dead readers' or
// released leases held is reclaimed at the next open without waiting for a
// commit. Verify() leases every generation it reads (those the writer
// collects first are skipped and counted), so it never reads an extent a
// running writer reuses. The secondary
// instance itself is not trusted to be current (it can show an older state
// after the writer flushes or reopens): each catch-up must show at least the
// generation COMMITTED acknowledges, never less than before, and the index
// digest recorded with the generation; otherwise the secondary is reopened.
//
// A store on a read-only filesystem. A reader cannot make its lease files
// there. Where the filesystem itself is read-only (its superblock: a `mount -o
// ro` or `remount,ro`, a read-only medium), nothing anywhere can write the
// store, so no writer and no GC exist to keep a generation from: OpenReadOnly
// then reads without leases. Where only the reader's mount is read-only (a
// read-only bind mount of a writable filesystem), a writer through another
// mount could collect what a reader reads: OpenReadOnly refuses, saying so
// (CheckReaderFilesystem).
//
// Every chunk carries an XXH3-64 of its logical bytes, verified on every read:
// a mismatch is kCorruption naming store, tensor, field, chunk and generation.
//
// Damage. Open (read-write) refuses a store whose index holds committed
// generations while COMMITTED is missing, empty, truncated or holds no valid
// slot (no crash leaves it so), or acknowledges a generation the index lacks;
// the error says what is damaged and what to do: restore a copied checkpoint
// into a new store, or, when Verify finds nothing else, accept the index as it
// is by creating <path>/COMMITTED.accept-index (removed once COMMITTED is
// rewritten). Verify (read-only too) reports the same, and a damaged or
// incomplete RETAINED (rewritten by the next read-write open).
//
// Thread-safety: Store and GenerationView methods are thread-safe. A ChunkIo
// is used by one thread at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "vfs/file_system.h"

namespace optstate::vfs {

inline constexpr uint64_t kMiB = 1ull << 20;
inline constexpr uint64_t kChunkAlignBytes = 2 * kMiB;   // CUDA VMM granularity
inline constexpr uint64_t kDefaultChunkBytes = 8 * kMiB; // README "Defaults"
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint64_t kLatest = UINT64_MAX;          // "the newest committed generation"

// A field's element dtype is optstate::DType (base/dtype.h). A q8s/q8u field
// decodes with the fp32 absmax of each block of kQ8BlockElems elements, which
// another field of the tensor holds, named Q8ScalesField(codes field); the
// maps are kernels::Q8MapValue's (docs/MOMENTS.md).

// Elements per scale of a q8 field (one fp32 absmax per 256 elements).
using optstate::kQ8BlockElems;
// The field holding the scales of q8 field `codes`: "<codes>.absmax".
std::string Q8ScalesField(std::string_view codes);

struct FieldSpec {
  std::string name;              // "main", "exp_avg", "exp_avg_sq", ...
  DType dtype = DType::kF32;
  // Elements of the field. 0 (default) = the tensor's numel.
  uint64_t numel = 0;
  // Bytes of the field per chunk: chunk c holds bytes [c x chunk_bytes,
  // (c + 1) x chunk_bytes) of the field. 0 (default) = the store's chunk
  // size; else a multiple of 4096 that is at most the chunk size (a shorter
  // chunk is stored in a piece of a slot). Lets fields of different element
  // sizes cut the same elements into chunk c (a q8 tensor's scales: chunk
  // size / 64 bytes = the blocks of one codes chunk).
  uint64_t chunk_bytes = 0;
};
// main, exp_avg, exp_avg_sq, all f32.
std::vector<FieldSpec> AdamFields();
// The fields of a tensor with 8-bit block-scaled Adam moments in a store of
// chunk_size_bytes: main (f32), exp_avg (q8s), exp_avg_sq (q8u) with one
// byte per element in chunks of chunk_size_bytes, and exp_avg.absmax /
// exp_avg_sq.absmax (f32, ceil(numel / 256) elements, chunks of
// chunk_size_bytes / 64): chunk c of every field covers the same elements.
std::vector<FieldSpec> AdamQ8Fields(uint64_t numel, uint64_t chunk_size_bytes);

struct TensorSpec {
  std::string name;              // any UTF-8 except NUL, 1..4096 bytes
  DType dtype = DType::kF32;     // the model parameter's dtype (informational)
  uint64_t numel = 0;
  uint32_t group = 0;
  std::vector<uint64_t> shape;         // local shard shape; empty = {numel}
  std::vector<uint64_t> global_shape;  // empty = shape
  // The shard's box in the global tensor: [shard_offset, shard_offset + shape).
  // Or, when shape and shard_offset are 1-D and global_shape is not, the flat
  // range [shard_offset[0], shard_offset[0] + numel) of global_shape's
  // row-major flattening (a distributed optimizer's flat-buffer shard).
  std::vector<uint64_t> shard_offset;  // empty = zeros of global_shape's rank
  std::vector<FieldSpec> fields;       // empty = AdamFields()

  // Field geometry (fields[field]; 0 for a field index out of range).
  uint64_t field_numel(uint32_t field) const;        // FieldSpec::numel or numel
  uint64_t field_bytes(uint32_t field) const;        // field_numel x dtype size
  // FieldSpec::chunk_bytes, or store_chunk_bytes where it is 0.
  uint64_t field_chunk_bytes(uint32_t field, uint64_t store_chunk_bytes) const;
  uint64_t field_chunk_count(uint32_t field, uint64_t store_chunk_bytes) const;
  // Index of the field named `name`, or -1.
  int FieldIndexOf(std::string_view name) const;
};

// Checks a tensor's fields for a store of chunk_size_bytes: names (non-empty,
// no NUL or '/', unique), chunk_bytes (0, or a multiple of 4096 <= the chunk
// size), and each q8 field's scales: a field Q8ScalesField(name), f32, with
// ceil(field numel / 256) elements, in chunks of 1/64 of the codes field's
// chunk bytes (so chunk c of both covers the same elements). Errors name
// `where`, the tensor and the field.
Status ValidateFields(const TensorSpec& spec, uint64_t chunk_size_bytes, std::string_view where);

struct TensorInfo : TensorSpec {
  uint32_t id = 0;                   // stable within the store
  uint64_t created_generation = 0;   // first generation that contains it
  // First generation that no longer contains it (Store::DropTensors); 0 = not
  // dropped. Generations in [created_generation, dropped_generation) still
  // show it, with its chunks, as they were committed.
  uint64_t dropped_generation = 0;
};

// A parameter group as persisted with each generation. Hyperparameters are a
// name -> value map so that vfs stays optimizer-agnostic (memmgr writes lr,
// beta1, beta2, eps, weight_decay, adamw).
struct GroupInfo {
  uint32_t id = 0;
  uint64_t step_count = 0;
  std::map<std::string, double> hyper;
};

// Per-tensor step counts. torch's optimizers count steps per param (a param
// without a gradient in a step keeps its count), so a generation records the
// count of every tensor: GroupInfo::step_count (the steps in which any tensor
// of the group stepped) for most, and in tensor_steps (tensor id -> count)
// those whose count differs from their group's. TensorStepCount reads it.
struct CommitInfo {
  uint64_t step = 0;                 // the trainer's global step
  std::vector<GroupInfo> groups;     // replaces the previous generation's groups
  // Replaces the previous generation's per-tensor counts: a tensor not listed
  // takes its group's step_count. Entries equal to the group's count are
  // dropped; an id the generation does not hold is kInvalidArgument.
  std::map<uint32_t, uint64_t> tensor_steps = {};
};

struct GenerationInfo {
  uint64_t generation = 0;           // 0 = the empty store before any commit
  uint64_t step = 0;
  std::vector<GroupInfo> groups;
  // Tensor id -> step count, only where it differs from the group's
  // step_count (generations committed before it existed record none).
  std::map<uint32_t, uint64_t> tensor_steps = {};
  int64_t commit_time_unix_ms = 0;
  // Digest of the generation's index entries (its tensors and the version of
  // each chunk it sees), written by the writer at commit. A read-only store
  // checks the index it read against it before serving the generation: a
  // RocksDB secondary instance can lag or serve stale entries after the writer
  // flushes or reopens (docs/RELIABILITY.md section 11). 0 = not recorded
  // (generations committed before it existed).
  uint64_t index_digest = 0;
};

// Tensor t's step count in generation g: its tensor_steps entry, else its
// group's step_count (0 when g has no such group).
uint64_t TensorStepCount(const GenerationInfo& g, const TensorInfo& t);

struct SnapshotInfo {
  std::string name;
  uint64_t generation = 0;
  int64_t create_time_unix_ms = 0;
};

// What Store::RevertToSnapshot did.
struct RevertResult {
  uint64_t generation = 0;      // the new head (the snapshot's generation when it was the head)
  std::string kept_snapshot;    // the snapshot that keeps the replaced head; empty when none was made
};

struct ChunkRef {
  uint32_t tensor_id = 0;
  uint32_t field = 0;                // index into TensorInfo::fields
  uint64_t index = 0;                // chunk number within the field
};

// One version of one chunk as seen by a generation.
struct ChunkInfo {
  uint64_t offset_bytes = 0;         // within the field
  uint64_t length_bytes = 0;         // logical bytes; < chunk size only for the last chunk
  bool zero = true;                  // never written: zeros, no extent, no I/O
  uint64_t checksum = 0;             // XXH3-64 of the logical bytes (zeros too)
  uint64_t written_generation = 0;   // generation whose commit published it (0 if zero)
  uint32_t data_dir = 0;             // extent location (when !zero)
  uint64_t file_offset = 0;
};

struct StoreIdentity {
  uint32_t format_version = kFormatVersion;
  std::string uuid;
  std::string name;
  uint64_t chunk_size_bytes = kDefaultChunkBytes;
  // Absolute, where they are now (IDENTITY records those inside the store
  // directory relative to it).
  std::vector<std::string> data_dirs;
  int64_t create_time_unix_ms = 0;
  // The training job (lineage) the store's state belongs to: every rank of
  // one job, and every store restored or resharded from its checkpoints,
  // carry the same id (written to each manifest as "job"; optstate-reshard
  // refuses to merge checkpoints of different jobs). Empty: unknown (a store
  // created before stores recorded it).
  std::string job;
};

struct StoreOptions {
  // Create only. Store name; default: the directory's base name.
  std::string name;
  // Create only. The job the store belongs to (StoreIdentity::job). Default:
  // empty = a new uuid (the store is a job of its own).
  std::string job;
  // Create only. Multiple of 2 MiB. Default 8 MiB (README "Defaults").
  uint64_t chunk_size_bytes = kDefaultChunkBytes;
  // Create only. Data directories (one per NVMe drive); default {<path>/data}.
  // One outside <path> is external: the store cannot then be copied with cp.
  std::vector<std::string> data_dirs;
  // Data files grow by this many bytes at a time (fallocate). Default 1 GiB.
  uint64_t preallocate_step_bytes = 1ull << 30;
  // Committed generations kept besides snapshots and leases (>= 1). Default 1.
  uint32_t retained_generations = 1;
  // O_DIRECT for data files (falls back to buffered with a warning on tmpfs).
  bool direct_io = true;
  // Where files are touched; default FileSystem::Default(). Not owned.
  FileSystem* fs = nullptr;
};

struct ChunkIoOptions {
  uint32_t queue_depth = 32;
  // Caller-owned buffers to register with io_uring (staging buffers).
  std::vector<std::span<std::byte>> registered_buffers;
  // IoEngineOptions::max_sqe_bytes (0 = one SQE per chunk request).
  uint64_t max_sqe_bytes = 0;
  // IoEngineOptions::wakeable: ChunkIo::Wake() may be used.
  bool wakeable = false;
  // IoEngineOptions::defer_submit: requests reach the kernel at the next Reap,
  // batched (adjacent chunks merge). Default false.
  bool defer_submit = false;
  // false: Reap does not check read chunks' checksums; each read completion
  // carries what VerifyChunkRead needs, and the caller must call it before it
  // uses or hands out a byte of the chunk. For a reader whose I/O thread should
  // keep the disk busy rather than hash (mount/chunk_reader.cc).
  bool verify_reads = true;
  // Threads that hash chunks of at least kAsyncHashMinBytes (writes' checksums,
  // reads' verification) instead of the thread that calls SubmitWrite and
  // Reap; a write is hashed while it is in flight, and a completion is handed
  // out only once both its I/O and its hash are done. 0 (default): that
  // thread hashes, in SubmitWrite and Reap. Makes the engine wakeable.
  uint32_t hash_threads = 0;
};

// Chunks shorter than this are hashed on the ChunkIo's own thread even with
// ChunkIoOptions::hash_threads: handing a few KiB to another thread costs
// more than hashing them.
inline constexpr uint64_t kAsyncHashMinBytes = 256 * 1024;

struct ChunkCompletion {
  uint64_t tag = 0;
  Status status;
  // A successful read from a ChunkIo with verify_reads = false: unverified;
  // VerifyChunkRead(*this, buf) checks it.
  bool needs_verify = false;
  uint64_t verify_length = 0;      // logical bytes the checksum covers
  uint64_t expected_checksum = 0;  // XXH3-64
  uint64_t file_offset = 0;        // of the extent in its data file
  std::string what;                // store, tensor, field, chunk, generation
};

// The checksum check a ChunkIo with verify_reads = false skipped: OK when
// !c.needs_verify or buf's first c.verify_length bytes hash to
// c.expected_checksum, else kCorruption naming store, tensor, field, chunk,
// generation and file offset.
Status VerifyChunkRead(const ChunkCompletion& c, const void* buf);

// Asynchronous chunk reads (and, from a writable Store, writes). Buffers must
// be 4096-aligned and hold chunk_size_bytes; they stay the caller's and must
// live until the request completes. Never-written chunks complete at once,
// zero-filled, with no I/O. Reads verify the checksum before completing.
class ChunkIo {
 public:
  virtual ~ChunkIo() = default;
  // Store::NewChunkIo: the newest version (a write completed in the pending
  // generation, else the latest committed). GenerationView::NewChunkIo: that
  // generation's version.
  // buf holds buf_bytes (0 = chunk_size_bytes; at least the chunk's length
  // rounded up to 4096, else kInvalidArgument); the bytes past the chunk's
  // length are zeroed up to buf_bytes.
  virtual Status SubmitRead(const ChunkRef& ref, void* buf, uint64_t tag, uint64_t buf_bytes) = 0;
  Status SubmitRead(const ChunkRef& ref, void* buf, uint64_t tag) { return SubmitRead(ref, buf, tag, 0); }
  // Writable stores only: writes the chunk's logical bytes (padding to 4 KiB
  // is written too but not checksummed) to a fresh extent; on completion the
  // chunk's pending version points there. Fails at once with kNoSpace when no
  // slot can be allocated, naming the data dir.
  virtual Status SubmitWrite(const ChunkRef& ref, const void* buf, uint64_t tag) = 0;
  // Appends >= min_complete completions (fewer only if fewer are in flight).
  virtual Status Reap(std::vector<ChunkCompletion>* out, size_t min_complete) = 0;
  virtual size_t in_flight() const = 0;
  // Thread-safe: makes a Reap blocked waiting for completions (or the next
  // one) return early, with what is complete (IoEngine::Wake). Needs
  // ChunkIoOptions::wakeable.
  virtual void Wake() = 0;
};

// A committed generation, frozen: its tensors, groups and chunk versions. Holds
// a reader lease for its lifetime, so its extents stay valid.
class GenerationView {
 public:
  virtual ~GenerationView() = default;
  virtual const StoreIdentity& identity() const = 0;
  virtual const GenerationInfo& info() const = 0;
  virtual const std::vector<TensorInfo>& tensors() const = 0;   // sorted by name
  virtual Result<TensorInfo> FindTensor(std::string_view name) const = 0;
  virtual uint64_t ChunkCount(const TensorInfo& t, uint32_t field) const = 0;
  virtual Result<ChunkInfo> Chunk(const ChunkRef& ref) const = 0;
  // Synchronous read of one chunk into buf (4096-aligned, of buf_bytes as
  // for ChunkIo::SubmitRead: 0 = chunk_size_bytes; the tail past the chunk's
  // length is zeroed up to there), verified.
  virtual Status ReadChunk(const ChunkRef& ref, void* buf, uint64_t buf_bytes) const = 0;
  Status ReadChunk(const ChunkRef& ref, void* buf) const { return ReadChunk(ref, buf, 0); }
  virtual Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions& opts) const = 0;
};

struct StoreStats {
  uint64_t latest_generation = 0;
  uint64_t live_bytes = 0;             // logical bytes of written chunks in latest
  uint64_t referenced_extent_bytes = 0;// disk space (slots and pieces) of every retained version
  uint64_t pending_bytes = 0;          // disk space written in the uncommitted generation
  std::vector<uint64_t> data_file_bytes;  // allocated size per data dir
  std::vector<uint64_t> data_free_bytes;  // free space (slots and pieces) per data dir
  uint64_t lifetime_bytes_written = 0; // over the store's life (SSD endurance)
  uint64_t generations_retained = 0;
  uint64_t snapshots = 0;
  uint64_t leases = 0;
};

struct VerifyReport {
  uint64_t chunks_checked = 0;
  uint64_t bytes_checked = 0;
  uint64_t generations_checked = 0;    // each read under a lease
  uint64_t generations_skipped = 0;    // collected by a running writer before they could be leased
  // Each names what is damaged (store, tensor, field, chunk, generation, or
  // file) and, for damage to the store's own files, what the user can do.
  std::vector<std::string> problems;
  uint64_t leaked_slots = 0;           // slots or pieces allocated, unreferenced and not free-listed
  bool ok() const { return problems.empty() && leaked_slots == 0; }
};

class Store {
 public:
  virtual ~Store() = default;

  // Creates a new store at `path` (which must not exist or be an empty
  // directory that is not a mount point; its parent must exist).
  // Atomic: built in a temporary sibling directory and renamed (over the
  // empty directory), so a crash leaves either no store (the empty directory
  // as it was) or a complete empty one.
  static Result<std::unique_ptr<Store>> Create(const std::string& path, const StoreOptions& opts);
  // Opens an existing store read-write; takes LOCK and its data files' flocks.
  // Missing/damaged -> error with the path, the reason and what to do (never
  // creates). In use -> kBusy naming the pid. A copy sharing a data file with
  // another store directory -> refused (see "Copies and moves").
  static Result<std::unique_ptr<Store>> Open(const std::string& path, const StoreOptions& opts);
  // Opens without taking LOCK (RocksDB secondary instance). Writes, Commit,
  // snapshots and GC return kFailedPrecondition.
  static Result<std::unique_ptr<Store>> OpenReadOnly(const std::string& path,
                                                     const StoreOptions& opts);

  virtual const std::string& path() const = 0;
  virtual const StoreIdentity& identity() const = 0;
  uint64_t chunk_size_bytes() const { return identity().chunk_size_bytes; }
  virtual bool read_only() const = 0;
  // Read-only stores: follows the writer (TryCatchUpWithPrimary). Writable: no-op.
  virtual Status CatchUp() = 0;

  // Tensors. CreateTensor registers a tensor in the pending generation (no
  // data is written: every chunk reads as zeros until written).
  virtual Result<TensorInfo> CreateTensor(const TensorSpec& spec) = 0;
  virtual Result<TensorInfo> FindTensor(std::string_view name) const = 0;  // NotFound lists near names
  // FindTensor without the message: nullopt when there is no such tensor, in
  // O(log n) (FindTensor's NotFound compares the name with every tensor's).
  virtual std::optional<TensorInfo> LookupTensor(std::string_view name) const = 0;
  virtual std::vector<TensorInfo> ListTensors() const = 0;                // sorted by name
  virtual uint64_t ChunkCount(const TensorInfo& t, uint32_t field) const = 0;
  virtual Result<uint32_t> FieldIndex(const TensorInfo& t, std::string_view field) const = 0;

  // The writer's I/O (see ChunkIo).
  virtual Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions& opts) = 0;
  // Synchronous conveniences over a private ChunkIo. buf: 4096-aligned, chunk_size_bytes.
  virtual Status ReadChunk(const ChunkRef& ref, void* buf) = 0;
  virtual Status WriteChunk(const ChunkRef& ref, const void* buf) = 0;

  // Makes every completed write durable and publishes them as generation
  // latest+1. kFailedPrecondition while writes are in flight. Returns the new
  // generation. On error nothing is published; after an fsync error the store
  // is poisoned (kDataLoss) until reopened.
  virtual Result<uint64_t> Commit(const CommitInfo& info) = 0;
  // Drops tensors from the store for good: commits generation latest+1 with
  // the latest's step, groups and per-tensor step counts, without the tensors
  // named (their names are free again). Older generations and snapshots keep
  // showing them, their chunks included, until GC drops the last generation
  // that holds them. kNotFound (with near names) for a name the latest
  // generation does not hold, kInvalidArgument for none or a duplicate,
  // kFailedPrecondition while writes or tensors are pending (nothing of the
  // pending generation is published with the drop). Returns the new generation.
  virtual Result<uint64_t> DropTensors(const std::vector<std::string>& names) = 0;
  // Makes the pending generation's completed chunk writes durable without
  // publishing anything (fdatasync of the data files, no lock held while it
  // runs), so a long step can overlap the device's flush with its remaining
  // I/O and leave Commit little to sync. Thread-safe; optional.
  virtual Status SyncData() = 0;
  // Drops the pending generation: its writes (their extents become free) and
  // the tensors it created. (Open drops those too: a writer that died before
  // its commit leaves none behind.)
  virtual Status AbortPending() = 0;
  virtual GenerationInfo LatestGeneration() const = 0;
  virtual std::vector<GenerationInfo> ListGenerations() const = 0;  // retained, ascending

  // A frozen view of a committed generation (kLatest = newest), holding a lease.
  virtual Result<std::unique_ptr<GenerationView>> OpenGeneration(uint64_t generation) = 0;
  // Frozen view of a snapshot's generation.
  virtual Result<std::unique_ptr<GenerationView>> OpenSnapshot(std::string_view name) = 0;

  // Snapshots of the latest committed generation.
  virtual Result<SnapshotInfo> CreateSnapshot(const std::string& name) = 0;
  virtual Status ReleaseSnapshot(const std::string& name) = 0;
  virtual std::vector<SnapshotInfo> ListSnapshots() const = 0;

  // Makes snapshot `name`'s state the head again without copying data: one
  // new committed generation whose tensors, chunk versions (the snapshot's
  // extents, shared with it), per-group and per-tensor step counts,
  // hyperparameters and step equal the snapshot's. The head it replaces is
  // kept as snapshot "pre-revert-<generation>-<unix ms>" in the same synced
  // RocksDB WriteBatch (a crash leaves either the old head or the reverted one
  // with its kept snapshot). Chunks the snapshot never wrote and the head did
  // are written as zeros first (the only data written). Cost: metadata of the
  // chunks that changed since the snapshot. kNotFound for an unknown snapshot;
  // kFailedPrecondition while the store has uncommitted writes or holds a
  // tensor created after the snapshot (a revert would drop it). A snapshot
  // of the head itself is a no-op (its generation, no snapshot kept).
  virtual Result<RevertResult> RevertToSnapshot(const std::string& name) = 0;

  // Frees every extent no retained generation, snapshot or lease references.
  // Runs on its own after Commit and ReleaseSnapshot; callable explicitly.
  virtual Status CollectGarbage() = 0;
  virtual Result<StoreStats> Stats() const = 0;
  // Reads every chunk of every retained generation and snapshot under a lease
  // (safe while a writer runs: generations it collects meanwhile are skipped),
  // checks every checksum and reference, COMMITTED and RETAINED, and counts
  // leaked extents. Read-only stores catch up with the writer first.
  virtual Result<VerifyReport> Verify() = 0;

  // Imports a checkpoint directory (manifest.json + tensors/...) as a new
  // committed generation, after verifying every chunk hash and that its layout
  // matches this store (vfs/checkpoint.h; implemented in vfs/checkpoint.cc).
  Result<uint64_t> Restore(const std::string& checkpoint_dir);
};

// The XXH3-64 used for every chunk checksum.
uint64_t ChunkChecksum(const void* data, uint64_t len);

// Whether readers can open stores under `dir` (a store or a directory of
// stores, e.g. the mount's STORE_ROOT): OK where `dir` is writable or its
// whole filesystem is read-only (readers need no leases there: see "A store on
// a read-only filesystem" above); kFailedPrecondition naming `dir`, its mount
// point and what to do where only this mount of a writable filesystem is
// read-only, or where /proc/self/mountinfo cannot tell which.
Status CheckReaderFilesystem(const std::string& dir);

}  // namespace optstate::vfs
