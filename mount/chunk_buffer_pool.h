// ChunkBufferPool: the chunk buffers of a mount's readers (mount/chunk_reader.h),
// shared by all of them so that memory for read-ahead is bounded by one budget.
#pragma once

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

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
  char* Take(uint64_t bytes, bool must);
  void Give(char* buf, uint64_t bytes);

  uint64_t allocated_bytes() const;

 private:
  mutable std::mutex mu_;
  const uint64_t budget_bytes_;
  uint64_t allocated_bytes_ = 0;                   // guarded by mu_; idle + in use
  uint64_t idle_bytes_ = 0;                        // guarded by mu_; of idle_
  std::vector<std::pair<uint64_t, char*>> idle_;   // guarded by mu_
};

}  // namespace optstate::mount
