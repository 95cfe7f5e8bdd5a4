// optstate-bench step's comparison mode, the state its phases share.
// RunCompare (compare.cc) sets up ours and runs the interleaved rounds; each
// round times the I/O floor (floors.cc), ours, miles' NVMe streaming
// (miles_streaming.cc), the stores with narrower moments (moment_stores.cc), the
// synchronous O_DIRECT engine (sync_direct_engine.h) and the training-loop
// simulation (loop.cc); report.cc prints the table or the JSON.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tools/bench_miles_streaming.h"
#include "tools/bench_step/step.h"
#include "tools/internal/process.h"
#include "tools/internal/store_read.h"
#include "vfs/store.h"

namespace optstate::tools::bench::step {

// The comparison's setup, read by every phase. RunCompare owns what the
// references and pointers name, for the whole run.
struct Comparison {
  const StepOptions& o;
  const Common& c;
  const std::string& dir;        // scratch directory (--dir or a new one in /tmp)
  const std::string& disk_path;  // dir + "/store": the disk whose counters each phase reads
  const std::vector<std::pair<std::string, uint64_t>>& params;  // ParamMix: {name, numel}
  uint64_t numel_total = 0, max_numel = 0;
  uint64_t state_bytes = 0;  // 12 B per parameter
  const vfs::StoreOptions& so;
  memmgr::MemoryManager* mm = nullptr;  // ours
  memmgr::StreamedAdam* opt = nullptr;  // ours
  bool cuda = false;                    // mm's backend is kCuda
  const memmgr::StreamedAdamOptions& ao;
  const memmgr::ParamGroup& g;
  // Same initial weights and gradients for every method.
  const std::vector<float>& w0;
  const std::vector<void*>& grad_ptrs;
  const std::vector<const void*>& grad_cptrs;  // the same, for MilesStreamingBaseline
  // The model's bf16 parameters, which every method updates.
  const std::vector<void*>& model_param_ptrs;
  const std::vector<memmgr::ParamGrad>& pg;  // ours' Step() argument
};

// --bf16-moments / --q8-moments: the same params, gradients and budget on
// a store whose moments are bf16 or q8 (its own store and manager), stepped
// in each round next to ours: what narrower moments save, measured side by
// side.
struct MomentStore {
  std::string dtype;  // "bf16" or "q8"
  MomentDType moment_dtype = MomentDType::kF32;
  std::unique_ptr<vfs::Store> store;
  std::unique_ptr<memmgr::MemoryManager> mm;
  std::unique_ptr<memmgr::StreamedAdam> opt;
  std::vector<double> t;       // until its commit is durable
  std::vector<bool> before_ours;  // per round: stepped before ours
  std::vector<memmgr::StreamedAdam::StepStats> stats;
  DiskPhase disk;
  std::vector<uint64_t> written;  // chunk bytes written per step (the manager's count)
};

// What the rounds measured: per round, seconds of each method's step.
struct CompareResults {
  std::vector<double> t_floor, t_ours, t_direct, t_warm, t_cold;
  std::vector<double> t_ours_returned;  // until Step returned (its commit may still run)
  // The share of miles' streaming's files in the page cache before each
  // warm step and after each eviction; the eviction's fdatasync time.
  std::vector<double> warm_resident, cold_resident, cold_writeback;
  std::vector<std::pair<double, double>> ours_unix;  // each step's start and end, Unix seconds (JSON)
  std::vector<memmgr::StreamedAdam::StepStats> stats;
  // How the disk under --dir was used during the floor and our steps.
  DiskPhase disk_floor, disk_ours;
  // Per timed step: chunk bytes read from the store / served by the host cache tier.
  std::vector<std::pair<uint64_t, uint64_t>> step_io;
  // Per timed step: chunk bytes written to the store (the manager's count).
  std::vector<uint64_t> step_written;
  // The state's bytes per param of each rule stepped (its fields: f32 main
  // and moments), in rule order, by rule name.
  std::vector<std::pair<std::string, double>> rule_bytes_per_param;
  // What a step writes of ours' store (every chunk of every field): logical
  // bytes and the disk space of those versions as the store allocates them.
  FullWrite write_ours;
  // --prefetch: exposed step seconds in the loop simulation, without and with
  // Prefetch(), and the bytes each step found prefetched.
  std::vector<double> t_loop_plain, t_loop_prefetch;
  std::vector<uint64_t> loop_prefetch_hits;
  std::vector<std::vector<std::string>> step_order;  // per round, JSON
  // After the rounds: the steps held only in the host cache (--durable-every
  // > 1) and the seconds MakeDurable took for them (NAN when none).
  uint64_t cached_steps = 0;
  double t_durable = NAN;
  // H2D / D2H bytes per second from pinned host memory (NAN when unmeasured).
  double h2d = NAN, d2h = NAN;
};

// floors.cc: one round of the I/O floor (fio reading and writing state_bytes
// at once), into res->t_floor and res->disk_floor.
Status RunFioFloor(const Comparison& cmp, CompareResults* res);
// H2D / D2H bandwidth through the manager's copies from pinned host memory
// (the same kind the host cache tier and the staging buffers use).
Status MeasureCopies(memmgr::MemoryManager* mm, double* h2d, double* d2h);

// moment_stores.cc: the stores --bf16-moments and --q8-moments ask for (bf16
// first), each after its warm-up step.
Status SetUpMomentStores(const Comparison& cmp, std::vector<MomentStore>* extras);
// One timed step of x, until its commit is durable, in round r.
Status StepMomentStore(const Comparison& cmp, MomentStore& x, uint32_t r, bool before_ours);

// miles_streaming.cc: miles' NVMe streaming on its own files, after its
// untimed first step; its timed step with its state in the page cache (warm)
// and evicted first (cold).
Result<std::unique_ptr<MilesStreamingBaseline>> SetUpMilesStreaming(const Comparison& cmp);
Status StepMilesStreamingWarm(const Comparison& cmp, MilesStreamingBaseline& miles, CompareResults* res);
Status StepMilesStreamingCold(const Comparison& cmp, MilesStreamingBaseline& miles, CompareResults* res);

// loop.cc: one round of the training-loop simulation (--prefetch).
Status SimulateLoopRound(const Comparison& cmp, CompareResults* res);

// report.cc: the comparison's table (or JSON with --json); returns the exit code.
int ReportComparison(const Comparison& cmp, const std::vector<MomentStore>& extras, const MilesStreamingBaseline* miles,
                     const CompareResults& res);

}  // namespace optstate::tools::bench::step
