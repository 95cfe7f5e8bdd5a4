// The state of StreamedAdam that its files share beyond the public header:
// the background commit and the background prefetch. Internal to memmgr.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "memmgr/internal/step_pipeline.h"
#include "memmgr/streamed_adam.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::memmgr {

// A step handed to the background: its pipeline (the write tail), the commit
// to publish, and what the thread found. The thread owns pipeline, the
// optimizer's io_ and the store's pending generation until it is joined.
struct StreamedAdam::InFlightCommit {
  std::thread thread;
  std::unique_ptr<internal::StepPipeline> pipeline;
  vfs::CommitInfo info;            // the step's generation (step counts after it)
  bool cache_mode = false;         // the step's slices lived in the host cache
  uint64_t generation = 0;         // the generation the commit publishes
  uint64_t steps = 1;              // steps it makes durable (cached ones too)
  // Written by the thread, read after join.
  Status status;
  uint64_t committed = 0;          // the generation Store::Commit returned
  uint64_t slices = 0, write_bytes = 0, peak_write_bytes = 0;
  uint64_t write_bytes_at_return = 0;  // of the step's writes, complete when Step returned
  double io_wait_seconds = 0, commit_seconds = 0;
  // Set by the thread when it is done (status and committed final); a
  // prefetch waits on it before it reads the store.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
};

// A prefetch running on a thread of the optimizer (StreamedAdam::Prefetch).
struct StreamedAdam::PrefetchRun {
  std::thread thread;
  std::atomic<bool> stop{false};  // set (under the in-flight commit's mu, if any) by StopPrefetch
  // Written by the thread, read after join.
  uint64_t read_bytes = 0;  // chunk bytes read into the host cache tier
  uint64_t disk_bytes = 0;  // chunk bytes read from the store (some may have found an entry by then)
  uint64_t failed = 0;      // chunks not read (a read error; the step reads them again)
  std::vector<StagedChunk> staged;  // read into staging buffers for the next step
  uint64_t write_mark = 0;          // the manager's nvme_write_bytes when reading started
};

}  // namespace optstate::memmgr
