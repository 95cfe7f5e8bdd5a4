#include "mount/chunk_buffer_pool.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "vfs/io_buffer.h"
#include "base/log.h"

namespace optstate::mount {

// Chunk buffers in 2 MiB pages (vfs/io_buffer.h): a chunk then reaches the
// disk as few large requests; never slower than base pages on the machines of
// docs/BENCHMARKS.md ("Defaults", staging_pages).
constexpr vfs::IoPages kPoolPages = vfs::IoPages::kHuge;

ChunkBufferPool::~ChunkBufferPool() {
  for (auto& [bytes, buf] : idle_) vfs::FreeIoMemory(buf, bytes, kPoolPages);
}

char* ChunkBufferPool::Take(uint64_t bytes, bool must) {
  std::vector<std::pair<uint64_t, char*>> evicted;
  {
    MutexLock l(&mu_);
    for (size_t i = 0; i < idle_.size(); ++i) {
      if (idle_[i].first == bytes) {
        char* b = idle_[i].second;
        idle_bytes_ -= bytes;
        idle_[i] = idle_.back();
        idle_.pop_back();
        return b;
      }
    }
    if (allocated_bytes_ - idle_bytes_ + bytes > budget_bytes_ && !must) return nullptr;
    // Idle buffers of another size (another file's chunk length) make room first.
    while (allocated_bytes_ + bytes > budget_bytes_ && !idle_.empty()) {
      allocated_bytes_ -= idle_.back().first;
      idle_bytes_ -= idle_.back().first;
      evicted.push_back(idle_.back());
      idle_.pop_back();
    }
    allocated_bytes_ += bytes;  // reserved; mapped and zeroed below, outside the lock
  }
  // Unmapping and faulting in (an 8 MiB memset) outside the lock: under it a
  // burst of opens, each taking a buffer, queues every reader behind the
  // others' page faults.
  for (auto& [n, b] : evicted) vfs::FreeIoMemory(b, n, kPoolPages);
  auto b = vfs::AllocateIoMemory(bytes, kPoolPages);
  if (!b.ok()) {
    MutexLock l(&mu_);
    allocated_bytes_ -= bytes;
    return nullptr;
  }
  return static_cast<char*>(*b);
}

void ChunkBufferPool::Give(char* buf, uint64_t bytes) {
  if (buf == nullptr) return;
  MutexLock l(&mu_);
  if (allocated_bytes_ <= budget_bytes_) {
    idle_.emplace_back(bytes, buf);
    idle_bytes_ += bytes;
    return;
  }
  allocated_bytes_ -= bytes;  // over budget (a `must` buffer): shrink back
  vfs::FreeIoMemory(buf, bytes, kPoolPages);
}

uint64_t ChunkBufferPool::allocated_bytes() const {
  MutexLock l(&mu_);
  return allocated_bytes_;
}

}  // namespace optstate::mount
