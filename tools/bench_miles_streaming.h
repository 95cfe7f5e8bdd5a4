// MilesStreamingBaseline: the first in-trainer version of optimizer-state
// streaming, as it runs, for optstate-bench step to measure against.
//
// The method is the one of radixark/miles
// miles_plugins/optimizers/nvme_stream.py (NVMeOptimizerStateStore.step):
//  - parameters are grouped into buckets of at most 200,000,000 elements
//    (BUCKET_NUMEL_LIMIT, plan_buckets); one file per bucket,
//    "bucket<5 digits>.bin", laid out [main | exp_avg | exp_avg_sq], every
//    parameter's region of every segment 4096-byte aligned (IO_ALIGN, _align,
//    _Bucket.__init__), fp32, reserved with posix_fallocate (_allocate_file);
//  - per bucket: read its segments (only main on the first step, before the
//    moments exist) with buffered preadv through ONE pinned staging buffer of
//    256 MiB (_Stager, --offload-train-disk-chunk-mb default 256), each chunk
//    copied to the device before the next is read (_Stager.transfer); the
//    fused Adam over the bucket (bucket.adam.step); the updated mains copied
//    into the model's bf16 parameters (_copy_main_to_model_params); the three
//    segments copied back through the same buffer and written with buffered
//    pwritev (_Bucket.flush);
//  - no fsync: the page cache holds the state when RAM allows, and the kernel
//    writes it back in the background.
// With bf16 moments (moment_dtype "bf16") the moment segments hold bf16; the
// miles' streaming casts them to and from its fp32 moments on the device around
// each transfer, the baseline runs our kernel on the bf16 moments directly
// (credited with that fusion too): the same bytes on disk and over PCIe.
// The Adam kernel is ours (kernels::AdamStepCuda / AdamStepCpu), so the
// baseline and StreamedAdam compute the same numbers; it also writes the bf16
// parameter copy in its pass, where miles' NVMe streaming runs a separate cast
// copy (a pass over 6 bytes per parameter on the device: the baseline is
// credited with that fusion).
//
// Cold-cache emulation without root: DropPageCache() writes the dirty pages
// (fdatasync) and evicts each file with POSIX_FADV_DONTNEED, the first
// version's own _drop_file_cache(sync=True); ResidentBytes() checks with
// mincore() what is still cached.
//
// Thread-safety: one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/adam.h"
#include "memmgr/memory_manager.h"
#include "tools/internal/device_buffer.h"
#include "base/status.h"

namespace optstate::tools::bench {

struct MilesStreamingOptions {
  // Elements per bucket: a bucket closes once it reaches this many
  // (BUCKET_NUMEL_LIMIT). Default 200,000,000.
  uint64_t bucket_numel_limit = 200'000'000;
  // The pinned staging buffer (--offload-train-disk-chunk-mb). Default 256 MiB.
  uint64_t staging_bytes = 256ull << 20;
  // Hyperparameters of every step; `step` is ignored (the baseline counts).
  kernels::AdamParams adam;
  // Run the CUDA kernel (the manager's backend is cuda); else AdamStepCpu.
  bool cuda = false;
  // AdamStepCpu threads. Default 1.
  int cpu_threads = 1;
  // The moments' dtype on disk (moment_dtype "fp32" or "bf16"): kF32 or
  // kBF16. Default kF32.
  MomentDType moment_type = MomentDType::kF32;
};

class MilesStreamingBaseline {
 public:
  // One bucket file: which parameters it holds and where each segment of each
  // parameter starts (bytes).
  struct Bucket {
    std::string path;
    int fd = -1;
    std::vector<size_t> params;           // indexes into the params given to Create
    std::vector<uint64_t> offsets[3];     // per segment (main, exp_avg, exp_avg_sq), per param
    std::vector<uint64_t> device_elems;   // each param's element offset in the device buffers
    uint64_t numel = 0;
    uint64_t nbytes = 0;
  };

  // Creates `dir`, plans the buckets over `params` ({name, numel}, in model
  // order), allocates the files and writes each parameter's main from
  // `h_w0` (host fp32, at least max numel elements; every parameter starts
  // from its first numel values), then syncs and evicts the mains
  // (refresh_main_from_model_params, sync_and_drop_main_cache). Device memory:
  // 12 bytes per element of the largest bucket; pinned host: staging_bytes.
  static Result<std::unique_ptr<MilesStreamingBaseline>> Create(
      const std::string& dir, const std::vector<std::pair<std::string, uint64_t>>& params,
      memmgr::MemoryManager* mm, const float* h_w0, const MilesStreamingOptions& options);
  ~MilesStreamingBaseline();
  MilesStreamingBaseline(const MilesStreamingBaseline&) = delete;
  MilesStreamingBaseline& operator=(const MilesStreamingBaseline&) = delete;

  // One optimizer step over every bucket. d_grads[p]: param p's fp32
  // gradient (device). d_params[p]: its bf16 model copy to update (device),
  // or nullptr; d_params may be empty.
  Status Step(const std::vector<const void*>& d_grads, const std::vector<void*>& d_params);

  // Makes every bucket file's dirty pages durable, then evicts the files from
  // the page cache. *sync_seconds: the time of the fdatasync calls.
  Status DropPageCache(double* sync_seconds);
  // Bytes of the bucket files in the page cache (mincore).
  Result<uint64_t> ResidentBytes() const;

  uint64_t step_count() const { return step_count_; }
  uint64_t file_bytes() const;
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const MilesStreamingOptions& options() const { return options_; }

 private:
  MilesStreamingBaseline() = default;
  Status Transfer(const Bucket& b, int segment, size_t k, bool to_disk);
  // Bytes per element of a segment (0 main, 1 exp_avg, 2 exp_avg_sq) on disk.
  uint64_t SegmentElemBytes(int segment) const;

  memmgr::MemoryManager* mm_ = nullptr;
  MilesStreamingOptions options_;
  std::vector<std::pair<std::string, uint64_t>> params_;
  std::vector<Bucket> buckets_;
  void* h_staging_ = nullptr;  // pinned, options_.staging_bytes
  DeviceBuffer d_state_[3];    // the materialized bucket: main, exp_avg, exp_avg_sq
  bool moments_ready_ = false;
  uint64_t step_count_ = 0;
};

}  // namespace optstate::tools::bench
