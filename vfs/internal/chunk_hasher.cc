// ChunkHasher (vfs/internal/chunk_hasher.h).
#include "vfs/internal/chunk_hasher.h"

#include "vfs/store.h"

namespace optstate::vfs::internal {

ChunkHasher::ChunkHasher(uint32_t threads, std::function<void()> on_result) : on_result_(std::move(on_result)) {
  threads_.reserve(threads);
  for (uint32_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

ChunkHasher::~ChunkHasher() {
  {
    MutexLock l(&mu_);
    stop_ = true;
    jobs_.clear();
  }
  work_cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

void ChunkHasher::Post(uint64_t tag, const void* buf, uint64_t len) {
  {
    MutexLock l(&mu_);
    jobs_.push_back(Job{tag, buf, len});
  }
  work_cv_.Signal();
}

void ChunkHasher::Collect(std::vector<Result>* out) {
  MutexLock l(&mu_);
  out->insert(out->end(), results_.begin(), results_.end());
  results_.clear();
}

void ChunkHasher::WaitForResult() {
  MutexLock l(&mu_);
  while (results_.empty()) result_cv_.Wait(&mu_);
}

void ChunkHasher::Loop() {
  MutexLock l(&mu_);
  for (;;) {
    while (!stop_ && jobs_.empty()) work_cv_.Wait(&mu_);
    if (stop_) return;
    const Job job = jobs_.front();
    jobs_.pop_front();
    l.Unlock();
    const uint64_t sum = ChunkChecksum(job.buf, job.len);
    l.Lock();
    results_.push_back(Result{job.tag, sum});
    result_cv_.Signal();
    // Outside the lock: the owner may be blocked in the I/O engine, not on
    // result_cv_ (the result is queued first, so a wake is never lost).
    l.Unlock();
    if (on_result_) on_result_();
    l.Lock();
  }
}

}  // namespace optstate::vfs::internal
