// StreamedAdam: one step: the gradient checks, BeginStep / StepParam / EndStep
// over the step pipeline, and the abort of a failed step.
#include "memmgr/internal/streamed_engine.h"

#include <algorithm>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "memmgr/internal/committer.h"
#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_pipeline.h"
#include "memmgr/internal/prefetcher.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::memmgr::internal {


Status StreamedEngine::CheckGrad(const ParamGrad& g) const {
  const Param* p = params_.Find(g.name);
  if (p == nullptr) {
    if (params_.retired(g.name)) {
      return InvalidArgument("StreamedAdam: gradient for param '" + g.name + "' of store " + store_->path() +
                             ", which was retired in this run");
    }
    std::string some;
    int n = 0;
    for (const auto& [name, q] : params_.all()) {
      if (n++ == 5) break;
      some += (some.empty() ? "" : ", ") + name;
    }
    return NotFound("StreamedAdam::StepParam: unknown param '" + g.name + "' (store " + store_->path() + " has " +
                    std::to_string(params_.size()) + " params: " + some + (params_.size() > 5 ? ", ..." : "") + ")");
  }
  if (!IsFloat(g.grad_type)) {
    return InvalidArgument("StreamedAdam::StepParam " + g.name + ": gradient dtype " + DTypeName(g.grad_type) +
                           " not supported (f32, bf16, f16)");
  }
  if (g.d_param != nullptr && (!g.param_type || !IsFloat(*g.param_type))) {
    return InvalidArgument("StreamedAdam::StepParam " + g.name + ": param dtype " + DTypeText(g.param_type) +
                           " not supported (f32, bf16, f16)");
  }
  if (g.d_grad == nullptr) return InvalidArgument("StreamedAdam::StepParam " + g.name + ": null gradient");
  if (g.numel != 0 && g.numel != p->info.numel) {
    return InvalidArgument("StreamedAdam::StepParam '" + g.name + "': the gradient has " + std::to_string(g.numel) +
                           " elements; store " + store_->path() + " has the param with numel " +
                           std::to_string(p->info.numel));
  }
  return Status::Ok();
}

Status StreamedEngine::Fail(Status s) {
  if (pipeline_) {
    pipeline_->Abort();
    pipeline_.reset();
  }
  (void)committer_->FinishSync();  // the step's error is s
  Status a = store_->AbortPending();
  if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed step: {}", a.ToString());
  mem_->OnAbortPending();
  step_.phase = StepPhase::kIdle;
  step_.tensors.clear();
  const std::string lost = counts_.Revert();
  if (!lost.empty()) s = s.WithContext(lost);
  s = WithNote(s, DropUncommittedRegistrations());
  // A CUDA error is sticky for the process: refuse to continue.
  if (mm_->backend() == Backend::kCuda && s.message().find("CUDA") != std::string::npos) {
    poison_ = s.WithContext("StreamedAdam is unusable after a CUDA error");
  }
  // The caller gets s (the C ABI as its error, the tools print it): an error
  // line here would say it twice.
  OPTSTATE_LOG_DEBUG("StreamedAdam: step aborted, nothing committed: {}", s.ToString());
  return s;
}

// The step path, top-down: Step checks every gradient, then BeginStep
// (the step's mode and pipeline), StepParam per param (its plan of units,
// pumped through the pipeline to the rule's kernel), EndStep (drain, then
// commit, defer or drop).
Status StreamedEngine::Step(std::span<const ParamGrad> grads, const float* d_found_inf, const float* d_grad_scale) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (step_.in_step()) return FailedPrecondition("StreamedAdam::Step: a step begun with BeginStep has not ended");
  // Every gradient is checked before the step starts: a mismatch leaves the
  // optimizer, the store and the pending registrations as they were.
  std::set<std::string_view> seen;
  for (const ParamGrad& g : grads) {
    OPTSTATE_RETURN_IF_ERROR(CheckGrad(g));
    if (!seen.insert(g.name).second) {
      return InvalidArgument("StreamedAdam::Step: param '" + g.name + "' of store " + store_->path() +
                             " given twice in one step");
    }
  }
  OPTSTATE_RETURN_IF_ERROR(BeginStep(d_found_inf, d_grad_scale));
  for (const ParamGrad& g : grads) OPTSTATE_RETURN_IF_ERROR(StepParam(g));
  auto r = EndStep();
  return r.status();
}

Status StreamedEngine::BeginStep(const float* d_found_inf, const float* d_grad_scale) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (step_.in_step()) return FailedPrecondition("StreamedAdam::BeginStep: the previous step has not ended");
  const double t_begin = NowS();
  double wait_s = 0;
  {
    Status fs = FinishCommit(&wait_s, /*keep_staged=*/true);  // completes the previous step's stats
    if (!fs.ok()) prefetcher_->DropStaged();  // the step they were read for is gone
    OPTSTATE_RETURN_IF_ERROR(fs);
  }
  // Staged prefetched chunks go to this step's pipeline below; any early
  // return gives them back.
  struct DropUnadopted {
    Prefetcher* p;
    ~DropUnadopted() { p->DropStaged(); }
  } drop_unadopted{prefetcher_.get()};
  OPTSTATE_RETURN_IF_ERROR(CheckModelComplete());
  step_.found_inf = d_found_inf;
  step_.groups.clear();
  step_.tensors.clear();
  last_stats_ = StepStats{};
  last_stats_.seconds = t_begin;
  last_stats_.commit_wait_seconds = wait_s;
  last_stats_.prefetch_read_bytes = prefetcher_->TakeReadBytes();
  if (d_found_inf != nullptr) {
    float flag = 0;
    OPTSTATE_RETURN_IF_ERROR(mm_->CopyToHost(&flag, d_found_inf, sizeof(float)));
    if (flag != 0.0f) {
      step_.phase = StepPhase::kSkipping;
      return Status::Ok();
    }
  }
  step_.grad_scale = grad_scale_;
  if (d_grad_scale != nullptr) {
    float scale = 0;
    OPTSTATE_RETURN_IF_ERROR(mm_->CopyToHost(&scale, d_grad_scale, sizeof(float)));
    OPTSTATE_RETURN_IF_ERROR(CheckGradScale(scale, "StreamedAdam: the step's d_grad_scale", store_->path()));
    step_.grad_scale = scale;
  }
  // Registrations and LoadMainFrom since the last commit are in the pending
  // generation: this step's commit publishes them with its own writes.
  OPTSTATE_RETURN_IF_ERROR(FitStaging());
  OPTSTATE_RETURN_IF_ERROR(EnsureIo());
  const bool cached = CacheHoldsState();
  if (!cached && opts_.durable_every_steps > 1 && warned_cache_small_.First()) {
    OPTSTATE_LOG_WARN("StreamedAdam: durable_every_steps {} needs the host cache tier ({} bytes) to hold the whole "
                      "state of store {}; every step commits",
                      opts_.durable_every_steps, mem_->cache()->capacity_bytes(), store_->path());
  }
  if (!cached && mem_->cache()->enabled() && warned_cache_partial_.First()) {
    OPTSTATE_LOG_INFO("StreamedAdam: the host cache tier ({} bytes) holds part of the {} bytes of state of store {}; "
                      "steps read the chunks it admits from RAM and the rest from disk",
                      mem_->cache()->capacity_bytes(), StateCacheBytes(), store_->path());
  }
  const StepMode mode =
      StepState::ModeOf(cached, counts_.uncommitted_steps() + 1 >= opts_.durable_every_steps);
  committer_->BeginStep();
  internal::Committer* committer = committer_.get();
  pipeline_ = std::make_unique<internal::SlicePipeline>(
      mem_, io_.get(), opts_.cpu_threads, [committer](uint64_t bytes) { committer->OnWritten(bytes); }, d_found_inf,
      MaxSliceSize(), StepReapPolicy());
  pipeline_->SetMode(mode);
  pipeline_->SetStateSlices(state_slices_);
  pipeline_->Adopt(prefetcher_->TakeStaged());
  step_.order.clear();
  step_.mode = mode;
  Status s = pipeline_->Begin();
  if (!s.ok()) {
    pipeline_->Release();
    pipeline_.reset();
    return s;
  }
  step_.phase = StepPhase::kStepping;
  return Status::Ok();
}

Status StreamedEngine::StepParam(const ParamGrad& g) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (!step_.in_step()) return FailedPrecondition("StreamedAdam::StepParam " + g.name + ": no BeginStep");
  if (Status cs = CheckGrad(g); !cs.ok()) return Fail(cs);
  const Param& p = *params_.Find(g.name);
  if (step_.phase == StepPhase::kSkipping) return Status::Ok();
  if (step_.tensors.count(p.info.id)) {
    return Fail(InvalidArgument("StreamedAdam::StepParam " + g.name + ": given twice in one step"));
  }
  Status ds = mem_->DropTensor(p.info.id);
  if (!ds.ok()) return Fail(ds.WithContext("StreamedAdam::StepParam " + g.name));
  step_.tensors.insert(p.info.id);
  step_.order.push_back(StepOrderEntry{p.info.id, p.rule, p.fields, p.info.numel});
  // The rule's arguments for this param: its group's hyperparameters and
  // its own count after this step, as torch's.
  RuleArgs args;
  const UpdateRule& rule = *rules_[p.rule];
  Status as = rule.MakeArgs(groups_.at(p.info.group).per_rule[p.rule], counts_.tensor(p.info.id).value() + 1,
                            step_.grad_scale, &args);
  if (!as.ok()) return Fail(as.WithContext("StreamedAdam::StepParam " + g.name));
  step_.groups.insert(p.info.group);
  ParamPlan::Inputs in;
  in.tensor = &p.info;
  in.fields = p.fields.data();
  in.rule = &rule;
  in.layout = &LayoutOf(p);
  in.grad = g.d_grad;
  in.grad_type = g.grad_type;
  in.param = g.d_param;
  if (g.d_param != nullptr) in.param_type = *g.param_type;
  in.args = args;
  pipeline_->Enqueue(ParamPlan::Make(in));
  Status ps = pipeline_->Pump(false);
  if (!ps.ok()) return Fail(ps);
  return Status::Ok();
}

Result<uint64_t> StreamedEngine::EndStep() {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (!step_.in_step()) return FailedPrecondition("StreamedAdam::EndStep: no BeginStep");
  if (step_.phase == StepPhase::kSkipping) {
    step_.phase = StepPhase::kIdle;
    step_.last = StepOutcome::kSkipped;
    last_stats_.seconds = NowS() - last_stats_.seconds;
    OPTSTATE_LOG_INFO("StreamedAdam: found-inf set; step skipped, nothing committed (generation {})",
                      counts_.last_generation());
    return counts_.last_generation();
  }
  // Pipelined commit: once every slice is computed (params updated), the
  // write tail and the commit go to the background, unless found-inf was
  // raised meanwhile (then the step is drained and dropped below).
  const bool pipelined = opts_.commit_lag_steps > 0 && step_.write_through();
  Status ds = pipeline_->Pump(true, /*until_computed=*/pipelined);
  if (!ds.ok()) return Fail(ds);
  if (pipelined) {
    Result<bool> raised = FoundInfRaised();
    if (!raised.ok()) return Fail(raised.status());
    if (!*raised) return EndPipelined();
    ds = pipeline_->Pump(true);
    if (!ds.ok()) return Fail(ds);
  }
  ds = committer_->FinishSync();
  if (!ds.ok()) return Fail(ds);
  internal::SlicePipeline& pl = *pipeline_;
  NoteReadSideStats(pl);
  last_stats_.slices = pl.slices;
  last_stats_.write_bytes = pl.write_bytes;
  last_stats_.peak_write_bytes_in_flight = pl.peak_write_bytes;
  last_stats_.device_slots = pl.device_slots();
  last_stats_.io_wait_seconds = pl.stall_s_;
  mem_->AddStats(pl.read_bytes, pl.write_bytes, pl.cache_hits, pl.h2d, pl.d2h, pl.stall_s_);
  pipeline_->Release();
  pipeline_.reset();
  // Incremental form: the flag may have been set after BeginStep. The kernel
  // skipped every slice after it was set; drop the step as a whole.
  Result<bool> raised = FoundInfRaised();
  if (!raised.ok()) return Fail(raised.status());
  if (*raised) return DropRaisedStep();
  if (!step_.write_through()) {
    // Deferred durability: the step lives in the host cache only.
    AdvanceCounts(/*cached=*/true);
    return EndKept(counts_.last_generation());
  }
  internal::Committer::Work w;
  w.info = MakeCommitInfo(true);
  w.write_dirty_cache = step_.cache_mode();
  internal::Committer::Outcome c = committer_->Run(std::move(w));
  last_stats_.commit_seconds = c.commit_seconds;
  if (!c.status.ok()) {
    return Fail(c.status.WithContext("StreamedAdam: commit of step " + std::to_string(counts_.global_step() + 1)));
  }
  AdvanceCounts(/*cached=*/false);
  NoteCommitted(c.committed);
  return EndKept(c.committed);
}

ReapPolicy StreamedEngine::StepReapPolicy() {
  // Tests fix the order of a step's I/O here; their callbacks set the bool
  // (tests/common/sync_point_flag.h).
  bool hold_until_drain = false;
  bool only_when_blocked = false;
  OPTSTATE_TEST_SYNC_POINT_CALLBACK("streamed_adam.hold_completions", &hold_until_drain);
  OPTSTATE_TEST_SYNC_POINT_CALLBACK("streamed_adam.reap_only_when_blocked", &only_when_blocked);
  if (hold_until_drain) return ReapPolicy::kHoldUntilDrain;
  if (only_when_blocked) return ReapPolicy::kOnlyWhenBlocked;
  return ReapPolicy::kEager;
}

Result<bool> StreamedEngine::FoundInfRaised() const {
  if (step_.found_inf == nullptr) return false;
  float flag = 0;
  OPTSTATE_RETURN_IF_ERROR(mm_->CopyToHost(&flag, step_.found_inf, sizeof(float)));
  return flag != 0.0f;
}

uint64_t StreamedEngine::EndKept(uint64_t gen) {
  step_.last = StepOutcome::kApplied;
  step_.phase = StepPhase::kIdle;
  last_stats_.seconds = NowS() - last_stats_.seconds;
  return gen;
}

Result<uint64_t> StreamedEngine::EndPipelined() {
  last_stats_.device_slots = pipeline_->device_slots();
  Status rs = pipeline_->ReleaseDevice();
  if (!rs.ok()) return Fail(rs.WithContext("StreamedAdam: end of the step's device work"));
  NoteReadSideStats(*pipeline_);
  const uint64_t gen = store_->LatestGeneration().generation + 1;
  StartBackgroundCommit();
  AdvanceCounts(/*cached=*/false);
  return EndKept(gen);
}

Result<uint64_t> StreamedEngine::DropRaisedStep() {
  Status a = store_->AbortPending();
  mem_->OnAbortPending();
  step_.phase = StepPhase::kIdle;
  step_.last = StepOutcome::kSkipped;
  if (step_.cache_mode()) {
    // Slices before the flag were updated in place in the cache.
    const std::string lost = counts_.Revert();
    OPTSTATE_LOG_WARN("StreamedAdam: found-inf raised during a cached step; step dropped{}{}",
                      lost.empty() ? "" : "; ", lost);
  }
  if (!a.ok()) return a;
  // The dropped pending generation also held what this step was to commit
  // with it: say so rather than return OK without it.
  const std::string dropped = DropUncommittedRegistrations();
  if (!dropped.empty()) {
    return FailedPrecondition("StreamedAdam: found-inf was raised after BeginStep; the step was dropped and "
                              "nothing committed (store " + store_->path() + ", generation " +
                              std::to_string(counts_.last_generation()) + "); " + dropped);
  }
  return counts_.last_generation();
}

// The step's stats known once its kernels are done (a pipelined step's
// writes and commit are accounted when its commit is joined).
void StreamedEngine::NoteReadSideStats(const internal::SlicePipeline& pl) {
  last_stats_.read_bytes = pl.read_bytes;
  last_stats_.slices_in_flight = pl.depth();
  last_stats_.small_sets = pl.small_depth();
  last_stats_.small_slices = pl.small_slices;
  last_stats_.peak_read_bytes_in_flight = pl.peak_read_bytes;
  last_stats_.peak_unit_windows = static_cast<uint32_t>(pl.peak_unit_windows);
  last_stats_.compute_seconds = pl.compute_s_;
  last_stats_.submit_seconds = pl.submit_s_;
  last_stats_.prefetch_hit_bytes = pl.prefetch_hits;
}

}  // namespace optstate::memmgr::internal
