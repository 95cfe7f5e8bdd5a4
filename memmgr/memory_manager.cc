#include "memmgr/memory_manager.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>
#include <utility>

#include "memmgr/internal/manager_impl.h"
#include "memmgr/internal/resource_check.h"
#include "vfs/io_buffer.h"
#include "vfs/log.h"

namespace optstate::memmgr {

using internal::ManagerImpl;

const char* BackendName(Backend b) {
  switch (b) {
    case Backend::kAuto: return "auto";
    case Backend::kHost: return "host";
    case Backend::kCuda: return "cuda";
  }
  return "?";
}

Result<Backend> ParseBackend(std::string_view name) {
  for (Backend b : {Backend::kAuto, Backend::kHost, Backend::kCuda}) {
    if (name == BackendName(b)) return b;
  }
  return InvalidArgument("backend '" + std::string(name) + "': expected auto, host or cuda");
}

bool CudaAvailable() { return internal::CudaDeviceCount() > 0; }

// ---------------------------------------------------------------- PinnedRange

PinnedRange::~PinnedRange() {
  Status s = Unpin();
  if (!s.ok()) OPTSTATE_LOG_ERROR("memmgr: unpin in ~PinnedRange failed: {}", s.ToString());
}
PinnedRange::PinnedRange(PinnedRange&& o) noexcept
    : impl_(o.impl_), pin_id_(o.pin_id_), data_(o.data_), size_bytes_(o.size_bytes_), stream_(o.stream_) {
  o.impl_ = nullptr;
  o.data_ = nullptr;
  o.size_bytes_ = 0;
}
PinnedRange& PinnedRange::operator=(PinnedRange&& o) noexcept {
  if (this != &o) {
    Status s = Unpin();
    if (!s.ok()) OPTSTATE_LOG_ERROR("memmgr: unpin on move-assign failed: {}", s.ToString());
    impl_ = o.impl_;
    pin_id_ = o.pin_id_;
    data_ = o.data_;
    size_bytes_ = o.size_bytes_;
    stream_ = o.stream_;
    o.impl_ = nullptr;
    o.data_ = nullptr;
    o.size_bytes_ = 0;
  }
  return *this;
}
Status PinnedRange::Unpin() {
  if (impl_ == nullptr) return Status::Ok();
  ManagerImpl* impl = impl_;
  impl_ = nullptr;
  data_ = nullptr;
  return impl->Unpin(pin_id_);
}

// -------------------------------------------------------------- MemoryManager

MemoryManager::MemoryManager(std::unique_ptr<ManagerImpl> impl) : impl_(std::move(impl)) {}
MemoryManager::~MemoryManager() = default;

Result<std::unique_ptr<MemoryManager>> MemoryManager::Create(vfs::Store* store,
                                                             const MemoryManagerOptions& opts) {
  OPTSTATE_ASSIGN_OR_RETURN(auto impl, ManagerImpl::Create(store, opts));
  return std::unique_ptr<MemoryManager>(new MemoryManager(std::move(impl)));
}

Backend MemoryManager::backend() const { return impl_->device()->backend(); }
const std::string& MemoryManager::staging_pages() const { return impl_->staging_pages(); }
vfs::Store* MemoryManager::store() const { return impl_->store(); }
const MemoryManagerOptions& MemoryManager::options() const { return impl_->options(); }

Result<PinnedRange> MemoryManager::Pin(std::string_view tensor, std::string_view field, uint64_t first_elem,
                                       uint64_t count, Access access) {
  impl_->WaitBackgroundCommit();
  return impl_->Pin(tensor, field, first_elem, count, access);
}
Status MemoryManager::Prefetch(std::string_view tensor, std::string_view field, uint64_t first_elem,
                               uint64_t count) {
  impl_->WaitBackgroundCommit();
  return impl_->Prefetch(tensor, field, first_elem, count);
}
Status MemoryManager::Flush() {
  impl_->WaitBackgroundCommit();
  return impl_->Flush();
}
Status MemoryManager::ReleaseAll() {
  impl_->WaitBackgroundCommit();
  return impl_->ReleaseAll();
}
MemoryStats MemoryManager::stats() const { return impl_->stats(); }

Result<void*> MemoryManager::AllocDevice(uint64_t bytes) { return impl_->device()->Malloc(bytes); }
Status MemoryManager::FreeDevice(void* d_ptr) { return impl_->device()->Free(d_ptr); }
Result<void*> MemoryManager::AllocPinnedHost(uint64_t bytes) { return impl_->device()->AllocPinnedHost(bytes); }
void MemoryManager::FreePinnedHost(void* h_ptr, uint64_t bytes) { impl_->device()->FreePinnedHost(h_ptr, bytes); }
Status MemoryManager::CopyToDevice(void* d_dst, const void* h_src, uint64_t bytes) {
  internal::Device* dev = impl_->device();
  OPTSTATE_RETURN_IF_ERROR(dev->CopyH2D(d_dst, h_src, bytes, nullptr));
  return dev->SyncStream(nullptr);
}
Status MemoryManager::CopyToHost(void* h_dst, const void* d_src, uint64_t bytes) {
  internal::Device* dev = impl_->device();
  OPTSTATE_RETURN_IF_ERROR(dev->CopyD2H(h_dst, d_src, bytes, nullptr));
  return dev->SyncStream(nullptr);
}
Status MemoryManager::DeviceMemInfo(uint64_t* free_bytes, uint64_t* total_bytes) {
  return impl_->device()->MemInfo(free_bytes, total_bytes);
}

namespace internal {

// ------------------------------------------------------------------ HostCache

HostCache::HostCache(Device* dev, uint64_t capacity_bytes) : dev_(dev), capacity_(capacity_bytes) {}

HostCache::~HostCache() {
  for (auto& [k, e] : entries_) dev_->FreePinnedHost(e.h_buf, e.buf_bytes);
  for (auto& [bytes, bufs] : free_) {
    for (void* b : bufs) dev_->FreePinnedHost(b, bytes);
  }
}

HostCache::EntryMap::iterator HostCache::Drop(EntryMap::iterator it) {
  lru_.erase(it->second.lru);
  free_[it->second.buf_bytes].push_back(it->second.h_buf);
  entry_bytes_ -= it->second.buf_bytes;
  return entries_.erase(it);
}

void* HostCache::TakeBuffer(uint64_t bytes, bool may_evict) {
  for (;;) {
    auto same = free_.find(bytes);
    if (same != free_.end() && !same->second.empty()) {
      void* b = same->second.back();
      same->second.pop_back();
      return b;
    }
    if (allocated_ + bytes <= capacity_) break;
    // Over capacity: return free buffers of other sizes first, then (only
    // when asked) the oldest clean unused entry.
    auto other = std::find_if(free_.begin(), free_.end(), [](const auto& f) { return !f.second.empty(); });
    if (other != free_.end()) {
      dev_->FreePinnedHost(other->second.back(), other->first);
      other->second.pop_back();
      allocated_ -= other->first;
      continue;
    }
    if (!may_evict) return nullptr;
    auto victim = std::find_if(lru_.begin(), lru_.end(), [this](const ChunkKey& k) {
      const Entry& e = entries_.find(k)->second;
      return !e.dirty && e.users == 0;
    });
    if (victim == lru_.end()) return nullptr;
    Drop(entries_.find(*victim));
  }
  auto r = dev_->AllocPinnedHost(bytes);
  if (!r.ok()) {
    if (!warned_alloc_) {
      warned_alloc_ = true;
      OPTSTATE_LOG_WARN("memmgr: host cache tier stops growing at {} bytes: {}", allocated_, r.status().ToString());
    }
    return nullptr;
  }
  allocated_ += bytes;
  return *r;
}

void* HostCache::SlotFor(const ChunkKey& k, uint64_t len, bool may_evict) {
  const uint64_t bytes = EntryBytes(len);
  auto it = entries_.find(k);
  if (it != entries_.end()) {
    Entry& e = it->second;
    if (e.buf_bytes == bytes) {
      lru_.splice(lru_.end(), lru_, e.lru);
      e.len = len;
      return e.h_buf;
    }
    if (e.dirty || e.users != 0) return nullptr;
    Drop(it);
  }
  void* buf = TakeBuffer(bytes, may_evict);
  if (buf == nullptr) return nullptr;
  lru_.push_back(k);
  Entry e;
  e.h_buf = buf;
  e.len = len;
  e.buf_bytes = bytes;
  e.lru = std::prev(lru_.end());
  entries_[k] = e;
  entry_bytes_ += bytes;
  return buf;
}

bool HostCache::Get(const ChunkKey& k, void* dst, uint64_t len, bool dst_is_device, void* stream) {
  if (!enabled()) return false;
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  if (it == entries_.end() || it->second.len != len) return false;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  if (dst_is_device) {
    if (!dev_->CopyH2D(dst, it->second.h_buf, len, stream).ok() || !dev_->SyncStream(stream).ok()) return false;
  } else {
    std::memcpy(dst, it->second.h_buf, len);
  }
  return true;
}

void HostCache::Put(const ChunkKey& k, const void* src, uint64_t len) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  if (it != entries_.end() && it->second.users != 0) return;  // StreamedAdam's working copy wins
  const bool dirty = it != entries_.end() && it->second.dirty;
  void* buf = SlotFor(k, len, /*may_evict=*/false);
  if (buf == nullptr) {
    // No room for the new bytes: an older copy must not stay behind.
    if (auto old = entries_.find(k); old != entries_.end() && !old->second.dirty) Drop(old);
    return;
  }
  std::memcpy(buf, src, len);
  entries_[k].prefetched = false;
  // Put is called with bytes just written to the store (or read from it): a
  // dirty entry stays dirty (newer than the commit) but is now in the pending
  // generation.
  if (dirty) entries_[k].written = true;
}

void* HostCache::Acquire(const ChunkKey& k, uint64_t len, bool may_evict, bool* valid) {
  *valid = false;
  if (!enabled()) return nullptr;
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  *valid = it != entries_.end() && it->second.len == len;
  void* buf = SlotFor(k, len, may_evict);
  if (buf == nullptr) {
    *valid = false;
    return nullptr;
  }
  ++entries_[k].users;
  return buf;
}

void HostCache::Release(const ChunkKey& k, bool dirty) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  if (it == entries_.end()) return;
  if (it->second.users > 0) --it->second.users;
  if (dirty) {
    it->second.dirty = true;
    it->second.written = false;
    it->second.prefetched = false;
  }
}

bool HostCache::WantsPrefetch(const ChunkKey& k, uint64_t len) const {
  if (!enabled()) return false;
  std::lock_guard<std::mutex> l(mu_);
  return entries_.find(k) == entries_.end() && entry_bytes_ + EntryBytes(len) <= capacity_;
}

bool HostCache::PutPrefetched(const ChunkKey& k, const void* src, uint64_t len) {
  if (!enabled()) return false;
  std::lock_guard<std::mutex> l(mu_);
  // An entry that appeared meanwhile (a write-back's Put) holds newer bytes.
  if (entries_.find(k) != entries_.end()) return false;
  void* buf = SlotFor(k, len, /*may_evict=*/false);
  if (buf == nullptr) return false;
  std::memcpy(buf, src, len);
  entries_[k].prefetched = true;
  return true;
}

bool HostCache::Contains(const ChunkKey& k, uint64_t len) const {
  if (!enabled()) return false;
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  return it != entries_.end() && it->second.len == len;
}

bool HostCache::TakePrefetched(const ChunkKey& k) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  if (it == entries_.end() || !it->second.prefetched) return false;
  it->second.prefetched = false;
  return true;
}

void HostCache::MarkWritten(const ChunkKey& k) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  if (it != entries_.end()) it->second.written = true;
}

std::vector<std::pair<ChunkKey, void*>> HostCache::DirtyUnwritten() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::pair<ChunkKey, void*>> out;
  for (const auto& [k, e] : entries_) {
    if (e.dirty && !e.written) out.emplace_back(k, e.h_buf);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

bool HostCache::HasDirty() const {
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& [k, e] : entries_) {
    if (e.dirty) return true;
  }
  return false;
}

void HostCache::MarkAllClean() {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& [k, e] : entries_) e.dirty = e.written = false;
}

void HostCache::ForgetPendingWrites() {
  if (!enabled()) return;
  std::lock_guard<std::mutex> l(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.dirty || e.users != 0) {
      e.written = false;
      ++it;
      continue;
    }
    it = Drop(it);
  }
}

void HostCache::PutFromDevice(const ChunkKey& k, const void* d_src, uint64_t len, void* stream) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> l(mu_);
  void* buf = SlotFor(k, len, /*may_evict=*/false);
  if (buf == nullptr) {
    if (auto old = entries_.find(k); old != entries_.end() && !old->second.dirty && old->second.users == 0) Drop(old);
    return;
  }
  if (!dev_->CopyD2H(buf, d_src, len, stream).ok() || !dev_->SyncStream(stream).ok()) Drop(entries_.find(k));
}

void HostCache::Erase(const ChunkKey& k) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> l(mu_);
  auto it = entries_.find(k);
  // A dirty entry is the only copy of uncommitted steps: keep it (a Pin for
  // writing then loads it, and its write-back Puts the new bytes).
  if (it == entries_.end() || it->second.dirty || it->second.users != 0) return;
  Drop(it);
}

void HostCache::EraseTensor(uint32_t tensor_id) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> l(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = it->first.tensor_id == tensor_id ? Drop(it) : std::next(it);
  }
}

void HostCache::Clear() {
  if (!enabled()) return;
  std::lock_guard<std::mutex> l(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) it = Drop(it);
}

uint64_t HostCache::bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return entry_bytes_;
}

// ---------------------------------------------------------------- ManagerImpl

namespace {
uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
std::string Mib(uint64_t b) { return std::to_string(b >> 20) + " MiB (" + std::to_string(b) + " bytes)"; }

// MemoryManagerOptions::kAutoHostCache: min(MemAvailable / 2, MemAvailable -
// 4 GiB) / LOCAL_WORLD_SIZE; *why says how it was derived.
uint64_t AutoHostCacheBytes(std::string* why) {
  constexpr uint64_t kFreeFloorBytes = 4ull << 30;
  uint64_t avail = 0;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") {
      avail = kib << 10;
      break;
    }
  }
  uint64_t ranks = 1;
  if (const char* e = std::getenv("LOCAL_WORLD_SIZE"); e != nullptr && std::strtoull(e, nullptr, 10) > 0) {
    ranks = std::strtoull(e, nullptr, 10);
  }
  const uint64_t bytes = avail > kFreeFloorBytes ? std::min(avail / 2, avail - kFreeFloorBytes) / ranks : 0;
  *why = "auto: half of MemAvailable " + Mib(avail) + ", at least 4 GiB left free, / " + std::to_string(ranks) +
         " local rank(s)";
  return bytes;
}
}  // namespace

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
  if (resolved.host_cache_bytes == MemoryManagerOptions::kAutoHostCache) {
    resolved.host_cache_bytes = AutoHostCacheBytes(&cache_why);
  }
  auto impl = std::unique_ptr<ManagerImpl>(new ManagerImpl(store, resolved, std::move(dev)));
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
  uint32_t ra = PipelineSlices(opts_);
  uint32_t n_staging = opts_.staging_buffers;
  if (n_staging == 0) n_staging = 3 * ra + 4;
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
  cache_ = std::make_unique<HostCache>(dev_.get(), opts_.host_cache_bytes);
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
  io_ = std::move(*io);
  worker_ = std::thread([this] { WorkerLoop(); });
  OPTSTATE_LOG_INFO("memmgr: {} backend, budget {} ({} pages of {}), {} staging buffers, host cache {}{}",
                    BackendName(dev_->backend()), Mib(opts_.device_budget_bytes), budget_pages_,
                    Mib(page_bytes_), staging_.size(), Mib(opts_.host_cache_bytes),
                    cache_why_.empty() ? "" : " (" + cache_why_ + ")");
  return Status::Ok();
}

ManagerImpl::~ManagerImpl() {
  {
    std::lock_guard<std::mutex> l(task_mu_);
    stop_ = true;
  }
  task_cv_.notify_all();
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
  for (void* b : staging_) o.registered_buffers.emplace_back(static_cast<std::byte*>(b), page_bytes_);
  return o;
}

Result<ManagerImpl::Region*> ManagerImpl::GetRegion(std::string_view tensor, std::string_view field) {
  auto tit = tensors_.find(tensor);
  if (tit == tensors_.end()) {
    OPTSTATE_ASSIGN_OR_RETURN(vfs::TensorInfo found, store_->FindTensor(tensor));
    tit = tensors_.emplace(std::string(tensor), std::move(found)).first;
  }
  const vfs::TensorInfo& info = tit->second;
  OPTSTATE_ASSIGN_OR_RETURN(uint32_t f, store_->FieldIndex(info, field));
  auto key = std::make_pair(info.id, f);
  auto it = regions_.find(key);
  if (it != regions_.end()) return it->second.get();
  auto r = std::make_unique<Region>();
  r->info = info;
  r->field = f;
  r->elem_bytes = vfs::DTypeSize(info.fields[f].dtype);
  r->field_bytes = info.field_bytes(f);
  uint64_t chunks = (r->field_bytes + page_bytes_ - 1) / page_bytes_;
  r->reserved = std::max<uint64_t>(chunks, 1) * page_bytes_;
  OPTSTATE_ASSIGN_OR_RETURN(r->base, dev_->Reserve(r->reserved));
  r->slots.resize(chunks);
  Region* raw = r.get();
  regions_by_tensor_[info.id].push_back(raw);
  regions_.emplace(key, std::move(r));
  return raw;
}

uint64_t ManagerImpl::ChunkLen(const Region& r, uint64_t c) const {
  return std::min(page_bytes_, r.field_bytes - c * page_bytes_);
}

ManagerImpl::Slot& ManagerImpl::SlotOf(const ChunkKey& k) {
  return regions_.at({k.tensor_id, k.field})->slots[k.index];
}

void ManagerImpl::LruRemove(Slot& s) {
  if (s.in_lru) {
    lru_.erase(s.lru);
    s.in_lru = false;
  }
}
void ManagerImpl::LruPush(const ChunkKey& k, Slot& s) {
  LruRemove(s);
  lru_.push_back(k);
  s.lru = std::prev(lru_.end());
  s.in_lru = true;
}
void ManagerImpl::NoteResident() { peak_pages_ = std::max(peak_pages_, physical_pages_); }

bool ManagerImpl::TryTakePage(uint64_t* handle, Status* err) {
  if (!pool_.empty()) {
    *handle = pool_.back();
    pool_.pop_back();
    return true;
  }
  if (physical_pages_ < budget_pages_) {
    auto r = dev_->CreatePage(page_bytes_);
    if (!r.ok()) {
      *err = r.status();
      return false;
    }
    *handle = *r;
    ++physical_pages_;
    NoteResident();
    return true;
  }
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    Region* r = regions_.at({it->tensor_id, it->field}).get();
    Slot& s = r->slots[it->index];
    if (s.dirty || s.pins != 0 || s.state != State::kResident) continue;
    Status st = dev_->Unmap(r->base + it->index * page_bytes_, page_bytes_);
    if (!st.ok()) {
      *err = st;
      return false;
    }
    *handle = s.page;
    s.state = State::kAbsent;
    s.in_lru = false;
    lru_.erase(it);
    ++evictions_;
    return true;
  }
  return false;
}

Status ManagerImpl::WriteBackLocked(std::unique_lock<std::mutex>& lock, const ChunkKey& k) {
  Region* r = regions_.at({k.tensor_id, k.field}).get();
  Slot& s = r->slots[k.index];
  s.state = State::kWriting;
  s.dirty = false;
  LruRemove(s);
  IoItem item{k, reinterpret_cast<void*>(r->base + k.index * page_bytes_), ChunkLen(*r, k.index)};
  lock.unlock();
  Status st = StoreChunks({item});
  lock.lock();
  Slot& s2 = r->slots[k.index];
  s2.state = State::kResident;
  if (!st.ok()) s2.dirty = true;
  if (s2.pins == 0) LruPush(k, s2);
  cv_.notify_all();
  return st;
}

bool ManagerImpl::WriteBackOneLocked(std::unique_lock<std::mutex>& lock, Status* err) {
  for (const ChunkKey& k : lru_) {
    Slot& s = SlotOf(k);
    if (s.dirty && s.pins == 0 && s.state == State::kResident) {
      ChunkKey key = k;
      *err = WriteBackLocked(lock, key);
      return true;
    }
  }
  return false;
}

Status ManagerImpl::LoadChunks(const std::vector<IoItem>& items) {
  if (items.empty()) return Status::Ok();
  std::lock_guard<std::mutex> io_lock(io_mu_);
  size_t pos = 0;
  while (pos < items.size()) {
    std::vector<void*> bufs = AcquireStaging(1, std::min<size_t>(items.size() - pos, staging_.size()));
    std::vector<std::pair<size_t, void*>> submitted;  // item index, staging
    Status st;
    size_t b = 0;
    for (; pos < items.size() && b < bufs.size(); ++pos) {
      const IoItem& it = items[pos];
      if (cache_->Get(it.key, it.d_page, it.len, true, copy_stream_)) {
        cache_hit_ += it.len;
        continue;
      }
      vfs::ChunkRef ref{it.key.tensor_id, it.key.field, it.key.index};
      st = io_->SubmitRead(ref, bufs[b], submitted.size());
      if (!st.ok()) break;
      submitted.emplace_back(pos, bufs[b]);
      ++b;
    }
    std::vector<vfs::ChunkCompletion> done;
    uint64_t t0 = NowNs();
    while (io_->in_flight() > 0) {
      Status rs = io_->Reap(&done, io_->in_flight());
      if (!rs.ok() && st.ok()) st = rs;
      if (!rs.ok()) break;
    }
    stall_ns_ += NowNs() - t0;
    for (const auto& c : done) {
      if (!c.status.ok()) {
        if (st.ok()) st = c.status;
        continue;
      }
      const auto& [idx, buf] = submitted[c.tag];
      const IoItem& it = items[idx];
      nvme_read_ += it.len;
      Status cs = dev_->CopyH2D(it.d_page, buf, it.len, copy_stream_);
      if (!cs.ok() && st.ok()) st = cs;
      h2d_ += it.len;
      cache_->Put(it.key, buf, it.len);
    }
    Status ss = dev_->SyncStream(copy_stream_);
    if (!ss.ok() && st.ok()) st = ss;
    ReleaseStaging(bufs);
    OPTSTATE_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

Status ManagerImpl::StoreChunks(const std::vector<IoItem>& items) {
  if (items.empty()) return Status::Ok();
  std::lock_guard<std::mutex> io_lock(io_mu_);
  size_t pos = 0;
  while (pos < items.size()) {
    std::vector<void*> bufs = AcquireStaging(1, std::min<size_t>(items.size() - pos, staging_.size()));
    size_t n = std::min(bufs.size(), items.size() - pos);
    Status st;
    for (size_t i = 0; i < n; ++i) {
      const IoItem& it = items[pos + i];
      st = dev_->CopyD2H(bufs[i], it.d_page, it.len, copy_stream_);
      if (!st.ok()) break;
      d2h_ += it.len;
    }
    if (st.ok()) st = dev_->SyncStream(copy_stream_);
    size_t submitted = 0;
    for (size_t i = 0; st.ok() && i < n; ++i) {
      const IoItem& it = items[pos + i];
      vfs::ChunkRef ref{it.key.tensor_id, it.key.field, it.key.index};
      st = io_->SubmitWrite(ref, bufs[i], i);
      if (st.ok()) ++submitted;
    }
    std::vector<vfs::ChunkCompletion> done;
    uint64_t t0 = NowNs();
    while (io_->in_flight() > 0) {
      Status rs = io_->Reap(&done, io_->in_flight());
      if (!rs.ok()) {
        if (st.ok()) st = rs;
        break;
      }
    }
    stall_ns_ += NowNs() - t0;
    for (const auto& c : done) {
      const IoItem& it = items[pos + c.tag];
      if (!c.status.ok()) {
        if (st.ok()) st = c.status;
        cache_->Erase(it.key);
        continue;
      }
      nvme_write_ += it.len;
      cache_->Put(it.key, bufs[c.tag], it.len);
    }
    ReleaseStaging(bufs);
    pos += n;
    OPTSTATE_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

std::vector<void*> ManagerImpl::AcquireStaging(size_t min, size_t max) {
  std::unique_lock<std::mutex> l(staging_mu_);
  min = std::min(std::max<size_t>(min, 1), staging_.size());
  staging_cv_.wait(l, [&] { return staging_free_.size() >= min; });
  size_t n = std::min(max, staging_free_.size());
  std::vector<void*> out(staging_free_.end() - static_cast<long>(n), staging_free_.end());
  staging_free_.resize(staging_free_.size() - n);
  return out;
}

void ManagerImpl::ReleaseStaging(const std::vector<void*>& bufs) {
  {
    std::lock_guard<std::mutex> l(staging_mu_);
    staging_free_.insert(staging_free_.end(), bufs.begin(), bufs.end());
  }
  staging_cv_.notify_all();
}

Result<PinnedRange> ManagerImpl::Pin(std::string_view tensor, std::string_view field, uint64_t first,
                                     uint64_t count, Access access) {
  if (count == 0) {
    return InvalidArgument("Pin " + std::string(tensor) + "/" + std::string(field) + ": count is 0");
  }
  std::unique_lock<std::mutex> lock(mu_);
  OPTSTATE_ASSIGN_OR_RETURN(Region * r, GetRegion(tensor, field));
  uint64_t numel = r->info.numel;
  if (first > numel || count > numel - first) {
    return InvalidArgument("Pin " + std::string(tensor) + "/" + std::string(field) + ": elements [" +
                           std::to_string(first) + ", " + std::to_string(first + count) +
                           ") outside the tensor's " + std::to_string(numel) + " elements");
  }
  const uint64_t eb = r->elem_bytes;
  const uint64_t c0 = first * eb / page_bytes_;
  const uint64_t c1 = ((first + count) * eb - 1) / page_bytes_;
  const uint64_t n = c1 - c0 + 1;
  if (n > budget_pages_) {
    return ResourceExhausted("Pin " + std::string(tensor) + "/" + std::string(field) + " [" +
                             std::to_string(first) + ", +" + std::to_string(count) + "): needs " +
                             std::to_string(n) + " chunks = " + Mib(n * page_bytes_) +
                             ", more than the whole device budget " + Mib(budget_pages_ * page_bytes_) +
                             "; pin a smaller range or raise device_budget_bytes");
  }
  std::vector<uint64_t> to_load;
  for (;;) {
    if (!bg_error_.ok()) {
      Status e = bg_error_;
      bg_error_ = Status::Ok();
      return e.WithContext("background write-back failed");
    }
    bool busy = false;
    uint64_t missing = 0;
    for (uint64_t c = c0; c <= c1; ++c) {
      State st = r->slots[c].state;
      if (st == State::kLoading || st == State::kWriting) busy = true;
      if (st == State::kAbsent) ++missing;
    }
    if (busy) {
      cv_.wait(lock);
      continue;
    }
    uint64_t avail = pool_.size() + (budget_pages_ - physical_pages_);
    bool dirty_evictable = false;
    for (const ChunkKey& k : lru_) {
      if (k.tensor_id == r->info.id && k.field == r->field && k.index >= c0 && k.index <= c1) continue;
      const Slot& s = SlotOf(k);
      if (s.pins != 0 || s.state != State::kResident) continue;
      if (s.dirty) {
        dirty_evictable = true;
      } else {
        ++avail;
      }
    }
    if (avail >= missing) break;
    if (dirty_evictable) {
      Status err;
      WriteBackOneLocked(lock, &err);
      if (!err.ok()) return err.WithContext("Pin: evicting a dirty chunk");
      continue;
    }
    cv_.wait(lock);
  }
  // Claim: pin the resident chunks first so that taking pages cannot evict them.
  for (uint64_t c = c0; c <= c1; ++c) {
    Slot& s = r->slots[c];
    s.pins++;
    LruRemove(s);
  }
  Status err;
  for (uint64_t c = c0; c <= c1; ++c) {
    Slot& s = r->slots[c];
    if (s.state != State::kAbsent) continue;
    uint64_t h = 0;
    if (!TryTakePage(&h, &err)) {
      if (err.ok()) err = Internal("Pin: budget accounting found no page although one was counted");
      break;
    }
    Status ms = dev_->Map(r->base + c * page_bytes_, page_bytes_, h);
    if (!ms.ok()) {
      pool_.push_back(h);
      err = ms;
      break;
    }
    s.page = h;
    s.state = State::kLoading;
    to_load.push_back(c);
  }
  auto undo = [&](const Status& e) -> Status {
    for (uint64_t c : to_load) {
      Slot& s = r->slots[c];
      (void)dev_->Unmap(r->base + c * page_bytes_, page_bytes_);
      pool_.push_back(s.page);
      s.state = State::kAbsent;
    }
    for (uint64_t c = c0; c <= c1; ++c) {
      Slot& s = r->slots[c];
      s.pins--;
      if (s.pins == 0 && s.state == State::kResident) LruPush(Key(*r, c), s);
    }
    cv_.notify_all();
    return e.WithContext("Pin " + r->info.name + "/" + r->info.fields[r->field].name);
  };
  if (!err.ok()) return undo(err);
  if (access != Access::kRead) {
    for (uint64_t c = c0; c <= c1; ++c) cache_->Erase(Key(*r, c));
  }
  std::vector<IoItem> items;
  for (uint64_t c : to_load) {
    uint64_t lo = c * page_bytes_, len = ChunkLen(*r, c);
    bool covered = first * eb <= lo && (first + count) * eb >= lo + len;
    if (access == Access::kWrite && covered) continue;
    items.push_back(IoItem{Key(*r, c), reinterpret_cast<void*>(r->base + lo), len});
  }
  lock.unlock();
  Status ls = LoadChunks(items);
  lock.lock();
  if (!ls.ok()) return undo(ls);
  for (uint64_t c : to_load) r->slots[c].state = State::kResident;
  cv_.notify_all();
  uint64_t id = next_pin_id_++;
  pins_.emplace(id, PinRec{r, c0, c1, access});
  ++pins_total_;
  PinnedRange pr;
  pr.impl_ = this;
  pr.pin_id_ = id;
  pr.data_ = reinterpret_cast<void*>(r->base + first * eb);
  pr.size_bytes_ = count * eb;
  pr.stream_ = copy_stream_;
  return pr;
}

Status ManagerImpl::Unpin(uint64_t pin_id) {
  std::vector<ChunkKey> dirty;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pins_.find(pin_id);
    if (it == pins_.end()) return Internal("Unpin: unknown pin id " + std::to_string(pin_id));
    PinRec rec = it->second;
    pins_.erase(it);
    for (uint64_t c = rec.c0; c <= rec.c1; ++c) {
      Slot& s = rec.region->slots[c];
      s.pins--;
      if (rec.access != Access::kRead) s.dirty = true;
      if (s.pins == 0) {
        LruPush(Key(*rec.region, c), s);
        if (s.dirty) dirty.push_back(Key(*rec.region, c));
      }
    }
  }
  cv_.notify_all();
  if (!dirty.empty()) {
    {
      std::lock_guard<std::mutex> l(task_mu_);
      for (const ChunkKey& k : dirty) {
        Task t;
        t.prefetch = false;
        t.key = k;
        tasks_.push_back(std::move(t));
      }
    }
    task_cv_.notify_one();
  }
  return Status::Ok();
}

Status ManagerImpl::Prefetch(std::string_view tensor, std::string_view field, uint64_t first, uint64_t count) {
  {
    // Validate now so the caller hears about bad names at once.
    std::lock_guard<std::mutex> lock(mu_);
    OPTSTATE_ASSIGN_OR_RETURN(Region * r, GetRegion(tensor, field));
    if (first > r->info.numel || count > r->info.numel - first) {
      return InvalidArgument("Prefetch " + std::string(tensor) + "/" + std::string(field) +
                             ": range outside the tensor's " + std::to_string(r->info.numel) + " elements");
    }
  }
  if (count == 0) return Status::Ok();
  {
    std::lock_guard<std::mutex> l(task_mu_);
    Task t;
    t.prefetch = true;
    t.tensor = std::string(tensor);
    t.field = std::string(field);
    t.first = first;
    t.count = count;
    tasks_.push_back(std::move(t));
  }
  task_cv_.notify_one();
  return Status::Ok();
}

void ManagerImpl::WorkerLoop() {
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> l(task_mu_);
      task_cv_.wait(l, [&] { return stop_ || !tasks_.empty(); });
      if (stop_ && tasks_.empty()) return;
      t = std::move(tasks_.front());
      tasks_.pop_front();
      ++busy_;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (!t.prefetch) {
      auto rit = regions_.find({t.key.tensor_id, t.key.field});
      if (rit != regions_.end()) {
        Slot& s = rit->second->slots[t.key.index];
        if (s.dirty && s.pins == 0 && s.state == State::kResident) {
          Status st = WriteBackLocked(lock, t.key);
          if (!st.ok()) {
            OPTSTATE_LOG_ERROR("memmgr: background write-back failed: {}", st.ToString());
            if (bg_error_.ok()) bg_error_ = st;
          }
        }
      }
    } else {
      auto rr = GetRegion(t.tensor, t.field);
      if (rr.ok()) {
        Region* r = *rr;
        uint64_t eb = r->elem_bytes;
        uint64_t c0 = t.first * eb / page_bytes_, c1 = ((t.first + t.count) * eb - 1) / page_bytes_;
        std::vector<uint64_t> loading;
        std::vector<IoItem> items;
        for (uint64_t c = c0; c <= c1; ++c) {
          Slot& s = r->slots[c];
          if (s.state != State::kAbsent) continue;
          uint64_t h = 0;
          Status err;
          if (!TryTakePage(&h, &err)) break;
          if (!dev_->Map(r->base + c * page_bytes_, page_bytes_, h).ok()) {
            pool_.push_back(h);
            break;
          }
          s.page = h;
          s.state = State::kLoading;
          loading.push_back(c);
          items.push_back(IoItem{Key(*r, c), reinterpret_cast<void*>(r->base + c * page_bytes_), ChunkLen(*r, c)});
        }
        lock.unlock();
        Status st = LoadChunks(items);
        lock.lock();
        for (uint64_t c : loading) {
          Slot& s = r->slots[c];
          if (st.ok()) {
            s.state = State::kResident;
            if (s.pins == 0) LruPush(Key(*r, c), s);
          } else {
            (void)dev_->Unmap(r->base + c * page_bytes_, page_bytes_);
            pool_.push_back(s.page);
            s.state = State::kAbsent;
          }
        }
        if (!st.ok()) OPTSTATE_LOG_WARN("memmgr: prefetch of {}/{} failed: {}", t.tensor, t.field, st.ToString());
        cv_.notify_all();
      }
    }
    lock.unlock();
    {
      std::lock_guard<std::mutex> l(task_mu_);
      --busy_;
    }
    task_cv_.notify_all();
  }
}

Status ManagerImpl::Flush() {
  // Let queued background work finish first (it may hold chunks in kWriting).
  {
    std::unique_lock<std::mutex> l(task_mu_);
    task_cv_.wait(l, [&] { return (tasks_.empty() && busy_ == 0) || worker_.get_id() == std::thread::id(); });
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    bool busy = false;
    const ChunkKey* todo = nullptr;
    ChunkKey key;
    for (auto& [rk, r] : regions_) {
      for (uint64_t c = 0; c < r->slots.size(); ++c) {
        Slot& s = r->slots[c];
        if (s.state == State::kLoading || s.state == State::kWriting) busy = true;
        if (s.state == State::kResident && s.dirty && s.pins == 0 && todo == nullptr) {
          key = Key(*r, c);
          todo = &key;
        }
      }
    }
    if (todo != nullptr) {
      OPTSTATE_RETURN_IF_ERROR(WriteBackLocked(lock, key));
      continue;
    }
    if (busy) {
      cv_.wait(lock);
      continue;
    }
    break;
  }
  if (!bg_error_.ok()) {
    Status e = bg_error_;
    bg_error_ = Status::Ok();
    return e.WithContext("background write-back failed");
  }
  return Status::Ok();
}

Status ManagerImpl::ReleaseAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!pins_.empty() || arena_pages_ != 0) {
      return FailedPrecondition("ReleaseAll: " + std::to_string(pins_.size()) + " pins and " +
                                std::to_string(arena_pages_) + " optimizer slot pages outstanding");
    }
  }
  OPTSTATE_RETURN_IF_ERROR(Flush());
  std::unique_lock<std::mutex> lock(mu_);
  for (auto& [rk, r] : regions_) {
    for (uint64_t c = 0; c < r->slots.size(); ++c) {
      Slot& s = r->slots[c];
      if (s.state == State::kAbsent) continue;
      if (s.pins != 0 || s.dirty || s.state != State::kResident) {
        return FailedPrecondition("ReleaseAll: chunk " + std::to_string(c) + " of " + r->info.name + "/" +
                                  r->info.fields[r->field].name + " was pinned or dirtied concurrently");
      }
      OPTSTATE_RETURN_IF_ERROR(dev_->Unmap(r->base + c * page_bytes_, page_bytes_));
      dev_->DestroyPage(s.page, page_bytes_);
      --physical_pages_;
      LruRemove(s);
      s.state = State::kAbsent;
    }
  }
  for (uint64_t h : pool_) dev_->DestroyPage(h, page_bytes_);
  physical_pages_ -= pool_.size();
  pool_.clear();
  cv_.notify_all();
  return Status::Ok();
}

Status ManagerImpl::DropTensor(uint32_t tensor_id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = regions_by_tensor_.find(tensor_id);
  if (it == regions_by_tensor_.end()) return Status::Ok();
  for (;;) {
    bool again = false;
    for (Region* r : it->second) {
      for (uint64_t c = 0; c < r->slots.size() && !again; ++c) {
        Slot& s = r->slots[c];
        if (s.state == State::kAbsent) continue;
        if (s.pins != 0) {
          return FailedPrecondition("tensor " + r->info.name + " field " + r->info.fields[r->field].name +
                                    " chunk " + std::to_string(c) + " is pinned; unpin before Step");
        }
        if (s.state != State::kResident) {
          cv_.wait(lock);
          again = true;
          break;
        }
        if (s.dirty) {
          OPTSTATE_RETURN_IF_ERROR(WriteBackLocked(lock, Key(*r, c)));
          again = true;
          break;
        }
        OPTSTATE_RETURN_IF_ERROR(dev_->Unmap(r->base + c * page_bytes_, page_bytes_));
        pool_.push_back(s.page);
        LruRemove(s);
        s.state = State::kAbsent;
      }
      if (again) break;
    }
    if (!again) break;
  }
  cv_.notify_all();
  return Status::Ok();
}

Result<Arena> ManagerImpl::AcquireArena(uint64_t min_pages, uint64_t max_pages) {
  if (min_pages > budget_pages_) {
    return ResourceExhausted("device budget " + Mib(budget_pages_ * page_bytes_) + " is smaller than " +
                             std::to_string(min_pages) + " chunks in flight (" + Mib(min_pages * page_bytes_) +
                             "; one chunk per field of a slice)");
  }
  max_pages = std::max(max_pages, min_pages);
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t take = 0;
  for (;;) {
    uint64_t avail = pool_.size() + (budget_pages_ - physical_pages_);
    bool dirty_evictable = false;
    for (const ChunkKey& k : lru_) {
      const Slot& s = SlotOf(k);
      if (s.pins != 0 || s.state != State::kResident) continue;
      if (s.dirty) {
        dirty_evictable = true;
      } else {
        ++avail;
      }
    }
    if (avail >= max_pages || (avail >= min_pages && !dirty_evictable)) {
      take = std::min(avail, max_pages);
      break;
    }
    if (dirty_evictable) {
      Status err;
      WriteBackOneLocked(lock, &err);
      OPTSTATE_RETURN_IF_ERROR(err);
      continue;
    }
    cv_.wait(lock);
  }
  Arena a;
  a.page_bytes = page_bytes_;
  Status err;
  for (uint64_t i = 0; i < take; ++i) {
    uint64_t h = 0;
    if (!TryTakePage(&h, &err)) break;
    a.handles.push_back(h);
  }
  auto give_back = [&](Status e) -> Status {
    for (uint64_t h : a.handles) pool_.push_back(h);
    cv_.notify_all();
    return e;
  };
  if (!err.ok()) return give_back(err);
  if (a.handles.size() < min_pages) return give_back(Internal("AcquireArena: page accounting mismatch"));
  a.pages = a.handles.size();
  auto base = dev_->Reserve(a.pages * page_bytes_);
  if (!base.ok()) return give_back(base.status());
  a.base = *base;
  for (uint64_t i = 0; i < a.pages; ++i) {
    Status ms = dev_->Map(a.base + i * page_bytes_, page_bytes_, a.handles[i]);
    if (!ms.ok()) {
      for (uint64_t j = 0; j < i; ++j) (void)dev_->Unmap(a.base + j * page_bytes_, page_bytes_);
      dev_->Unreserve(a.base, a.pages * page_bytes_);
      return give_back(ms);
    }
  }
  arena_pages_ += a.pages;
  return a;
}

void ManagerImpl::ReleaseArena(Arena* a) {
  if (a->pages == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t i = 0; i < a->pages; ++i) {
    Status s = dev_->Unmap(a->base + i * page_bytes_, page_bytes_);
    if (!s.ok()) OPTSTATE_LOG_ERROR("memmgr: unmapping optimizer slot page: {}", s.ToString());
    pool_.push_back(a->handles[i]);
  }
  dev_->Unreserve(a->base, a->pages * page_bytes_);
  arena_pages_ -= a->pages;
  a->pages = 0;
  a->handles.clear();
  cv_.notify_all();
}

void ManagerImpl::OnAbortPending(bool keep_dirty_cache) {
  // The pending generation's writes are gone: cached copies and clean
  // resident chunks may hold their bytes. Forget both.
  if (keep_dirty_cache) {
    cache_->ForgetPendingWrites();
  } else {
    cache_->Clear();
  }
  std::lock_guard<std::mutex> lock(mu_);
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
    std::lock_guard<std::mutex> lock(mu_);
    s.resident_bytes = physical_pages_ * page_bytes_;
    s.peak_resident_bytes = peak_pages_ * page_bytes_;
    s.pins = pins_total_;
    s.evictions = evictions_;
  }
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
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

}  // namespace internal
}  // namespace optstate::memmgr
