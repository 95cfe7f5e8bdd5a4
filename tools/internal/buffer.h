// AlignedBuffer: page-aligned anonymous memory for O_DIRECT I/O (mmap'd, so
// 4096-aligned and zero-filled). Owns the mapping; movable, not copyable.
// Thread-safety: a value; no internal synchronisation.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

namespace optstate::tools {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      size_ = 0;
      return;
    }
    data_ = static_cast<std::byte*>(p);
  }
  ~AlignedBuffer() {
    if (data_) munmap(data_, size_);
  }
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      if (data_) munmap(data_, size_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  // False when the allocation failed (or size 0).
  bool ok() const { return data_ != nullptr; }
  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(data_); }
  template <typename T>
  const T* as() const { return reinterpret_cast<const T*>(data_); }
  size_t size() const { return size_; }
  std::span<std::byte> span() { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace optstate::tools
