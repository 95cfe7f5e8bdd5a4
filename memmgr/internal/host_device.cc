// Host backend: the CUDA VMM page table emulated with mmap. A reservation is
// mmap(PROT_NONE, MAP_NORESERVE); physical pages are slices of one memfd,
// mapped MAP_SHARED|MAP_FIXED while resident and replaced by a fresh
// PROT_NONE mapping when unmapped (so a stale pointer faults instead of
// reading another chunk's bytes). Copies are memcpy, kernels the update rules' CPU ones.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "memmgr/internal/device.h"
#include "vfs/io_buffer.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace optstate::memmgr::internal {
namespace {

class HostDevice final : public Device {
 public:
  explicit HostDevice(bool huge_page_pinned)
      : pinned_pages_(huge_page_pinned ? vfs::IoPages::kHuge : vfs::IoPages::kBase) {}
  ~HostDevice() override {
    if (memfd_ >= 0) close(memfd_);
  }
  Backend backend() const override { return Backend::kHost; }
  uint64_t granularity() const override { return 2ull << 20; }

  Result<uint64_t> Reserve(uint64_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return ErrnoStatus("mmap reserve " + std::to_string(bytes) + " bytes", errno);
    return reinterpret_cast<uint64_t>(p);
  }
  void Unreserve(uint64_t base, uint64_t bytes) override {
    munmap(reinterpret_cast<void*>(base), bytes);
  }

  Result<uint64_t> CreatePage(uint64_t bytes) override EXCLUDES(mu_) {
    MutexLock l(&mu_);
    if (memfd_ < 0) {
      memfd_ = memfd_create("optstate-host-device", MFD_CLOEXEC);
      if (memfd_ < 0) return ErrnoStatus("memfd_create", errno);
    }
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].second == bytes) {
        uint64_t off = free_[i].first;
        free_.erase(free_.begin() + static_cast<long>(i));
        return off;
      }
    }
    uint64_t off = size_;
    if (ftruncate(memfd_, static_cast<off_t>(size_ + bytes)) != 0) {
      return ErrnoStatus("ftruncate host-device memfd to " + std::to_string(size_ + bytes), errno);
    }
    size_ += bytes;
    return off;
  }
  void DestroyPage(uint64_t handle, uint64_t bytes) override EXCLUDES(mu_) {
    MutexLock l(&mu_);
    // Give the memory back (the memfd keeps its size; the slot is reused).
    fallocate(memfd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(handle),
              static_cast<off_t>(bytes));
    free_.emplace_back(handle, bytes);
  }
  Status Map(uint64_t va, uint64_t bytes, uint64_t handle) override EXCLUDES(mu_) {
    int fd = -1;
    {
      MutexLock l(&mu_);
      fd = memfd_;
    }
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                   static_cast<off_t>(handle));
    if (p == MAP_FAILED) return ErrnoStatus("mmap page at va " + std::to_string(va), errno);
    return Status::Ok();
  }
  Status Unmap(uint64_t va, uint64_t bytes) override {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) return ErrnoStatus("mmap PROT_NONE over page at va " + std::to_string(va), errno);
    return Status::Ok();
  }

  // I/O memory (vfs/io_buffer.h rounds to whole pages), locked.
  Result<void*> AllocPinnedHost(uint64_t bytes) override {
    OPTSTATE_ASSIGN_OR_RETURN(void* p, vfs::AllocateIoMemory(bytes, pinned_pages_));
    // Several threads allocate at once (pins' loads, the worker's write-backs,
    // the optimizer's staging): one of them warns.
    if (mlock(p, bytes) != 0 && !warned_mlock_.exchange(true)) {
      OPTSTATE_LOG_WARN("memmgr host backend: mlock of {} bytes failed ({}); staging stays pageable "
                        "(raise RLIMIT_MEMLOCK to pin it)", bytes, std::strerror(errno));
    }
    return p;
  }
  // munmap (FreeIoMemory) also unlocks.
  void FreePinnedHost(void* p, uint64_t bytes) override { vfs::FreeIoMemory(p, bytes, pinned_pages_); }

  Result<void*> Malloc(uint64_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) & ~uint64_t{255});
    if (p == nullptr) return ResourceExhausted("host scratch alloc of " + std::to_string(bytes) + " bytes");
    return p;
  }
  Status Free(void* p) override {
    std::free(p);
    return Status::Ok();
  }

  Result<void*> CreateStream() override { return static_cast<void*>(nullptr); }
  void DestroyStream(void*) override {}
  Result<void*> CreateEvent() override { return static_cast<void*>(nullptr); }
  void DestroyEvent(void*) override {}
  Status RecordEvent(void*, void*) override { return Status::Ok(); }
  Result<bool> QueryEvent(void*) override { return true; }
  Status SyncEvent(void*) override { return Status::Ok(); }
  Status SyncStream(void*) override { return Status::Ok(); }

  Status CopyH2D(void* d, const void* h, uint64_t bytes, void*) override {
    if (bytes) std::memcpy(d, h, bytes);
    return Status::Ok();
  }
  Status CopyD2H(void* h, const void* d, uint64_t bytes, void*) override {
    if (bytes) std::memcpy(h, d, bytes);
    return Status::Ok();
  }
  Status CopyD2D(void* d, const void* s, uint64_t bytes, void*) override {
    if (bytes) std::memmove(d, s, bytes);
    return Status::Ok();
  }
  Status Memset(void* d, int value, uint64_t bytes, void*) override {
    if (bytes) std::memset(d, value, bytes);
    return Status::Ok();
  }
  Status RunRule(const UpdateRule& rule, const SliceOperands& o, const RuleArgs& a, int cpu_threads,
                 void*) override {
    return rule.RunCpu(o, a, cpu_threads < 1 ? 1 : cpu_threads);
  }
  Status MemInfo(uint64_t* free_bytes, uint64_t* total_bytes) override {
    *free_bytes = 0;
    *total_bytes = 0;
    return Status::Ok();
  }

 private:
  Mutex mu_;
  const vfs::IoPages pinned_pages_;  // AllocPinnedHost memory
  int memfd_ GUARDED_BY(mu_) = -1;   // created by the first CreatePage
  uint64_t size_ GUARDED_BY(mu_) = 0;
  std::vector<std::pair<uint64_t, uint64_t>> free_ GUARDED_BY(mu_);  // (offset, bytes)
  std::atomic<bool> warned_mlock_{false};
};

}  // namespace

std::unique_ptr<Device> NewHostDevice(bool huge_page_pinned) {
  return std::make_unique<HostDevice>(huge_page_pinned);
}

}  // namespace optstate::memmgr::internal
