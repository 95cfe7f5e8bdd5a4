// EngineMemory: what the streamed optimizer engine (StreamedAdam, its step
// pipeline, background commit and prefetch) may ask of the memory manager,
// beyond MemoryManager's public face: budgeted device arenas, the staging
// pool, the host cache tier, coordination with pins and write-backs, and
// stats. Internal to memmgr; ManagerImpl implements it, and EngineMemoryOf
// is the one place the engine reaches behind a MemoryManager.
//
// Thread-safety: every method is thread-safe (ManagerImpl's locks), except
// that the host cache's entries in use belong to the thread that acquired
// them (HostCache).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/status.h"
#include "memmgr/internal/device.h"
#include "memmgr/internal/host_cache.h"
#include "memmgr/memory_manager.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

// A budgeted, contiguous device range of whole pages (the pipeline's slots).
struct Arena {
  uint64_t base = 0;
  uint64_t pages = 0;
  uint64_t page_bytes = 0;
  std::vector<uint64_t> handles;
  void* ptr(uint64_t page) const { return reinterpret_cast<void*>(base + page * page_bytes); }
};

class EngineMemory {
 public:
  // Geometry and devices.
  virtual const MemoryManagerOptions& options() const = 0;
  virtual uint64_t page_bytes() const = 0;    // the store's chunk size
  virtual uint64_t budget_pages() const = 0;  // device_budget_bytes in pages
  virtual Device* device() const = 0;
  virtual vfs::Store* store() const = 0;
  // Options for a ChunkIo that registers every staging buffer.
  virtual vfs::ChunkIoOptions ChunkIoOpts() const = 0;

  // Takes between min_pages and max_pages of budget as one contiguous mapped
  // range: evicts unpinned chunks (writing dirty ones back) and waits for
  // unpins while fewer than min_pages can be had. wait false: kBusy instead
  // of waiting for unpins (evictions and write-backs still happen).
  virtual Result<Arena> AcquireArena(uint64_t min_pages, uint64_t max_pages, bool wait = true) = 0;
  virtual void ReleaseArena(Arena* a) = 0;

  // Exclusive staging buffers (chunk-sized, pinned): between min and max.
  virtual std::vector<void*> AcquireStaging(size_t min, size_t max) = 0;
  virtual void ReleaseStaging(const std::vector<void*>& bufs) = 0;
  // Staging buffers in the pool (free or held).
  virtual size_t staging_count() const = 0;
  // With an automatic pool, grows it to `total` buffers (a failed allocation
  // keeps what it had: the pipeline then runs fewer slices at once).
  virtual void GrowStaging(size_t total) = 0;

  // The host cache tier (disabled when host_cache_bytes is 0).
  virtual HostCache* cache() = 0;

  // Writes back and drops every resident chunk of the tensor (the engine
  // owns its state during a step). kFailedPrecondition when one is pinned.
  virtual Status DropTensor(uint32_t tensor_id) = 0;
  // Makes every write-back of pins durable in the pending generation.
  virtual Status Flush() = 0;
  // Called after Store::AbortPending: forget what the pending generation held.
  // keep_dirty_cache: the host cache's dirty entries (steps not yet committed)
  // stay, unwritten, for a retry; otherwise the whole cache is dropped.
  virtual void OnAbortPending(bool keep_dirty_cache = false) = 0;
  // Bracket a commit or prefetch on a thread of the engine: the manager's
  // Pin, Prefetch, Flush and ReleaseAll wait until none runs (they nest).
  virtual void BeginBackgroundCommit() = 0;
  virtual void EndBackgroundCommit() = 0;

  virtual MemoryStats stats() const = 0;
  virtual void AddStats(uint64_t nvme_read, uint64_t nvme_write, uint64_t cache_hit, uint64_t h2d, uint64_t d2h,
                        double stall_s) = 0;

 protected:
  ~EngineMemory() = default;
};

// The engine's view of mm's manager.
EngineMemory* EngineMemoryOf(const MemoryManager& mm);

}  // namespace optstate::memmgr::internal
