// ChunkHasher: XXH3 of chunk buffers (ChunkChecksum) on threads of its own,
// for a ChunkIo whose owner thread should keep the disk queue full rather
// than hash.
//
// Why: every byte a step writes is hashed before its extent is published and
// every byte it reads is verified before use; on the owner's thread that
// hashing, not the disk, set the step's pace (docs/BENCHMARKS.md "Defaults",
// hash_threads).
//
// Post queues a job; a hasher thread computes it, queues (tag, sum) and calls
// `on_result` (ChunkIo: IoEngine::Wake, so an owner blocked waiting for I/O
// comes back for it). The owner takes results with Collect. The buffer of a
// posted job must stay unchanged and alive until its result is collected or
// the hasher is destroyed.
//
// Thread-safety: Post, Collect and WaitForResult from one owner thread;
// `on_result` runs on hasher threads. The destructor finishes the job each
// thread is on, drops queued ones and joins.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace optstate::vfs::internal {

class ChunkHasher {
 public:
  struct Result {
    uint64_t tag = 0;
    uint64_t sum = 0;  // ChunkChecksum(buf, len)
  };

  // REQUIRES: threads >= 1.
  ChunkHasher(uint32_t threads, std::function<void()> on_result);
  ~ChunkHasher();
  ChunkHasher(const ChunkHasher&) = delete;
  ChunkHasher& operator=(const ChunkHasher&) = delete;

  void Post(uint64_t tag, const void* buf, uint64_t len) EXCLUDES(mu_);
  // Appends every finished result to *out.
  void Collect(std::vector<Result>* out) EXCLUDES(mu_);
  // Blocks until a result is there to collect. REQUIRES: a posted job whose
  // result was not collected yet.
  void WaitForResult() EXCLUDES(mu_);

 private:
  struct Job {
    uint64_t tag = 0;
    const void* buf = nullptr;
    uint64_t len = 0;
  };
  void Loop() EXCLUDES(mu_);

  const std::function<void()> on_result_;
  Mutex mu_;
  CondVar work_cv_;    // with mu_: jobs_ not empty, or stop_
  CondVar result_cv_;  // with mu_: results_ not empty
  std::deque<Job> jobs_ GUARDED_BY(mu_);
  std::vector<Result> results_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace optstate::vfs::internal
