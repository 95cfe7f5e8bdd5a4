// optstate-bench step --prefetch T (seconds): a training-loop simulation of
// ours. "forward/backward" is T seconds of sleep on the host (the bench's
// stand-in for GPU work; the optimizer's threads have the CPU), then Step();
// the exposed step time is from the end of T to Step's return, with the
// previous step's commit (and its write tail) in flight during T.
#include <chrono>
#include <thread>
#include <vector>

#include "tools/bench_step/compare.h"
#include "tools/internal/cli.h"

namespace optstate::tools::bench::step {
namespace {

// One loop iteration: Prefetch() at the start of T when asked, T, Step();
// the exposed seconds into *exposed unless null.
Status LoopStep(const Comparison& cmp, bool prefetch, std::vector<double>* exposed, CompareResults* res) {
  if (prefetch) OPTSTATE_RETURN_IF_ERROR(cmp.opt->Prefetch());
  std::this_thread::sleep_for(std::chrono::duration<double>(cmp.o.prefetch_compute_s));
  const double t0 = NowSeconds();
  OPTSTATE_RETURN_IF_ERROR(cmp.opt->Step(cmp.pg));
  if (exposed != nullptr) exposed->push_back(NowSeconds() - t0);
  if (prefetch) res->loop_prefetch_hits.push_back(cmp.opt->last_step_stats().prefetch_hit_bytes);
  return Status::Ok();
}

}  // namespace

// Times one step without Prefetch() and one with it, after an untimed one
// that puts a commit in flight.
Status SimulateLoopRound(const Comparison& cmp, CompareResults* res) {
  Status s = LoopStep(cmp, false, nullptr, res);
  if (s.ok()) s = LoopStep(cmp, false, &res->t_loop_plain, res);
  if (s.ok()) s = LoopStep(cmp, true, &res->t_loop_prefetch, res);
  if (s.ok()) s = cmp.opt->WaitForCommit();  // keeps our writes out of the next round's methods
  return s;
}

}  // namespace optstate::tools::bench::step
