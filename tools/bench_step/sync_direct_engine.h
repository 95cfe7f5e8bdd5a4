// A synchronous O_DIRECT engine, optstate-bench step's "direct" baseline
// (--baselines direct): what the disk gives a naive engine that is durable
// like ours, with no pipelining.
//
// One private file per parameter field; per parameter, chunk by chunk,
// O_DIRECT pread of main, exp_avg and exp_avg_sq through one pinned staging
// buffer, each copied to the device; the fused kernel; each field copied back
// through the same buffer and pwritten in place; fdatasync of every file at
// the end.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "memmgr/memory_manager.h"
#include "tools/internal/device_buffer.h"
#include "vfs/file_system.h"

namespace optstate::tools::bench::step {

class SyncDirectEngine {
 public:
  // Creates dir and one file per param field; writes the initial state (main
  // = w0, moments zero) and fdatasyncs it.
  static Result<std::unique_ptr<SyncDirectEngine>> Create(
      const std::string& dir, const std::vector<std::pair<std::string, uint64_t>>& params,
      uint64_t chunk, memmgr::MemoryManager* mm, const std::vector<float>& w0);

  // grads[p]: device pointer of param p's fp32 gradient.
  Status Step(const std::vector<void*>& grads, uint64_t step, bool cuda);

 private:
  struct Param {
    uint64_t numel = 0;
    std::unique_ptr<vfs::File> files[3];
  };
  SyncDirectEngine() = default;

 public:
  ~SyncDirectEngine() {
    if (h_staging_ != nullptr) mm_->FreePinnedHost(h_staging_, chunk_);
  }

 private:
  memmgr::MemoryManager* mm_ = nullptr;
  uint64_t chunk_ = 0;
  void* h_staging_ = nullptr;  // pinned, chunk bytes
  DeviceBuffer d_[3];
  std::vector<Param> params_;
};

}  // namespace optstate::tools::bench::step
