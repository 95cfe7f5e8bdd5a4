// ChunkBufferPool: the chunk buffers of a mount's readers (mount/chunk_reader.h),
// shared by all of them so that memory for read-ahead is bounded by one budget.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace optstate::mount {

// A bounded set of 4096-aligned chunk buffers reused across readers (a `cp -r`
// of many files does not fault in fresh 8 MiB buffers per file). Idle buffers
// count against the budget. Thread-safe.
class ChunkBufferPool {
 public:
  explicit ChunkBufferPool(uint64_t budget_bytes) : budget_bytes_(budget_bytes) {}
  ~ChunkBufferPool();
  ChunkBufferPool(const ChunkBufferPool&) = delete;
  ChunkBufferPool& operator=(const ChunkBufferPool&) = delete;

  // A buffer of `bytes` (a multiple of 4096). nullptr when the budget is spent
  // and `must` is false, or when allocation fails. `must` lets a reader that
  // holds no buffer exceed the budget by this one.
  char* Take(uint64_t bytes, bool must) EXCLUDES(mu_);
  void Give(char* buf, uint64_t bytes) EXCLUDES(mu_);

  uint64_t allocated_bytes() const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  const uint64_t budget_bytes_;
  uint64_t allocated_bytes_ GUARDED_BY(mu_) = 0;  // idle + in use
  uint64_t idle_bytes_ GUARDED_BY(mu_) = 0;       // of idle_
  std::vector<std::pair<uint64_t, char*>> idle_ GUARDED_BY(mu_);
};

}  // namespace optstate::mount
