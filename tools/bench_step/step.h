// optstate-bench step: a StreamedAdam step vs the I/O floor (fio reading and
// writing the same bytes at once) vs miles' NVMe streaming as it runs,
// with its state in the page cache (warm) and evicted before each step (cold)
// (compare.h); and, with --store, a deterministic synthetic mode that leaves
// its store behind (synthetic.cc). This header holds what the files of
// tools/bench_step/ share: the command line and the options both modes parse.
#pragma once

#include <cstdint>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/adam.h"
#include "memmgr/memory_manager.h"

namespace optstate::tools::bench::step {

inline constexpr const char* kTool = "optstate-bench step";

// The command line (options.cc registers it).
struct StepOptions {
  // synthetic mode
  std::string store;
  uint64_t params = 0;
  uint64_t steps = 1;
  uint32_t tensors = 1;
  std::string snapshot;
  // comparison mode
  std::string dir;
  std::string state_text = "1G";
  uint32_t rounds = 3;
  bool no_fio = false;
  bool no_batch_submit = false;  // MemoryManagerOptions::batch_submit = false
  bool no_baselines = false;
  std::string baselines_text = "warm,cold";  // baselines: warm, cold, direct
  // both
  std::string chunk_text = "8M";
  std::string budget_text = "256M";
  std::string host_cache_text = "0";
  std::string backend = "auto";
  uint32_t queue_depth = 32;
  uint32_t write_queue_depth = 32;
  uint32_t read_ahead = 0;
  uint64_t hidden = 1024;
  uint32_t durable_every = 1;
  uint32_t commit_lag = 1;  // StreamedAdamOptions::commit_lag_steps
  // comparison mode: the update rule of our store: adamw, lion, sgd (SGD
  // with Nesterov momentum) or muon (Muon for the weight matrices, AdamW for
  // the rest); its bytes per param set the state's params.
  std::string optimizer = "adamw";
  // --optimizer muon: Newton-Schulz iterations per matrix (the Muon group's
  // ns_steps; default 5). 0 leaves the step's matrices I/O-bound on a CPU.
  int ns_steps = 5;
  bool ns_steps_given = false;  // --ns-steps was on the command line (only muon takes it)
  std::string moments = "f32";  // synthetic mode: StreamedAdamOptions::moment_dtype
  bool moments_given = false;   // --moments was on the command line (comparison mode refuses it)
  bool compare_bf16 = false;    // comparison mode: also a store with bf16 moments, interleaved
  bool compare_q8 = false;      // comparison mode: also a store with q8 moments, interleaved
  std::string miles_moments = "f32";  // miles' streaming's moment_dtype: f32 or bf16
  int cpu_threads = 1;
  uint32_t hash_threads = memmgr::MemoryManagerOptions::kAutoHashThreads;
  std::string sync_every_text = "512M";
  bool huge_pages = false;
  bool base_pages = false;
  std::string max_sqe_text = "0";
  double prefetch_compute_s = 0;  // --prefetch: simulated forward/backward seconds (0 = off)
  bool json = false;
};

// The options both modes parse the same way.
struct Common {
  uint64_t chunk = 0, budget = 0, host_cache = 0, sync_every = 0, max_sqe = 0;
  memmgr::Backend backend = memmgr::Backend::kAuto;
};

Result<Common> ParseCommon(const StepOptions& o);
// The MomentDType of --moments or --miles-moments; kInvalidArgument
// naming the flag and the names it takes otherwise (never a default instead).
Result<MomentDType> MomentsNamed(const char* flag, const std::string& name);
// The MemoryManagerOptions of every store the command steps (ours and the
// comparison's moment stores alike).
memmgr::MemoryManagerOptions ManagerOptions(const Common& c, const StepOptions& o);

// The two modes; each returns the process's exit code.
int RunSynthetic(const StepOptions& o);  // synthetic.cc
int RunCompare(const StepOptions& o);    // compare.cc

}  // namespace optstate::tools::bench::step
