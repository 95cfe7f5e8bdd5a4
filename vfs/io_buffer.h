// Memory for O_DIRECT I/O: every buffer that the store, the mount, the memory
// manager's staging and the tools hand to the kernel for direct I/O comes from
// here. Zero-filled anonymous mappings, 4096-aligned, faulted in.
//
// IoPages::kHuge: from 2 MiB up, 2 MiB-aligned and asked to be backed by
// transparent huge pages (MADV_HUGEPAGE; plain pages where THP is `never`).
// What it changes: the block layer ends a request once it holds max_segments
// physically discontiguous pieces (/sys/block/<dev>/queue/max_segments, 254
// on virtio disks), so an 8 MiB chunk in scattered 4 KiB pages
// reaches the device as ~9 requests of ~1 MiB, in huge pages as 2 of 4 MiB
// (max_sectors_kb). That is faster only on a device whose requests can be
// 2 MiB or more (a disk capped at 1280 KiB, which base pages nearly fill, got
// slower: docs/BENCHMARKS.md "Defaults", staging_pages), so PreferredIoPages
// picks kHuge only there (MemoryManagerOptions::staging_pages kAuto);
// everything else uses kBase.
//
// Thread-safety: the functions are thread-safe; an IoBuffer is a value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "base/status.h"

namespace optstate::vfs {

enum class IoPages { kBase, kHuge };

// bytes > 0. Zero-filled and faulted in (the pages exist when it returns).
Result<void*> AllocateIoMemory(uint64_t bytes, IoPages pages = IoPages::kBase);
// p from AllocateIoMemory(bytes, pages) (same bytes and pages), or null.
void FreeIoMemory(void* p, uint64_t bytes, IoPages pages = IoPages::kBase);

// The largest request the block device under `path` takes, bytes: its
// /sys/dev/block/<major>:<minor>/queue/max_sectors_kb (a partition's: its
// disk's). NotFound when `path` is on no block device (tmpfs, overlay) or
// sysfs does not say; an errno error when `path` cannot be stat'ed.
Result<uint64_t> MaxDeviceRequestBytes(const std::string& path);

// kHuge when the device under `path` takes requests of 2 MiB or more (base
// pages end a direct I/O request near 1 MiB: max_segments pieces of 4 KiB),
// else kBase. *why (if not null) says what was read, for a log line.
IoPages PreferredIoPages(const std::string& path, std::string* why);

// Owns one AllocateIoMemory block. Movable, not copyable.
class IoBuffer {
 public:
  IoBuffer() = default;
  // ok() is false when the allocation failed (or bytes is 0).
  explicit IoBuffer(size_t bytes, IoPages pages = IoPages::kBase);
  ~IoBuffer() { FreeIoMemory(data_, size_, pages_); }
  IoBuffer(IoBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), pages_(o.pages_) {}
  IoBuffer& operator=(IoBuffer&& o) noexcept {
    if (this != &o) {
      FreeIoMemory(data_, size_, pages_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      pages_ = o.pages_;
    }
    return *this;
  }
  IoBuffer(const IoBuffer&) = delete;
  IoBuffer& operator=(const IoBuffer&) = delete;

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
  IoPages pages_ = IoPages::kBase;
};

}  // namespace optstate::vfs
