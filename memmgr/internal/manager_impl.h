// ManagerImpl: the MemoryManager's state and the lower-level services that
// the streamed optimizer engine uses through EngineMemory (budgeted device
// arenas, staging buffers, the host cache tier, stats). Internal to memmgr.
//
// Locking (checked by clang's -Wthread-safety: the GUARDED_BY, REQUIRES and
// EXCLUDES below): mu_ guards regions, chunk states, the LRU, the page pool
// and budget accounting; io_mu_ guards the shared ChunkIo used by Pin,
// Prefetch and write-back; staging_mu_ the staging pool; the host cache locks
// itself. Lock order: io_mu_ before staging_mu_ and the host cache's lock;
// mu_ before the host cache's lock; io_mu_ and mu_ are never held together,
// and mu_ is never held across I/O (LoadChunks and StoreChunks exclude it).
// staging_mu_, task_mu_ and commit_mu_ are leaves (nothing is acquired while
// holding them). A Region's slots are reached only through regions_ (or a
// PinRec of pins_), so mu_ guards them too.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "memmgr/internal/device.h"
#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/host_cache.h"
#include "memmgr/memory_manager.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

// "N MiB (B bytes)", for messages that state sizes.
std::string Mib(uint64_t bytes);

// The manager's state; its methods live in files of one idea:
// manager_impl.cc (life cycle, abort handling, stats), residency.cc (regions,
// the LRU, pages within the budget, write-back, arenas), pins.cc (Pin, Unpin,
// Prefetch, the background worker), staging_pool.cc (the staging pool and
// the chunk transfers through it).
class ManagerImpl final : public EngineMemory {
 public:
  static Result<std::unique_ptr<ManagerImpl>> Create(vfs::Store* store, const MemoryManagerOptions& opts);
  ~ManagerImpl();

  // --- MemoryManager's API ---
  Result<PinnedRange> Pin(std::string_view tensor, std::string_view field, uint64_t first, uint64_t count,
                          Access access) EXCLUDES(mu_, io_mu_);
  Status Unpin(uint64_t pin_id) EXCLUDES(mu_, task_mu_);
  Status Prefetch(std::string_view tensor, std::string_view field, uint64_t first, uint64_t count)
      EXCLUDES(mu_, task_mu_);
  Status Flush() override EXCLUDES(mu_, io_mu_, task_mu_);
  Status ReleaseAll() EXCLUDES(mu_, io_mu_);
  MemoryStats stats() const override EXCLUDES(mu_, staging_mu_);

  // --- EngineMemory: services for the streamed optimizer engine ---
  Device* device() const override { return dev_.get(); }
  vfs::Store* store() const override { return store_; }
  const MemoryManagerOptions& options() const override { return opts_; }
  const std::string& staging_pages() const { return staging_pages_; }
  uint64_t page_bytes() const override { return page_bytes_; }
  uint64_t budget_pages() const override { return budget_pages_; }
  // Takes between min_pages and max_pages of budget as one contiguous mapped
  // range: evicts unpinned chunks (writing dirty ones back) and waits for
  // unpins while fewer than min_pages can be had.
  Result<Arena> AcquireArena(uint64_t min_pages, uint64_t max_pages, bool wait = true) override EXCLUDES(mu_, io_mu_);
  void ReleaseArena(Arena* a) override EXCLUDES(mu_);
  // Writes back and drops every resident chunk of the tensor (StreamedAdam
  // owns its state during a step). kFailedPrecondition when one is pinned.
  Status DropTensor(uint32_t tensor_id) override EXCLUDES(mu_, io_mu_);
  // Exclusive staging buffers (chunk-sized, pinned): between min and max.
  std::vector<void*> AcquireStaging(size_t min, size_t max) override EXCLUDES(staging_mu_);
  void ReleaseStaging(const std::vector<void*>& bufs) override EXCLUDES(staging_mu_);
  // Staging buffers in the pool (free or held).
  size_t staging_count() const override EXCLUDES(staging_mu_);
  // An automatic pool's size at Create: one buffer for pins and two spare.
  static constexpr uint32_t kInitialAutoStaging = 3;
  // With an automatic pool (MemoryManagerOptions::staging_buffers 0), grows
  // it to `total` buffers: a StreamedAdam whose slices take more chunks than
  // f32's (bf16, q8 moments) asks for what keeps as many bytes in flight.
  // A failed allocation keeps the buffers had so far (logged): the pipeline
  // then runs fewer slices at once, as it would with a smaller pool.
  void GrowStaging(size_t total) override EXCLUDES(staging_mu_);
  HostCache* cache() override { return cache_.get(); }
  // Options for a ChunkIo that registers every staging buffer.
  vfs::ChunkIoOptions ChunkIoOpts() const override EXCLUDES(staging_mu_);
  // Called after Store::AbortPending: forget what the pending generation held.
  // keep_dirty_cache: the host cache's dirty entries (steps not yet committed)
  // stay, unwritten, for a retry; otherwise the whole cache is dropped.
  void OnAbortPending(bool keep_dirty_cache = false) override EXCLUDES(mu_);
  void AddStats(uint64_t nvme_read, uint64_t nvme_write, uint64_t cache_hit, uint64_t h2d, uint64_t d2h,
                double stall_s) override;

  // A StreamedAdam commit (commit_lag_steps 1) or prefetch running on a
  // thread of the optimizer: MemoryManager's Pin, Prefetch, Flush and
  // ReleaseAll wait for them first, since until a commit ends the store's
  // pending generation holds a step that is half written, and a prefetch
  // fills the host cache tier from the store. Begin/End bracket each (they
  // nest: a prefetch may start while a commit runs); ManagerImpl's own
  // methods do not wait (the commit itself calls Flush).
  void BeginBackgroundCommit() override EXCLUDES(commit_mu_) {
    MutexLock lock(&commit_mu_);
    ++commit_running_;
  }
  void EndBackgroundCommit() override EXCLUDES(commit_mu_) {
    {
      MutexLock lock(&commit_mu_);
      --commit_running_;
    }
    commit_cv_.SignalAll();
  }
  void WaitBackgroundCommit() EXCLUDES(commit_mu_) {
    MutexLock lock(&commit_mu_);
    while (commit_running_ != 0) commit_cv_.Wait(&commit_mu_);
  }

 private:
  enum class State : uint8_t { kAbsent, kLoading, kResident, kWriting };
  struct Slot {
    State state = State::kAbsent;
    uint64_t page = 0;  // physical page handle while kLoading/kResident/kWriting
    uint32_t pins = 0;
    bool dirty = false;
    bool in_lru = false;
    std::list<ChunkKey>::iterator lru;
  };
  struct Region {
    vfs::TensorInfo info;
    uint32_t field = 0;
    uint64_t elem_bytes = 4;
    uint64_t field_bytes = 0;
    uint64_t base = 0;       // reserved VA
    uint64_t reserved = 0;   // bytes
    std::vector<Slot> slots;
  };
  struct PinRec {
    Region* region;
    uint64_t c0, c1;
    Access access;
  };

  ManagerImpl(vfs::Store* store, const MemoryManagerOptions& opts, std::unique_ptr<Device> dev);
  Status Init() EXCLUDES(mu_, io_mu_, staging_mu_);
  Result<Region*> GetRegion(std::string_view tensor, std::string_view field) REQUIRES(mu_);
  uint64_t ChunkLen(const Region& r, uint64_t c) const;
  ChunkKey Key(const Region& r, uint64_t c) const { return ChunkKey{r.info.id, r.field, c}; }
  Slot& SlotOf(const ChunkKey& k) REQUIRES(mu_);
  // A physical page: pool, new within budget, or evicting a clean unpinned
  // chunk. false when none can be had now (*err set when that is an error).
  bool TryTakePage(uint64_t* handle, Status* err) REQUIRES(mu_);
  // Writes back one dirty unpinned resident chunk (LRU order); false if
  // there is none. mu_ is released during the I/O and held again on return.
  bool WriteBackOneLocked(Status* err) REQUIRES(mu_) EXCLUDES(io_mu_);
  // Writes back `k`; mu_ is released during the I/O and held again on return.
  Status WriteBackLocked(const ChunkKey& k) REQUIRES(mu_) EXCLUDES(io_mu_);
  void LruRemove(Slot& s) REQUIRES(mu_);
  void LruPush(const ChunkKey& k, Slot& s) REQUIRES(mu_);
  void NoteResident() REQUIRES(mu_);
  // Chunk I/O through the shared ChunkIo (io_mu_). dst/src are device pages.
  struct IoItem {
    ChunkKey key;
    void* d_page;
    uint64_t len;
  };
  Status LoadChunks(const std::vector<IoItem>& items) EXCLUDES(mu_, io_mu_);
  Status StoreChunks(const std::vector<IoItem>& items) EXCLUDES(mu_, io_mu_);
  void WorkerLoop() EXCLUDES(mu_, io_mu_, task_mu_);

  vfs::Store* store_;
  std::string staging_pages_;  // MemoryManager::staging_pages(); set by Create
  std::string cache_why_;      // how an automatic host_cache_bytes was chosen; set by Create
  std::shared_ptr<CacheBudget> cache_budget_;  // the cache's budget, from Create until Init hands it to cache_
  MemoryManagerOptions opts_;
  std::unique_ptr<Device> dev_;
  uint64_t page_bytes_ = 0;
  uint64_t budget_pages_ = 0;

  mutable Mutex mu_;
  CondVar cv_;  // with mu_: a chunk left kLoading/kWriting, pages or pins were given back
  std::map<std::pair<uint32_t, uint32_t>, std::unique_ptr<Region>> regions_ GUARDED_BY(mu_);
  std::map<std::string, vfs::TensorInfo, std::less<>> tensors_ GUARDED_BY(mu_);
  Status bg_error_ GUARDED_BY(mu_);  // the first worker error
  std::map<uint32_t, std::vector<Region*>> regions_by_tensor_ GUARDED_BY(mu_);
  std::list<ChunkKey> lru_ GUARDED_BY(mu_);     // front = oldest
  std::vector<uint64_t> pool_ GUARDED_BY(mu_);  // free physical pages
  uint64_t physical_pages_ GUARDED_BY(mu_) = 0;
  uint64_t peak_pages_ GUARDED_BY(mu_) = 0;
  uint64_t arena_pages_ GUARDED_BY(mu_) = 0;
  std::unordered_map<uint64_t, PinRec> pins_ GUARDED_BY(mu_);
  uint64_t next_pin_id_ GUARDED_BY(mu_) = 1;
  uint64_t pins_total_ GUARDED_BY(mu_) = 0;
  uint64_t evictions_ GUARDED_BY(mu_) = 0;

  Mutex io_mu_ ACQUIRED_BEFORE(staging_mu_);
  std::unique_ptr<vfs::ChunkIo> io_ GUARDED_BY(io_mu_);
  // The stream of the manager's copies: set by Init, then constant. Copies
  // on it are made with io_mu_ held; a PinnedRange hands it to its user.
  void* copy_stream_ = nullptr;

  mutable Mutex staging_mu_;
  CondVar staging_cv_;  // with staging_mu_: buffers were released or added
  // All buffers (grows, never shrinks, until destruction) and the free ones.
  std::vector<void*> staging_ GUARDED_BY(staging_mu_);
  std::vector<void*> staging_free_ GUARDED_BY(staging_mu_);

  std::unique_ptr<HostCache> cache_;

  std::atomic<uint64_t> nvme_read_{0}, nvme_write_{0}, cache_hit_{0}, h2d_{0}, d2h_{0};
  std::atomic<uint64_t> stall_ns_{0};

  // Background worker: prefetches and write-backs.
  struct Task {
    bool prefetch;
    std::string tensor, field;
    uint64_t first = 0, count = 0;
    ChunkKey key;
  };
  Mutex task_mu_;
  CondVar task_cv_;  // with task_mu_: a task was queued or finished, or stop_
  std::deque<Task> tasks_ GUARDED_BY(task_mu_);
  bool stop_ GUARDED_BY(task_mu_) = false;
  int busy_ GUARDED_BY(task_mu_) = 0;  // tasks taken and not yet finished
  std::thread worker_;

  Mutex commit_mu_;
  CondVar commit_cv_;  // with commit_mu_: commit_running_ fell
  uint32_t commit_running_ GUARDED_BY(commit_mu_) = 0;  // background commits and prefetches running
};

// The manager's state behind a MemoryManager, for tests of its internals
// (the engine goes through EngineMemoryOf).
inline ManagerImpl* ImplOf(const MemoryManager& mm) { return static_cast<ManagerImpl*>(EngineMemoryOf(mm)); }

}  // namespace optstate::memmgr::internal
