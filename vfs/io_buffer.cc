#include "vfs/io_buffer.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

namespace optstate::vfs {

namespace {

constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kHugePageBytes = 2ull << 20;

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

bool Huge(uint64_t bytes, IoPages pages) { return pages == IoPages::kHuge && bytes >= kHugePageBytes; }

// The mapping behind a block of `bytes`: whole 2 MiB pages for a huge block.
uint64_t MappedBytes(uint64_t bytes, IoPages pages) {
  return Huge(bytes, pages) ? RoundUp(bytes, kHugePageBytes) : RoundUp(bytes, kPageBytes);
}

}  // namespace

Result<void*> AllocateIoMemory(uint64_t bytes, IoPages pages) {
  if (bytes == 0) return InvalidArgument("AllocateIoMemory: 0 bytes");
  const uint64_t len = MappedBytes(bytes, pages);
  const uint64_t align = Huge(bytes, pages) ? kHugePageBytes : kPageBytes;
  // Map align bytes more and trim, so the block starts on a 2 MiB boundary
  // (a huge page can back only an aligned 2 MiB range).
  const uint64_t span = len + (align > kPageBytes ? align : 0);
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    return ErrnoStatus("mmap of " + std::to_string(span) + " bytes for an I/O buffer", errno);
  }
  const auto base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t start = (base + align - 1) / align * align;
  if (start > base) munmap(m, start - base);
  if (const uintptr_t end = base + span; end > start + len) {
    munmap(reinterpret_cast<void*>(start + len), end - (start + len));
  }
  void* p = reinterpret_cast<void*>(start);
  // Advice only: without THP (or with it off) the buffer is plain pages.
  if (align == kHugePageBytes) (void)madvise(p, len, MADV_HUGEPAGE);
  std::memset(p, 0, len);  // fault the pages in now, not on the first I/O
  return p;
}

void FreeIoMemory(void* p, uint64_t bytes, IoPages pages) {
  if (p != nullptr) munmap(p, MappedBytes(bytes, pages));
}

Result<uint64_t> MaxDeviceRequestBytes(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus("stat " + path, errno);
  const std::string dev = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                          std::to_string(minor(st.st_dev));
  for (const char* queue : {"/queue/max_sectors_kb", "/../queue/max_sectors_kb"}) {
    std::ifstream in(dev + queue);
    uint64_t kib = 0;
    if (in >> kib && kib > 0) return kib << 10;
  }
  return NotFound(path + " (device " + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev)) +
                  ") is on no block device with a max_sectors_kb in sysfs");
}

IoPages PreferredIoPages(const std::string& path, std::string* why) {
  auto max = MaxDeviceRequestBytes(path);
  const IoPages pages = max.ok() && *max >= kHugePageBytes ? IoPages::kHuge : IoPages::kBase;
  if (why != nullptr) {
    *why = max.ok() ? "requests of up to " + std::to_string(*max >> 10) + " KiB on the device under " + path
                    : max.status().message();
  }
  return pages;
}

IoBuffer::IoBuffer(size_t bytes, IoPages pages) : pages_(pages) {
  if (bytes == 0) return;
  auto p = AllocateIoMemory(bytes, pages);
  if (!p.ok()) return;
  data_ = static_cast<std::byte*>(*p);
  size_ = bytes;
}

}  // namespace optstate::vfs
