// MemoryManager: a thin facade over internal::ManagerImpl (the pin/LRU
// machinery, the staging pool, the host cache tier); PinnedRange; backend names.
#include "memmgr/memory_manager.h"

#include <utility>

#include "memmgr/internal/device.h"
#include "memmgr/internal/manager_impl.h"
#include "base/log.h"

namespace optstate::memmgr {

using internal::ManagerImpl;

namespace internal {
EngineMemory* EngineMemoryOf(const MemoryManager& mm) { return mm.impl_.get(); }
}  // namespace internal

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
namespace {
// The host cache tier as an export's chunk source (the exporter checks what
// it fills against the generation's checksums).
class CacheChunkSource final : public vfs::ChunkSource {
 public:
  explicit CacheChunkSource(const internal::HostCache* cache) : cache_(cache) {}
  bool Fill(const vfs::ChunkRef& ref, void* dst, uint64_t len) override {
    return cache_->CopyIdle(internal::ChunkKey{ref.tensor_id, ref.field, ref.index}, dst, len);
  }

 private:
  const internal::HostCache* cache_;
};
}  // namespace

Result<vfs::ExportResult> MemoryManager::ExportCheckpoint(const std::string& dest, vfs::ExportOptions opts) {
  impl_->WaitBackgroundCommit();
  CacheChunkSource source(impl_->cache());
  opts.chunk_source = &source;
  return vfs::ExportCheckpoint(impl_->store(), dest, opts);
}

Status MemoryManager::DeviceMemInfo(uint64_t* free_bytes, uint64_t* total_bytes) {
  return impl_->device()->MemInfo(free_bytes, total_bytes);
}

}  // namespace optstate::memmgr
