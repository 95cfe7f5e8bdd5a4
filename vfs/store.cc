// Store implementation (vfs/store.h): RocksDB index, copy-on-write chunk
// versions in preallocated data files, generations, snapshots, leases, GC.
//
// Shared state lives in Core, owned by shared_ptr by the Store, its
// GenerationViews and ChunkIos, so a view or ChunkIo may outlive the Store
// object (the index and LOCK stay open until the last one goes).
//
// Lock order: Core::mu_ may be taken while holding the lease flock
// (leases/.lock, LOCK_EX in GC); never the other way round.
#include "vfs/store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <cerrno>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "vfs/internal/chunk_hasher.h"
#include "vfs/internal/rocks_util.h"
#include "vfs/internal/store_format.h"
#include "vfs/io_buffer.h"
#include "vfs/io_engine.h"
#include "vfs/log.h"

namespace optstate::vfs {

// ---------------------------------------------------------------------------
// Small public helpers declared in store.h.

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view s) {
  if (s == "f32" || s == "float32") return DType::kF32;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f16" || s == "float16") return DType::kF16;
  return InvalidArgument("unknown dtype '" + std::string(s) + "' (expected f32, bf16 or f16)");
}

uint32_t DTypeSize(DType d) { return d == DType::kF32 ? 4 : 2; }

std::vector<FieldSpec> AdamFields() {
  return {{"main", DType::kF32}, {"exp_avg", DType::kF32}, {"exp_avg_sq", DType::kF32}};
}

uint64_t TensorInfo::field_bytes(uint32_t field) const {
  if (field >= fields.size()) return 0;
  return numel * DTypeSize(fields[field].dtype);
}

namespace {

using internal::Extent;
using internal::RocksStatus;

constexpr uint64_t kIoAlign = 4096;
constexpr uint64_t kInfinity = UINT64_MAX;

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string JoinPath(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::string AbsPath(const std::string& p) {
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

// GenerationInfo::index_digest is a wrapping sum of one XXH3 per tensor the
// generation sees and one per chunk version it sees, so the writer (its maps
// plus the pending versions) and a reader (its own index) need not walk them
// in the same order.
uint64_t TensorDigest(const TensorInfo& t) {
  const uint64_t a[4] = {t.id, t.numel, t.fields.size(), t.created_generation};
  return ChunkChecksum(a, sizeof(a));
}
uint64_t VersionDigest(const Key& k, const Version& v) {
  const uint64_t a[8] = {k.t, k.f, k.c, v.gen, v.ext.dir, v.ext.file_offset, v.ext.length, v.ext.checksum};
  return ChunkChecksum(a, sizeof(a));
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

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

bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<uint8_t>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

Status ValidateSnapshotName(const std::string& name) {
  if (name.empty() || name.size() > 255 || name == "." || name == "..") {
    return InvalidArgument("invalid snapshot name '" + name + "': 1..255 characters, not '.' or '..'");
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return InvalidArgument("invalid snapshot name '" + name + "': only [A-Za-z0-9._-] allowed");
    }
  }
  return Status();
}

// Forwards RocksDB's warnings and errors to our log instead of a LOG file
// (also keeps RocksDB's background logging out of fault-injection op counts).
class RocksLogger : public rocksdb::Logger {
 public:
  RocksLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char buf[1024];
    vsnprintf(buf, sizeof(buf), format, ap);
    OPTSTATE_LOG_WARN("rocksdb: {}", buf);
  }
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
    const uint64_t off = index * chunk();
    return off >= bytes ? 0 : std::min(chunk(), bytes - off);
  }
  static uint64_t ChunkCountOf(const TensorInfo& t, uint32_t field, uint64_t chunk) {
    return (t.field_bytes(field) + chunk - 1) / chunk;
  }

  std::string Describe(const TensorInfo* t, const Key& k, uint64_t gen) const {
    std::string s = "store " + path_ + " tensor '" + (t ? t->name : "#" + std::to_string(k.t)) +
                    "' field '" +
                    (t && k.f < t->fields.size() ? t->fields[k.f].name : "#" + std::to_string(k.f)) +
                    "' chunk " + std::to_string(k.c);
    if (gen != kInfinity) s += " generation " + std::to_string(gen);
    return s;
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
  Status LoadIndexChecked(uint64_t acked) {
    auto saved = std::make_tuple(std::move(tensors_), std::move(names_), next_tensor_id_, latest_,
                                 std::move(generations_), std::move(snapshots_), std::move(versions_), lifetime_bytes_);
    Status s = LoadIndex();
    const uint64_t floor = std::max(acked, max_latest_loaded_);
    if (s.ok() && latest_.generation < floor) {
      s = Busy("store " + path_ + ": this reader's copy of the index shows generation " +
               std::to_string(latest_.generation) + " as latest, but generation " + std::to_string(floor) +
               (floor == acked ? " was acknowledged (COMMITTED)" : " was latest before") +
               ": the RocksDB secondary instance lags the writer" +
               (floor == acked ? " (if this persists while no writer runs, the index lost acknowledged "
                                 "generations: the store is damaged; run `optstate-inspect " +
                                     path_ + " verify`)"
                               : ""));
    }
    if (s.ok()) s = CheckIndexOf(latest_.generation);
    if (!s.ok()) {
      std::tie(tensors_, names_, next_tensor_id_, latest_, generations_, snapshots_, versions_, lifetime_bytes_) =
          std::move(saved);
      loaded_seq_.reset();
      return s;
    }
    max_latest_loaded_ = latest_.generation;
    loaded_seq_ = db_->GetLatestSequenceNumber();
    return s;
  }

  // A secondary instance of the index with its own files in `dir` (created
  // here, removed again on failure). `what` names the attempt in the error.
  Result<std::unique_ptr<rocksdb::DB>> OpenSecondary(const std::string& dir, const std::string& what) {
    OPTSTATE_RETURN_IF_ERROR(fs_->CreateDir(dir));
    rocksdb::Options o = IndexOptions(this);
    // Each catch-up that brings a new version opens its table files through a
    // pool of this many threads, created and ended every time (default 16:
    // the mount's daemon created thousands of threads in a `cp -r`); the
    // index has few table files.
    o.max_file_opening_threads = 1;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status rs = rocksdb::DB::OpenAsSecondary(o, JoinPath(path_, "index"), dir, &raw);
    if (!rs.ok()) {
      (void)fs_->RemoveAll(dir);
      return RocksStatus("store " + path_ + what, rs);
    }
    return std::unique_ptr<rocksdb::DB>(raw);
  }

  // A fresh secondary instance in place of the current one. catchup_mu_ held.
  Status ReopenSecondary() {
    const std::string dir = secondary_base_ + "-r" + std::to_string(++secondary_reopens_);
    OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<rocksdb::DB> db, OpenSecondary(dir, ": reopen of the index (secondary)"));
    std::unique_ptr<rocksdb::DB> old;
    std::string old_dir;
    {
      std::lock_guard l(mu_);
      old = std::exchange(db_, std::move(db));
      old_dir = std::exchange(secondary_dir_, dir);
    }
    old.reset();
    (void)fs_->RemoveAll(old_dir);
    return Status();
  }

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
  Status CatchUpChecked(bool reopen_first) {
    std::lock_guard cl(catchup_mu_);
    const uint64_t acked = ReadAckedGeneration();  // before the catch-up: a floor for it
    Status s;
    for (int attempt = 0; attempt < 4; ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5 * attempt));
      if (attempt == 0 && !reopen_first) {
        s = RocksStatus("store " + path_ + ": catch up with the writer", db_->TryCatchUpWithPrimary());
        if (s.ok() && loaded_seq_.has_value() && *loaded_seq_ == db_->GetLatestSequenceNumber()) {
          std::lock_guard l(mu_);
          if (acked <= latest_.generation) return s;
        }
      } else {
        s = ReopenSecondary();
      }
      if (s.ok()) {
        std::lock_guard l(mu_);
        s = LoadIndexChecked(acked);
      }
      if (s.ok()) return s;
      OPTSTATE_LOG_INFO("store {}: catch-up try {} failed ({}); reopening the index", path_, attempt + 1,
                        s.ToString());
    }
    return s;
  }

  // --- index loading -------------------------------------------------------

  // Rebuilds every in-memory map from the index. mu_ held.
  Status LoadIndex() {
    tensors_.clear();
    names_.clear();
    generations_.clear();
    snapshots_.clear();
    versions_.clear();
    rocksdb::ReadOptions ro;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
    bool have_latest = false, have_identity = false;
    uint64_t latest = 0;
    const std::string where = "store " + path_ + ": index";
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const std::string_view k(it->key().data(), it->key().size());
      const std::string_view v(it->value().data(), it->value().size());
      if (k.starts_with(internal::kChunkPrefix)) {
        OPTSTATE_ASSIGN_OR_RETURN(auto parts, internal::ParseChunkKey(k));
        OPTSTATE_ASSIGN_OR_RETURN(auto ext, internal::DecodeExtent(v));
        // Keys sort newest first within a chunk.
        versions_[Key{parts.tensor, parts.field, parts.chunk}].push_back(Version{parts.gen, ext});
      } else if (k.starts_with(internal::kTensorPrefix)) {
        auto t = internal::DecodeTensor(v);
        if (!t.ok()) return t.status().WithContext(where);
        names_[t->name] = t->id;
        tensors_[t->id] = std::move(*t);
      } else if (k.starts_with(internal::kGenerationPrefix)) {
        auto g = internal::DecodeGeneration(v);
        if (!g.ok()) return g.status().WithContext(where);
        generations_[g->generation] = std::move(*g);
      } else if (k.starts_with(internal::kSnapshotPrefix)) {
        auto s = internal::DecodeSnapshot(k.substr(internal::kSnapshotPrefix.size()), v);
        if (!s.ok()) return s.status().WithContext(where);
        snapshots_[s->name] = std::move(*s);
      } else if (k == internal::kLatestKey) {
        OPTSTATE_ASSIGN_OR_RETURN(latest, internal::DecodeU64(v, where + " latest"));
        have_latest = true;
      } else if (k == internal::kNextTensorIdKey) {
        OPTSTATE_ASSIGN_OR_RETURN(uint64_t n, internal::DecodeU64(v, where + " next tensor id"));
        next_tensor_id_ = static_cast<uint32_t>(n);
      } else if (k == internal::kLifetimeKey) {
        OPTSTATE_ASSIGN_OR_RETURN(lifetime_bytes_, internal::DecodeU64(v, where + " lifetime"));
      } else if (k == internal::kIdentityKey) {
        auto id = internal::DecodeIdentity(v, where + " identity");
        if (!id.ok()) return id.status();
        if (id->uuid != identity_.uuid) {
          return Corruption(where + " belongs to store uuid " + id->uuid + " but IDENTITY says " +
                            identity_.uuid);
        }
        have_identity = true;
      }
    }
    OPTSTATE_RETURN_IF_ERROR(RocksStatus(where + " scan", it->status()));
    if (!have_latest || !have_identity) {
      return Corruption(where + " lacks its identity or latest-generation record");
    }
    auto g = generations_.find(latest);
    if (g == generations_.end()) {
      return Corruption(where + ": latest generation " + std::to_string(latest) + " has no record");
    }
    latest_ = g->second;
    // Versions newer than latest cannot exist (published with latest in one
    // batch); a secondary instance might see them mid-catch-up: drop them.
    for (auto& [key, vs] : versions_) {
      std::erase_if(vs, [&](const Version& v) { return v.gen > latest; });
    }
    std::erase_if(versions_, [](const auto& kv) { return kv.second.empty(); });
    return Status();
  }

  // Free space = the data files minus what the committed versions use (slots
  // and pieces; see DirSpace). mu_ held.
  Status BuildFreeLists() {
    const size_t n = identity_.data_dirs.size();
    const uint64_t slot_bytes = SlotBytes();
    space_.assign(n, {});
    dirty_.assign(n, false);
    grown_.assign(n, false);
    for (uint32_t d = 0; d < n; ++d) {
      if (!data_files_[d]) continue;
      OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, data_files_[d]->Size());
      space_[d].slots = size / slot_bytes;
    }
    // Per dir: slot -> class of what it holds (slot_bytes: used whole), and the
    // pieces in use; the first version seen in a slot names it in errors.
    struct SlotUse {
      uint64_t piece_bytes = 0;
      std::set<uint64_t> pieces;
      Key key;
      uint64_t gen = 0;
    };
    std::vector<std::map<uint64_t, SlotUse>> used(n);
    for (const auto& [key, vs] : versions_) {
      for (const auto& v : vs) {
        auto describe = [&] {
          auto t = tensors_.find(key.t);
          return Describe(t == tensors_.end() ? nullptr : &t->second, key, v.gen) + ": extent (data dir " +
                 std::to_string(v.ext.dir) + ", offset " + std::to_string(v.ext.file_offset) + ", length " +
                 std::to_string(v.ext.length) + ")";
        };
        const uint64_t bytes = v.ext.length == 0 ? 0 : AllocBytes(v.ext.length);
        if (v.ext.dir >= n || bytes == 0 || v.ext.file_offset % bytes != 0 ||
            v.ext.file_offset / slot_bytes >= space_[v.ext.dir].slots) {
          return Corruption(describe() + " lies outside the data files");
        }
        const uint64_t slot = v.ext.file_offset / slot_bytes;
        auto [it, fresh] = used[v.ext.dir].try_emplace(slot);
        SlotUse& u = it->second;
        if (fresh) {
          u.piece_bytes = bytes;
          u.key = key;
          u.gen = v.gen;
        } else if (u.piece_bytes != bytes) {
          auto t = tensors_.find(u.key.t);
          return Corruption(describe() + " shares slot " + std::to_string(slot) + " with a " +
                            std::to_string(u.piece_bytes) + "-byte extent of " +
                            Describe(t == tensors_.end() ? nullptr : &t->second, u.key, u.gen) +
                            " (extents of one slot must have one size class)");
        }
        u.pieces.insert((v.ext.file_offset - slot * slot_bytes) / bytes);
      }
    }
    for (uint32_t d = 0; d < n; ++d) {
      DirSpace& sp = space_[d];
      for (uint64_t s = 0; s < sp.slots; ++s) {
        auto u = used[d].find(s);
        if (u == used[d].end()) {
          sp.free_slots.insert(s);
          continue;
        }
        if (u->second.piece_bytes == slot_bytes) continue;
        CarvedSlot& c = Carve(&sp, s, u->second.piece_bytes);
        for (uint64_t i : u->second.pieces) SetPiece(&sp, s, &c, i, true);
      }
    }
    return Status();
  }

  // --- slots and pieces (mu_ held) ----------------------------------------

  // Starts slot s of sp as a carved slot of class piece_bytes, all pieces free.
  CarvedSlot& Carve(DirSpace* sp, uint64_t s, uint64_t piece_bytes) {
    CarvedSlot& c = sp->carved[s];
    c.piece_bytes = piece_bytes;
    c.used = 0;
    c.bits.assign((c.pieces(SlotBytes()) + 63) / 64, 0);
    sp->partial[piece_bytes].insert(s);
    return c;
  }

  // Marks piece i of carved slot s in use or free, keeping `partial` exact.
  // Freeing the last used piece returns the slot to the whole-slot free list.
  void SetPiece(DirSpace* sp, uint64_t s, CarvedSlot* c, uint64_t i, bool in_use) {
    if (c->InUse(i) == in_use) return;
    c->bits[i / 64] ^= uint64_t{1} << (i % 64);
    const uint64_t pieces = c->pieces(SlotBytes());
    if (in_use) {
      if (++c->used == pieces) sp->partial[c->piece_bytes].erase(s);
      return;
    }
    if (--c->used > 0) {
      sp->partial[c->piece_bytes].insert(s);
      return;
    }
    sp->partial[c->piece_bytes].erase(s);
    sp->carved.erase(s);
    sp->free_slots.insert(s);
  }

  uint64_t FreeBytes(uint32_t d) const {
    const DirSpace& sp = space_[d];
    uint64_t b = sp.free_slots.size() * SlotBytes();
    for (const auto& [s, c] : sp.carved) b += (c.pieces(SlotBytes()) - c.used) * c.piece_bytes;
    return b;
  }

  // How the allocator holds [off, off + bytes) of dir d.
  enum class Held { kInUse, kFree, kOtherClass };
  Held HeldAs(uint32_t d, uint64_t off, uint64_t bytes) const {
    const DirSpace& sp = space_[d];
    const uint64_t s = off / SlotBytes();
    if (sp.free_slots.count(s)) return Held::kFree;
    auto c = sp.carved.find(s);
    if (c == sp.carved.end()) return bytes == SlotBytes() ? Held::kInUse : Held::kOtherClass;
    if (c->second.piece_bytes != bytes) return Held::kOtherClass;
    return c->second.InUse((off - s * SlotBytes()) / bytes) ? Held::kInUse : Held::kFree;
  }

  // Grows dir d's file (or by one slot when that does not fit). The growth
  // doubles the file, from 4 slots up to the preallocation step, so a small
  // store does not reserve a whole step (1 GiB by default) on disk.
  Status Grow(uint32_t d) {
    File* f = data_files_[d].get();
    DirSpace& sp = space_[d];
    const uint64_t max_slots = std::max<uint64_t>(1, opts_.preallocate_step_bytes / SlotBytes());
    const uint64_t step_slots = std::min<uint64_t>(max_slots, std::max<uint64_t>(4, sp.slots));
    Status last;
    for (uint64_t want : {step_slots, uint64_t{1}}) {
      const uint64_t off = sp.slots * SlotBytes();
      last = f->Fallocate(off, want * SlotBytes());
      if (last.ok()) {
        for (uint64_t s = sp.slots; s < sp.slots + want; ++s) sp.free_slots.insert(s);
        sp.slots += want;
        grown_[d] = true;
        return Status();
      }
      if (want == 1) break;
    }
    return last;
  }

  // Space for a chunk version of `length` bytes: a free piece of its class
  // (lowest offset first, so freed slots coalesce), else a free slot (carved
  // for a short chunk), round-robin over the data dirs, growing files as
  // needed.
  Result<Extent> AllocateSlot(uint64_t length) {
    const uint32_t n = static_cast<uint32_t>(data_files_.size());
    const uint64_t bytes = AllocBytes(length);
    std::string errors;
    Status first_error;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t d = (next_dir_ + i) % n;
      DirSpace& sp = space_[d];
      Extent e;
      e.dir = d;
      e.length = length;
      auto part = bytes < SlotBytes() ? sp.partial.find(bytes) : sp.partial.end();
      if (part != sp.partial.end() && !part->second.empty()) {
        const uint64_t s = *part->second.begin();
        CarvedSlot& c = sp.carved.at(s);
        uint64_t piece = 0;  // the first free one (partial: there is one)
        for (size_t w = 0; w < c.bits.size(); ++w) {
          if (c.bits[w] != ~uint64_t{0}) {
            piece = w * 64 + std::countr_one(c.bits[w]);
            break;
          }
        }
        SetPiece(&sp, s, &c, piece, true);
        e.file_offset = s * SlotBytes() + piece * bytes;
      } else {
        if (sp.free_slots.empty()) {
          Status s = Grow(d);
          if (!s.ok()) {
            if (first_error.ok()) first_error = s;
            errors += (errors.empty() ? "" : "; ") + s.ToString();
            continue;
          }
        }
        const uint64_t s = *sp.free_slots.begin();
        sp.free_slots.erase(sp.free_slots.begin());
        if (bytes < SlotBytes()) SetPiece(&sp, s, &Carve(&sp, s, bytes), 0, true);
        e.file_offset = s * SlotBytes();
      }
      next_dir_ = (d + 1) % n;
      dirty_[d] = true;
      return e;
    }
    std::string dirs;
    for (const auto& d : identity_.data_dirs) dirs += (dirs.empty() ? "" : ", ") + d;
    const std::string msg = "store " + path_ + ": no free chunk slot and cannot grow data files in " +
                            dirs + ": " + errors;
    if (first_error.code() == StatusCode::kNoSpace) return Status(StatusCode::kNoSpace, msg, ENOSPC);
    return Status(first_error.code() == StatusCode::kOk ? StatusCode::kIoError : first_error.code(), msg,
                  first_error.err());
  }

  // Returns an extent's slot or piece to the free lists.
  void FreeSlot(const Extent& e) {
    DirSpace& sp = space_[e.dir];
    const uint64_t bytes = AllocBytes(e.length);
    const uint64_t s = e.file_offset / SlotBytes();
    if (bytes == SlotBytes()) {
      sp.free_slots.insert(s);
      return;
    }
    auto c = sp.carved.find(s);
    if (c == sp.carved.end() || c->second.piece_bytes != bytes) {
      // Cannot happen while the maps match the index; Verify reports it.
      OPTSTATE_LOG_ERROR("store {}: freeing a {}-byte piece at dir {} offset {} that the allocator does not hold",
                         path_, bytes, e.dir, e.file_offset);
      return;
    }
    SetPiece(&sp, s, &c->second, (e.file_offset - s * SlotBytes()) / bytes, false);
  }

  // Records a completed write as the chunk's pending version. mu_ held.
  void SetPending(const Key& k, const Extent& e) {
    auto [it, inserted] = pending_.try_emplace(k, e);
    if (!inserted) {
      FreeSlot(it->second);
      it->second = e;
    }
    lifetime_bytes_ += e.length;
  }

  // Newest version of k: pending, else latest committed; nullopt = zeros. mu_ held.
  std::optional<Version> Newest(const Key& k) const {
    auto p = pending_.find(k);
    if (p != pending_.end()) return Version{latest_.generation + 1, p->second};
    auto v = versions_.find(k);
    if (v == versions_.end() || v->second.empty()) return std::nullopt;
    return v->second.front();
  }

  // Version of k visible in generation g. mu_ held.
  std::optional<Version> AtGeneration(const Key& k, uint64_t g) const {
    auto v = versions_.find(k);
    if (v == versions_.end()) return std::nullopt;
    for (const auto& ver : v->second) {
      if (ver.gen <= g) return ver;
    }
    return std::nullopt;
  }

  // Validates ref against the tensor map; returns the tensor and chunk length. mu_ held.
  Result<std::pair<const TensorInfo*, uint64_t>> Resolve(const std::map<uint32_t, TensorInfo>& tensors,
                                                         const ChunkRef& ref) const {
    auto t = tensors.find(ref.tensor_id);
    if (t == tensors.end()) {
      return NotFound("store " + path_ + ": no tensor with id " + std::to_string(ref.tensor_id));
    }
    if (ref.field >= t->second.fields.size()) {
      return InvalidArgument("store " + path_ + " tensor '" + t->second.name + "': no field #" +
                             std::to_string(ref.field) + " (it has " +
                             std::to_string(t->second.fields.size()) + ")");
    }
    const uint64_t n = ChunkCountOf(t->second, ref.field, chunk());
    if (ref.index >= n) {
      return InvalidArgument(Describe(&t->second, Key{ref.tensor_id, ref.field, ref.index}, kInfinity) +
                             ": out of range (the field has " + std::to_string(n) + " chunks)");
    }
    return std::make_pair(&t->second, ChunkLen(t->second, ref.field, ref.index));
  }

  // --- index digests ----------------------------------------------------------

  // Digest of generation g as this process's index shows it (BuildView's
  // selection: tensors created at or before g, each chunk's newest version at
  // or below g). mu_ held.
  uint64_t IndexDigest(uint64_t g) const {
    uint64_t d = 0;
    for (const auto& [id, t] : tensors_) {
      if (t.created_generation <= g) d += TensorDigest(t);
    }
    for (const auto& [key, vs] : versions_) {
      auto t = tensors_.find(key.t);
      if (t == tensors_.end() || t->second.created_generation > g) continue;
      for (const auto& v : vs) {
        if (v.gen <= g) {
          d += VersionDigest(key, v);
          break;
        }
      }
    }
    return d;
  }

  // Digest of generation gen about to be committed: the pending versions over
  // the newest committed ones. mu_ held.
  uint64_t CommitDigest(uint64_t gen) const {
    uint64_t d = 0;
    for (const auto& [id, t] : tensors_) d += TensorDigest(t);
    for (const auto& [key, vs] : versions_) {
      if (!vs.empty() && !pending_.count(key)) d += VersionDigest(key, vs.front());
    }
    for (const auto& [key, ext] : pending_) d += VersionDigest(key, Version{gen, ext});
    return d;
  }

  // Whether this index shows generation g as its writer committed it; Busy if
  // not (a read-only store's RocksDB secondary instance lagging or holding
  // stale entries). mu_ held.
  Status CheckIndexOf(uint64_t g) const {
    auto it = generations_.find(g);
    if (it == generations_.end() || it->second.index_digest == 0) return Status();
    const uint64_t d = IndexDigest(g);
    if (d == it->second.index_digest) return Status();
    char m[96];
    snprintf(m, sizeof(m), " as it was committed (index digest %016llx, recorded %016llx)",
             static_cast<unsigned long long>(d), static_cast<unsigned long long>(it->second.index_digest));
    return Busy("store " + path_ + ": this reader's copy of the index does not show generation " +
                std::to_string(g) + m + ": the RocksDB secondary instance lags the writer");
  }

  // --- RETAINED ------------------------------------------------------------

  // "OSRETAIN", count (LE), the generations (LE, ascending), XXH3 of all that.
  static std::string EncodeRetained(const std::vector<uint64_t>& gens) {
    std::string rec(16 + 8 * gens.size() + 8, '\0');
    std::memcpy(rec.data(), "OSRETAIN", 8);
    const uint64_t n = gens.size();
    std::memcpy(rec.data() + 8, &n, 8);
    if (n > 0) std::memcpy(rec.data() + 16, gens.data(), 8 * n);
    const uint64_t sum = ChunkChecksum(rec.data(), rec.size() - 8);
    std::memcpy(rec.data() + rec.size() - 8, &sum, 8);
    return rec;
  }
  static Result<std::vector<uint64_t>> DecodeRetained(const std::string& rec, const std::string& where) {
    uint64_t n = 0, sum = 0;
    if (rec.size() < 24 || std::memcmp(rec.data(), "OSRETAIN", 8) != 0) {
      return Corruption(where + ": not a RETAINED record (" + std::to_string(rec.size()) + " bytes)");
    }
    std::memcpy(&n, rec.data() + 8, 8);
    if (n > (rec.size() - 24) / 8) return Corruption(where + ": count " + std::to_string(n) + " overruns the file");
    std::memcpy(&sum, rec.data() + 16 + 8 * n, 8);
    if (sum != ChunkChecksum(rec.data(), 16 + 8 * n)) return Corruption(where + ": checksum mismatch");
    std::vector<uint64_t> gens(n);
    if (n > 0) std::memcpy(gens.data(), rec.data() + 16, 8 * n);
    return gens;
  }

  // The generations with records, plus `adding` (a commit's new one). mu_ held.
  std::vector<uint64_t> GenerationNumbers(std::optional<uint64_t> adding = std::nullopt) const {
    std::vector<uint64_t> out;
    for (const auto& [g, info] : generations_) out.push_back(g);
    if (adding && (out.empty() || out.back() < *adding)) out.push_back(*adding);
    return out;
  }

  // Writer, exclusive lease flock held. A batch that drops generations is
  // framed by two writes: before it, every generation before or after it (so
  // a reader whose index shows either side finds its generation, even if the
  // writer dies in between); after it, the exact set. Readers only read under
  // the shared flock, so they see one of the two. Not synced: RETAINED only
  // has to hold while processes that can read it live; Open rewrites it.
  Status WriteRetained(const std::vector<uint64_t>& gens) {
    if (retained_file_ == nullptr || (retained_written_ && gens == *retained_written_)) return Status();
    const std::string rec = EncodeRetained(gens);
    OPTSTATE_RETURN_IF_ERROR(retained_file_->Pwrite(0, rec.data(), rec.size()).WithContext("store " + path_ +
                                                                                             ": RETAINED"));
    retained_written_ = gens;
    return Status();
  }

  // After a durable batch: the exact set. A failure leaves the superset
  // written before the batch (safe for readers); the next GC retries.
  void RewriteRetainedAfterBatch() {
    if (Status s = WriteRetained(GenerationNumbers()); !s.ok()) {
      OPTSTATE_LOG_WARN("store {}: {} (it still lists generations just collected; the next GC rewrites it)", path_,
                        s.ToString());
    }
  }

  // Reader, lease flock held. nullopt when the store has no usable RETAINED
  // (written by an older version, or torn by a crash; the writer rewrites it
  // at open): the caller falls back to its own index.
  std::optional<std::vector<uint64_t>> ReadRetained() {
    auto text = fs_->ReadFileToString(JoinPath(path_, "RETAINED"));
    if (text.status().IsNotFound()) return std::nullopt;
    if (!text.ok()) {
      OPTSTATE_LOG_WARN("store {}: RETAINED unreadable ({}); checking leases against the index", path_,
                        text.status().ToString());
      return std::nullopt;
    }
    auto gens = DecodeRetained(*text, "store " + path_ + ": RETAINED");
    if (!gens.ok()) {
      OPTSTATE_LOG_WARN("{}; checking leases against the index", gens.status().ToString());
      return std::nullopt;
    }
    return std::move(gens).value();
  }

  // Forgets the tensors that only the pending generation holds (created after
  // the latest commit): an aborted step's or a crashed writer's registrations
  // must not reach the next commit as tensors of zeros. Writer, mu_ held.
  Status DropUncommittedTensors() {
    rocksdb::WriteBatch b;
    std::vector<uint32_t> ids;
    for (const auto& [id, t] : tensors_) {
      if (t.created_generation > latest_.generation) {
        b.Delete(internal::TensorKey(t.name));
        ids.push_back(id);
      }
    }
    if (ids.empty()) return Status();
    // Not synced: an entry that survives a crash is dropped again at Open.
    OPTSTATE_RETURN_IF_ERROR(RocksStatus("store " + path_ + ": drop uncommitted tensors",
                                         db_->Write(rocksdb::WriteOptions(), &b)));
    for (uint32_t id : ids) {
      names_.erase(tensors_.at(id).name);
      tensors_.erase(id);
    }
    return Status();
  }

  // --- leases --------------------------------------------------------------

  Result<FlockGuard> LockLeases(int op) {
    if (!lease_lock_file_) {
      return FailedPrecondition("store " + path_ + ": leases/.lock is not open");
    }
    return FlockGuard::Take(lease_lock_file_.get(), op);
  }

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
  Result<std::vector<uint64_t>> LeasedGenerations() {
    std::vector<uint64_t> gens;
    OPTSTATE_ASSIGN_OR_RETURN(auto names, fs_->ListDir(leases_dir_));
    for (const auto& name : names) {
      if (name.empty() || name[0] == '.') continue;
      unsigned long long pid = 0, gen = 0, nonce = 0;
      int used = 0;
      if (sscanf(name.c_str(), "%llu.%llu.%llu%n", &pid, &gen, &nonce, &used) != 3) continue;
      const std::string_view rest = std::string_view(name).substr(static_cast<size_t>(used));
      const std::string file = JoinPath(leases_dir_, name);
      if (rest == kLeaseSuffix) {
        if (LeaseFileHeld(file)) gens.push_back(gen);
        continue;
      }
      if (!rest.empty()) continue;
      if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        (void)fs_->Remove(file);
        continue;
      }
      gens.push_back(gen);
    }
    return gens;
  }

  static constexpr std::string_view kLeaseSuffix = ".flock";

  // Whether a reader holds the flock of lease file `file`; removes it if not.
  // Lease flock held (LOCK_EX).
  bool LeaseFileHeld(const std::string& file) {
    OpenOptions oo;
    oo.read_only = true;
    auto f = fs_->Open(file, oo);
    if (!f.ok()) {
      if (f.status().IsNotFound()) return false;  // its reader released it just now
      OPTSTATE_LOG_WARN("store {}: cannot check reader lease {} ({}); keeping its generation", path_, file,
                        f.status().ToString());
      return true;
    }
    for (;;) {
      if (::flock((*f)->fd(), LOCK_EX | LOCK_NB) == 0) break;
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) {
        OPTSTATE_LOG_WARN("store {}: flock of reader lease {}: {}; keeping its generation", path_, file,
                          std::strerror(errno));
      }
      return true;
    }
    OPTSTATE_LOG_INFO("store {}: removing the lease {} of a reader that has ended", path_, file);
    (void)fs_->Remove(file);
    return false;
  }

  // --- GC ------------------------------------------------------------------

  struct GcPlan {
    std::vector<std::pair<Key, uint64_t>> dead_versions;  // (chunk, gen)
    std::vector<uint64_t> dead_generations;
  };

  // Which versions/generation records no retained generation can see once
  // `new_gen` (with pending_ as its new versions, if publish) is latest. mu_ held.
  GcPlan PlanGc(uint64_t new_gen, bool publish, const std::vector<uint64_t>& leased) const {
    std::set<uint64_t> retained;
    const uint64_t k = std::max<uint32_t>(1, opts_.retained_generations);
    for (uint64_t g = new_gen + 1 > k ? new_gen + 1 - k : 0; g <= new_gen; ++g) retained.insert(g);
    for (const auto& [name, s] : snapshots_) retained.insert(s.generation);
    for (const auto& [g, n] : view_refs_) {
      if (n > 0) retained.insert(g);
    }
    for (uint64_t g : leased) retained.insert(g);
    GcPlan plan;
    for (const auto& [key, vs] : versions_) {
      uint64_t superseded = publish && pending_.count(key) ? new_gen : kInfinity;
      for (const auto& v : vs) {
        auto r = retained.lower_bound(v.gen);
        if (r == retained.end() || *r >= superseded) plan.dead_versions.emplace_back(key, v.gen);
        superseded = v.gen;
      }
    }
    for (const auto& [g, info] : generations_) {
      if (!retained.count(g)) plan.dead_generations.push_back(g);
    }
    return plan;
  }

  void AddGcToBatch(const GcPlan& plan, rocksdb::WriteBatch* b) const {
    for (const auto& [key, gen] : plan.dead_versions) b->Delete(internal::ChunkKey(key.t, key.f, key.c, gen));
    for (uint64_t g : plan.dead_generations) b->Delete(internal::GenerationKey(g));
  }

  void ApplyGc(const GcPlan& plan) {  // mu_ held, after the batch is durable
    for (const auto& [key, gen] : plan.dead_versions) {
      auto it = versions_.find(key);
      if (it == versions_.end()) continue;
      auto& vs = it->second;
      for (auto v = vs.begin(); v != vs.end(); ++v) {
        if (v->gen == gen) {
          FreeSlot(v->ext);
          vs.erase(v);
          break;
        }
      }
      if (vs.empty()) versions_.erase(it);
    }
    for (uint64_t g : plan.dead_generations) generations_.erase(g);
  }

  // 32 bytes: "OSCOMMIT", generation (LE), XXH3 of those 16 bytes, zeros.
  static std::string EncodeCommittedMark(uint64_t gen) {
    std::string rec(32, '\0');
    std::memcpy(rec.data(), "OSCOMMIT", 8);
    std::memcpy(rec.data() + 8, &gen, 8);
    const uint64_t sum = ChunkChecksum(rec.data(), 16);
    std::memcpy(rec.data() + 16, &sum, 8);
    return rec;
  }
  static Result<uint64_t> DecodeCommittedMark(const std::string& rec, const std::string& where) {
    uint64_t gen = 0, sum = 0;
    if (rec.size() < 32 || std::memcmp(rec.data(), "OSCOMMIT", 8) != 0) {
      return Corruption(where + ": not a COMMITTED record (" + std::to_string(rec.size()) + " bytes)");
    }
    std::memcpy(&gen, rec.data() + 8, 8);
    std::memcpy(&sum, rec.data() + 16, 8);
    if (sum != ChunkChecksum(rec.data(), 16)) return Corruption(where + ": checksum mismatch");
    return gen;
  }
  // Two slots (generation parity picks one), so a torn or lost write of the
  // newest mark leaves the previous one readable.
  static constexpr uint64_t kMarkSlotBytes = 4096;
  // The newest valid mark in `contents` (COMMITTED's first 2 slots or less);
  // nullopt, with the reason in *why, when neither slot holds one.
  static std::optional<uint64_t> NewestCommittedMark(const std::string& contents, const std::string& where,
                                                     std::string* why) {
    std::optional<uint64_t> best;
    for (uint64_t slot = 0; slot < 2; ++slot) {
      if (contents.size() < slot * kMarkSlotBytes + 32) continue;
      auto g = DecodeCommittedMark(contents.substr(slot * kMarkSlotBytes, 32),
                                   where + " slot " + std::to_string(slot));
      if (g.ok()) {
        best = std::max(best.value_or(0), *g);
      } else {
        *why = g.status().ToString();
      }
    }
    return best;
  }
  // COMMITTED's full size: both slots written (at the first open, and again at
  // every open that finds the index ahead of it). Commits rewrite one slot in
  // place, so a crash can tear a slot but never shorten the file.
  static constexpr uint64_t kCommittedBytes = kMarkSlotBytes + 32;

  // What a user can do about a store whose COMMITTED is damaged while its
  // index holds committed generations up to `latest`.
  std::string CommittedRecoveryHint(uint64_t latest) const {
    auto g = generations_.find(latest);
    const std::string step = g == generations_.end() ? "" : " (step " + std::to_string(g->second.step) + ")";
    return "What you can do: if `optstate-inspect " + path_ + " verify` finds no other problem and generation " +
           std::to_string(latest) + step + " is the last one you committed, accept the index as it is with `touch " +
           JoinPath(path_, kAcceptIndexFile) + "` and open the store again; otherwise copy its newest good "
           "generation or a snapshot out (optstate-mount: `cp -r MOUNT/<store>/latest DIR`) and restore it into a "
           "new store with `optstate-restore DIR NEW_STORE --create NAME`";
  }
  // Made by the user to accept the index as it is when COMMITTED is damaged;
  // the writer removes it once COMMITTED is rewritten.
  static constexpr const char* kAcceptIndexFile = "COMMITTED.accept-index";

  // Verify's check of COMMITTED and RETAINED against an index whose latest
  // generation is index_latest. A read-only store may read a slot the writer
  // is rewriting: a damaged slot counts only if it reads damaged three times.
  void VerifyMarks(uint64_t index_latest, std::vector<std::string>* problems) {
    const std::string name = JoinPath(path_, "COMMITTED");
    std::string hint;
    {
      std::lock_guard l(mu_);
      hint = CommittedRecoveryHint(index_latest);
    }
    for (int attempt = 0;; ++attempt) {
      auto text = fs_->ReadFileToString(name);
      std::string problem;
      if (!text.ok()) {
        if (!text.status().IsNotFound()) {
          problem = "store " + path_ + ": COMMITTED is unreadable: " + text.status().ToString();
        } else if (index_latest > 0) {
          problem = "store " + path_ + " is damaged: COMMITTED is missing, but the index holds committed "
                    "generations up to " + std::to_string(index_latest) + ". " + hint;
        }
      } else if (index_latest > 0 || !text->empty()) {
        std::string why;
        const auto best = NewestCommittedMark(*text, "COMMITTED", &why);
        if (text->size() < kCommittedBytes) {
          problem = "store " + path_ + " is damaged: COMMITTED is " +
                    (text->empty() ? std::string("empty") : "truncated to " + std::to_string(text->size()) +
                                                                " bytes (" + std::to_string(kCommittedBytes) +
                                                                " written)") +
                    ". " + hint;
        } else if (!best || !why.empty()) {
          problem = "store " + path_ + " is damaged: COMMITTED " +
                    (best ? "has a damaged slot (" + why + "; the other holds generation " +
                                std::to_string(*best) + ")"
                          : "holds no valid record (" + why + ")") +
                    ". " + hint;
        } else if (!read_only_ && *best != index_latest) {
          problem = "store " + path_ + ": COMMITTED acknowledges generation " + std::to_string(*best) +
                    " but the index's latest is " + std::to_string(index_latest);
        }
      }
      if (problem.empty()) break;
      if (!read_only_ || attempt == 2) {
        problems->push_back(problem);
        break;
      }
    }
    // RETAINED, read as readers read it (under the shared lease flock).
    Result<std::string> text = std::string();
    {
      std::lock_guard ll(lease_lock_mu_);
      auto guard = LockLeases(LOCK_SH);
      if (!guard.ok()) {
        problems->push_back(guard.status().ToString());
        return;
      }
      text = fs_->ReadFileToString(JoinPath(path_, "RETAINED"));
    }
    const std::string fix = ": readers then check their leases against their own copy of the index only. Opening "
                            "the store read-write (any training step, or `optstate-restore`) rewrites it";
    if (!text.ok()) {
      problems->push_back("store " + path_ + ": RETAINED is " +
                          (text.status().IsNotFound() ? std::string("missing") : "unreadable (" + text.status().ToString() + ")") + fix);
      return;
    }
    auto gens = DecodeRetained(*text, "store " + path_ + ": RETAINED");
    if (!gens.ok()) {
      problems->push_back(gens.status().ToString() + fix);
      return;
    }
    if (read_only_) return;  // the writer may have moved on since this reader's index
    std::lock_guard l(mu_);
    for (const auto& [g, info] : generations_) {
      if (!std::binary_search(gens->begin(), gens->end(), g)) {
        problems->push_back("store " + path_ + ": RETAINED lacks retained generation " + std::to_string(g) + fix);
      }
    }
  }

  // Read-only stores: the newest acknowledged generation, 0 if unknown.
  uint64_t ReadAckedGeneration() {
    auto text = fs_->ReadFileToString(JoinPath(path_, "COMMITTED"));
    std::string why;
    return text.ok() ? NewestCommittedMark(*text, "COMMITTED", &why).value_or(0) : 0;
  }
  Status WriteCommittedMark(uint64_t gen, bool both_slots = false) {
    if (committed_file_ == nullptr) return Status();
    const std::string rec = EncodeCommittedMark(gen);
    for (uint64_t slot : {gen % 2, (gen + 1) % 2}) {
      OPTSTATE_RETURN_IF_ERROR(committed_file_->Pwrite(slot * kMarkSlotBytes, rec.data(), rec.size()));
      if (!both_slots) break;
    }
    return committed_file_->Fdatasync();
  }

  Status WriteSynced(rocksdb::WriteBatch* b, std::string_view what) {
    rocksdb::WriteOptions wo;
    wo.sync = true;
    return RocksStatus("store " + path_ + ": " + std::string(what), db_->Write(wo, b));
  }

  void Poison(const Status& why) {  // mu_ held
    if (!poisoned_) {
      poisoned_ = true;
      poison_reason_ = why.ToString();
      OPTSTATE_LOG_ERROR("store {} poisoned until reopen: {}", path_, poison_reason_);
    }
  }

  Status CollectGarbage() {
    std::lock_guard ll(lease_lock_mu_);
    OPTSTATE_ASSIGN_OR_RETURN(auto lease_guard, LockLeases(LOCK_EX));
    OPTSTATE_ASSIGN_OR_RETURN(auto leased, LeasedGenerations());
    std::lock_guard l(mu_);
    OPTSTATE_RETURN_IF_ERROR(CheckWritable("garbage collection"));
    GcPlan plan = PlanGc(latest_.generation, /*publish=*/false, leased);
    OPTSTATE_RETURN_IF_ERROR(WriteRetained(GenerationNumbers()));
    if (plan.dead_versions.empty() && plan.dead_generations.empty()) return Status();
    rocksdb::WriteBatch b;
    AddGcToBatch(plan, &b);
    CrashPoint("gc.before_batch");
    Status s = WriteSynced(&b, "garbage collection batch");
    if (!s.ok()) {
      Poison(s);
      return s;
    }
    ApplyGc(plan);
    RewriteRetainedAfterBatch();
    CrashPoint("gc.after_batch");
    return Status();
  }

  // fdatasync of the data files written since the last commit, outside mu_
  // (writes go on meanwhile); dirty_ stays set, so Commit still syncs what
  // arrives later. A failure poisons the store like a failed commit sync.
  Status SyncData() {
    std::vector<std::pair<uint32_t, File*>> files;
    {
      std::lock_guard l(mu_);
      OPTSTATE_RETURN_IF_ERROR(CheckWritable("data sync"));
      for (uint32_t d = 0; d < data_files_.size(); ++d) {
        if (dirty_[d] || grown_[d]) files.emplace_back(d, data_files_[d].get());
      }
    }
    for (const auto& [d, f] : files) {
      Status s = f->Fdatasync();
      if (!s.ok()) {
        Status e(StatusCode::kDataLoss, "store " + path_ + ": sync of " + FileName(d) + " failed: " + s.ToString(),
                 s.err());
        std::lock_guard l(mu_);
        Poison(e);
        return e;
      }
    }
    return Status();
  }

  Result<uint64_t> Commit(const CommitInfo& info) {
    std::lock_guard ll(lease_lock_mu_);
    OPTSTATE_ASSIGN_OR_RETURN(auto lease_guard, LockLeases(LOCK_EX));
    OPTSTATE_ASSIGN_OR_RETURN(auto leased, LeasedGenerations());
    std::lock_guard l(mu_);
    OPTSTATE_RETURN_IF_ERROR(CheckWritable("commit"));
    if (writes_in_flight_ > 0) {
      return FailedPrecondition("store " + path_ + ": commit with " + std::to_string(writes_in_flight_) +
                                " chunk writes in flight; reap them first");
    }
    const uint64_t gen = latest_.generation + 1;
    CrashPoint("commit.before_sync");
    for (uint32_t d = 0; d < data_files_.size(); ++d) {
      if (!dirty_[d] && !grown_[d]) continue;
      Status s = grown_[d] ? data_files_[d]->Fsync() : data_files_[d]->Fdatasync();
      if (!s.ok()) {
        Status e(StatusCode::kDataLoss,
                 "store " + path_ + ": commit of generation " + std::to_string(gen) + ": sync of " +
                     FileName(d) + " failed: " + s.ToString(),
                 s.err());
        Poison(e);
        return e;
      }
      dirty_[d] = grown_[d] = false;
    }
    GenerationInfo g;
    g.generation = gen;
    g.step = info.step;
    g.groups = info.groups;
    g.commit_time_unix_ms = NowUnixMs();
    g.index_digest = CommitDigest(gen);
    rocksdb::WriteBatch b;
    for (const auto& [key, ext] : pending_) b.Put(internal::ChunkKey(key.t, key.f, key.c, gen), internal::EncodeExtent(ext));
    b.Put(internal::GenerationKey(gen), internal::EncodeGeneration(g));
    b.Put(internal::kLatestKey, internal::EncodeU64(gen));
    b.Put(internal::kLifetimeKey, internal::EncodeU64(lifetime_bytes_));
    generations_[gen] = g;  // so PlanGc sees it as a record (removed below on failure)
    GcPlan plan = PlanGc(gen, /*publish=*/true, leased);
    generations_.erase(gen);
    OPTSTATE_RETURN_IF_ERROR(
        WriteRetained(GenerationNumbers(gen)).WithContext("commit of generation " + std::to_string(gen)));
    AddGcToBatch(plan, &b);
    CrashPoint("commit.before_batch");
    Status s = WriteSynced(&b, "commit of generation " + std::to_string(gen));
    if (!s.ok()) {
      // The batch may or may not be in the WAL: nothing in memory can be
      // trusted to match the index any more.
      Poison(s);
      return Status(StatusCode::kDataLoss, s.message() + " (store poisoned until reopen)", s.err());
    }
    if (Status w = WriteCommittedMark(gen); !w.ok()) {
      // The generation is in the index (a reopen may show it) but is not
      // acknowledged: keep the previous one in memory, refuse more commits.
      Status e(StatusCode::kDataLoss,
               "store " + path_ + ": generation " + std::to_string(gen) +
                   " is in the index but its COMMITTED mark could not be made durable: " + w.ToString() +
                   " (store poisoned until reopen)",
               w.err());
      Poison(e);
      return e;
    }
    for (const auto& [key, ext] : pending_) {
      auto& vs = versions_[key];
      vs.insert(vs.begin(), Version{gen, ext});
    }
    pending_.clear();
    generations_[gen] = g;
    latest_ = g;
    ApplyGc(plan);
    RewriteRetainedAfterBatch();
    CrashPoint("commit.after_batch");
    return gen;
  }
};

// ---------------------------------------------------------------------------
// Views.

// A frozen generation: its tensors and chunk versions, plus the lease that
// keeps them (released when the last holder goes).
struct ViewData {
  std::shared_ptr<Core> core;
  GenerationInfo info;
  std::vector<TensorInfo> tensors;        // sorted by name
  std::map<uint32_t, TensorInfo> by_id;
  std::map<Key, Version> chunks;          // written chunks only
  std::string lease_file;                 // read-only stores: the lease file
  std::unique_ptr<File> lease_handle;     // open, flock'ed: the lease is alive
  bool in_process_ref = false;            // writable stores: Core::view_refs_

  ~ViewData() {
    if (in_process_ref) {
      std::lock_guard l(core->mu_);
      if (--core->view_refs_[info.generation] <= 0) core->view_refs_.erase(info.generation);
    }
    if (!lease_file.empty()) (void)core->fs_->Remove(lease_file);
    lease_handle.reset();  // after the removal: never an unlocked lease file the writer could misjudge
  }
};

// Builds the frozen view of generation g. mu_ held.
std::shared_ptr<ViewData> BuildView(const std::shared_ptr<Core>& core, uint64_t g) {
  auto v = std::make_shared<ViewData>();
  v->core = core;
  v->info = core->generations_.at(g);
  for (const auto& [id, t] : core->tensors_) {
    if (t.created_generation <= g) {
      v->tensors.push_back(t);
      v->by_id[id] = t;
    }
  }
  std::sort(v->tensors.begin(), v->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  for (const auto& [key, vs] : core->versions_) {
    if (!v->by_id.count(key.t)) continue;
    for (const auto& ver : vs) {
      if (ver.gen <= g) {
        v->chunks.emplace(key, ver);
        break;
      }
    }
  }
  return v;
}

// `what` + ": checksum mismatch (expected xxh3 E, read R) at [PATH ]offset O".
Status ChecksumMismatch(const std::string& what, uint64_t expected, uint64_t read, const std::string& path,
                        uint64_t offset) {
  char m[96];
  snprintf(m, sizeof(m), ": checksum mismatch (expected xxh3 %016llx, read %016llx) at ",
           static_cast<unsigned long long>(expected), static_cast<unsigned long long>(read));
  return Corruption(what + m + (path.empty() ? "" : path + " ") + "offset " + std::to_string(offset));
}

// Reads one version synchronously into buf (buf_bytes long: the tail past the
// chunk is zeroed up to there) and verifies it.
Status ReadVersion(Core* core, const TensorInfo* t, const Key& k, const Version& v, void* buf, uint64_t buf_bytes) {
  File* f = v.ext.dir < core->data_files_.size() ? core->data_files_[v.ext.dir].get() : nullptr;
  if (f == nullptr) {
    return IoError(core->Describe(t, k, v.gen) + ": data file of dir " + std::to_string(v.ext.dir) +
                   " is missing");
  }
  Status s = f->Pread(v.ext.file_offset, buf, RoundUp(v.ext.length, kIoAlign));
  if (!s.ok()) return s.WithContext("read of " + core->Describe(t, k, v.gen));
  const uint64_t sum = ChunkChecksum(buf, v.ext.length);
  if (sum != v.ext.checksum) {
    return ChecksumMismatch(core->Describe(t, k, v.gen), v.ext.checksum, sum, f->path(), v.ext.file_offset);
  }
  if (v.ext.length < buf_bytes) std::memset(static_cast<char*>(buf) + v.ext.length, 0, buf_bytes - v.ext.length);
  return Status();
}

// A caller's buffer size (0 = a whole chunk), checked against the chunk it is
// to hold: the one rule of ChunkIo::SubmitRead and GenerationView::ReadChunk.
Result<uint64_t> BufferBytesFor(const Core& core, const TensorInfo* t, const Key& k, uint64_t chunk_len,
                                uint64_t buf_bytes) {
  const uint64_t n = buf_bytes == 0 ? core.chunk() : std::min(buf_bytes, core.chunk());
  if (RoundUp(chunk_len, kIoAlign) > n) {
    return InvalidArgument(core.Describe(t, k, kInfinity) + ": a " + std::to_string(chunk_len) +
                           "-byte chunk does not fit the " + std::to_string(n) + "-byte buffer");
  }
  return n;
}

// ---------------------------------------------------------------------------
// ChunkIo.

class ChunkIoImpl final : public ChunkIo {
 public:
  ChunkIoImpl(std::shared_ptr<Core> core, std::shared_ptr<ViewData> view, std::unique_ptr<IoEngine> engine,
              bool verify, uint32_t hash_threads)
      : core_(std::move(core)), view_(std::move(view)), engine_(std::move(engine)), verify_(verify) {
    if (hash_threads > 0) {
      IoEngine* e = engine_.get();
      hasher_ = std::make_unique<internal::ChunkHasher>(hash_threads, [e] { e->Wake(); });
    }
  }

  ~ChunkIoImpl() override {
    // Drain: the engine and the hashers must not touch buffers or files after
    // we are gone, and completed writes must reach the pending map.
    std::vector<ChunkCompletion> sink;
    while (in_flight() > 0) {
      if (!Reap(&sink, 1).ok()) break;
    }
    hasher_.reset();  // before the engine its threads wake
  }

  Status SubmitRead(const ChunkRef& ref, void* buf, uint64_t tag, uint64_t buf_bytes) override {
    const Key k{ref.tensor_id, ref.field, ref.index};
    Op op;
    op.user_tag = tag;
    op.key = k;
    op.buf = buf;
    {
      std::lock_guard l(core_->mu_);
      const auto& tensors = view_ ? view_->by_id : core_->tensors_;
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(tensors, ref));
      op.tensor = *res.first;
      OPTSTATE_ASSIGN_OR_RETURN(op.buf_bytes, BufferBytesFor(*core_, &op.tensor, k, res.second, buf_bytes));
      std::optional<Version> v;
      if (view_) {
        auto it = view_->chunks.find(k);
        if (it != view_->chunks.end()) v = it->second;
      } else {
        v = core_->Newest(k);
      }
      if (!v) {
        std::memset(buf, 0, op.buf_bytes);
        ChunkCompletion zero;  // never written: zeros, nothing to verify
        zero.tag = tag;
        ready_.push_back(std::move(zero));
        return Status();
      }
      op.version = *v;
    }
    File* f = op.version.ext.dir < core_->data_files_.size() ? core_->data_files_[op.version.ext.dir].get()
                                                            : nullptr;
    if (f == nullptr) return IoError(core_->Describe(&op.tensor, k, op.version.gen) + ": data file missing");
    IoRequest r;
    r.op = IoRequest::Op::kRead;
    r.file = f;
    r.offset = op.version.ext.file_offset;
    r.length = RoundUp(op.version.ext.length, kIoAlign);
    r.buf = buf;
    r.tag = next_tag_++;
    OPTSTATE_RETURN_IF_ERROR(
        engine_->Submit(std::span<const IoRequest>(&r, 1)).WithContext("read of " +
                                                                         core_->Describe(&op.tensor, k, op.version.gen)));
    ops_.emplace(r.tag, std::move(op));
    return Status();
  }

  Status SubmitWrite(const ChunkRef& ref, const void* buf, uint64_t tag) override {
    if (view_) {
      return FailedPrecondition("store " + core_->path_ + ": writes through a GenerationView's ChunkIo");
    }
    const Key k{ref.tensor_id, ref.field, ref.index};
    Op op;
    op.user_tag = tag;
    op.key = k;
    op.write = true;
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("chunk write"));
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors_, ref));
      op.tensor = *res.first;
      const uint64_t len = res.second;
      auto ext = core_->AllocateSlot(len);
      if (!ext.ok()) return ext.status().WithContext("write of " + core_->Describe(&op.tensor, k, kInfinity));
      op.version.ext = *ext;
      op.version.gen = core_->latest_.generation + 1;
      ++core_->writes_in_flight_;
    }
    // A big chunk is hashed by the hashers while its write is in flight.
    const bool async_hash = hasher_ != nullptr && op.version.ext.length >= kAsyncHashMinBytes;
    if (!async_hash) op.version.ext.checksum = ChunkChecksum(buf, op.version.ext.length);
    CrashPoint("extent.before_write");
    IoRequest r;
    r.op = IoRequest::Op::kWrite;
    r.file = core_->data_files_[op.version.ext.dir].get();
    r.offset = op.version.ext.file_offset;
    r.length = RoundUp(op.version.ext.length, kIoAlign);
    r.buf = const_cast<void*>(buf);
    r.tag = next_tag_++;
    Status s = engine_->Submit(std::span<const IoRequest>(&r, 1));
    if (!s.ok()) {
      std::lock_guard l(core_->mu_);
      core_->FreeSlot(op.version.ext);
      --core_->writes_in_flight_;
      return s.WithContext("write of " + core_->Describe(&op.tensor, k, kInfinity));
    }
    if (async_hash) {
      op.hashing = true;
      hasher_->Post(r.tag, buf, op.version.ext.length);
    }
    ops_.emplace(r.tag, std::move(op));
    return Status();
  }

  // A completion is handed out once its I/O and, with hashers, its hash (a
  // big write's checksum, posted at submit; a big read's verification, posted
  // here when the read lands) are both done. Waits in the engine while it has
  // requests in flight (a hasher's result wakes it), else for a hash.
  Status Reap(std::vector<ChunkCompletion>* out, size_t min_complete) override {
    size_t got = 0;
    while (!ready_.empty()) {
      out->push_back(std::move(ready_.front()));
      ready_.pop_front();
      ++got;
    }
    std::vector<IoCompletion> done;
    for (;;) {
      got += CollectHashes(out);
      if (const size_t n = engine_->in_flight(); n > 0) {
        OPTSTATE_RETURN_IF_ERROR(engine_->Reap(&done, got >= min_complete ? 0 : std::min(min_complete - got, n)));
        for (auto& c : done) got += OnIoDone(c, out);
        done.clear();
      } else if (got < min_complete && hasher_ != nullptr && !ops_.empty()) {
        hasher_->WaitForResult();  // everything left is hashing
        continue;
      } else {
        return Status();  // nothing in flight, nothing to wait for
      }
      if (got >= min_complete || ops_.empty()) return Status();
    }
  }

  // ops_ holds every request not handed out yet: in the engine, or hashing.
  size_t in_flight() const override { return ops_.size() + ready_.size(); }
  void Wake() override { engine_->Wake(); }

 private:
  struct Op {
    uint64_t user_tag = 0;
    Key key;
    bool write = false;
    TensorInfo tensor;
    Version version;
    void* buf = nullptr;
    uint64_t buf_bytes = 0;  // zeroed past the chunk's length up to here
    // A hash job is out for this op (hashers only); the I/O is done
    // (io_status holds its result); a hash came back (sum).
    bool hashing = false;
    bool io_done = false;
    Status io_status;
    std::optional<uint64_t> sum;
  };

  // The engine finished op c.tag: hands it out, or first posts its
  // verification (a big read) or waits for the hash posted at submit (a big
  // write). Returns the completions handed out (0 or 1).
  size_t OnIoDone(IoCompletion& c, std::vector<ChunkCompletion>* out) {
    auto it = ops_.find(c.tag);
    if (it == ops_.end()) return 0;
    Op& op = it->second;
    op.io_done = true;
    op.io_status = std::move(c.status);
    if (hasher_ != nullptr && !op.write && verify_ && op.io_status.ok() &&
        op.version.ext.length >= kAsyncHashMinBytes) {
      op.hashing = true;
      hasher_->Post(c.tag, op.buf, op.version.ext.length);
    }
    if (op.hashing) return 0;
    HandOut(it, out);
    return 1;
  }

  // Takes the hashers' results; hands out the ops whose I/O is done too.
  size_t CollectHashes(std::vector<ChunkCompletion>* out) {
    if (hasher_ == nullptr) return 0;
    hashed_.clear();
    hasher_->Collect(&hashed_);
    size_t n = 0;
    for (const auto& h : hashed_) {
      auto it = ops_.find(h.tag);
      if (it == ops_.end()) continue;
      it->second.hashing = false;
      it->second.sum = h.sum;
      if (it->second.io_done) {
        HandOut(it, out);
        ++n;
      }
    }
    return n;
  }

  // Finishes a done op (I/O and any hash) and hands its completion out.
  void HandOut(std::unordered_map<uint64_t, Op>::iterator it, std::vector<ChunkCompletion>* out) {
    Op op = std::move(it->second);
    ops_.erase(it);
    if (op.write && op.sum) op.version.ext.checksum = *op.sum;
    ChunkCompletion cc;
    cc.tag = op.user_tag;
    cc.status = Finish(op, op.io_status, &cc);
    out->push_back(std::move(cc));
  }

  Status Finish(const Op& op, const Status& io, ChunkCompletion* out) {
    Core* c = core_.get();
    if (op.write) {
      std::lock_guard l(c->mu_);
      --c->writes_in_flight_;
      if (!io.ok()) {
        c->FreeSlot(op.version.ext);
        return io.WithContext("write of " + c->Describe(&op.tensor, op.key, kInfinity));
      }
      c->SetPending(op.key, op.version.ext);
      CrashPoint("extent.after_write");
      return Status();
    }
    if (!io.ok()) return io.WithContext("read of " + c->Describe(&op.tensor, op.key, op.version.gen));
    if (verify_) {
      const uint64_t sum = op.sum ? *op.sum : ChunkChecksum(op.buf, op.version.ext.length);
      if (sum != op.version.ext.checksum) {
        return ChecksumMismatch(c->Describe(&op.tensor, op.key, op.version.gen), op.version.ext.checksum, sum,
                                "", op.version.ext.file_offset);
      }
    } else {
      out->needs_verify = true;
      out->verify_length = op.version.ext.length;
      out->expected_checksum = op.version.ext.checksum;
      out->file_offset = op.version.ext.file_offset;
      out->what = c->Describe(&op.tensor, op.key, op.version.gen);
    }
    if (op.version.ext.length < op.buf_bytes) {
      std::memset(static_cast<char*>(op.buf) + op.version.ext.length, 0, op.buf_bytes - op.version.ext.length);
    }
    return Status();
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<ViewData> view_;  // null: the store's newest versions
  std::unique_ptr<IoEngine> engine_;
  const bool verify_;  // ChunkIoOptions::verify_reads
  std::unordered_map<uint64_t, Op> ops_;
  std::deque<ChunkCompletion> ready_;  // zero chunks, completed at submit
  uint64_t next_tag_ = 1;
  std::unique_ptr<internal::ChunkHasher> hasher_;  // ChunkIoOptions::hash_threads > 0
  std::vector<internal::ChunkHasher::Result> hashed_;  // CollectHashes' scratch
};

}  // namespace

Status VerifyChunkRead(const ChunkCompletion& c, const void* buf) {
  if (!c.needs_verify) return Status();
  const uint64_t sum = ChunkChecksum(buf, c.verify_length);
  if (sum == c.expected_checksum) return Status();
  return ChecksumMismatch(c.what, c.expected_checksum, sum, "", c.file_offset);
}

namespace {

Result<std::unique_ptr<ChunkIo>> MakeChunkIo(const std::shared_ptr<Core>& core, std::shared_ptr<ViewData> view,
                                             const ChunkIoOptions& opts) {
  std::unique_ptr<IoEngine> engine;
  if (!opts.use_sync_engine) {
    IoEngineOptions eo;
    eo.queue_depth = opts.queue_depth;
    eo.registered_buffers = opts.registered_buffers;
    eo.max_sqe_bytes = opts.max_sqe_bytes;
    eo.wakeable = opts.wakeable || opts.hash_threads > 0;  // a hasher's result wakes Reap
    eo.defer_submit = opts.defer_submit;
    auto e = IoEngine::NewUring(eo);
    if (e.ok()) {
      engine = std::move(*e);
    } else {
      static std::once_flag warned;
      std::call_once(warned, [&] {
        OPTSTATE_LOG_WARN("io_uring unavailable ({}); using the synchronous engine", e.status().ToString());
      });
    }
  }
  if (!engine) {
    OPTSTATE_ASSIGN_OR_RETURN(engine, IoEngine::NewSync(core->chunk()));
  }
  return std::unique_ptr<ChunkIo>(new ChunkIoImpl(core, std::move(view), std::move(engine), opts.verify_reads,
                                                   opts.hash_threads));
}

// ---------------------------------------------------------------------------

class GenerationViewImpl final : public GenerationView {
 public:
  explicit GenerationViewImpl(std::shared_ptr<ViewData> v) : v_(std::move(v)) {}
  const StoreIdentity& identity() const override { return v_->core->identity_; }
  const GenerationInfo& info() const override { return v_->info; }
  const std::vector<TensorInfo>& tensors() const override { return v_->tensors; }
  Result<TensorInfo> FindTensor(std::string_view name) const override {
    for (const auto& t : v_->tensors) {
      if (t.name == name) return t;
    }
    std::vector<std::string> names;
    for (const auto& t : v_->tensors) names.push_back(t.name);
    return NotFound("store " + v_->core->path_ + " generation " + std::to_string(v_->info.generation) +
                    ": no tensor '" + std::string(name) + "'" + ClosestNames(name, names.begin(), names.end()));
  }
  uint64_t ChunkCount(const TensorInfo& t, uint32_t field) const override {
    return Core::ChunkCountOf(t, field, v_->core->chunk());
  }
  Result<ChunkInfo> Chunk(const ChunkRef& ref) const override {
    const Core* c = v_->core.get();
    uint64_t len;
    {
      std::lock_guard l(c->mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto res, c->Resolve(v_->by_id, ref));
      len = res.second;
    }
    ChunkInfo info;
    info.offset_bytes = ref.index * c->chunk();
    info.length_bytes = len;
    auto it = v_->chunks.find(Key{ref.tensor_id, ref.field, ref.index});
    if (it == v_->chunks.end()) {
      info.zero = true;
      info.checksum = ZeroChecksum(len);
      return info;
    }
    info.zero = false;
    info.checksum = it->second.ext.checksum;
    info.written_generation = it->second.gen;
    info.data_dir = it->second.ext.dir;
    info.file_offset = it->second.ext.file_offset;
    return info;
  }
  Status ReadChunk(const ChunkRef& ref, void* buf, uint64_t buf_bytes) const override {
    Core* c = v_->core.get();
    const Key k{ref.tensor_id, ref.field, ref.index};
    const TensorInfo* t;
    uint64_t n = 0;
    {
      std::lock_guard l(c->mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto res, c->Resolve(v_->by_id, ref));
      t = res.first;
      OPTSTATE_ASSIGN_OR_RETURN(n, BufferBytesFor(*c, t, k, res.second, buf_bytes));
    }
    auto it = v_->chunks.find(k);
    if (it == v_->chunks.end()) {
      std::memset(buf, 0, n);
      return Status();
    }
    return ReadVersion(c, t, k, it->second, buf, n);
  }
  Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions& opts) const override {
    return MakeChunkIo(v_->core, v_, opts);
  }
  const ViewData& data() const { return *v_; }

 private:
  uint64_t ZeroChecksum(uint64_t len) const {
    static thread_local std::vector<char> zeros;
    if (zeros.size() < len) zeros.assign(len, 0);
    return ChunkChecksum(zeros.data(), len);
  }
  std::shared_ptr<ViewData> v_;
};

// ---------------------------------------------------------------------------
// Opening.

rocksdb::Options IndexOptions(Core* core) {
  rocksdb::Options o;
  o.env = core->env_ ? core->env_.get() : rocksdb::Env::Default();
  core->logger_ = std::make_shared<RocksLogger>();
  o.info_log = core->logger_;
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  o.max_open_files = -1;       // required for secondary instances
  o.paranoid_checks = true;
  o.keep_log_file_num = 2;
  o.write_buffer_size = 16 << 20;
  return o;
}

Status ValidateOptions(const StoreOptions& opts) {
  if (opts.chunk_size_bytes == 0 || opts.chunk_size_bytes % kChunkAlignBytes != 0) {
    return InvalidArgument("chunk_size_bytes " + std::to_string(opts.chunk_size_bytes) +
                           " is not a positive multiple of 2 MiB");
  }
  if (opts.retained_generations == 0) return InvalidArgument("retained_generations must be >= 1");
  return Status();
}

Result<StoreIdentity> ReadIdentity(FileSystem* fs, const std::string& path) {
  auto exists = fs->Exists(path);
  if (!exists.ok()) return exists.status().WithContext("store " + path);
  if (!*exists) return NotFound("store " + path + " does not exist");
  auto text = fs->ReadFileToString(JoinPath(path, "IDENTITY"));
  if (!text.ok()) {
    return Corruption("store " + path + " is missing or damaged: cannot read IDENTITY: " +
                      text.status().ToString());
  }
  return internal::DecodeIdentity(*text, "store " + path + ": IDENTITY");
}

Status OpenDataFiles(Core* core, bool create_missing) {
  const auto& dirs = core->identity_.data_dirs;
  core->data_files_.resize(dirs.size());
  for (uint32_t d = 0; d < dirs.size(); ++d) {
    if (core->data_files_[d]) continue;
    const std::string name = core->FileName(d);
    OPTSTATE_ASSIGN_OR_RETURN(bool exists, core->fs_->Exists(name));
    if (!exists && !create_missing) continue;  // checked against references later
    OpenOptions oo;
    oo.read_only = core->read_only_;
    oo.create = !exists;
    oo.direct = core->opts_.direct_io;
    auto f = core->fs_->Open(name, oo);
    if (!f.ok()) return f.status().WithContext("store " + core->path_ + ": data file");
    core->data_files_[d] = std::move(*f);
    if (!exists) {
      OPTSTATE_RETURN_IF_ERROR(core->data_files_[d]->Fsync());
      OPTSTATE_RETURN_IF_ERROR(core->fs_->SyncDir(dirs[d]));
    }
  }
  return Status();
}

// What a user can do to get a second, independent store from one.
constexpr const char* kIndependentCopyHint =
    "to make an independent copy of a store, copy a checkpoint of it (`cp -r MOUNT/<store>/latest DIR` from "
    "optstate-mount, or a snapshot's directory) and import it with `optstate-restore DIR NEW_STORE --create NAME`";

// Turns the data dirs recorded in IDENTITY into absolute paths for this store
// directory (identity_.data_dirs) and marks which lie inside it. A relative
// dir is inside. An absolute one was written by an older version, which
// recorded every dir absolute: inside this directory, it is inside; naming a
// dir of the directory the store was created in (this one is a copy or was
// moved), this directory's own copy of it is used, recognised by this store's
// data file being there; inside any other store directory, refused (the copy
// would write another store's data file). Others are external.
Status ResolveDataDirs(Core* c) {
  auto& dirs = c->identity_.data_dirs;
  c->internal_dirs_.assign(dirs.size(), false);
  const std::string data_file = c->identity_.uuid + ".chunks";
  for (size_t d = 0; d < dirs.size(); ++d) {
    const std::string rec = dirs[d];
    if (!rec.starts_with("/")) {
      dirs[d] = rec == "." ? c->path_ : AbsPath(JoinPath(c->path_, rec));
      c->internal_dirs_[d] = true;
      continue;
    }
    if (internal::RelativeToStore(rec, c->path_)) {
      c->internal_dirs_[d] = true;
      c->identity_needs_rewrite_ = true;
      continue;
    }
    std::vector<std::string> parts;
    for (const auto& part : std::filesystem::path(rec)) {
      if (!part.empty() && part != "/") parts.push_back(part.string());
    }
    std::string rel;
    for (size_t k = parts.size(); k-- > 0 && !c->internal_dirs_[d];) {
      rel = rel.empty() ? parts[k] : parts[k] + "/" + rel;
      const std::string here = JoinPath(c->path_, rel);
      auto e = c->fs_->Exists(JoinPath(here, data_file));
      if (e.ok() && *e) {
        OPTSTATE_LOG_INFO("store {}: data dir {} recorded by an older version is this store directory's {}", c->path_,
                          rec, here);
        dirs[d] = here;
        c->internal_dirs_[d] = true;
        c->identity_needs_rewrite_ = true;
      }
    }
    if (c->internal_dirs_[d]) continue;
    for (std::filesystem::path a(rec); !a.empty(); a = a.parent_path()) {
      const std::string anc = a.string();
      auto e = c->fs_->Exists(JoinPath(anc, "IDENTITY"));
      if (e.ok() && *e && anc != c->path_) {
        return FailedPrecondition(
            "store " + c->path_ + ": IDENTITY names data dir " + rec + ", which lies inside the store directory " +
            anc + ", and this directory has no copy of it (no " + rel + "/" + data_file +
            "): this store is a copy of " + anc + " (or was moved from there) made without its data, and opening it "
            "would use that store's data file. Copy the whole store directory with `cp -a`, or " +
            kIndependentCopyHint);
      }
      if (anc == "/") break;
    }
  }
  return Status();
}

// Writer: makes each open data file this store directory's, or refuses. The
// data file is flock'ed (LOCK_EX) for as long as it is open, so no two
// processes ever write it; its owner record (<uuid>.owner) names the store
// directory that writes it. A record naming another directory is taken over
// when the data file is not the one that directory wrote (a copy of the store
// directory copied it: its inode differs); the same data file owned by another
// directory (a copied store sharing an external data dir, or a hard-linked
// copy) is refused.
Status ClaimDataFiles(Core* c) {
  struct stat self;
  if (::stat(c->path_.c_str(), &self) != 0) return ErrnoStatus("store " + c->path_ + ": stat", errno);
  c->claimed_.resize(c->data_files_.size(), false);
  c->data_locks_.resize(c->data_files_.size());
  for (uint32_t d = 0; d < c->data_files_.size(); ++d) {
    File* f = c->data_files_[d].get();
    if (f == nullptr || c->claimed_[d]) continue;
    const std::string file = c->FileName(d);
    const std::string owner_path = JoinPath(c->identity_.data_dirs[d], c->identity_.uuid + ".owner");
    auto owner_text = c->fs_->ReadFileToString(owner_path);
    std::optional<internal::DataFileOwner> owner;
    if (owner_text.ok()) {
      auto o = internal::DecodeDataFileOwner(*owner_text, owner_path);
      if (o.ok()) {
        owner = std::move(*o);
      } else {
        OPTSTATE_LOG_WARN("store {}: {}; rewriting it", c->path_, o.status().ToString());
      }
    } else if (!owner_text.status().IsNotFound()) {
      return owner_text.status().WithContext("store " + c->path_ + ": owner record of data file " + file);
    }
    const std::string other = owner ? owner->store_path : std::string("unknown (no owner record)");
    OpenOptions lo;
    lo.read_only = true;
    auto lock = c->fs_->Open(file, lo);
    if (!lock.ok()) return lock.status().WithContext("store " + c->path_ + ": lock of data file");
    for (;;) {
      if (::flock((*lock)->fd(), LOCK_EX | LOCK_NB) == 0) break;
      const int e = errno;
      if (e == EINTR) continue;
      if (e == EWOULDBLOCK) {
        return Status(StatusCode::kBusy,
                      "store " + c->path_ + ": data file " + file + " is open for writing by another process, a "
                      "writer of store " + other + ": two stores never write one data file. The two are copies "
                      "of one store that share a data dir outside them (or hard-linked copies); close the other "
                      "writer and use one of them, or " + kIndependentCopyHint,
                      e);
      }
      return ErrnoStatus("store " + c->path_ + ": flock data file " + file, e);
    }
    struct statx st;
    if (::statx(f->fd(), "", AT_EMPTY_PATH, STATX_INO | STATX_NLINK | STATX_BTIME, &st) != 0) {
      return ErrnoStatus("store " + c->path_ + ": statx " + file, errno);
    }
    if (st.stx_nlink > 1) {
      return FailedPrecondition("store " + c->path_ + ": data file " + file + " has " +
                                std::to_string(st.stx_nlink) +
                                " hard links: another store directory may share it (a copy made with `cp -l` "
                                "or `rsync --link-dest`). Copy a store with `cp -a`, or " + kIndependentCopyHint);
    }
    internal::DataFileOwner mine;
    mine.uuid = c->identity_.uuid;
    mine.store_path = c->path_;
    mine.store_dev = static_cast<uint64_t>(self.st_dev);
    mine.store_ino = static_cast<uint64_t>(self.st_ino);
    mine.data_dev = (uint64_t{st.stx_dev_major} << 32) | st.stx_dev_minor;
    mine.data_ino = st.stx_ino;
    if (st.stx_mask & STATX_BTIME) {
      mine.data_btime_ns = static_cast<uint64_t>(st.stx_btime.tv_sec) * 1000000000ull + st.stx_btime.tv_nsec;
    }
    bool write = true;
    if (owner) {
      // Same directory: same inode, and same device or same path (device
      // numbers of drives can change across reboots; a rename keeps both).
      const bool same_dir = owner->store_ino == mine.store_ino &&
                            (owner->store_dev == mine.store_dev || owner->store_path == mine.store_path);
      const bool same_file = owner->data_ino == mine.data_ino &&
                             (owner->data_btime_ns == 0 || mine.data_btime_ns == 0 ||
                              owner->data_btime_ns == mine.data_btime_ns) &&
                             (owner->data_dev == mine.data_dev || same_dir);
      if (owner->uuid != mine.uuid) {
        return FailedPrecondition("store " + c->path_ + ": data file " + file + " has an owner record (" +
                                  owner_path + ") of another store, uuid " + owner->uuid +
                                  "; the data directory was tampered with: " + kIndependentCopyHint);
      }
      if (same_dir) {
        write = owner->store_path != mine.store_path || owner->store_dev != mine.store_dev ||
                owner->data_dev != mine.data_dev || owner->data_ino != mine.data_ino ||
                owner->data_btime_ns != mine.data_btime_ns;
      } else if (!same_file) {
        OPTSTATE_LOG_INFO("store {}: data file {} is this store directory's own copy (its owner record named {}); "
                          "taking it over", c->path_, file, owner->store_path);
      } else {
        struct stat o;
        const bool other_exists = ::stat(owner->store_path.c_str(), &o) == 0 &&
                                  static_cast<uint64_t>(o.st_ino) == owner->store_ino;
        return FailedPrecondition(
            "store " + c->path_ + ": data file " + file + " belongs to the store directory " + owner->store_path +
            (other_exists ? " (which still exists)" : " (which is no longer there)") +
            ": this store is a copy of it, or it was moved or restored from a backup, and its data dir " +
            c->identity_.data_dirs[d] +
            (c->internal_dirs_[d] ? " is the same directory for both (a symbolic link or mount copied as such)"
                                  : " lies outside the store directory") +
            ", so a copy would write the same data file. A store whose data dirs are not its own cannot be "
            "copied with cp; " + kIndependentCopyHint +
            ". If this directory replaces " + owner->store_path + " (moved, or the only copy left) and no other "
            "copy will be opened, delete " + owner_path + " and open it again");
      }
    }
    if (write) {
      OPTSTATE_RETURN_IF_ERROR(c->fs_->WriteFileAtomic(owner_path, internal::EncodeDataFileOwner(mine))
                                   .WithContext("store " + c->path_ + ": owner record of data file " + file));
    }
    c->data_locks_[d] = std::move(*lock);
    c->claimed_[d] = true;
  }
  return Status();
}

Status CheckReferencedFiles(Core* core) {  // mu_ held
  for (const auto& [key, vs] : core->versions_) {
    for (const auto& v : vs) {
      if (v.ext.dir >= core->data_files_.size() || !core->data_files_[v.ext.dir]) {
        return Corruption("store " + core->path_ + ": data file " +
                          (v.ext.dir < core->identity_.data_dirs.size() ? core->FileName(v.ext.dir)
                                                                         : "#" + std::to_string(v.ext.dir)) +
                          " is missing but generation " + std::to_string(v.gen) + " references it");
      }
    }
  }
  return Status();
}

class StoreImpl final : public Store {
 public:
  explicit StoreImpl(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  const std::string& path() const override { return core_->path_; }
  const StoreIdentity& identity() const override { return core_->identity_; }
  bool read_only() const override { return core_->read_only_; }

  Status CatchUp() override {
    if (!core_->read_only_) return Status();
    return core_->CatchUpChecked(/*reopen_first=*/false);
  }

  Result<TensorInfo> CreateTensor(const TensorSpec& spec) override {
    OPTSTATE_RETURN_IF_ERROR(ValidateSpec(spec));
    TensorInfo t;
    static_cast<TensorSpec&>(t) = spec;
    if (t.fields.empty()) t.fields = AdamFields();
    if (t.shape.empty()) t.shape = {t.numel};
    if (t.global_shape.empty()) t.global_shape = t.shape;
    if (t.shard_offset.empty()) t.shard_offset.assign(t.global_shape.size(), 0);
    if (t.shard_offset.size() != t.global_shape.size()) {
      return InvalidArgument("tensor '" + spec.name + "': shard_offset rank " +
                             std::to_string(t.shard_offset.size()) + " != global_shape rank " +
                             std::to_string(t.global_shape.size()));
    }
    std::lock_guard l(core_->mu_);
    OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("create tensor '" + spec.name + "'"));
    if (core_->names_.count(spec.name)) {
      return AlreadyExists("store " + core_->path_ + ": tensor '" + spec.name + "' already exists");
    }
    t.id = core_->next_tensor_id_;
    t.created_generation = core_->latest_.generation + 1;
    rocksdb::WriteBatch b;
    b.Put(internal::TensorKey(t.name), internal::EncodeTensor(t));
    b.Put(internal::kNextTensorIdKey, internal::EncodeU64(t.id + 1));
    // Not synced: the next commit's synced batch makes it durable (one WAL).
    OPTSTATE_RETURN_IF_ERROR(RocksStatus("store " + core_->path_ + ": create tensor '" + t.name + "'",
                                         core_->db_->Write(rocksdb::WriteOptions(), &b)));
    core_->next_tensor_id_ = t.id + 1;
    core_->names_[t.name] = t.id;
    core_->tensors_[t.id] = t;
    return t;
  }

  Result<TensorInfo> FindTensor(std::string_view name) const override {
    std::lock_guard l(core_->mu_);
    auto it = core_->names_.find(name);
    if (it != core_->names_.end() && Visible(core_->tensors_.at(it->second))) {
      return core_->tensors_.at(it->second);
    }
    std::vector<std::string> names;
    for (const auto& [id, t] : core_->tensors_) {
      if (Visible(t)) names.push_back(t.name);
    }
    return NotFound("store " + core_->path_ + ": no tensor '" + std::string(name) + "'" +
                    ClosestNames(name, names.begin(), names.end()));
  }

  std::vector<TensorInfo> ListTensors() const override {
    std::lock_guard l(core_->mu_);
    std::vector<TensorInfo> out;
    for (const auto& [name, id] : core_->names_) {
      const auto& t = core_->tensors_.at(id);
      if (Visible(t)) out.push_back(t);
    }
    return out;
  }

  uint64_t ChunkCount(const TensorInfo& t, uint32_t field) const override {
    return Core::ChunkCountOf(t, field, core_->chunk());
  }

  Result<uint32_t> FieldIndex(const TensorInfo& t, std::string_view field) const override {
    std::string names;
    for (uint32_t i = 0; i < t.fields.size(); ++i) {
      if (t.fields[i].name == field) return i;
      names += (i ? ", " : "") + t.fields[i].name;
    }
    return NotFound("store " + core_->path_ + " tensor '" + t.name + "': no field '" + std::string(field) +
                    "' (fields: " + names + ")");
  }

  Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions& opts) override {
    return MakeChunkIo(core_, nullptr, opts);
  }

  Status ReadChunk(const ChunkRef& ref, void* buf) override {
    const Key k{ref.tensor_id, ref.field, ref.index};
    TensorInfo t;
    std::optional<Version> v;
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors_, ref));
      t = *res.first;
      v = core_->Newest(k);
    }
    if (!v) {
      std::memset(buf, 0, core_->chunk());
      return Status();
    }
    return ReadVersion(core_.get(), &t, k, *v, buf, core_->chunk());
  }

  Status WriteChunk(const ChunkRef& ref, const void* buf) override {
    const Key k{ref.tensor_id, ref.field, ref.index};
    TensorInfo t;
    Extent ext;
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("chunk write"));
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors_, ref));
      t = *res.first;
      auto e = core_->AllocateSlot(res.second);
      if (!e.ok()) return e.status().WithContext("write of " + core_->Describe(&t, k, kInfinity));
      ext = *e;
      ++core_->writes_in_flight_;
    }
    ext.checksum = ChunkChecksum(buf, ext.length);
    CrashPoint("extent.before_write");
    Status s = core_->data_files_[ext.dir]->Pwrite(ext.file_offset, buf, RoundUp(ext.length, kIoAlign));
    std::lock_guard l(core_->mu_);
    --core_->writes_in_flight_;
    if (!s.ok()) {
      core_->FreeSlot(ext);
      return s.WithContext("write of " + core_->Describe(&t, k, kInfinity));
    }
    core_->SetPending(k, ext);
    CrashPoint("extent.after_write");
    return Status();
  }

  Result<uint64_t> Commit(const CommitInfo& info) override {
    if (core_->read_only_) return core_->CheckWritable("commit");
    return core_->Commit(info);
  }

  Status SyncData() override {
    if (core_->read_only_) return core_->CheckWritable("data sync");
    return core_->SyncData();
  }

  Status AbortPending() override {
    std::lock_guard l(core_->mu_);
    OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("abort pending"));
    if (core_->writes_in_flight_ > 0) {
      return FailedPrecondition("store " + core_->path_ + ": abort with chunk writes in flight");
    }
    for (const auto& [k, e] : core_->pending_) core_->FreeSlot(e);
    core_->pending_.clear();
    return core_->DropUncommittedTensors();
  }

  GenerationInfo LatestGeneration() const override {
    std::lock_guard l(core_->mu_);
    return core_->latest_;
  }

  std::vector<GenerationInfo> ListGenerations() const override {
    std::lock_guard l(core_->mu_);
    std::vector<GenerationInfo> out;
    for (const auto& [g, info] : core_->generations_) out.push_back(info);
    return out;
  }

  Result<std::unique_ptr<GenerationView>> OpenGeneration(uint64_t generation) override {
    return OpenView(generation, "");
  }

  Result<std::unique_ptr<GenerationView>> OpenSnapshot(std::string_view name) override {
    return OpenView(0, std::string(name));
  }

  Result<SnapshotInfo> CreateSnapshot(const std::string& name) override {
    OPTSTATE_RETURN_IF_ERROR(ValidateSnapshotName(name));
    std::lock_guard l(core_->mu_);
    OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("create snapshot '" + name + "'"));
    if (core_->snapshots_.count(name)) {
      return AlreadyExists("store " + core_->path_ + ": snapshot '" + name + "' already exists (generation " +
                           std::to_string(core_->snapshots_[name].generation) + ")");
    }
    SnapshotInfo s;
    s.name = name;
    s.generation = core_->latest_.generation;
    s.create_time_unix_ms = NowUnixMs();
    rocksdb::WriteBatch b;
    b.Put(internal::SnapshotKey(name), internal::EncodeSnapshot(s));
    CrashPoint("snapshot.create");
    OPTSTATE_RETURN_IF_ERROR(core_->WriteSynced(&b, "create snapshot '" + name + "'"));
    core_->snapshots_[name] = s;
    return s;
  }

  Status ReleaseSnapshot(const std::string& name) override {
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("release snapshot '" + name + "'"));
      if (!core_->snapshots_.count(name)) return SnapshotNotFound(name);
      rocksdb::WriteBatch b;
      b.Delete(internal::SnapshotKey(name));
      CrashPoint("snapshot.release");
      OPTSTATE_RETURN_IF_ERROR(core_->WriteSynced(&b, "release snapshot '" + name + "'"));
      core_->snapshots_.erase(name);
    }
    return core_->CollectGarbage();
  }

  std::vector<SnapshotInfo> ListSnapshots() const override {
    std::lock_guard l(core_->mu_);
    std::vector<SnapshotInfo> out;
    for (const auto& [n, s] : core_->snapshots_) out.push_back(s);
    return out;
  }

  Status CollectGarbage() override {
    if (core_->read_only_) return core_->CheckWritable("garbage collection");
    return core_->CollectGarbage();
  }

  Result<StoreStats> Stats() const override {
    StoreStats st;
    std::vector<uint64_t> leased;
    if (core_->lease_lock_file_) {
      auto names = core_->fs_->ListDir(core_->leases_dir_);
      if (names.ok()) {
        for (const auto& n : *names) {
          if (!n.empty() && n[0] != '.') ++st.leases;
        }
      }
    }
    std::lock_guard l(core_->mu_);
    for (const auto& [g, n] : core_->view_refs_) st.leases += n;
    st.latest_generation = core_->latest_.generation;
    for (const auto& [key, vs] : core_->versions_) {
      if (!vs.empty()) st.live_bytes += vs.front().ext.length;
      for (const auto& v : vs) st.referenced_extent_bytes += core_->AllocBytes(v.ext.length);
    }
    // A pending write of a chunk never written before adds live bytes only at commit.
    for (const auto& [key, e] : core_->pending_) st.pending_bytes += core_->AllocBytes(e.length);
    for (uint32_t d = 0; d < core_->data_files_.size(); ++d) {
      uint64_t size = 0;
      if (core_->data_files_[d]) {
        auto s = core_->data_files_[d]->Size();
        if (s.ok()) size = *s;
      }
      st.data_file_bytes.push_back(size);
      st.data_free_bytes.push_back(core_->read_only_ ? 0 : core_->FreeBytes(d));
    }
    st.lifetime_bytes_written = core_->lifetime_bytes_;
    st.generations_retained = core_->generations_.size();
    st.snapshots = core_->snapshots_.size();
    return st;
  }

  Result<VerifyReport> Verify() override;

  // Opening helpers.
  Result<std::unique_ptr<GenerationView>> OpenView(uint64_t generation, const std::string& snapshot);

 private:
  bool Visible(const TensorInfo& t) const {  // mu_ held
    return !core_->read_only_ || t.created_generation <= core_->latest_.generation;
  }

  Status SnapshotNotFound(const std::string& name) const {  // mu_ held
    std::string names;
    for (const auto& [n, s] : core_->snapshots_) names += (names.empty() ? "" : ", ") + n;
    return NotFound("store " + core_->path_ + ": no snapshot '" + name + "' (snapshots: " +
                    (names.empty() ? "none" : names) + ")");
  }

  Status ValidateSpec(const TensorSpec& spec) const {
    if (spec.name.empty() || spec.name.size() > 4096 || spec.name.find('\0') != std::string::npos ||
        !ValidUtf8(spec.name)) {
      return InvalidArgument("store " + core_->path_ + ": invalid tensor name (1..4096 bytes of UTF-8, no NUL)");
    }
    if (!spec.shape.empty()) {
      uint64_t n = 1;
      for (uint64_t d : spec.shape) n *= d;
      if (n != spec.numel) {
        return InvalidArgument("tensor '" + spec.name + "': shape has " + std::to_string(n) +
                               " elements but numel is " + std::to_string(spec.numel));
      }
    }
    std::set<std::string> seen;
    for (const auto& f : spec.fields) {
      if (f.name.empty() || f.name.find('\0') != std::string::npos || f.name.find('/') != std::string::npos ||
          !seen.insert(f.name).second) {
        return InvalidArgument("tensor '" + spec.name + "': invalid or duplicate field name '" + f.name + "'");
      }
    }
    return Status();
  }

  std::shared_ptr<Core> core_;
};

Result<std::unique_ptr<GenerationView>> StoreImpl::OpenView(uint64_t generation, const std::string& snapshot) {
  Core* c = core_.get();
  auto resolve = [&](uint64_t* g) -> Status {  // mu_ held
    if (!snapshot.empty()) {
      auto s = c->snapshots_.find(snapshot);
      if (s == c->snapshots_.end()) return SnapshotNotFound(snapshot);
      *g = s->second.generation;
    } else {
      *g = generation == kLatest ? c->latest_.generation : generation;
    }
    if (!c->generations_.count(*g)) {
      std::string have;
      for (const auto& [x, i] : c->generations_) have += (have.empty() ? "" : ", ") + std::to_string(x);
      return NotFound("store " + c->path_ + ": generation " + std::to_string(*g) +
                      " is not retained (retained: " + have + ")");
    }
    return Status();
  };
  if (!c->read_only_) {
    std::lock_guard l(c->mu_);
    uint64_t g;
    OPTSTATE_RETURN_IF_ERROR(resolve(&g));
    auto v = BuildView(core_, g);
    ++c->view_refs_[g];
    v->in_process_ref = true;
    return std::unique_ptr<GenerationView>(new GenerationViewImpl(std::move(v)));
  }
  // Read-only: a lease file, then (under the same shared flock) RETAINED says
  // whether the writer still keeps g; g's entries come from this process's
  // index, checked against g's digest.
  static std::atomic<uint64_t> nonce{0};
  std::mt19937_64 rng(std::random_device{}());
  bool reopen = false;
  Status why = Busy("the writer collected each generation before a lease on it was taken");
  for (int attempt = 0; attempt < 20; ++attempt) {
    OPTSTATE_RETURN_IF_ERROR(c->CatchUpChecked(reopen));
    reopen = false;
    uint64_t g;
    {
      std::lock_guard l(c->mu_);
      OPTSTATE_RETURN_IF_ERROR(resolve(&g));
    }
    const std::string lease =
        JoinPath(c->leases_dir_, std::to_string(getpid()) + "." + std::to_string(g) + "." +
                                     std::to_string((rng() & 0xffffffffull) * 1000 + nonce++ % 1000) +
                                     std::string(Core::kLeaseSuffix));
    std::optional<std::vector<uint64_t>> retained;
    std::unique_ptr<File> handle;
    {
      std::lock_guard ll(c->lease_lock_mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto guard, c->LockLeases(LOCK_SH));
      OpenOptions oo;
      oo.create = true;
      oo.exclusive = true;
      auto f = c->fs_->Open(lease, oo);
      if (!f.ok()) return f.status().WithContext("store " + c->path_ + ": take reader lease");
      handle = std::move(*f);
      // Locked before the lease flock is released: the writer's GC, which
      // lists leases under LOCK_EX, never sees this file unlocked while we live.
      while (::flock(handle->fd(), LOCK_EX | LOCK_NB) != 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        handle.reset();
        (void)c->fs_->Remove(lease);
        return ErrnoStatus("store " + c->path_ + ": flock reader lease " + lease, e);
      }
      retained = c->ReadRetained();
    }
    // Without RETAINED (a store last opened by an older writer): a GC that
    // dropped g before the lease existed is in the index by now.
    Status s = retained ? Status() : c->CatchUpChecked(false);
    const bool kept = retained ? std::binary_search(retained->begin(), retained->end(), g) : true;
    std::unique_lock l(c->mu_);
    if (s.ok() && kept && c->generations_.count(g)) {
      s = c->CheckIndexOf(g);
      if (s.ok()) {
        auto v = BuildView(core_, g);
        v->lease_file = lease;
        v->lease_handle = std::move(handle);
        l.unlock();
        return std::unique_ptr<GenerationView>(new GenerationViewImpl(std::move(v)));
      }
      reopen = true;  // g's entries in this index are stale
      why = s;
    } else if (s.ok() && kept) {
      reopen = true;  // the writer keeps g, this index lost it: stale
    }
    l.unlock();
    (void)c->fs_->Remove(lease);
    handle.reset();
    if (!s.ok() && s.code() != StatusCode::kBusy) return s;
    if (!kept && generation != kLatest && snapshot.empty()) {
      return NotFound("store " + c->path_ + ": generation " + std::to_string(g) +
                      " was collected before a lease could be taken");
    }
  }
  return Busy("store " + c->path_ + ": could not lease a generation after 20 attempts: " + why.ToString());
}

Result<VerifyReport> StoreImpl::Verify() {
  struct Item {
    TensorInfo tensor;
    Key key;
    Version v;
    uint64_t expected_len;
  };
  VerifyReport rep;
  Core* c = core_.get();
  if (c->read_only_) OPTSTATE_RETURN_IF_ERROR(c->CatchUpChecked(/*reopen_first=*/false));
  // Every generation is read through a view that holds a lease on it (a read-
  // only store's lease file, a writable store's in-process reference), so the
  // writer (another process, or this one on another thread) never reuses an
  // extent that is being checked. A generation the writer collected before its
  // lease could be taken is skipped: it is no longer part of the store.
  // The latest generation first: leasing it retries with a newer one when
  // the writer collects it meanwhile, so at least one is always checked.
  std::vector<std::unique_ptr<GenerationView>> views;
  {
    auto v = OpenView(kLatest, "");
    if (!v.ok()) return v.status().WithContext("store " + c->path_ + ": verify: lease on the latest generation");
    views.push_back(std::move(*v));
  }
  std::vector<uint64_t> gens;
  {
    std::lock_guard l(c->mu_);
    for (const auto& [g, i] : c->generations_) {
      if (g != views[0]->info().generation) gens.push_back(g);
    }
  }
  for (uint64_t g : gens) {
    auto v = OpenView(g, "");
    if (v.ok()) {
      views.push_back(std::move(*v));
    } else if (v.status().IsNotFound()) {
      ++rep.generations_skipped;
    } else {
      return v.status().WithContext("store " + c->path_ + ": verify: lease on generation " + std::to_string(g));
    }
  }
  std::vector<Item> items;
  std::set<std::tuple<Key, uint64_t>> planned;
  for (const auto& view : views) {
    const ViewData& d = static_cast<const GenerationViewImpl&>(*view).data();
    ++rep.generations_checked;
    for (const auto& [k, v] : d.chunks) {
      if (!planned.insert({k, v.gen}).second) continue;
      const TensorInfo& t = d.by_id.at(k.t);
      if (k.f >= t.fields.size() || k.c >= Core::ChunkCountOf(t, k.f, c->chunk())) continue;  // reported below
      items.push_back(Item{t, k, v, c->ChunkLen(t, k.f, k.c)});
    }
  }
  // (dir, offset) -> the version using it and its allocation (slot or piece) size.
  struct Owner {
    const TensorInfo* tensor;
    Key key;
    uint64_t gen;
    uint64_t bytes;
  };
  std::map<std::pair<uint32_t, uint64_t>, Owner> owner;
  uint64_t allocated = 0, free_bytes = 0, owned_bytes = 0;
  uint64_t index_latest = 0;
  {
    std::lock_guard l(core_->mu_);
    index_latest = c->latest_.generation;
    for (const auto& [n, s] : c->snapshots_) {
      if (!c->generations_.count(s.generation)) {
        rep.problems.push_back("store " + c->path_ + ": snapshot '" + n + "' pins generation " +
                               std::to_string(s.generation) + " which has no record");
      }
    }
    // References: every committed and pending version, inside the files, no
    // two on overlapping space, each held in use by the allocator as an
    // extent of its size class.
    const uint64_t slot_bytes = c->SlotBytes();
    auto claim = [&](const TensorInfo* tp, const Key& k, uint64_t gen, const Extent& e) {
      const uint64_t bytes = c->AllocBytes(e.length);
      const std::string what = c->Describe(tp, k, gen) + ": extent (dir " + std::to_string(e.dir) + ", offset " +
                               std::to_string(e.file_offset) + ", " + std::to_string(bytes) + " bytes)";
      if (e.dir >= c->space_.size() || e.file_offset % bytes != 0 ||
          (!c->read_only_ && e.file_offset / slot_bytes >= c->space_[e.dir].slots)) {
        rep.problems.push_back(what + " is dangling");
        return;
      }
      auto [it, fresh] = owner.try_emplace({e.dir, e.file_offset}, Owner{tp, k, gen, bytes});
      if (!fresh) {
        rep.problems.push_back(what + " is also referenced by generation " + std::to_string(it->second.gen));
        return;
      }
      owned_bytes += bytes;
      auto overlaps = [&](auto lo, auto hi) {
        return lo->first.first == hi->first.first && lo->first.second + lo->second.bytes > hi->first.second;
      };
      if (it != owner.begin() && overlaps(std::prev(it), it)) {
        const Owner& o = std::prev(it)->second;
        rep.problems.push_back(what + " overlaps the extent of " + c->Describe(o.tensor, o.key, o.gen));
      }
      if (std::next(it) != owner.end() && overlaps(it, std::next(it))) {
        const Owner& o = std::next(it)->second;
        rep.problems.push_back(what + " overlaps the extent of " + c->Describe(o.tensor, o.key, o.gen));
      }
      if (c->read_only_) return;
      switch (c->HeldAs(e.dir, e.file_offset, bytes)) {
        case Core::Held::kInUse: break;
        case Core::Held::kFree: rep.problems.push_back(what + ": referenced extent is on the free list"); break;
        case Core::Held::kOtherClass:
          rep.problems.push_back(what + ": the allocator holds its slot for another size class");
          break;
      }
    };
    for (const auto& [k, vs] : c->versions_) {
      auto t = c->tensors_.find(k.t);
      const TensorInfo* tp = t == c->tensors_.end() ? nullptr : &t->second;
      if (!tp) {
        rep.problems.push_back(c->Describe(nullptr, k, kInfinity) + ": versions of an unknown tensor");
      } else if (k.f >= tp->fields.size() || k.c >= Core::ChunkCountOf(*tp, k.f, c->chunk())) {
        rep.problems.push_back(c->Describe(tp, k, kInfinity) + ": version outside the tensor's chunks");
      }
      for (const auto& v : vs) claim(tp, k, v.gen, v.ext);
    }
    for (const auto& [k, e] : c->pending_) {
      auto t = c->tensors_.find(k.t);
      claim(t == c->tensors_.end() ? nullptr : &t->second, k, c->latest_.generation + 1, e);
    }
    // Leaks: space the allocator holds in use that no version owns.
    if (!c->read_only_) {
      for (uint32_t d = 0; d < c->space_.size(); ++d) {
        const Core::DirSpace& sp = c->space_[d];
        allocated += sp.slots * slot_bytes;
        free_bytes += c->FreeBytes(d);
        for (uint64_t s = 0; s < sp.slots; ++s) {
          if (sp.free_slots.count(s)) continue;
          auto cs = sp.carved.find(s);
          if (cs == sp.carved.end()) {
            if (!owner.count({d, s * slot_bytes})) ++rep.leaked_slots;
            continue;
          }
          const Core::CarvedSlot& cv = cs->second;
          uint64_t in_use = 0;
          for (uint64_t i = 0; i < cv.pieces(slot_bytes); ++i) {
            if (!cv.InUse(i)) continue;
            ++in_use;
            if (!owner.count({d, s * slot_bytes + i * cv.piece_bytes})) ++rep.leaked_slots;
          }
          if (in_use != cv.used || in_use == 0) {
            rep.problems.push_back("store " + c->path_ + ": data dir " + std::to_string(d) + " slot " +
                                   std::to_string(s) + " of " + std::to_string(cv.piece_bytes) +
                                   "-byte pieces counts " + std::to_string(cv.used) + " in use, its map " +
                                   std::to_string(in_use));
          }
        }
      }
    }
  }
  IoBuffer buf(core_->chunk());
  if (!buf.ok()) return ResourceExhausted("store " + core_->path_ + ": verify: out of memory for a chunk buffer");
  for (const auto& it : items) {
    if (it.v.ext.length != it.expected_len) {
      rep.problems.push_back(core_->Describe(&it.tensor, it.key, it.v.gen) + ": extent length " +
                             std::to_string(it.v.ext.length) + " != chunk length " +
                             std::to_string(it.expected_len));
      continue;
    }
    Status s = ReadVersion(core_.get(), &it.tensor, it.key, it.v, buf.data(), core_->chunk());
    ++rep.chunks_checked;
    rep.bytes_checked += it.v.ext.length;
    if (!s.ok()) rep.problems.push_back(s.ToString());
  }
  if (!core_->read_only_ && owned_bytes + free_bytes > allocated) {
    rep.problems.push_back("store " + core_->path_ + ": space accounting: " + std::to_string(owned_bytes) +
                           " bytes referenced/pending + " + std::to_string(free_bytes) + " free but only " +
                           std::to_string(allocated) + " allocated");
  }
  c->VerifyMarks(index_latest, &rep.problems);
  return rep;
}

Status CleanStaleCreations(FileSystem* fs, const std::string& parent, const std::string& base) {
  auto names = fs->ListDir(parent);
  if (!names.ok()) return names.status();
  const std::string prefix = "." + base + ".creating-";
  for (const auto& n : *names) {
    if (!n.starts_with(prefix)) continue;
    const long pid = std::strtol(n.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && pid != getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      OPTSTATE_LOG_INFO("removing half-created store {}", JoinPath(parent, n));
      (void)fs->RemoveAll(JoinPath(parent, n));
    }
  }
  return Status();
}

Result<std::shared_ptr<Core>> NewCore(const std::string& path, const StoreOptions& opts, bool read_only) {
  auto core = std::make_shared<Core>();
  core->path_ = AbsPath(path);
  core->opts_ = opts;
  core->fs_ = opts.fs ? opts.fs : FileSystem::Default();
  core->read_only_ = read_only;
  core->leases_dir_ = JoinPath(core->path_, "leases");
  if (core->fs_->hooks() != nullptr) core->env_ = internal::NewHookedEnv(core->fs_->hooks());
  return core;
}

// Opens (creating if absent) COMMITTED and refuses an index older than the
// generation it records: the acknowledged generations must all be there. A
// store whose index holds committed generations must have a whole COMMITTED
// (missing, empty, truncated or with no valid slot is damage: no crash makes
// it so, and without it a lost index write-ahead log would go unnoticed),
// unless the user accepted the index as it is (kAcceptIndexFile).
Status OpenCommittedMark(Core* c) {
  const std::string name = JoinPath(c->path_, "COMMITTED");
  const std::string accept = JoinPath(c->path_, Core::kAcceptIndexFile);
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, c->fs_->Exists(name));
  OPTSTATE_ASSIGN_OR_RETURN(bool accepted, c->fs_->Exists(accept));
  OpenOptions oo;
  oo.create = !exists;
  std::unique_ptr<File> f;
  uint64_t size = 0;
  if (exists || c->latest_.generation == 0 || accepted) {
    auto opened = c->fs_->Open(name, oo);
    if (!opened.ok()) return opened.status().WithContext("store " + c->path_ + ": COMMITTED");
    f = std::move(*opened);
    OPTSTATE_ASSIGN_OR_RETURN(size, f->Size());
  }
  std::lock_guard l(c->mu_);
  const uint64_t index_latest = c->latest_.generation;
  std::string damage;  // what is wrong with COMMITTED, if anything
  std::optional<uint64_t> acked;
  bool both_valid = false;
  if (!exists) {
    damage = "is missing";
  } else if (size == 0) {
    damage = "is empty";
  } else {
    // The newest valid slot; an invalid slot is a torn or lost unsynced write.
    std::string contents(std::min<uint64_t>(size, Core::kCommittedBytes), '\0');
    Status rs = f->Pread(0, contents.data(), contents.size());
    if (!rs.ok()) return rs.WithContext("store " + c->path_ + ": COMMITTED");
    std::string why;
    acked = Core::NewestCommittedMark(contents, "slot", &why);
    both_valid = acked && why.empty();
    if (size < Core::kCommittedBytes) {
      damage = "is truncated to " + std::to_string(size) + " bytes (" + std::to_string(Core::kCommittedBytes) +
               " written)";
    } else if (!acked) {
      damage = "holds no valid record (" + why + ")";
    }
  }
  std::string problem;
  if (!damage.empty() && index_latest > 0) {
    problem = "store " + c->path_ + " is damaged: COMMITTED " + damage +
              ", but the index (index/) holds committed generations up to " + std::to_string(index_latest) +
              ": the store cannot tell whether the index lost acknowledged generations. ";
  } else if (acked && index_latest < *acked) {
    problem = "store " + c->path_ + " is damaged: its index (RocksDB, index/) holds generation " +
              std::to_string(index_latest) + " but generation " + std::to_string(*acked) +
              " was committed and acknowledged (COMMITTED): the index write-ahead log was lost or damaged; "
              "refusing to open an older state silently. ";
  }
  if (!problem.empty()) {
    if (!accepted) return Corruption(problem + c->CommittedRecoveryHint(index_latest));
    OPTSTATE_LOG_WARN("{}{} exists: accepting the index as it is, generation {}", problem, accept, index_latest);
  }
  if (damage.empty() && both_valid && acked == index_latest) {
    c->committed_file_ = std::move(f);
  } else {
    // A fresh store (or one whose creation crashed before COMMITTED was
    // written), an index ahead of the mark (a crash after the commit batch,
    // before the mark), a torn slot, or the user's acceptance: both slots anew.
    if (f == nullptr) {
      auto opened = c->fs_->Open(name, oo);
      if (!opened.ok()) return opened.status().WithContext("store " + c->path_ + ": COMMITTED");
      f = std::move(*opened);
    }
    c->committed_file_ = std::move(f);
    OPTSTATE_RETURN_IF_ERROR(
        c->WriteCommittedMark(index_latest, /*both_slots=*/true).WithContext("store " + c->path_ + ": COMMITTED"));
    if (!exists) OPTSTATE_RETURN_IF_ERROR(c->fs_->SyncDir(c->path_));
  }
  if (accepted) {
    OPTSTATE_RETURN_IF_ERROR(c->fs_->Remove(accept).WithContext("store " + c->path_));
    OPTSTATE_RETURN_IF_ERROR(c->fs_->SyncDir(c->path_));
  }
  return Status();
}

Status OpenLeaseLock(Core* c) {
  OPTSTATE_RETURN_IF_ERROR(c->fs_->CreateDir(c->leases_dir_));
  OpenOptions oo;
  oo.create = true;
  auto f = c->fs_->Open(JoinPath(c->leases_dir_, ".lock"), oo);
  if (!f.ok()) return f.status().WithContext("store " + c->path_ + ": leases/.lock");
  c->lease_lock_file_ = std::move(*f);
  return Status();
}

}  // namespace

// ---------------------------------------------------------------------------

Result<std::unique_ptr<Store>> Store::Create(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  FileSystem* fs = opts.fs ? opts.fs : FileSystem::Default();
  const std::string path = AbsPath(path_in);
  const std::filesystem::path p(path);
  const std::string parent = p.parent_path().string();
  const std::string base = p.filename().string();
  if (base.empty() || base == "." || base == "..") return InvalidArgument("store path '" + path_in + "' has no name");
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, fs->Exists(path));
  if (exists) return AlreadyExists("store " + path + " already exists");
  OPTSTATE_ASSIGN_OR_RETURN(bool parent_exists, fs->Exists(parent));
  if (!parent_exists) return NotFound("store " + path + ": parent directory " + parent + " does not exist");
  OPTSTATE_RETURN_IF_ERROR(CleanStaleCreations(fs, parent, base));

  const std::string tmp = JoinPath(parent, "." + base + ".creating-" + std::to_string(getpid()));
  OPTSTATE_ASSIGN_OR_RETURN(bool tmp_exists, fs->Exists(tmp));
  if (tmp_exists) OPTSTATE_RETURN_IF_ERROR(fs->RemoveAll(tmp));
  OPTSTATE_RETURN_IF_ERROR(fs->CreateDir(tmp));
  CrashPoint("store.create.begin");

  StoreIdentity id;
  id.name = opts.name.empty() ? base : opts.name;
  {
    std::random_device rd;
    char u[40];
    const uint64_t a = (uint64_t{rd()} << 32) | rd(), b = (uint64_t{rd()} << 32) | rd();
    snprintf(u, sizeof(u), "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32),
             static_cast<unsigned>((a >> 16) & 0xffff), static_cast<unsigned>(a & 0xfff),
             static_cast<unsigned>(0x8000 | ((b >> 48) & 0x3fff)),
             static_cast<unsigned long long>(b & 0xffffffffffffull));
    id.uuid = u;
  }
  id.chunk_size_bytes = opts.chunk_size_bytes;
  id.create_time_unix_ms = NowUnixMs();
  std::vector<std::string> real_dirs;  // where the dirs are while building
  if (opts.data_dirs.empty()) {
    id.data_dirs = {JoinPath(path, "data")};
    real_dirs = {JoinPath(tmp, "data")};
  } else {
    for (const auto& d : opts.data_dirs) {
      const std::string a = AbsPath(d);
      id.data_dirs.push_back(a);
      real_dirs.push_back(a == path || a.starts_with(path + "/") ? tmp + a.substr(path.size()) : a);
    }
  }
  auto fail = [&](const Status& s) {
    (void)fs->RemoveAll(tmp);
    return s.WithContext("create store " + path);
  };
  for (size_t d = 0; d < real_dirs.size(); ++d) {
    Status s = fs->CreateDir(real_dirs[d]);
    if (!s.ok()) return fail(s);
    OpenOptions oo;
    oo.create = true;
    oo.exclusive = true;
    auto f = fs->Open(JoinPath(real_dirs[d], id.uuid + ".chunks"), oo);
    if (!f.ok()) return fail(f.status());
    s = (*f)->Fsync();
    if (s.ok()) s = fs->SyncDir(real_dirs[d]);
    if (!s.ok()) return fail(s);
  }
  {
    Status s = fs->WriteFileAtomic(JoinPath(tmp, "IDENTITY"), internal::EncodeIdentity(id, path));
    if (!s.ok()) return fail(s);
  }
  CrashPoint("store.create.identity");
  {
    auto core = NewCore(tmp, opts, false);
    if (!core.ok()) return fail(core.status());
    Status s = fs->CreateDir(JoinPath(tmp, "index"));
    if (!s.ok()) return fail(s);
    rocksdb::Options o = IndexOptions(core->get());
    o.create_if_missing = true;
    o.error_if_exists = true;
    rocksdb::DB* raw = nullptr;
    s = RocksStatus("create index", rocksdb::DB::Open(o, JoinPath(tmp, "index"), &raw));
    if (!s.ok()) return fail(s);
    (*core)->db_.reset(raw);
    GenerationInfo g0;
    g0.commit_time_unix_ms = id.create_time_unix_ms;
    rocksdb::WriteBatch b;
    b.Put(internal::kIdentityKey, internal::EncodeIdentity(id, path));
    b.Put(internal::kLatestKey, internal::EncodeU64(0));
    b.Put(internal::kNextTensorIdKey, internal::EncodeU64(0));
    b.Put(internal::kLifetimeKey, internal::EncodeU64(0));
    b.Put(internal::GenerationKey(0), internal::EncodeGeneration(g0));
    s = (*core)->WriteSynced(&b, "initial index");
    if (!s.ok()) return fail(s);
  }
  CrashPoint("store.create.index");
  {
    Status s = fs->CreateDir(JoinPath(tmp, "leases"));
    if (s.ok()) s = fs->SyncDir(tmp);
    if (s.ok()) s = fs->Rename(tmp, path);
    if (!s.ok()) return fail(s);
    s = fs->SyncDir(parent);
    if (!s.ok()) return s.WithContext("create store " + path);
  }
  CrashPoint("store.create.renamed");
  return Open(path, opts);
}

Result<std::unique_ptr<Store>> Store::Open(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  OPTSTATE_ASSIGN_OR_RETURN(auto core, NewCore(path_in, opts, false));
  const std::string& path = core->path_;
  FileSystem* fs = core->fs_;
  OPTSTATE_ASSIGN_OR_RETURN(core->identity_, ReadIdentity(fs, path));
  OPTSTATE_RETURN_IF_ERROR(ResolveDataDirs(core.get()));

  // LOCK: one writer per store; the holder's pid inside for the error message.
  {
    OpenOptions oo;
    oo.create = true;
    const std::string lock_path = JoinPath(path, "LOCK");
    auto f = fs->Open(lock_path, oo);
    if (!f.ok()) return f.status().WithContext("store " + path + ": LOCK");
    if (::flock((*f)->fd(), LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e == EWOULDBLOCK) {
        auto text = fs->ReadFileToString(lock_path);
        std::string pid = text.ok() ? std::to_string(std::strtoll(text->c_str(), nullptr, 10)) : "unknown";
        return Status(StatusCode::kBusy, "store " + path + " is in use by pid " + pid, e);
      }
      return ErrnoStatus("store " + path + ": flock LOCK", e);
    }
    char pid[32];
    snprintf(pid, sizeof(pid), "%-23d\n", static_cast<int>(getpid()));
    OPTSTATE_RETURN_IF_ERROR((*f)->Pwrite(0, pid, 24).WithContext("store " + path + ": LOCK"));
    core->lock_file_ = std::move(*f);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenLeaseLock(core.get()));

  {
    const std::string index = JoinPath(path, "index");
    OPTSTATE_ASSIGN_OR_RETURN(bool has_index, fs->Exists(index));
    if (!has_index) return Corruption("store " + path + " is damaged: index/ is missing");
    rocksdb::Options o = IndexOptions(core.get());
    o.create_if_missing = false;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status rs = rocksdb::DB::Open(o, index, &raw);
    if (!rs.ok()) {
      Status s = RocksStatus("store " + path + " is damaged or unreadable: index", rs);
      if (s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound) {
        return Corruption(s.message());
      }
      return s;
    }
    core->db_.reset(raw);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/false));
  OPTSTATE_RETURN_IF_ERROR(ClaimDataFiles(core.get()));
  {
    std::lock_guard l(core->mu_);
    OPTSTATE_RETURN_IF_ERROR(core->LoadIndex());
    OPTSTATE_RETURN_IF_ERROR(CheckReferencedFiles(core.get()));
    OPTSTATE_RETURN_IF_ERROR(core->DropUncommittedTensors());
  }
  OPTSTATE_RETURN_IF_ERROR(OpenCommittedMark(core.get()));
  {
    OpenOptions oo;
    oo.create = true;
    auto f = fs->Open(JoinPath(path, "RETAINED"), oo);  // written by the GC below
    if (!f.ok()) return f.status().WithContext("store " + path + ": RETAINED");
    core->retained_file_ = std::move(*f);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/true));
  OPTSTATE_RETURN_IF_ERROR(ClaimDataFiles(core.get()));
  if (core->identity_needs_rewrite_) {
    // Data dirs inside the store directory recorded relative to it from now on.
    OPTSTATE_RETURN_IF_ERROR(fs->WriteFileAtomic(JoinPath(path, "IDENTITY"),
                                                 internal::EncodeIdentity(core->identity_, path))
                                 .WithContext("store " + path + ": rewrite of IDENTITY"));
  }
  {
    std::lock_guard l(core->mu_);
    OPTSTATE_RETURN_IF_ERROR(core->BuildFreeLists());
  }
  OPTSTATE_RETURN_IF_ERROR(core->CollectGarbage().WithContext("store " + path + ": garbage collection at open"));
  return std::unique_ptr<Store>(new StoreImpl(std::move(core)));
}

namespace {

// Read-only stores keep a RocksDB secondary instance in a directory of their
// own under /tmp (its info log; the instance holds no data). A reader killed
// by SIGKILL or a power loss leaves it behind, so each reader flocks
// <dir>.lock while it lives, and every read-only open removes the directories
// whose lock nobody holds: the kernel drops a flock when its process ends,
// however it ends, in any pid namespace. Directories of readers that predate
// the lock file are removed when their pid (the name's first number) is gone.
constexpr const char* kSecondaryRoot = "/tmp";
constexpr const char* kSecondaryPrefix = "optstate-secondary-";

int LockSecondaryBase(const std::string& base) {
  int fd = ::open((base + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return -1;  // the directory then only ages out by its pid
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Removes <root>/<base> and its reopened instances <base>-r<N>.
void RemoveSecondaryBase(const std::string& root, const std::string& base) {
  namespace sfs = std::filesystem;
  std::error_code ec;
  std::vector<sfs::path> doomed;
  for (sfs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == base || name.rfind(base + "-r", 0) == 0) doomed.push_back(it->path());
  }
  for (const auto& p : doomed) sfs::remove_all(p, ec);
}

void RemoveStaleSecondaryDirs(const std::string& root) {
  namespace sfs = std::filesystem;
  std::error_code ec;
  std::map<std::string, bool> bases;  // base -> has a lock file
  const size_t prefix = std::strlen(kSecondaryPrefix);
  for (sfs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kSecondaryPrefix, 0) != 0) continue;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".lock") == 0) {
      bases[name.substr(0, name.size() - 5)] = true;
      continue;
    }
    const auto r = name.find("-r", prefix);
    bases.emplace(r == std::string::npos ? name : name.substr(0, r), false);
  }
  for (const auto& [base, has_lock] : bases) {
    const std::string lock_path = root + "/" + base + ".lock";
    if (has_lock) {
      const int fd = ::open(lock_path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {  // its reader is gone
        RemoveSecondaryBase(root, base);
        (void)::unlink(lock_path.c_str());
      }
      ::close(fd);
      continue;
    }
    const char* digits = base.c_str() + prefix;
    char* end = nullptr;
    const long pid = std::strtol(digits, &end, 10);
    if (end == digits || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    RemoveSecondaryBase(root, base);
  }
}

}  // namespace

Result<std::unique_ptr<Store>> Store::OpenReadOnly(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  OPTSTATE_ASSIGN_OR_RETURN(auto core, NewCore(path_in, opts, true));
  const std::string& path = core->path_;
  FileSystem* fs = core->fs_;
  OPTSTATE_ASSIGN_OR_RETURN(core->identity_, ReadIdentity(fs, path));
  OPTSTATE_RETURN_IF_ERROR(ResolveDataDirs(core.get()));
  {
    OpenOptions oo;
    oo.create = true;  // a store created before leases/ existed has none yet
    auto f = fs->Open(JoinPath(core->leases_dir_, ".lock"), oo);
    if (!f.ok()) return f.status().WithContext("store " + path + ": leases/.lock");
    core->lease_lock_file_ = std::move(*f);
  }
  static std::atomic<uint64_t> counter{0};
  RemoveStaleSecondaryDirs(kSecondaryRoot);
  core->secondary_base_ = std::string(kSecondaryRoot) + "/" + kSecondaryPrefix + std::to_string(getpid()) + "-" +
                          std::to_string(counter++) + "-" + std::to_string(std::random_device{}());
  core->secondary_dir_ = core->secondary_base_;
  core->secondary_lock_fd_ = LockSecondaryBase(core->secondary_base_);
  {
    OPTSTATE_ASSIGN_OR_RETURN(bool has_index, fs->Exists(JoinPath(path, "index")));
    if (!has_index) return Corruption("store " + path + " is damaged: index/ is missing");
    OPTSTATE_ASSIGN_OR_RETURN(core->db_,
                              core->OpenSecondary(core->secondary_dir_, " is damaged or unreadable: index (secondary)"));
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/false));
  Status loaded;
  {
    std::lock_guard l(core->mu_);
    loaded = core->LoadIndexChecked(core->ReadAckedGeneration());
  }
  if (!loaded.ok()) OPTSTATE_RETURN_IF_ERROR(core->CatchUpChecked(/*reopen_first=*/true));
  std::lock_guard l(core->mu_);
  OPTSTATE_RETURN_IF_ERROR(CheckReferencedFiles(core.get()));
  core->space_.assign(core->data_files_.size(), {});  // slot counts only: no allocation here
  for (uint32_t d = 0; d < core->data_files_.size(); ++d) {
    if (!core->data_files_[d]) continue;
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, core->data_files_[d]->Size());
    core->space_[d].slots = size / core->SlotBytes();
  }
  return std::unique_ptr<Store>(new StoreImpl(std::move(core)));
}

}  // namespace optstate::vfs
