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
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
    jobs_.clear();
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ChunkHasher::Post(uint64_t tag, const void* buf, uint64_t len) {
  {
    std::lock_guard<std::mutex> l(mu_);
    jobs_.push_back(Job{tag, buf, len});
  }
  work_cv_.notify_one();
}

void ChunkHasher::Collect(std::vector<Result>* out) {
  std::lock_guard<std::mutex> l(mu_);
  out->insert(out->end(), results_.begin(), results_.end());
  results_.clear();
}

void ChunkHasher::WaitForResult() {
  std::unique_lock<std::mutex> l(mu_);
  result_cv_.wait(l, [this] { return !results_.empty(); });
}

void ChunkHasher::Loop() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    work_cv_.wait(l, [this] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    const Job job = jobs_.front();
    jobs_.pop_front();
    l.unlock();
    const uint64_t sum = ChunkChecksum(job.buf, job.len);
    l.lock();
    results_.push_back(Result{job.tag, sum});
    result_cv_.notify_one();
    // Outside the lock: the owner may be blocked in the I/O engine, not on
    // result_cv_ (the result is queued first, so a wake is never lost).
    l.unlock();
    if (on_result_) on_result_();
    l.lock();
  }
}

}  // namespace optstate::vfs::internal
