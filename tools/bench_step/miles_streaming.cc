// optstate-bench step's baseline: miles' NVMe streaming as it runs
// (MilesStreamingBaseline, tools/bench_miles_streaming.h: buffered I/O, no fsync)
// with its state in the page cache (warm) and evicted before each step (cold).
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "tools/bench_step/compare.h"
#include "tools/internal/bench.h"
#include "tools/internal/cli.h"

namespace optstate::tools::bench::step {

Result<std::unique_ptr<MilesStreamingBaseline>> SetUpMilesStreaming(const Comparison& cmp) {
  const StepOptions& o = cmp.o;
  MilesStreamingOptions mo;
  mo.adam.lr = cmp.g.lr;
  mo.adam.beta1 = cmp.g.beta1;
  mo.adam.beta2 = cmp.g.beta2;
  mo.adam.eps = cmp.g.eps;
  mo.adam.weight_decay = cmp.g.weight_decay;
  mo.adam.mode = cmp.g.adamw ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
  mo.cuda = cmp.cuda;
  mo.cpu_threads = o.cpu_threads;
  OPTSTATE_ASSIGN_OR_RETURN(mo.moment_type, MomentsNamed("--miles-moments", o.miles_moments));
  auto f = MilesStreamingBaseline::Create(cmp.dir + "/miles_streaming", cmp.params, cmp.mm, cmp.w0.data(), mo);
  if (!f.ok()) return f.status().WithContext("miles' streaming setup");
  std::unique_ptr<MilesStreamingBaseline> miles = std::move(*f);
  // Untimed first step (it reads only the mains; it writes every segment,
  // so the page cache then holds the whole state).
  std::vector<const void*> g_ptrs(cmp.grad_ptrs.begin(), cmp.grad_ptrs.end());
  if (Status s = miles->Step(g_ptrs, cmp.model_param_ptrs); !s.ok()) {
    return s.WithContext("miles' streaming, warm-up step");
  }
  return miles;
}

Status StepMilesStreamingWarm(const Comparison& cmp, MilesStreamingBaseline& miles, CompareResults* results) {
  auto res = miles.ResidentBytes();
  if (!res.ok()) return res.status();
  results->warm_resident.push_back(static_cast<double>(*res) / static_cast<double>(miles.file_bytes()));
  if (results->warm_resident.back() < 0.9) {
    Note(fmt::format("miles' streaming, warm: only {:.0f}% of its {} of files is in the page cache (RAM too small "
                     "for the state?)",
                     100 * results->warm_resident.back(), FormatBytes(miles.file_bytes())));
  }
  const double t0 = NowSeconds();
  if (Status s = miles.Step(cmp.grad_cptrs, cmp.model_param_ptrs); !s.ok()) {
    return s.WithContext("miles' streaming, warm");
  }
  results->t_warm.push_back(NowSeconds() - t0);
  return Status::Ok();
}

Status StepMilesStreamingCold(const Comparison& cmp, MilesStreamingBaseline& miles, CompareResults* results) {
  double sync_s = 0;
  if (Status s = miles.DropPageCache(&sync_s); !s.ok()) return s.WithContext("miles' streaming, cold");
  results->cold_writeback.push_back(sync_s);
  auto res = miles.ResidentBytes();
  if (!res.ok()) return res.status();
  results->cold_resident.push_back(static_cast<double>(*res) / static_cast<double>(miles.file_bytes()));
  if (results->cold_resident.back() > 0.01) {
    Note(fmt::format("miles' streaming, cold: {:.1f}% of its files stayed in the page cache after "
                     "fdatasync + POSIX_FADV_DONTNEED (a tmpfs --dir?); the cold step is partly warm",
                     100 * results->cold_resident.back()));
  }
  const double t0 = NowSeconds();
  if (Status s = miles.Step(cmp.grad_cptrs, cmp.model_param_ptrs); !s.ok()) {
    return s.WithContext("miles' streaming, cold");
  }
  results->t_cold.push_back(NowSeconds() - t0);
  return Status::Ok();
}

}  // namespace optstate::tools::bench::step
