// The store's shared state (vfs/store.h): Core holds what a Store, its
// GenerationViews and its ChunkIos share, owned by shared_ptr by each of them,
// so a view or ChunkIo may outlive the Store object (the index and LOCK stay
// open until the last one goes). Internal to vfs/.
//
// Lock order: Core::mu_ may be taken while holding the lease flock
// (leases/.lock, LOCK_EX in GC); never the other way round.
#pragma once

#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
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

#include "vfs/internal/rocks_util.h"
#include "vfs/internal/store_format.h"
#include "vfs/log.h"
#include "vfs/store.h"

namespace optstate::vfs::internal {


inline constexpr uint64_t kIoAlign = 4096;
inline constexpr uint64_t kInfinity = UINT64_MAX;

inline uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

inline int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline std::string JoinPath(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

inline std::string AbsPath(const std::string& p) {
  std::error_code ec;
  auto abs = std::filesystem::absolute(p, ec);
  if (ec) return p;
  std::string s = abs.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

struct Key {
  uint32_t t = 0;
  uint32_t f = 0;
  uint64_t c = 0;
  auto operator<=>(const Key&) const = default;
};

struct Version {
  uint64_t gen = 0;  // written (published) generation
  Extent ext;
};

// flock on an open File's fd; released on destruction.
class FlockGuard {
 public:
  FlockGuard() = default;
  static Result<FlockGuard> Take(File* f, int op) {
    for (;;) {
      if (::flock(f->fd(), op) == 0) break;
      if (errno == EINTR) continue;
      return ErrnoStatus("flock " + f->path(), errno);
    }
    FlockGuard g;
    g.fd_ = f->fd();
    return g;
  }
  FlockGuard(FlockGuard&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  FlockGuard& operator=(FlockGuard&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~FlockGuard() {
    if (fd_ >= 0) ::flock(fd_, LOCK_UN);
  }

 private:
  int fd_ = -1;
};

class Core;
rocksdb::Options IndexOptions(Core* core);

// ---------------------------------------------------------------------------
// Core: everything a Store, its views and its ChunkIos share.

class Core {
 public:
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

  // Immutable after open.
  std::string path_;
  StoreIdentity identity_;
  StoreOptions opts_;
  FileSystem* fs_ = nullptr;
  bool read_only_ = false;
  std::string secondary_dir_;
  std::string leases_dir_;
  std::unique_ptr<rocksdb::Env> env_;  // hooked env; outlives db_
  std::shared_ptr<rocksdb::Logger> logger_;
  std::unique_ptr<rocksdb::DB> db_;
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
  std::unique_ptr<File> lock_file_;
  // COMMITTED: the newest acknowledged generation, written and synced after
  // each commit batch. Open refuses an index older than it, so a damaged or
  // lost RocksDB write-ahead log can never silently roll the store back.
  std::unique_ptr<File> committed_file_;
  std::unique_ptr<File> lease_lock_file_;
  std::mutex lease_lock_mu_;  // serialises this process's use of lease_lock_file_
  // RETAINED (writer): the generations whose chunk versions GC keeps, rewritten
  // under the exclusive lease flock around every batch that can drop one (see
  // WriteRetained), and at open. A reader that made its lease file and then, still under the shared
  // flock, finds g in RETAINED knows no GC can free g's extents while the lease
  // lives, whatever its own (possibly lagging) copy of the index says.
  std::unique_ptr<File> retained_file_;
  std::optional<std::vector<uint64_t>> retained_written_;  // the last record written (writer)
  // Read-only stores: CatchUp is serialised and checked (CatchUpChecked).
  std::mutex catchup_mu_;
  uint64_t max_latest_loaded_ = 0;  // latest never moves back within one open store
  // The secondary's last sequence number when the maps were last loaded and
  // checked (LoadIndexChecked); none after a failed load. Guarded by
  // catchup_mu_ (held by every caller but OpenReadOnly, before the store is
  // shared: so the mount's first catch-up right after open does not reload).
  std::optional<uint64_t> loaded_seq_;
  std::string secondary_base_;      // secondary_dir_ is this plus a reopen count
  int secondary_lock_fd_ = -1;      // flock'ed <secondary_base_>.lock while this reader lives
  uint64_t secondary_reopens_ = 0;

  uint64_t chunk() const { return identity_.chunk_size_bytes; }
  uint64_t SlotBytes() const { return chunk(); }

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
  struct CarvedSlot {
    uint64_t piece_bytes = 0;
    uint64_t used = 0;            // pieces in use
    std::vector<uint64_t> bits;   // bit i set: piece i in use
    uint64_t pieces(uint64_t slot_bytes) const { return slot_bytes / piece_bytes; }
    bool InUse(uint64_t i) const { return (bits[i / 64] >> (i % 64)) & 1; }
  };
  struct DirSpace {
    uint64_t slots = 0;                                 // slots in the file
    std::set<uint64_t> free_slots;                      // whole free slots
    std::map<uint64_t, CarvedSlot> carved;              // slot -> its pieces
    std::map<uint64_t, std::set<uint64_t>> partial;     // class -> carved slots with a free piece
  };

  uint64_t AllocBytes(uint64_t length) const {
    const uint64_t piece = std::max(kIoAlign, std::bit_ceil(length));
    return piece <= SlotBytes() / 2 && SlotBytes() % piece == 0 ? piece : SlotBytes();
  }

  mutable std::mutex mu_;
  // Guarded by mu_.
  std::map<uint32_t, TensorInfo> tensors_;       // by id
  std::map<std::string, uint32_t, std::less<>> names_;  // name -> id
  uint32_t next_tensor_id_ = 0;
  GenerationInfo latest_;
  std::map<uint64_t, GenerationInfo> generations_;  // retained generation records
  std::map<std::string, SnapshotInfo> snapshots_;
  std::map<Key, std::vector<Version>> versions_;    // committed, newest first
  std::map<Key, Extent> pending_;                   // completed writes of latest+1
  std::vector<DirSpace> space_;                     // per data dir: slots and pieces
  std::vector<bool> dirty_;                         // written since last sync
  std::vector<bool> grown_;                         // fallocated since last sync
  uint32_t next_dir_ = 0;
  uint64_t lifetime_bytes_ = 0;
  std::map<uint64_t, int> view_refs_;               // in-process views per generation
  bool poisoned_ = false;
  std::string poison_reason_;
  uint64_t writes_in_flight_ = 0;

  std::string FileName(uint32_t dir) const {
    return JoinPath(identity_.data_dirs[dir], identity_.uuid + ".chunks");
  }

  Status CheckWritable(std::string_view what) const {  // mu_ held
    if (read_only_) {
      return FailedPrecondition("store " + path_ + ": " + std::string(what) +
                                " on a store opened read-only");
    }
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
  Status SnapshotNotFound(const std::string& name) const {
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
  Status LoadIndexChecked(uint64_t acked);

  // A secondary instance of the index with its own files in `dir` (created
  // here, removed again on failure). `what` names the attempt in the error.
  Result<std::unique_ptr<rocksdb::DB>> OpenSecondary(const std::string& dir, const std::string& what);

  // Catches up with the writer and loads the index, checked; after a failed
  // check (or at once, if reopen_first) through a fresh secondary instance, up
  // to 4 tries in about 30 ms. Read-only stores.
  // A catch-up that brought nothing (the instance's last sequence number is
  // the one the maps were loaded and checked at, and COMMITTED is not ahead of
  // them) keeps the maps: reloading the whole index took 25 ms for a store of
  // 5000 tensors (dev VM), under mu_, and the mount catches up on a lookup
  // under latest/ every catchup_interval_ms. Every write of the writer moves
  // the sequence number; a flush or compaction alone does not, and changes no
  // value (or, with the secondary's replay bugs above, shows an older one:
  // the checked maps are the better copy then).
  Status CatchUpChecked(bool reopen_first);

  // --- index loading -------------------------------------------------------

  // Rebuilds every in-memory map from the index. mu_ held.
  Status LoadIndex();

  // Free space = the data files minus what the committed versions use (slots
  // and pieces; see DirSpace). mu_ held.
  Status BuildFreeLists();

  // --- slots and pieces (mu_ held) ----------------------------------------

  uint64_t FreeBytes(uint32_t d) const;

  // How the allocator holds [off, off + bytes) of dir d.
  enum class Held { kInUse, kFree, kOtherClass };
  Held HeldAs(uint32_t d, uint64_t off, uint64_t bytes) const;

  // Space for a chunk version of `length` bytes: a free piece of its class
  // (lowest offset first, so freed slots coalesce), else a free slot (carved
  // for a short chunk), round-robin over the data dirs, growing files as
  // needed.
  Result<Extent> AllocateSlot(uint64_t length);

  // Returns an extent's slot or piece to the free lists.
  void FreeSlot(const Extent& e);

  // Records a completed write as the chunk's pending version. mu_ held.
  void SetPending(const Key& k, const Extent& e);

  // Newest version of k: pending, else latest committed; nullopt = zeros. mu_ held.
  std::optional<Version> Newest(const Key& k) const;

  // Validates ref against the tensor map; returns the tensor and chunk length. mu_ held.
  Result<std::pair<const TensorInfo*, uint64_t>> Resolve(const std::map<uint32_t, TensorInfo>& tensors,
                                                         const ChunkRef& ref) const;

  // --- index digests ----------------------------------------------------------

  // Whether this index shows generation g as its writer committed it; Busy if
  // not (a read-only store's RocksDB secondary instance lagging or holding
  // stale entries). mu_ held.
  Status CheckIndexOf(uint64_t g) const;

  // --- RETAINED ------------------------------------------------------------

  // Reader, lease flock held. nullopt when the store has no usable RETAINED
  // (written by an older version, or torn by a crash; the writer rewrites it
  // at open): the caller falls back to its own index.
  std::optional<std::vector<uint64_t>> ReadRetained();

  // Forgets the tensors that only the pending generation holds (created after
  // the latest commit): an aborted step's or a crashed writer's registrations
  // must not reach the next commit as tensors of zeros. Writer, mu_ held.
  Status DropUncommittedTensors();

  // --- leases --------------------------------------------------------------

  Result<FlockGuard> LockLeases(int op);

  static constexpr std::string_view kLeaseSuffix = ".flock";

  // --- GC ------------------------------------------------------------------

  struct GcPlan {
    std::vector<std::pair<Key, uint64_t>> dead_versions;  // (chunk, gen)
    std::vector<uint64_t> dead_generations;
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
  std::string CommittedRecoveryHint(uint64_t latest) const;
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

  Result<uint64_t> Commit(const CommitInfo& info);

 private:
  // A fresh secondary instance in place of the current one. catchup_mu_ held.
  Status ReopenSecondary();

  // Starts slot s of sp as a carved slot of class piece_bytes, all pieces free.
  CarvedSlot& Carve(DirSpace* sp, uint64_t s, uint64_t piece_bytes);

  // Marks piece i of carved slot s in use or free, keeping `partial` exact.
  // Freeing the last used piece returns the slot to the whole-slot free list.
  void SetPiece(DirSpace* sp, uint64_t s, CarvedSlot* c, uint64_t i, bool in_use);

  // Grows dir d's file (or by one slot when that does not fit). The growth
  // doubles the file, from 4 slots up to the preallocation step, so a small
  // store does not reserve a whole step (1 GiB by default) on disk.
  Status Grow(uint32_t d);

  // Version of k visible in generation g. mu_ held.
  std::optional<Version> AtGeneration(const Key& k, uint64_t g) const;

  // Digest of generation g as this process's index shows it (BuildView's
  // selection: tensors created at or before g, each chunk's newest version at
  // or below g). mu_ held.
  uint64_t IndexDigest(uint64_t g) const;

  // Digest of generation gen about to be committed: the pending versions over
  // the newest committed ones. mu_ held.
  uint64_t CommitDigest(uint64_t gen) const;

  // "OSRETAIN", count (LE), the generations (LE, ascending), XXH3 of all that.
  static std::string EncodeRetained(const std::vector<uint64_t>& gens);
  static Result<std::vector<uint64_t>> DecodeRetained(const std::string& rec, const std::string& where);

  // The generations with records, plus `adding` (a commit's new one). mu_ held.
  std::vector<uint64_t> GenerationNumbers(std::optional<uint64_t> adding = std::nullopt) const;

  // Writer, exclusive lease flock held. A batch that drops generations is
  // framed by two writes: before it, every generation before or after it (so
  // a reader whose index shows either side finds its generation, even if the
  // writer dies in between); after it, the exact set. Readers only read under
  // the shared flock, so they see one of the two. Not synced: RETAINED only
  // has to hold while processes that can read it live; Open rewrites it.
  Status WriteRetained(const std::vector<uint64_t>& gens);

  // After a durable batch: the exact set. A failure leaves the superset
  // written before the batch (safe for readers); the next GC retries.
  void RewriteRetainedAfterBatch();

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
  Result<std::vector<uint64_t>> LeasedGenerations();

  // Whether a reader holds the flock of lease file `file`; removes it if not.
  // Lease flock held (LOCK_EX).
  bool LeaseFileHeld(const std::string& file);

  // Which versions/generation records no retained generation can see once
  // `new_gen` (with pending_ as its new versions, if publish) is latest. mu_ held.
  GcPlan PlanGc(uint64_t new_gen, bool publish, const std::vector<uint64_t>& leased) const;
  void AddGcToBatch(const GcPlan& plan, rocksdb::WriteBatch* b) const;
  void ApplyGc(const GcPlan& plan);  // mu_ held, after the batch is durable

  // 32 bytes: "OSCOMMIT", generation (LE), XXH3 of those 16 bytes, zeros.
  static std::string EncodeCommittedMark(uint64_t gen);
  static Result<uint64_t> DecodeCommittedMark(const std::string& rec, const std::string& where);
  void Poison(const Status& why);  // mu_ held
};

// --- names (store.cc) ------------------------------------------------------

size_t EditDistance(std::string_view a, std::string_view b);

// "; closest: 'a', 'b', 'c'" over `names`, or "" when there are none.
template <typename It>
std::string ClosestNames(std::string_view want, It begin, It end) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (It it = begin; it != end; ++it) scored.emplace_back(EditDistance(want, *it), *it);
  if (scored.empty()) return "; the store has no tensors";
  std::sort(scored.begin(), scored.end());
  std::string s = "; closest:";
  for (size_t i = 0; i < scored.size() && i < 3; ++i) s += (i ? ", '" : " '") + scored[i].second + "'";
  return s;
}

// --- opening (store_open.cc and the files of each step) --------------------

// Opens the data file of every data dir that has one (all, creating the
// missing ones, if create_missing). store_data_files.cc.
Status OpenDataFiles(Core* core, bool create_missing);

// Turns the data dirs recorded in IDENTITY into absolute paths for this store
// directory and marks which lie inside it. store_data_files.cc.
Status ResolveDataDirs(Core* c);

// Writer: makes each open data file this store directory's (flock and owner
// record), or refuses. store_data_files.cc.
Status ClaimDataFiles(Core* c);

// Corruption when a committed version references a data file that is not
// open. mu_ held. store_data_files.cc.
Status CheckReferencedFiles(Core* core);

// Opens (creating if absent) COMMITTED and refuses an index older than the
// generation it records. store_marks.cc.
Status OpenCommittedMark(Core* c);

// Writer: creates leases/ and opens leases/.lock. store_leases.cc.
Status OpenLeaseLock(Core* c);

// Read-only stores keep a RocksDB secondary instance in a directory of their
// own under /tmp (its info log; the instance holds no data). A reader killed
// by SIGKILL or a power loss leaves it behind, so each reader flocks
// <dir>.lock while it lives, and every read-only open removes the directories
// whose lock nobody holds: the kernel drops a flock when its process ends,
// however it ends, in any pid namespace. Directories of readers that predate
// the lock file are removed when their pid (the name's first number) is gone.
// store_secondary.cc.
inline constexpr const char* kSecondaryRoot = "/tmp";
inline constexpr const char* kSecondaryPrefix = "optstate-secondary-";
// The flock'ed descriptor of <base>.lock, or -1 (the directory then only ages
// out by its pid).
int LockSecondaryBase(const std::string& base);
void RemoveStaleSecondaryDirs(const std::string& root);

// The Store over an opened core (store.cc).
std::unique_ptr<Store> NewStore(std::shared_ptr<Core> core);

// Store::Verify (store_verify.cc).
Result<VerifyReport> VerifyStore(const std::shared_ptr<Core>& core);

}  // namespace optstate::vfs::internal
