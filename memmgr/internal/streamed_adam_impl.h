// The state of StreamedEngine that its files share beyond the public header:
// the background prefetch. Internal to memmgr.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "memmgr/internal/committer.h"
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/internal/streamed_engine.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

// A prefetch running on a thread of the optimizer (StreamedEngine::Prefetch).
struct StreamedEngine::PrefetchRun {
  std::thread thread;
  std::atomic<bool> stop{false};  // set by StopPrefetch (Committer::Wake)
  // Written by the thread, read after join.
  uint64_t read_bytes = 0;  // chunk bytes read into the host cache tier
  uint64_t disk_bytes = 0;  // chunk bytes read from the store (some may have found an entry by then)
  uint64_t failed = 0;      // chunks not read (a read error; the step reads them again)
  std::vector<StagedChunk> staged;  // read into staging buffers for the next step
  uint64_t write_mark = 0;          // the manager's nvme_write_bytes when reading started
};

}  // namespace optstate::memmgr::internal
