// The store's shared state (vfs/store.h): Core holds what a Store, its
// GenerationViews and its ChunkIos share, owned by shared_ptr by each of them,
// so a view or ChunkIo may outlive the Store object (the index and LOCK stay
// open until the last one goes). Internal to vfs/.
//
// Core's state is private and grouped by the file of the idea that owns it
// (space, index, secondary, marks, leases, data files, ...); the table at
// class Core says which other code touches which group, and through what.
//
// Lock order: lease_lock_mu_ and catchup_mu_ before mu_; Core::mu_ may be
// taken while holding the lease flock (leases/.lock, LOCK_EX in GC); never the
// other way round. The rules on Core's members are annotated (GUARDED_BY,
// REQUIRES) and checked by clang's -Wthread-safety (base.thread_safety).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "vfs/chunk_space.h"
#include "vfs/internal/rocks_util.h"
#include "vfs/internal/store_format.h"
#include "vfs/internal/store_util.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "base/strings.h"
#include "vfs/store.h"

namespace optstate::vfs::internal {

// Core's friends (see the end of the class); vfs/internal/store_open.h documents
// the open steps, store.h's Store the rest.
class Core;
class StoreImpl;
struct ViewData;
rocksdb::Options IndexOptions(Core* core);
Status OpenDataFiles(Core* core, bool create_missing);
Status ResolveDataDirs(Core* c);
Status ClaimDataFiles(Core* c);
Status CheckReferencedFiles(Core* core);
Status OpenCommittedMark(Core* c);
Status OpenLeaseLock(Core* c);
Status OpenReaderLeaseLock(Core* c);
std::shared_ptr<ViewData> BuildView(const std::shared_ptr<Core>& core, uint64_t g);
Result<std::unique_ptr<GenerationView>> OpenGenerationView(const std::shared_ptr<Core>& core, uint64_t generation,
                                                           const std::string& snapshot);
Result<VerifyReport> VerifyStore(const std::shared_ptr<Core>& core);

// ---------------------------------------------------------------------------
// Core: everything a Store, its views and its ChunkIos share.
//
// Its state is private, in groups. Each group has one owning file, which
// defines the Core members that keep it; other code touches a group only where
// listed here (Core's members are the store_*.cc files' code; code outside
// Core uses the public methods, and the few functions that build or walk the
// whole state are the friends named at the end of the class):
//
//   configuration   path_, identity_, opts_, fs_, read_only_, leases_dir_. Set
//                   at open (the constructor, store_open.cc; store_data_files.cc
//                   resolves the data dirs); read everywhere, outside Core
//                   through path(), identity(), options(), fs(), read_only(),
//                   chunk().
//   index handle    env_, logger_, db_: store_open.cc. Written through by
//                   store_index.cc, store_commit.cc, store_secondary.cc and the
//                   Store API's CreateTensor.
//   data files      data_files_ .. identity_needs_rewrite_: store_data_files.cc.
//                   Written by chunk writes (data_file()), synced by commit,
//                   grown by store_space.cc, sized at open and by Stats; Verify.
//   marks           lock_file_, committed_file_, retained_file_,
//                   retained_written_: store_marks.cc (store_open.cc opens LOCK
//                   and RETAINED).
//   leases          lease_lock_file_, lease_lock_mu_: store_leases.cc. Commit,
//                   GC and RETAINED's writes take the lease flock; Stats counts
//                   the lease files.
//   secondary       secondary_dir_ .. secondary_reopens_: store_secondary.cc
//                   (store_open.cc makes the first instance).
//   catalog (mu_)   tensors_ .. lifetime_bytes_: loaded by store_index.cc
//                   (store_secondary.cc keeps the previous maps when a load
//                   fails its check); changed by commit, GC, the Store API
//                   (store.cc) and completed chunk writes (SetPending in
//                   store_space.cc); read by views, chunk I/O (tensors(),
//                   latest_generation()), marks, leases, data files' reference
//                   check, space and Verify.
//   space (mu_)     space_, dirty_, grown_, next_dir_: store_space.cc. Open
//                   sizes it from the data files, commit syncs and clears
//                   dirty_/grown_, Stats and Verify read it.
//   writer status   view_refs_, poisoned_, poison_reason_, writes_in_flight_:
//     (mu_)         store_commit.cc poisons; views and chunk writes count
//                   themselves (AddViewRef/DropViewRef, WriteStarted/
//                   WriteEnded); GC keeps the generations views hold; the Store
//                   API's AbortPending refuses while a write is in flight.

class Core {
 public:
  // Sets the configuration: an absolute `path`, the file system of `opts`
  // (or the default), leases/ under it, and the RocksDB env over the file
  // system's test hooks when it has any. Nothing is opened (store_open.cc).
  Core(const std::string& path, const StoreOptions& opts, bool read_only);
  ~Core() {
    db_.reset();
    env_.reset();
    data_files_.clear();
    data_locks_.clear();
    lease_lock_file_.reset();
    if (!secondary_dir_.empty()) (void)fs_->RemoveAll(secondary_dir_);
    if (secondary_lock_fd_ >= 0) {
      (void)::unlink((secondary_base_ + ".lock").c_str());
      ::close(secondary_lock_fd_);
    }
    lock_file_.reset();
  }
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // --- configuration (immutable after open) ---------------------------------
  const std::string& path() const { return path_; }
  const StoreIdentity& identity() const { return identity_; }
  const StoreOptions& options() const { return opts_; }
  FileSystem* fs() const { return fs_; }
  bool read_only() const { return read_only_; }
  uint64_t chunk() const { return identity_.chunk_size_bytes; }
  uint64_t SlotBytes() const { return chunk(); }

  // Guards the catalog, the space and the writer status (see the table above).
  Mutex& mu() const RETURN_CAPABILITY(mu_) { return mu_; }

  // --- narrow access for chunk I/O and views (mu_ held unless said) ---------
  // Dir d's data file; null when it is absent (a read-only store's missing
  // dir) or d is out of range. Any thread: the set is fixed after open.
  File* data_file(uint32_t d) const { return d < data_files_.size() ? data_files_[d].get() : nullptr; }
  const std::map<uint32_t, TensorInfo>& tensors() const REQUIRES(mu_) { return tensors_; }
  uint64_t latest_generation() const REQUIRES(mu_) { return latest_.generation; }
  // A chunk write between its slot's allocation and SetPending/FreeSlot
  // (AbortPending refuses while one is in flight).
  void WriteStarted() REQUIRES(mu_) { ++writes_in_flight_; }
  void WriteEnded() REQUIRES(mu_) { --writes_in_flight_; }
  // A writer's in-process view of generation g: GC keeps g while one lives.
  void AddViewRef(uint64_t g) REQUIRES(mu_) { ++view_refs_[g]; }
  void DropViewRef(uint64_t g) REQUIRES(mu_) {
    if (--view_refs_[g] <= 0) view_refs_.erase(g);
  }

  // --- space: slots and pieces ----------------------------------------------
  //
  // A data file is a row of slots of SlotBytes() (the chunk size). A chunk
  // version takes AllocBytes(length): a whole slot, or for a short chunk (a
  // tensor's tail, a small tensor) a piece of its length rounded up to a power
  // of two >= kIoAlign (its class) that divides the slot and is at most half
  // of it. A slot is free, used whole, or carved into SlotBytes()/class pieces
  // of one class; a carved slot whose pieces are all free is whole-free again.
  // Nothing of this is stored: Open derives it from the committed extents
  // (an extent's class follows from its length), so crash consistency is the
  // index's, and stores written before pieces existed (every extent at a slot
  // boundary) read the same.
  //
  // Disk in proportion to the state. A slot's space is allocated in the file
  // (fallocate) before anything is written to it, never by the write itself:
  // a slot for whole chunks all at once, a carved slot only as far as its
  // pieces reach (doubling), so a store of small tensors holds on disk about
  // what its pieces take, not whole slots. Files grow by doubling, from four
  // slots up to the preallocation step, allocated at once when a whole chunk
  // needs the space; growth for a piece allocates only the last kIoAlign
  // bytes (which set the file's size), and its slots are allocated as they
  // are used. Freed space stays allocated and is reused (the file system
  // may be mounted with discard: punched space is slow to write again).
  // What is known to be allocated is not stored: after Open each slot's
  // first use allocates it again (fallocate of allocated space is a no-op).
  struct CarvedSlot {
    uint64_t piece_bytes = 0;
    uint64_t used = 0;            // pieces in use
    uint64_t backed = 0;          // pieces [0, backed) are allocated in the file
    std::vector<uint64_t> bits;   // bit i set: piece i in use
    uint64_t pieces(uint64_t slot_bytes) const { return slot_bytes / piece_bytes; }
    bool InUse(uint64_t i) const { return (bits[i / 64] >> (i % 64)) & 1; }
  };
  struct DirSpace {
    uint64_t slots = 0;                                 // slots in the file
    std::vector<bool> backed;                           // per slot: wholly allocated in the file
    std::set<uint64_t> free_slots;                      // whole free slots
    std::map<uint64_t, CarvedSlot> carved;              // slot -> its pieces
    std::map<uint64_t, std::set<uint64_t>> partial;     // class -> carved slots with a free piece
  };

  uint64_t AllocBytes(uint64_t length) const { return ChunkAllocatedBytes(length, SlotBytes()); }
  static_assert(kMinPieceBytes == kIoAlign, "a piece is the unit of O_DIRECT I/O");

  std::string FileName(uint32_t dir) const {
    return JoinPath(identity_.data_dirs[dir], identity_.uuid + ".chunks");
  }

  // kFailedPrecondition on a store opened read-only (needs no lock: the
  // configuration is immutable).
  Status CheckNotReadOnly(std::string_view what) const {
    if (read_only_) {
      return FailedPrecondition("store " + path_ + ": " + std::string(what) +
                                " on a store opened read-only");
    }
    return Status();
  }
  Status CheckWritable(std::string_view what) const REQUIRES(mu_) {
    OPTSTATE_RETURN_IF_ERROR(CheckNotReadOnly(what));
    if (poisoned_) {
      return DataLoss("store " + path_ + ": " + std::string(what) + " refused: store is poisoned (" +
                      poison_reason_ + "); reopen it");
    }
    return Status();
  }

  uint64_t ChunkLen(const TensorInfo& t, uint32_t field, uint64_t index) const {
    const uint64_t bytes = t.field_bytes(field);
    const uint64_t stride = t.field_chunk_bytes(field, chunk());
    const uint64_t off = index * stride;
    return off >= bytes ? 0 : std::min(stride, bytes - off);
  }
  static uint64_t ChunkCountOf(const TensorInfo& t, uint32_t field, uint64_t chunk) {
    return t.field_chunk_count(field, chunk);
  }

  std::string Describe(const TensorInfo* t, const Key& k, uint64_t gen) const {
    std::string s = "store " + path_ + " tensor '" + (t ? t->name : "#" + std::to_string(k.t)) +
                    "' field '" +
                    (t && k.f < t->fields.size() ? t->fields[k.f].name : "#" + std::to_string(k.f)) +
                    "' chunk " + std::to_string(k.c);
    if (gen != kInfinity) s += " generation " + std::to_string(gen);
    return s;
  }

  // NotFound for snapshot `name`, listing the snapshots there are. mu_ held.
  Status SnapshotNotFound(const std::string& name) const REQUIRES(mu_) {
    std::string names;
    for (const auto& [n, s] : snapshots_) names += (names.empty() ? "" : ", ") + n;
    return NotFound("store " + path_ + ": no snapshot '" + name + "' (snapshots: " +
                    (names.empty() ? "none" : names) + ")");
  }

  // --- read-only catch-up ----------------------------------------------------
  //
  // A RocksDB secondary instance can show an OLDER state after
  // TryCatchUpWithPrimary() returns OK: entries it replayed from a write-ahead
  // log the writer has since flushed shadow the newer flushed ones (RocksDB
  // issues 14444 and 15051), and a WAL the writer deletes between the
  // secondary's MANIFEST read and its WAL listing is skipped. Seen here as
  // latest/ stepping back one or more generations for a moment after the
  // writer reopened (docs/RELIABILITY.md section 11). So every load is checked
  // against what the writer publishes outside RocksDB (COMMITTED, the
  // generation's index digest); a failed check reopens the secondary
  // instance, which starts from the writer's current MANIFEST and WALs.

  // Rebuilds the maps and checks them: latest at least `acked` and at least
  // any latest loaded before, and the latest generation's digest. On failure
  // the previous maps stay. mu_ held.
  Status LoadIndexChecked(uint64_t acked) REQUIRES(catchup_mu_, mu_);

  // A secondary instance of the index with its own files in `dir` (created
  // here, removed again on failure). `what` names the attempt in the error.
  Result<std::unique_ptr<rocksdb::DB>> OpenSecondary(const std::string& dir, const std::string& what);

  // Catches up with the writer and loads the index, checked; after a failed
  // check (or at once, if reopen_first) through a fresh secondary instance, up
  // to 4 tries in about 30 ms. Read-only stores.
  // A catch-up that brought nothing (the instance's last sequence number is
  // the one the maps were loaded and checked at, and COMMITTED is not ahead of
  // them) keeps the maps: reloading the whole index takes milliseconds per
  // thousand tensors, under mu_, and the mount catches up on a lookup under
  // latest/ every catchup_interval_ms. Every write of the writer moves
  // the sequence number; a flush or compaction alone does not, and changes no
  // value (or, with the secondary's replay bugs above, shows an older one:
  // the checked maps are the better copy then).
  Status CatchUpChecked(bool reopen_first) EXCLUDES(catchup_mu_, mu_);

  // --- index loading -------------------------------------------------------

  // Rebuilds every in-memory map from the index. mu_ held.
  Status LoadIndex() REQUIRES(mu_);

  // Free space = the data files minus what the committed versions use (slots
  // and pieces; see DirSpace). mu_ held.
  Status BuildFreeLists() REQUIRES(mu_);

  // --- slots and pieces (mu_ held) ----------------------------------------

  uint64_t FreeBytes(uint32_t d) const REQUIRES(mu_);

  // How the allocator holds [off, off + bytes) of dir d.
  enum class Held { kInUse, kFree, kOtherClass };
  Held HeldAs(uint32_t d, uint64_t off, uint64_t bytes) const REQUIRES(mu_);

  // Space for a chunk version of `length` bytes: a free piece of its class
  // (lowest offset first, so freed slots coalesce), else a free slot (carved
  // for a short chunk), round-robin over the data dirs, growing files as
  // needed.
  Result<Extent> AllocateSlot(uint64_t length) REQUIRES(mu_);

  // Returns an extent's slot or piece to the free lists.
  void FreeSlot(const Extent& e) REQUIRES(mu_);

  // Records a completed write as the chunk's pending version. mu_ held.
  void SetPending(const Key& k, const Extent& e) REQUIRES(mu_);

  // Newest version of k: pending, else latest committed; nullopt = zeros. mu_ held.
  std::optional<Version> Newest(const Key& k) const REQUIRES(mu_);

  // Validates ref against the tensor map; returns the tensor and chunk length. mu_ held.
  Result<std::pair<const TensorInfo*, uint64_t>> Resolve(const std::map<uint32_t, TensorInfo>& tensors,
                                                         const ChunkRef& ref) const REQUIRES(mu_);

  // --- index digests ----------------------------------------------------------

  // Whether this index shows generation g as its writer committed it; Busy if
  // not (a read-only store's RocksDB secondary instance lagging or holding
  // stale entries). mu_ held.
  Status CheckIndexOf(uint64_t g) const REQUIRES(mu_);

  // --- RETAINED ------------------------------------------------------------

  // Reader, lease flock held. nullopt when the store has no usable RETAINED
  // (written by an older version, or torn by a crash; the writer rewrites it
  // at open): the caller falls back to its own index.
  std::optional<std::vector<uint64_t>> ReadRetained() REQUIRES(lease_lock_mu_);

  // Forgets the tensors that only the pending generation holds (created after
  // the latest commit): an aborted step's or a crashed writer's registrations
  // must not reach the next commit as tensors of zeros. Writer, mu_ held.
  Status DropUncommittedTensors() REQUIRES(mu_);

  // --- leases --------------------------------------------------------------

  // The lease flock (leases/.lock) in mode op (LOCK_SH, LOCK_EX) for the
  // guard's life; lease_lock_mu_ serialises this process's threads on it.
  Result<FlockGuard> LockLeases(int op) REQUIRES(lease_lock_mu_);

  static constexpr std::string_view kLeaseSuffix = ".flock";

  // --- GC ------------------------------------------------------------------

  struct GcPlan {
    std::vector<std::pair<Key, uint64_t>> dead_versions;  // (chunk, gen)
    // (gen, pack) -> its dead versions, for the versions in pack records.
    std::map<std::pair<uint64_t, uint32_t>, std::vector<Key>> dead_in_packs;
    std::vector<uint64_t> dead_generations;
    std::vector<uint32_t> dead_dropped;  // dropped tensors no retained generation holds
  };

  // Two slots (generation parity picks one), so a torn or lost write of the
  // newest mark leaves the previous one readable.
  static constexpr uint64_t kMarkSlotBytes = 4096;
  // The newest valid mark in `contents` (COMMITTED's first 2 slots or less);
  // nullopt, with the reason in *why, when neither slot holds one.
  static std::optional<uint64_t> NewestCommittedMark(const std::string& contents, const std::string& where,
                                                     std::string* why);
  // COMMITTED's full size: both slots written (at the first open, and again at
  // every open that finds the index ahead of it). Commits rewrite one slot in
  // place, so a crash can tear a slot but never shorten the file.
  static constexpr uint64_t kCommittedBytes = kMarkSlotBytes + 32;

  // What a user can do about a store whose COMMITTED is damaged while its
  // index holds committed generations up to `latest`.
  std::string CommittedRecoveryHint(uint64_t latest) const REQUIRES(mu_);
  // Made by the user to accept the index as it is when COMMITTED is damaged;
  // the writer removes it once COMMITTED is rewritten.
  static constexpr const char* kAcceptIndexFile = "COMMITTED.accept-index";

  // Verify's check of COMMITTED and RETAINED against an index whose latest
  // generation is index_latest. A read-only store may read a slot the writer
  // is rewriting: a damaged slot counts only if it reads damaged three times.
  void VerifyMarks(uint64_t index_latest, std::vector<std::string>* problems);

  // Read-only stores: the newest acknowledged generation, 0 if unknown.
  uint64_t ReadAckedGeneration();
  Status WriteCommittedMark(uint64_t gen, bool both_slots = false);

  Status WriteSynced(rocksdb::WriteBatch* b, std::string_view what);

  Status CollectGarbage();

  // fdatasync of the data files written since the last commit, outside mu_
  // (writes go on meanwhile); dirty_ stays set, so Commit still syncs what
  // arrives later. A failure poisons the store like a failed commit sync.
  Status SyncData();

  // Publishes generation latest+1. `drop`: ids of tensors (of tensors_) the
  // new generation no longer holds; they move to dropped_ in the same batch.
  Result<uint64_t> Commit(const CommitInfo& info, const std::vector<uint32_t>& drop = {});

  // The tensor of id `id` as generation g holds it (tensors_ or dropped_);
  // null if g does not hold it. mu_ held.
  const TensorInfo* TensorAt(uint32_t id, uint64_t g) const REQUIRES(mu_);
  // tensors_ or dropped_'s record of id, whatever generation; null if none. mu_ held.
  const TensorInfo* AnyTensor(uint32_t id) const REQUIRES(mu_);

  // A commit that makes generation revert_to's chunk versions the new
  // generation's (sharing their extents; a chunk revert_to never wrote must
  // already be pending, written as zeros) and, in the same batch, pins the
  // replaced head as snapshot keep_head_as (if non-empty). REQUIRES: no
  // pending writes besides those zero chunks.
  struct RevertSpec {
    uint64_t revert_to = 0;
    std::string keep_head_as;
  };
  Result<uint64_t> Commit(const CommitInfo& info, const RevertSpec* revert);
  // Both commits' one implementation (a revert drops nothing).
  Result<uint64_t> CommitGeneration(const CommitInfo& info, const RevertSpec* revert,
                                    const std::vector<uint32_t>& drop);

  // Drops one reference to extent e: returns its space to the free lists
  // unless another chunk version still shares it (a revert's). mu_ held.
  void ReleaseExtent(const Extent& e) REQUIRES(mu_);

  // Version of k visible in generation g (public for the revert). mu_ held.
  std::optional<Version> VersionAt(const Key& k, uint64_t g) const REQUIRES(mu_) { return AtGeneration(k, g); }

 private:
  // A fresh secondary instance in place of the current one. catchup_mu_ held.
  Status ReopenSecondary() REQUIRES(catchup_mu_) EXCLUDES(mu_);

  // Starts slot s of sp as a carved slot of class piece_bytes, all pieces free.
  CarvedSlot& Carve(DirSpace* sp, uint64_t s, uint64_t piece_bytes) REQUIRES(mu_);

  // Marks piece i of carved slot s in use or free, keeping `partial` exact.
  // Freeing the last used piece returns the slot to the whole-slot free list.
  void SetPiece(DirSpace* sp, uint64_t s, CarvedSlot* c, uint64_t i, bool in_use) REQUIRES(mu_);

  // Grows dir d's file (or by one slot when that does not fit): doubles it,
  // from 4 slots up to the preallocation step. `whole` (for a whole chunk):
  // allocated at once; else only its last kIoAlign bytes (see "Disk in
  // proportion to the state").
  Status Grow(uint32_t d, bool whole) REQUIRES(mu_);

  // Allocates slot s of dir d in the file (once known, no more calls).
  Status BackSlot(uint32_t d, uint64_t s) REQUIRES(mu_);
  // Allocates piece i of carved slot s of dir d in the file (and, doubling,
  // the pieces before it and after it, up to the slot's end).
  Status BackPiece(uint32_t d, uint64_t s, CarvedSlot* c, uint64_t i) REQUIRES(mu_);

  // Version of k visible in generation g. mu_ held.
  std::optional<Version> AtGeneration(const Key& k, uint64_t g) const REQUIRES(mu_);

  // Digest of generation g as this process's index shows it (BuildView's
  // selection: tensors created at or before g, each chunk's newest version at
  // or below g). mu_ held.
  uint64_t IndexDigest(uint64_t g) const REQUIRES(mu_);

  // Digest of generation gen about to be committed: the pending versions over
  // the newest committed ones, without the tensors in `drop`. mu_ held.
  uint64_t CommitDigest(uint64_t gen, const std::vector<uint32_t>& drop) const REQUIRES(mu_);

  // "OSRETAIN", count (LE), the generations (LE, ascending), XXH3 of all that.
  static std::string EncodeRetained(const std::vector<uint64_t>& gens);
  static Result<std::vector<uint64_t>> DecodeRetained(const std::string& rec, const std::string& where);

  // The generations with records, plus `adding` (a commit's new one). mu_ held.
  std::vector<uint64_t> GenerationNumbers(std::optional<uint64_t> adding = std::nullopt) const REQUIRES(mu_);

  // Writer, exclusive lease flock held. A batch that drops generations is
  // framed by two writes: before it, every generation before or after it (so
  // a reader whose index shows either side finds its generation, even if the
  // writer dies in between); after it, the exact set. Readers only read under
  // the shared flock, so they see one of the two. Not synced: RETAINED only
  // has to hold while processes that can read it live; Open rewrites it.
  Status WriteRetained(const std::vector<uint64_t>& gens) REQUIRES(lease_lock_mu_);

  // After a durable batch: the exact set. A failure leaves the superset
  // written before the batch (safe for readers); the next GC retries.
  void RewriteRetainedAfterBatch() REQUIRES(lease_lock_mu_, mu_);

  // Generations leased by live readers; removes the leases of dead ones. A
  // lease file leases/<pid>.<gen>.<nonce>.flock is flock'ed by its reader for
  // the lease's life, and the kernel drops the flock when the reader's process
  // ends however it ends: a lease file that can be locked here is dead. (A pid
  // cannot tell: a killed reader not yet waited for is a zombie that kill(pid,
  // 0) finds, its pid can be reused, and it means nothing in another pid
  // namespace.) Files leases/<pid>.<gen>.<nonce> of readers of an older
  // version, which held no flock, are judged by their pid. Call with the
  // exclusive lease flock held (no reader is between making its lease file
  // and locking it).
  Result<std::vector<uint64_t>> LeasedGenerations() REQUIRES(lease_lock_mu_);

  // Whether a reader holds the flock of lease file `file`; removes it if not.
  // Lease flock held (LOCK_EX).
  bool LeaseFileHeld(const std::string& file) REQUIRES(lease_lock_mu_);

  // Which versions/generation records no retained generation can see once
  // `new_gen` (with pending_ as its new versions, if publish) is latest. mu_ held.
  GcPlan PlanGc(uint64_t new_gen, bool publish, const std::vector<uint64_t>& leased) const REQUIRES(mu_);
  void AddGcToBatch(const GcPlan& plan, rocksdb::WriteBatch* b) const REQUIRES(mu_);
  void ApplyGc(const GcPlan& plan) REQUIRES(mu_);  // after the batch is durable

  // 32 bytes: "OSCOMMIT", generation (LE), XXH3 of those 16 bytes, zeros.
  static std::string EncodeCommittedMark(uint64_t gen);
  static Result<uint64_t> DecodeCommittedMark(const std::string& rec, const std::string& where);
  void Poison(const Status& why) REQUIRES(mu_);

  // --- state (see the table at the top) -------------------------------------
  // Configuration: set by the constructor and the open steps, then immutable.
  std::string path_;
  StoreIdentity identity_;
  StoreOptions opts_;
  FileSystem* fs_ = nullptr;
  bool read_only_ = false;
  std::string leases_dir_;

  // Index handle (store_open.cc).
  std::unique_ptr<rocksdb::Env> env_;  // hooked env; outlives db_
  std::shared_ptr<rocksdb::Logger> logger_;
  // A read-only store's catch-up replaces it (ReopenSecondary) with both
  // catchup_mu_ and mu_ held, so either of them held keeps it; a writer's
  // never changes after open.
  std::unique_ptr<rocksdb::DB> db_;

  // Data files (store_data_files.cc).
  std::vector<std::unique_ptr<File>> data_files_;  // per data dir; null if absent (read-only)
  // Per data dir: it lies inside the store directory (a copy of the store
  // directory has its own copy of it), as opposed to an external one.
  std::vector<bool> internal_dirs_;
  // Writer, per data dir: the data file is flock'ed and its owner record
  // names this store directory (ClaimDataFiles).
  std::vector<bool> claimed_;
  // Writer, per data dir: a second descriptor of the data file that holds its
  // flock. Never given to io_uring: a ring of a killed process keeps the files
  // of its requests referenced until its teardown (asynchronous, after the
  // process is reaped), and a flock lives as long as its open file.
  std::vector<std::unique_ptr<File>> data_locks_;
  // IDENTITY records a data dir inside the store directory as an absolute
  // path (written by an older version): the writer rewrites it at open.
  bool identity_needs_rewrite_ = false;

  // Marks (store_marks.cc) and the store's LOCK.
  std::unique_ptr<File> lock_file_;
  // COMMITTED: the newest acknowledged generation, written and synced after
  // each commit batch. Open refuses an index older than it, so a damaged or
  // lost RocksDB write-ahead log can never silently roll the store back.
  std::unique_ptr<File> committed_file_;
  // RETAINED (writer): the generations whose chunk versions GC keeps, rewritten
  // under the exclusive lease flock around every batch that can drop one (see
  // WriteRetained), and at open. A reader that made its lease file and then, still under the shared
  // flock, finds g in RETAINED knows no GC can free g's extents while the lease
  // lives, whatever its own (possibly lagging) copy of the index says.
  std::unique_ptr<File> retained_file_;
  // The last record written (writer).
  std::optional<std::vector<uint64_t>> retained_written_ GUARDED_BY(lease_lock_mu_);

  // Leases (store_leases.cc).
  // A reader of a store whose whole filesystem is read-only (vfs/store.h): no
  // writer can exist, so its views take no lease and it has no lease lock.
  bool filesystem_read_only_ = false;
  std::unique_ptr<File> lease_lock_file_;
  Mutex lease_lock_mu_ ACQUIRED_BEFORE(mu_);  // serialises this process's use of lease_lock_file_

  // Secondary instance and catch-up (store_secondary.cc): read-only stores.
  std::string secondary_dir_;
  // CatchUp is serialised and checked (CatchUpChecked).
  Mutex catchup_mu_ ACQUIRED_BEFORE(mu_);
  uint64_t max_latest_loaded_ GUARDED_BY(catchup_mu_) = 0;  // latest never moves back within one open store
  // The secondary's last sequence number when the maps were last loaded and
  // checked (LoadIndexChecked); none after a failed load (so the mount's
  // first catch-up right after open does not reload).
  std::optional<uint64_t> loaded_seq_ GUARDED_BY(catchup_mu_);
  std::string secondary_base_;      // secondary_dir_ is this plus a reopen count
  int secondary_lock_fd_ = -1;      // flock'ed <secondary_base_>.lock while this reader lives
  uint64_t secondary_reopens_ GUARDED_BY(catchup_mu_) = 0;

  mutable Mutex mu_;
  // Guarded by mu_ (the analysis checks each).
  // Catalog (store_index.cc loads it).
  std::map<uint32_t, TensorInfo> tensors_ GUARDED_BY(mu_);       // by id
  std::map<std::string, uint32_t, std::less<>> names_ GUARDED_BY(mu_);  // name -> id
  // Dropped tensors (DropTensors) that a retained generation still holds, by
  // id; their dropped_generation is set. Not in tensors_ or names_.
  std::map<uint32_t, TensorInfo> dropped_ GUARDED_BY(mu_);
  uint32_t next_tensor_id_ GUARDED_BY(mu_) = 0;
  GenerationInfo latest_ GUARDED_BY(mu_);
  std::map<uint64_t, GenerationInfo> generations_ GUARDED_BY(mu_);  // retained generation records
  std::map<std::string, SnapshotInfo> snapshots_ GUARDED_BY(mu_);
  std::map<Key, std::vector<Version>> versions_ GUARDED_BY(mu_);    // committed, newest first
  std::map<Key, Extent> pending_ GUARDED_BY(mu_);                   // completed writes of latest+1
  // Chunk-map pack records (gen, pack) -> the chunks whose versions of gen it
  // holds and that are still in versions_ (writer: GC rewrites a record
  // with those left, or deletes it when none is).
  std::map<std::pair<uint64_t, uint32_t>, std::vector<Key>> packs_ GUARDED_BY(mu_);
  // Extents referenced by more than one chunk version (dir, file offset) ->
  // references beyond the first: a revert shares the snapshot's extents with
  // the generation it commits. Writer: built at open, kept by commits,
  // ReleaseExtent and AbortPending.
  std::map<std::pair<uint32_t, uint64_t>, uint32_t> shared_extents_ GUARDED_BY(mu_);
  uint64_t lifetime_bytes_ GUARDED_BY(mu_) = 0;
  // Space (store_space.cc).
  std::vector<DirSpace> space_ GUARDED_BY(mu_);                     // per data dir: slots and pieces
  std::vector<bool> dirty_ GUARDED_BY(mu_);                         // written since last sync
  std::vector<bool> grown_ GUARDED_BY(mu_);                         // fallocated since last sync
  uint32_t next_dir_ GUARDED_BY(mu_) = 0;
  // Writer status.
  std::map<uint64_t, int> view_refs_ GUARDED_BY(mu_);               // in-process views per generation
  bool poisoned_ GUARDED_BY(mu_) = false;
  std::string poison_reason_ GUARDED_BY(mu_);
  uint64_t writes_in_flight_ GUARDED_BY(mu_) = 0;

  // Friends: the code that builds the whole state at open, or reads or
  // changes the catalog as a whole.
  friend class vfs::Store;  // Store::Create, Open, OpenReadOnly (store_open.cc): the open steps in order
  friend rocksdb::Options IndexOptions(Core* core);  // the index handle's env and logger
  friend Status OpenDataFiles(Core* core, bool create_missing);  // store_data_files.cc: its open steps
  friend Status ResolveDataDirs(Core* c);
  friend Status ClaimDataFiles(Core* c);
  friend Status CheckReferencedFiles(Core* core);
  friend Status OpenCommittedMark(Core* c);  // store_marks.cc: its open step
  friend Status OpenLeaseLock(Core* c);      // store_leases.cc: its open step
  friend Status OpenReaderLeaseLock(Core* c);  // store_leases.cc: a reader's open step
  friend Result<std::unique_ptr<GenerationView>> OpenGenerationView(const std::shared_ptr<Core>& core,
                                                                    uint64_t generation,
                                                                    const std::string& snapshot);
  friend std::shared_ptr<ViewData> BuildView(const std::shared_ptr<Core>& core, uint64_t g);  // copies the catalog
  friend Result<VerifyReport> VerifyStore(const std::shared_ptr<Core>& core);  // checks every group
  friend class StoreImpl;  // the Store API (store.cc): tensors, snapshots, generations, stats
};

// The friends' lock rules (here, where Core is complete).
std::shared_ptr<ViewData> BuildView(const std::shared_ptr<Core>& core, uint64_t g) REQUIRES(core->mu_);
Status CheckReferencedFiles(Core* core) REQUIRES(core->mu_);

}  // namespace optstate::vfs::internal
