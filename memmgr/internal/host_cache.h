// ChunkKey and HostCache, the host cache tier: chunk copies in pinned host
// memory between the device and the store. Internal to memmgr.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "memmgr/internal/device.h"

namespace optstate::memmgr::internal {

// One chunk of a tensor field: store tensor id, field index, chunk index.
struct ChunkKey {
  uint32_t tensor_id = 0;
  uint32_t field = 0;
  uint64_t index = 0;
  bool operator==(const ChunkKey& o) const {
    return tensor_id == o.tensor_id && field == o.field && index == o.index;
  }
  bool operator<(const ChunkKey& o) const {
    if (tensor_id != o.tensor_id) return tensor_id < o.tensor_id;
    if (field != o.field) return field < o.field;
    return index < o.index;
  }
};
struct ChunkKeyHash {
  size_t operator()(const ChunkKey& k) const {
    return (static_cast<size_t>(k.tensor_id) * 0x9E3779B97F4A7C15ull) ^ (k.field * 0xC2B2AE3Dull) ^
           (k.index * 0x165667B19E3779F9ull);
  }
};

// Bytes of pinned host cache buffers that one or more HostCaches may hold
// together: a manager's own (an explicit host_cache_bytes) or the process's
// automatic one (SharedAutoCacheBudget), which every manager created with
// MemoryManagerOptions::kAutoHostCache draws from, so that all the
// optimizers of a process together stay within the automatic share.
// Thread-safe; a leaf lock (nothing is acquired while holding it).
class CacheBudget {
 public:
  explicit CacheBudget(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
  uint64_t capacity_bytes() const { return capacity_; }
  // Takes `bytes` when they fit within the capacity; false otherwise.
  bool Take(uint64_t bytes);
  void Give(uint64_t bytes);
  uint64_t used_bytes() const;
  uint64_t free_bytes() const;

 private:
  const uint64_t capacity_;
  mutable Mutex mu_;
  uint64_t used_ GUARDED_BY(mu_) = 0;
};

// The process's automatic host cache budget (MemoryManagerOptions::
// kAutoHostCache): computed from /proc/meminfo and LOCAL_WORLD_SIZE when no
// manager holds it, shared by every manager created while one does. *why
// says how it was sized.
std::shared_ptr<CacheBudget> SharedAutoCacheBudget(std::string* why);

// Host cache tier: copies of chunks in pinned host memory. Clean entries
// equal the store's newest version. StreamedAdam also uses entries as its
// working copy (Acquire/Release): such an entry is `dirty` (newer than the last
// commit) or in use, and is never evicted; `written` marks a dirty entry
// already written to the pending generation.
// Each entry owns a pinned, 4096-aligned buffer of EntryBytes(len) (direct
// I/O goes to and from it); its CacheBudget bounds the bytes of these
// buffers, free ones kept per size for reuse included (the budget may be
// shared with other managers' caches: SharedAutoCacheBudget). Admission policy: see
// MemoryManagerOptions::host_cache_bytes (admit while there is room, never
// evict a resident entry for a miss, except where a caller asks to: Acquire's
// may_evict, used when the tier holds the whole state).
class HostCache {
 public:
  // budget: null or of capacity 0 = off.
  HostCache(Device* dev, std::shared_ptr<CacheBudget> budget);
  ~HostCache();
  bool enabled() const { return budget_ != nullptr && budget_->capacity_bytes() > 0; }
  // Bytes an entry of a chunk of len bytes occupies (len rounded up to 4096).
  static uint64_t EntryBytes(uint64_t len) { return (len + 4095) & ~uint64_t{4095}; }
  // Copies the cached chunk (len bytes) to dst with `copy`; false on a miss.
  // dst_is_device: H2D copy on `stream` (synchronised before return).
  bool Get(const ChunkKey& k, void* dst, uint64_t len, bool dst_is_device, void* stream);
  // Replaces k's copy, or admits it when there is room, from host memory src.
  void Put(const ChunkKey& k, const void* src, uint64_t len);
  // As Put, from device memory (D2H on stream, synchronised).
  void PutFromDevice(const ChunkKey& k, const void* d_src, uint64_t len, void* stream);
  void Erase(const ChunkKey& k);
  void EraseTensor(uint32_t tensor_id);
  // Drops every entry, dirty ones included (after an aborted generation).
  void Clear();
  // Bytes of the resident entries' buffers.
  uint64_t bytes() const;
  // The bytes this tier can hold now: its own buffers plus what its budget
  // has left (less than the budget's capacity while other caches share it).
  uint64_t capacity_bytes() const;
  // The whole budget (shared with other caches or not).
  uint64_t budget_bytes() const { return budget_ ? budget_->capacity_bytes() : 0; }

  // The entry's own pinned buffer for k (EntryBytes(len), 4096-aligned),
  // marked in use (not evictable) until Release; *valid: it holds k's bytes
  // (len). A new entry is invalid until filled. Null when k has no entry and
  // none can be admitted: the tier is full (may_evict: of dirty or in-use
  // entries only; else the oldest clean unused entry makes room) or pinned
  // memory ran out.
  void* Acquire(const ChunkKey& k, uint64_t len, bool may_evict, bool* valid);
  // Ends a use. dirty: the buffer now holds bytes newer than the last commit.
  void Release(const ChunkKey& k, bool dirty);
  // A dirty entry's bytes reached the pending generation.
  void MarkWritten(const ChunkKey& k);
  // Dirty entries not yet written to the pending generation, with buffers.
  std::vector<std::pair<ChunkKey, void*>> DirtyUnwritten() const;
  bool HasDirty() const;
  // After a commit: every entry equals the committed state again.
  void MarkAllClean();
  // After the pending generation was dropped while the uncommitted steps stay
  // cached (a failed MakeDurable): every dirty entry is unwritten again, so a
  // retry writes it; clean entries, which may hold bytes of the dropped
  // generation, are dropped.
  void ForgetPendingWrites();
  // Prefetch: true when k has no entry and one of len bytes fits in the
  // tier without evicting (the admission a step's miss gets).
  bool WantsPrefetch(const ChunkKey& k, uint64_t len) const;
  // Prefetch: admits k with len bytes read from the store (a copy from src)
  // unless k has an entry by then; marks it prefetched. False when not put.
  bool PutPrefetched(const ChunkKey& k, const void* src, uint64_t len);
  // True (once) when k's entry was put by PutPrefetched and not replaced or
  // rewritten since; the step counts it as a prefetch hit.
  bool TakePrefetched(const ChunkKey& k);
  // k has an entry of len bytes.
  bool Contains(const ChunkKey& k, uint64_t len) const;
  // Copies k's entry (len bytes) to host memory dst when it has one of len
  // bytes that no user holds (Acquire without Release: a working copy being
  // written), under the lock, so that it is neither evicted, freed nor
  // rewritten while copied; false otherwise. Leaves the entry's recency as it
  // is (a checkpoint's read is no sign of use). Its bytes may be newer than
  // the last commit: the caller checks them against the version it wants.
  bool CopyIdle(const ChunkKey& k, void* dst, uint64_t len) const;

 private:
  struct Entry {
    void* h_buf = nullptr;
    uint64_t len = 0;
    uint64_t buf_bytes = 0;  // EntryBytes(len) when allocated
    std::list<ChunkKey>::iterator lru;
    bool dirty = false;
    bool written = false;
    bool prefetched = false;  // PutPrefetched, not yet taken or rewritten
    uint32_t users = 0;
  };
  using EntryMap = std::unordered_map<ChunkKey, Entry, ChunkKeyHash>;
  // Returns k's buffer for len bytes (its entry, or a new one when
  // admitted); null when none can be had.
  void* SlotFor(const ChunkKey& k, uint64_t len, bool may_evict) REQUIRES(mu_);
  // A buffer of `bytes`: a free one, or a new one within capacity (free
  // buffers of other sizes are returned to the system first).
  void* TakeBuffer(uint64_t bytes, bool may_evict) REQUIRES(mu_);
  // Moves e's buffer to the free lists and erases it.
  EntryMap::iterator Drop(EntryMap::iterator it) REQUIRES(mu_);
  Device* dev_;
  std::shared_ptr<CacheBudget> budget_;
  mutable Mutex mu_;
  EntryMap entries_ GUARDED_BY(mu_);
  std::list<ChunkKey> lru_ GUARDED_BY(mu_);                      // front = oldest
  std::map<uint64_t, std::vector<void*>> free_ GUARDED_BY(mu_);  // free buffers by size
  uint64_t allocated_ GUARDED_BY(mu_) = 0;    // bytes of all buffers (taken from budget_)
  uint64_t entry_bytes_ GUARDED_BY(mu_) = 0;  // bytes of entries' buffers
  bool warned_alloc_ GUARDED_BY(mu_) = false;
};

}  // namespace optstate::memmgr::internal
