// The value types of StreamedAdam's API (memmgr/streamed_adam.h): groups,
// shard geometry, gradients, options, registrations and step stats.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/dtype.h"

namespace optstate::memmgr {

struct ParamGroup {
  uint32_t id = 0;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;  // true: AdamW (decoupled decay); false: Adam (L2 in grad)
};

struct ShardInfo {
  std::vector<uint64_t> shape;         // local shard shape; empty = {numel}
  std::vector<uint64_t> global_shape;  // empty = shape
  std::vector<uint64_t> shard_offset;  // empty = zeros
};

struct ParamGrad {
  std::string name;
  const void* d_grad = nullptr;                     // numel elements of grad_type
  DType grad_type = DType::kF32;                    // f32, bf16 or f16
  void* d_param = nullptr;                          // model copy to update; may be null
  std::optional<DType> param_type = std::nullopt;   // d_param's dtype (f32, bf16, f16); needed with d_param
  // Elements in d_grad (and d_param). Checked against the registered numel
  // before the step starts: set it, so a model that no longer matches its
  // store fails cleanly instead of reading past the gradient. Default 0 = not
  // given (the caller guarantees the registered numel).
  uint64_t numel = 0;
};

struct StreamedAdamOptions {
  // Gradients are multiplied by 1/grad_scale: the scale of the first steps
  // (StreamedAdam::SetGradScale or a step's d_grad_scale change it). Default 1.
  float grad_scale = 1.0f;
  // CPU threads for AdamStepCpu (host backend). Default 1.
  int cpu_threads = 1;
  // Commit every N-th step when the host cache tier holds the whole state
  // (see above); 1 = every step is durable when Step returns. Default 1.
  uint32_t durable_every_steps = 1;
  // During a step, fdatasync the data files in the background every this many
  // bytes of completed writes, so part of the device's flush overlaps the step
  // instead of landing in Commit. 0 = only Commit syncs. Default 512 MiB
  // (docs/BENCHMARKS.md "Defaults" has the measurements behind it).
  uint64_t background_sync_bytes = 512ull << 20;
  // Steps whose commit may still be running when Step returns: 0 = Step
  // returns once its generation is committed (durable); 1 = Step returns
  // once the kernels and param copies are done and the commit (write tail,
  // data sync, index batch) completes in the background (see "Pipelined
  // commits" above). Default 1: the commit, about the write half of a step's
  // disk time plus its fdatasync, then overlaps the trainer's
  // forward/backward instead of adding to the step, and a crash can lose
  // only that one step. Other values are kInvalidArgument.
  uint32_t commit_lag_steps = 1;
  // Storage of exp_avg and exp_avg_sq: kF32 (12 bytes per param read and
  // written per step with the fp32 main) or kBF16 (8 bytes: the kernel
  // decodes, updates in fp32 and rounds to nearest even, relative error
  // <= 2^-8 per store; kernels/adam.h). Recorded per tensor field in the
  // store when a param is registered; a store holding the other dtype is
  // kInvalidArgument at Create (naming store, tensor, field, both dtypes).
  // With bf16 a slice is one chunk of each moment and the two main chunks of
  // the same elements: 4 chunk-sized device pages and staging buffers per
  // slice instead of 3, every one a whole chunk (so still a multiple of the
  // 2 MiB VMM granularity and the unit of I/O and checksums). Default kF32.
  MomentDType moment_dtype = MomentDType::kF32;
};

// One param of StreamedAdam::RegisterParams (as RegisterParam's arguments).
struct StreamedAdamParamSpec {
  std::string name;
  uint64_t numel = 0;
  uint32_t group = 0;
  const void* d_initial = nullptr;
  std::optional<DType> initial_type = DType::kF32;
  ShardInfo shard;
  uint32_t rule = 0;  // index into Create's rules
};

// What one step did (StreamedAdam::last_step_stats).
struct StreamedAdamStepStats {
  double seconds = 0;
  uint64_t slices = 0;
  uint64_t read_bytes = 0;
  uint64_t write_bytes = 0;
  uint32_t slices_in_flight = 0;  // pipeline depth used (staging sets)
  uint32_t small_sets = 0;        // staging sets for slices of small tensors (<= 256 KiB a field)
  uint64_t small_slices = 0;      // slices that went through them
  uint64_t peak_read_bytes_in_flight = 0;   // <= queue_depth chunks
  uint64_t peak_write_bytes_in_flight = 0;  // <= write_queue_depth chunks (shared: queue_depth)
  uint32_t device_slots = 0;      // slices that can be on the device at once
  // Whole-tensor units (Muon's matrices) that held a device window at once,
  // at most (0 when the step had none).
  uint32_t peak_unit_windows = 0;
  double io_wait_seconds = 0;     // blocked in Reap with nothing else to do
  double compute_seconds = 0;     // in copy/kernel launch calls (host: the whole kernel)
  double submit_seconds = 0;      // in SubmitRead/SubmitWrite (checksums, queue-full waits)
  double commit_seconds = 0;      // Store::Commit (fdatasync + index batch)
  // commit_lag_steps 1: how long this step waited at its start for the
  // previous step's background commit (0 when it had finished). slices,
  // write_bytes, peak_write_bytes_in_flight and commit_seconds are then
  // complete only once this step's own commit was waited for
  // (WaitForCommit, MakeDurable); the next step starts new stats.
  double commit_wait_seconds = 0;
  // Chunk bytes this step found in the host cache tier because Prefetch()
  // read them there (part of the tier's hits), and the bytes the prefetch
  // before this step read in all (some may have served no step yet).
  uint64_t prefetch_hit_bytes = 0;
  uint64_t prefetch_read_bytes = 0;
  // Bytes of this step's writes still in flight or queued when Step
  // returned (the write tail; complete, like write_bytes, once its commit
  // was waited for). 0 with commit_lag_steps 0.
  uint64_t write_tail_bytes = 0;
};

}  // namespace optstate::memmgr
