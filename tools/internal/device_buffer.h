// DeviceBuffer: scratch device memory through MemoryManager::AllocDevice (host
// memory on the host backend), freed on destruction. tools/ may not include
// CUDA headers, so every device allocation and copy goes through the manager.
// Thread-safety: a value owned by one thread.
#pragma once

#include <cstdint>
#include <utility>

#include "memmgr/memory_manager.h"

namespace optstate::tools {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Result<DeviceBuffer> Make(memmgr::MemoryManager* mm, uint64_t bytes) {
    DeviceBuffer b;
    b.mm_ = mm;
    b.bytes_ = bytes;
    if (bytes == 0) return b;
    OPTSTATE_ASSIGN_OR_RETURN(b.d_, mm->AllocDevice(bytes));
    return b;
  }
  ~DeviceBuffer() {
    if (d_) (void)mm_->FreeDevice(d_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : mm_(o.mm_), d_(std::exchange(o.d_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (d_) (void)mm_->FreeDevice(d_);
      mm_ = o.mm_;
      d_ = std::exchange(o.d_, nullptr);
      bytes_ = o.bytes_;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return d_; }
  uint64_t bytes() const { return bytes_; }

 private:
  memmgr::MemoryManager* mm_ = nullptr;
  void* d_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace optstate::tools
