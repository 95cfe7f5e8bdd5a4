// StreamedEngine: the engine behind StreamedAdam (memmgr/streamed_adam.h,
// which documents every public method; docs/STREAMED_ADAM.md its
// behaviour). Internal to memmgr. Its parts, each with its own header:
//   the update rules and their SliceLayouts (update_rule.h, slice_layout.h);
//   ParamRegistry (param_registry.h): the run's params and registrations;
//   StepCounts (step_counts.h): the step counts, now and as committed;
//   StepState (step_state.h): one step's phase, mode and what it stepped;
//   ParamPlan (step_plan.h): the units of a param stepped;
//   SlicePipeline (slice_pipeline.h): reads, kernels and writes over them;
//   Committer (committer.h): the end of a generation;
//   Prefetcher (prefetcher.h): the next step's reads, between steps;
//   EngineMemory (engine_memory.h): its only way to the memory manager.
// The step path reads top-down: Step -> BeginStep / StepParam / EndStep
// (streamed_adam_step.cc) -> ParamPlan::Make, SlicePipeline::Pump ->
// UpdateRule::RunCpu / RunCuda.
// Thread-safety: as StreamedAdam (one trainer thread); the commit and the
// prefetch run on threads of their own, which own what they touch until
// joined (FinishCommit, Prefetcher::Stop).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "memmgr/internal/param_registry.h"
#include "memmgr/internal/step_counts.h"
#include "memmgr/internal/slice_pipeline.h"
#include "memmgr/internal/step_state.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "memmgr/update_rule.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

class Committer;
class EngineMemory;
class Prefetcher;
class SliceLayout;
class SlicePipeline;
struct SliceSize;

class StreamedEngine {
 public:
  using ParamSpec = StreamedAdamParamSpec;
  using StepStats = StreamedAdamStepStats;
  static constexpr size_t kMaxRules = StreamedAdam::kMaxRules;

  // As StreamedAdam::Create (rules: a null single rule is AdamW).
  static Result<std::unique_ptr<StreamedEngine>> Create(vfs::Store* store, MemoryManager* mm,
                                                        const StreamedAdamOptions& opts,
                                                        std::vector<std::unique_ptr<UpdateRule>> rules);
  ~StreamedEngine();

  Status SetGroup(const ParamGroup& g);
  Result<ParamGroup> GetGroup(uint32_t id) const;
  Status SetGroupHyperparams(uint32_t id, const Hyperparams& h);
  Result<Hyperparams> GetGroupHyperparams(uint32_t id) const;
  Status RegisterParam(const std::string& name, uint64_t numel, uint32_t group, const void* d_initial,
                       std::optional<DType> initial_type, const ShardInfo& shard, uint32_t rule);
  Status RegisterParams(std::span<const ParamSpec> specs, std::vector<bool>* existed);
  bool HasParam(const std::string& name) const;
  std::vector<std::string> ParamNames() const;
  std::vector<std::string> UnregisteredParams() const;
  Status RetireParam(const std::string& name);
  Status Step(std::span<const ParamGrad> grads, const float* d_found_inf, const float* d_grad_scale);
  Status BeginStep(const float* d_found_inf, const float* d_grad_scale);
  Status StepParam(const ParamGrad& g);
  Result<uint64_t> EndStep();
  Status SetGradScale(float grad_scale);
  float grad_scale() const { return grad_scale_; }
  Status LoadMainFrom(const std::string& name, const void* d_weights, DType type);
  Result<uint64_t> MakeDurable();
  uint64_t uncommitted_steps() const { return counts_.uncommitted_steps(); }
  Status WaitForCommit();
  bool commit_in_flight() const;
  Status Prefetch();
  bool prefetch_running() const;
  uint64_t step_count(uint32_t group) const;
  Result<uint64_t> param_step_count(const std::string& name) const;
  uint64_t last_generation() const;
  bool last_step_skipped() const { return step_.last == StepOutcome::kSkipped; }
  uint64_t global_step() const { return counts_.global_step(); }
  void set_global_step(uint64_t s) { counts_.set_global_step(s); }
  const StepStats& last_step_stats() const { return last_stats_; }

 private:
  using Param = EngineParam;
  StreamedEngine(vfs::Store* store, MemoryManager* mm, const StreamedAdamOptions& opts);
  Status CheckUsable() const;
  // The first mismatch between g and the registered params, before a step.
  Status CheckGrad(const ParamGrad& g) const;
  // A restored param this run neither registered nor retired (when the run
  // registered any): kFailedPrecondition naming them.
  Status CheckModelComplete() const;
  // Compares a registration with the stored tensor t.
  Status CheckSameGeometry(const vfs::TensorInfo& t, const std::string& what, uint64_t numel, uint32_t group,
                           std::optional<DType> initial_type, const ShardInfo& shard, uint32_t rule) const;
  // After the pending generation was dropped: unregisters the params whose
  // registration was not committed and forgets uncommitted LoadMainFrom;
  // returns a sentence for messages ("" when there were none).
  std::string DropUncommittedRegistrations();
  // Outside a step: drops the pending generation (and with it what
  // DropUncommittedRegistrations forgets); s with what was dropped.
  Status AbortUncommitted(Status s);
  Status WriteMain(const Param& p, const void* d_src, DType type);
  // Writes the fp32 mains of several params from their weights, many chunks
  // in flight (small chunks from kSmallSliceBytes pieces of staging buffers).
  struct MainSource {
    const Param* p = nullptr;
    const void* src = nullptr;
    DType type = DType::kF32;
  };
  Status WriteMains(const std::vector<MainSource>& srcs);
  // Checks one registration against the run and the store, changing
  // nothing. *existing: a param of this run (its stored state is kept);
  // *entry: an uncommitted index entry of that name to take over.
  Status CheckRegistration(const ParamSpec& r, bool* existing, std::optional<vfs::TensorInfo>* entry) const;
  Status Fail(Status s);
  // The step's path below EndStep: whether found-inf is set now; the end of
  // a kept step (its generation, or the last one for a cached step); the
  // end of a pipelined step (its commit goes to the background); the drop
  // of a step whose found-inf was raised after BeginStep.
  Result<bool> FoundInfRaised() const;
  uint64_t EndKept(uint64_t gen);
  Result<uint64_t> EndPipelined();
  Result<uint64_t> DropRaisedStep();
  // The pipeline's reap policy: the product's, unless a test asks for
  // another at the sync points "streamed_adam.hold_completions" or
  // "streamed_adam.reap_only_when_blocked" (base/sync_point.h).
  static ReapPolicy StepReapPolicy();
  vfs::CommitInfo MakeCommitInfo(bool advance) const;
  // True when the host cache tier can hold every registered param's state.
  bool CacheHoldsState() const;
  // Bytes the host cache tier needs to hold every registered param's state.
  uint64_t StateCacheBytes() const;
  // Writes the cache's dirty entries not yet in the pending generation.
  Status WriteDirtyCache();
  // After a commit: the cache is clean, the counts and registrations
  // committed.
  void NoteCommitted(uint64_t gen);

  vfs::Store* store_;
  MemoryManager* mm_;
  EngineMemory* mem_;  // mm_'s services for the engine
  StreamedAdamOptions opts_;
  // The update rules (rules_[0] the default: AdamW with opts_.moment_dtype
  // moments unless given) and each one's chunk geometry in this store.
  std::vector<std::unique_ptr<UpdateRule>> rules_;
  std::vector<std::unique_ptr<SliceLayout>> layouts_;
  const SliceLayout& LayoutOf(const Param& p) const { return *layouts_[p.rule]; }
  // The widest slice of any rule (staging plans).
  SliceSize MaxSliceSize() const;
  // "AdamW" or "AdamW, Lion" (messages).
  std::string RuleNames() const;
  // The rule whose fields the stored tensor has exactly, else the first whose
  // fields of one value per element it has (CheckStored then names the
  // difference); none: not a param of this optimizer.
  std::optional<uint32_t> RuleOfStored(const vfs::TensorInfo& t) const;
  // kResourceExhausted when a whole-tensor rule's tensor of numel elements
  // (shape) cannot fit the device window.
  Status CheckUnitFits(const std::string& name, uint32_t rule, uint64_t numel,
                       const std::vector<uint64_t>& shape) const;
  // Resolves the tensor's field index of each of its rule's fields.
  Status ResolveFields(Param* p) const;
  // A group's hyperparameters as the rule and the store see them, and back.
  static Hyperparams GroupHyper(const ParamGroup& g);
  static ParamGroup GroupOf(uint32_t id, const Hyperparams& h);
  // A group: the values set (SetGroupHyperparams, or read from the store)
  // and what each rule sees (its defaults overlaid with them).
  struct Group {
    Hyperparams given;
    std::vector<Hyperparams> per_rule;
  };
  std::map<uint32_t, Group> groups_;
  // Sets group id's values (computing what each rule sees).
  void PutGroup(uint32_t id, Hyperparams given);
  // Every rule checks its view of group id's given values (its defaults
  // for the names given lacks): the first rule's error, else OK.
  Status CheckGroup(uint32_t id, const Hyperparams& given) const;
  // The group's values and the defaults every rule that knows them agrees on
  // (GetGroupHyperparams, the commit).
  Hyperparams GroupMap(const Group& g) const;
  // The run's params (registration state, retired, dropped).
  ParamRegistry params_;
  // The step counts, now and as last committed.
  StepCounts counts_;
  // The step in progress (or the last one): its phase, mode, scale and
  // what it stepped.
  StepState step_;
  // After a step that is kept: one more step for each group and param
  // that stepped in it; cached: held only in the host cache.
  void AdvanceCounts(bool cached) { counts_.Advance(step_.groups, step_.tensors, cached); }
  Once warned_cache_small_;
  Once warned_cache_partial_;
  // Set after a CUDA error (sticky for the process): every call returns it.
  Status poison_;
  float grad_scale_ = 1.0f;  // SetGradScale (from StreamedAdamOptions::grad_scale)
  std::unique_ptr<SlicePipeline> pipeline_;
  // The optimizer's ChunkIo (registers the manager's staging buffers once;
  // used by WriteMain and the step pipeline, never concurrently).
  std::unique_ptr<vfs::ChunkIo> io_;
  Status EnsureIo();
  // Staging buffers io_ registered when it was made (FitStaging makes it
  // again once the pool has grown, so that every buffer is registered).
  size_t io_staging_ = 0;
  // Grows an automatic staging pool to what the registered params' slices
  // use (StateStaging) and remakes io_ for the new buffers.
  // REQUIRES: io_ idle (no step, commit or prefetch running).
  Status FitStaging();
  // The registered params' slices when FitStaging last ran (the step's
  // pipeline plans its staging sets for them).
  internal::StateSlices state_slices_;
  // The commit of each step: inline, or on a thread of the optimizer
  // (commit_lag_steps 1; it then owns io_, the step's pipeline and the
  // store's pending generation until FinishCommit joins it).
  std::unique_ptr<Committer> committer_;
  // Hands the computed step in pipeline_ to a background commit.
  void StartBackgroundCommit();
  // The step's stats known once its kernels are done (a pipelined step's
  // writes and commit are accounted when its commit is joined).
  void NoteReadSideStats(const SlicePipeline& pl);
  // Joins the background commit, if any, and takes its outcome: on failure
  // the optimizer returns to the last commit and the error is returned.
  // *wait_s: seconds spent waiting (may be null). keep_staged: chunks a
  // prefetch staged stay for the step that begins now (BeginStep); every
  // other caller drops them.
  Status FinishCommit(double* wait_s = nullptr, bool keep_staged = false);
  // The background prefetch and the chunks it staged for the next step.
  std::unique_ptr<Prefetcher> prefetcher_;
  StepStats last_stats_;
};

}  // namespace optstate::memmgr::internal
