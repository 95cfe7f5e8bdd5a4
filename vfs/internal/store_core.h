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

// GenerationInfo::index_digest is a wrapping sum of one XXH3 per tensor the
// generation sees and one per chunk version it sees, so the writer (its maps
// plus the pending versions) and a reader (its own index) need not walk them
// in the same order.
inline uint64_t TensorDigest(const TensorInfo& t) {
  const uint64_t a[4] = {t.id, t.numel, t.fields.size(), t.created_generation};
  return ChunkChecksum(a, sizeof(a));
}
inline uint64_t VersionDigest(const Key& k, const Version& v) {
  const uint64_t a[8] = {k.t, k.f, k.c, v.gen, v.ext.dir, v.ext.file_offset, v.ext.length, v.ext.checksum};
  return ChunkChecksum(a, sizeof(a));
}
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

}  // namespace optstate::vfs::internal
