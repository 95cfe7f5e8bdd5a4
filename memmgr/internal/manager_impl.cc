// ManagerImpl's life cycle (backend and option resolution, staging and
// stream allocation, the ChunkIo, the worker thread), abort handling and stats.
#include "memmgr/internal/manager_impl.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <utility>

#include "kernels/adam.h"
#include "memmgr/internal/resource_check.h"
#include "memmgr/internal/step_pipeline.h"
#include "vfs/io_buffer.h"
#include "base/log.h"

namespace optstate::memmgr::internal {

std::string Mib(uint64_t b) { return std::to_string(b >> 20) + " MiB (" + std::to_string(b) + " bytes)"; }



ManagerImpl::ManagerImpl(vfs::Store* store, const MemoryManagerOptions& opts, std::unique_ptr<Device> dev)
    : store_(store), opts_(opts), dev_(std::move(dev)) {}

Result<std::unique_ptr<ManagerImpl>> ManagerImpl::Create(vfs::Store* store, const MemoryManagerOptions& opts) {
  if (store == nullptr) return InvalidArgument("MemoryManager::Create: store is null");
  if (store->read_only()) {
    return FailedPrecondition("MemoryManager::Create: store " + store->path() + " is open read-only");
  }
  OPTSTATE_RETURN_IF_ERROR(CheckDescriptorHeadroom(store->path(), kDescriptorHeadroom));
  std::unique_ptr<Device> dev;
  Backend want = opts.backend;
  if (want == Backend::kAuto) {
    int n = CudaDeviceCount();
    want = n > 0 ? Backend::kCuda : Backend::kHost;
    OPTSTATE_LOG_INFO("memmgr: backend auto -> {} ({} CUDA device(s) visible{})", BackendName(want), n,
                      kernels::CudaKernelsBuilt() ? "" : ", CUDA kernels not built");
  }
  bool huge = opts.staging_pages == MemoryManagerOptions::StagingPages::kHuge;
  std::string why;
  if (opts.staging_pages == MemoryManagerOptions::StagingPages::kAuto) {
    const std::vector<std::string>& dirs = store->identity().data_dirs;
    huge = vfs::PreferredIoPages(dirs.empty() ? store->path() : dirs[0], &why) == vfs::IoPages::kHuge;
  }
  std::string pages = std::string(huge ? "huge pages" : "base pages") + (why.empty() ? "" : " (auto: " + why + ")");
  OPTSTATE_LOG_INFO("memmgr: staging in {}", pages);
  if (want == Backend::kCuda) {
    OPTSTATE_ASSIGN_OR_RETURN(dev, NewCudaDevice(opts.cuda_device, huge));
  } else {
    dev = NewHostDevice(huge);
  }
  MemoryManagerOptions resolved = opts;
  std::string cache_why;
  std::shared_ptr<CacheBudget> budget;
  if (resolved.host_cache_bytes == MemoryManagerOptions::kAutoHostCache) {
    // One budget for every automatic cache of the process (the documented
    // share is per node, divided among its ranks), not one per manager.
    budget = SharedAutoCacheBudget(&cache_why);
  } else {
    budget = std::make_shared<CacheBudget>(resolved.host_cache_bytes);
  }
  resolved.host_cache_bytes = budget->capacity_bytes();
  auto impl = std::unique_ptr<ManagerImpl>(new ManagerImpl(store, resolved, std::move(dev)));
  impl->cache_budget_ = std::move(budget);
  impl->cache_why_ = std::move(cache_why);
  impl->staging_pages_ = std::move(pages);
  OPTSTATE_RETURN_IF_ERROR(impl->Init());
  return impl;
}

Status ManagerImpl::Init() {
  page_bytes_ = store_->chunk_size_bytes();
  if (page_bytes_ == 0 || page_bytes_ % dev_->granularity() != 0) {
    return InvalidArgument("MemoryManager: store " + store_->path() + " chunk size " +
                           std::to_string(page_bytes_) + " is not a multiple of the " +
                           BackendName(dev_->backend()) + " mapping granularity " +
                           std::to_string(dev_->granularity()));
  }
  budget_pages_ = opts_.device_budget_bytes / page_bytes_;
  if (budget_pages_ == 0) {
    return ResourceExhausted("MemoryManager: device budget " + Mib(opts_.device_budget_bytes) +
                             " is smaller than one chunk of store " + store_->path() + " (" +
                             Mib(page_bytes_) + ")");
  }
  // Automatic: a few buffers, grown to what is used (GrowStaging): by a
  // StreamedAdam to its state's slices (StateStaging), by pins to the chunks
  // they load at once; never beyond the throughput plan.
  uint32_t n_staging = opts_.staging_buffers;
  if (n_staging == 0) n_staging = kInitialAutoStaging;
  {
    // No other thread sees the manager yet; the lock is for the analysis.
    MutexLock l(&staging_mu_);
    staging_.reserve(n_staging);
    for (uint32_t i = 0; i < n_staging; ++i) {
      auto r = dev_->AllocPinnedHost(page_bytes_);
      if (!r.ok()) {
        return r.status().WithContext("MemoryManager: allocating staging buffer " + std::to_string(i) + " of " +
                                      std::to_string(n_staging) + " (" + Mib(page_bytes_) +
                                      " each; check RLIMIT_MEMLOCK / pinned memory)");
      }
      staging_.push_back(*r);
    }
    staging_free_ = staging_;
  }
  cache_ = std::make_unique<HostCache>(dev_.get(), std::move(cache_budget_));
  OPTSTATE_ASSIGN_OR_RETURN(copy_stream_, dev_->CreateStream());
  auto io = store_->NewChunkIo(ChunkIoOpts());
  if (!io.ok()) {
    OPTSTATE_LOG_WARN("memmgr: ChunkIo with registered staging buffers failed ({}); retrying unregistered",
                      io.status().ToString());
    vfs::ChunkIoOptions o = ChunkIoOpts();
    o.registered_buffers.clear();
    io = store_->NewChunkIo(o);
    if (!io.ok()) return io.status().WithContext("MemoryManager: store " + store_->path());
  }
  {
    MutexLock l(&io_mu_);
    io_ = std::move(*io);
  }
  worker_ = std::thread([this] { WorkerLoop(); });
  OPTSTATE_LOG_INFO("memmgr: {} backend, budget {} ({} pages of {}), {} staging buffers, host cache {}{}",
                    BackendName(dev_->backend()), Mib(opts_.device_budget_bytes), budget_pages_,
                    Mib(page_bytes_), staging_count(), Mib(opts_.host_cache_bytes),
                    cache_why_.empty() ? "" : " (" + cache_why_ + ")");
  return Status::Ok();
}

ManagerImpl::~ManagerImpl() {
  {
    MutexLock l(&task_mu_);
    stop_ = true;
  }
  task_cv_.SignalAll();
  if (worker_.joinable()) worker_.join();
  Status s = Flush();
  if (!s.ok()) OPTSTATE_LOG_ERROR("memmgr: flush at destruction failed: {}", s.ToString());
  if (!pins_.empty()) OPTSTATE_LOG_ERROR("memmgr: destroyed with {} pins outstanding", pins_.size());
  for (auto& [key, r] : regions_) {
    for (auto& s2 : r->slots) {
      if (s2.state != State::kAbsent) {
        uint64_t c = static_cast<uint64_t>(&s2 - r->slots.data());
        (void)dev_->Unmap(r->base + c * page_bytes_, page_bytes_);
        dev_->DestroyPage(s2.page, page_bytes_);
      }
    }
    dev_->Unreserve(r->base, r->reserved);
  }
  for (uint64_t h : pool_) dev_->DestroyPage(h, page_bytes_);
  io_.reset();
  cache_.reset();
  for (void* b : staging_) dev_->FreePinnedHost(b, page_bytes_);
  dev_->DestroyStream(copy_stream_);
}

vfs::ChunkIoOptions ManagerImpl::ChunkIoOpts() const {
  vfs::ChunkIoOptions o;
  o.queue_depth = opts_.queue_depth;
  o.max_sqe_bytes = opts_.max_sqe_bytes;
  o.hash_threads = opts_.hash_threads != MemoryManagerOptions::kAutoHashThreads ? opts_.hash_threads
                   : std::thread::hardware_concurrency() >= 8                 ? 4
                                                                              : 0;
  MutexLock lock(&staging_mu_);
  for (void* b : staging_) o.registered_buffers.emplace_back(static_cast<std::byte*>(b), page_bytes_);
  return o;
}

void ManagerImpl::OnAbortPending(bool keep_dirty_cache) {
  // The pending generation's writes are gone: cached copies and clean
  // resident chunks may hold their bytes. Forget both.
  if (keep_dirty_cache) {
    cache_->ForgetPendingWrites();
  } else {
    cache_->Clear();
  }
  MutexLock lock(&mu_);
  for (auto& [rk, r] : regions_) {
    for (uint64_t c = 0; c < r->slots.size(); ++c) {
      Slot& s = r->slots[c];
      if (s.state != State::kResident || s.pins != 0) continue;
      if (dev_->Unmap(r->base + c * page_bytes_, page_bytes_).ok()) {
        pool_.push_back(s.page);
        LruRemove(s);
        s.state = State::kAbsent;
        s.dirty = false;
      }
    }
  }
}

void ManagerImpl::AddStats(uint64_t nvme_read, uint64_t nvme_write, uint64_t cache_hit, uint64_t h2d, uint64_t d2h,
                           double stall_s) {
  nvme_read_ += nvme_read;
  nvme_write_ += nvme_write;
  cache_hit_ += cache_hit;
  h2d_ += h2d;
  d2h_ += d2h;
  stall_ns_ += static_cast<uint64_t>(stall_s * 1e9);
}

MemoryStats ManagerImpl::stats() const {
  MemoryStats s;
  {
    MutexLock lock(&mu_);
    s.resident_bytes = physical_pages_ * page_bytes_;
    s.peak_resident_bytes = peak_pages_ * page_bytes_;
    s.pins = pins_total_;
    s.evictions = evictions_;
  }
  {
    MutexLock lock(&staging_mu_);
    s.staging_buffers = static_cast<uint32_t>(staging_.size());
    s.staging_in_use = static_cast<uint32_t>(staging_.size() - staging_free_.size());
  }
  s.budget_bytes = opts_.device_budget_bytes;
  s.nvme_read_bytes = nvme_read_;
  s.nvme_write_bytes = nvme_write_;
  s.cache_hit_bytes = cache_hit_;
  s.cache_bytes = cache_->bytes();
  s.h2d_bytes = h2d_;
  s.d2h_bytes = d2h_;
  s.io_stall_seconds = static_cast<double>(stall_ns_.load()) * 1e-9;
  return s;
}

}  // namespace optstate::memmgr::internal
