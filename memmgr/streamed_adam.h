// StreamedAdam: an optimizer (AdamW, or any update rules: memmgr/
// update_rule.h) whose state (fp32 main and the rule's moments) lives in a
// vfs::Store on NVMe and is streamed through the MemoryManager's device
// budget during Step(): every param's chunk slices (or whole tensor, for a
// whole-tensor rule) are read ahead into staging, copied to the device,
// updated by the rule's kernel (which also writes the model's param copy),
// copied back and written copy-on-write; then one Store::Commit publishes
// the generation with the step counts and hyperparameters. Disk reads,
// writes, copies and compute overlap.
//
// Its behaviour (step counts per param, gradient scale, found-inf, errors
// and poisoning, reopening, retired params, the host cache tier, deferred
// durability, pipelined commits, the write tail, Prefetch) is specified in
// docs/STREAMED_ADAM.md; the option and stats types are in
// memmgr/streamed_adam_types.h; the engine behind this class in
// memmgr/internal/streamed_engine.h.
//
// Ownership: store and mm are not owned and must outlive the optimizer.
// Gradient/param pointers passed to StepParam must stay valid until EndStep.
// Thread-safety: not thread-safe; one trainer thread drives it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam_types.h"
#include "memmgr/update_rule.h"
#include "vfs/store.h"

namespace optstate::memmgr {

namespace internal {
class StreamedEngine;
}

class StreamedAdam {
 public:
  // AdamW with opts.moment_dtype moments. Fails when the manager's budget
  // cannot hold one slice (3 chunks; 4 with bf16 moments).
  static Result<std::unique_ptr<StreamedAdam>> Create(vfs::Store* store, MemoryManager* mm,
                                                      const StreamedAdamOptions& opts);
  // The same engine with another update rule (null: AdamW with
  // opts.moment_dtype moments).
  static Result<std::unique_ptr<StreamedAdam>> Create(vfs::Store* store, MemoryManager* mm,
                                                      const StreamedAdamOptions& opts,
                                                      std::unique_ptr<UpdateRule> rule);
  // One optimizer, several rules: a param is updated by the rule its
  // registration names (ParamSpec::rule, an index into rules; rules[0] is
  // the default). rules: 1 to kMaxRules, none null, no two with the same
  // fields (names and dtypes). A stored tensor's rule is the one whose
  // fields it has exactly. A group's hyperparameters are the union of the
  // rules' names; each rule sees the group's values of its own names and
  // its defaults for the rest. A whole-tensor rule (SliceUnit::kTensor) is
  // called once per tensor and step on the whole tensor in the device
  // window: the budget must hold the largest such tensor's fields and its
  // WorkspaceBytes (kResourceExhausted at Create for a stored tensor, at
  // RegisterParam(s) for a new one, naming the bytes and the budget).
  static constexpr size_t kMaxRules = 16;
  static Result<std::unique_ptr<StreamedAdam>> Create(vfs::Store* store, MemoryManager* mm,
                                                      const StreamedAdamOptions& opts,
                                                      std::vector<std::unique_ptr<UpdateRule>> rules);
  ~StreamedAdam();

  // Adds or updates a group's hyperparameters (applies from the next step).
  Status SetGroup(const ParamGroup& g);
  Result<ParamGroup> GetGroup(uint32_t id) const;
  // The same by the update rules' names ("lr", "beta1", ...): a name no
  // rule knows is kInvalidArgument, one h lacks keeps its default (each
  // rule's own). Every rule checks the values (UpdateRule::CheckHyperparams).
  // GetGroupHyperparams: the values set and the defaults the rules agree on.
  Status SetGroupHyperparams(uint32_t id, const Hyperparams& h);
  Result<Hyperparams> GetGroupHyperparams(uint32_t id) const;

  // Registers a parameter shard. d_initial (device pointer; host pointer on
  // the host backend) holds numel elements of initial_type (f32/bf16/f16) and
  // becomes the fp32 main; null = zeros. Moments start at zero. initial_type
  // is the tensor's recorded dtype (default f32) and, for a param the store
  // already holds, is checked against it; none skips that check and needs a
  // null d_initial.
  // rule: the index of its update rule in Create's rules (0: the default);
  // a param the store holds under another rule is kInvalidArgument naming
  // both rules.
  Status RegisterParam(const std::string& name, uint64_t numel, uint32_t group,
                       const void* d_initial, std::optional<DType> initial_type,
                       const ShardInfo& shard = {}, uint32_t rule = 0);
  // RegisterParam for many params at once (a model's thousands of small
  // tensors register in one call: their initial mains are written with many
  // writes in flight). Every registration is checked first (as
  // RegisterParam checks one; a name given twice is kInvalidArgument), and
  // nothing changes when one fails; a failure after that (creating a tensor,
  // writing a main) drops the registrations not yet committed, as
  // RegisterParam's does. existed (may be null): per spec, whether the store
  // already held the param (its state is kept).
  using ParamSpec = StreamedAdamParamSpec;
  Status RegisterParams(std::span<const ParamSpec> specs, std::vector<bool>* existed);
  bool HasParam(const std::string& name) const;
  std::vector<std::string> ParamNames() const;
  // Params restored from the store that this run has neither registered nor
  // retired (sorted). Empty while the run has registered nothing.
  std::vector<std::string> UnregisteredParams() const;
  // Leaves a param restored from the store out of this run's model (a model
  // that no longer has the tensor): its state stays in the store, unchanged
  // in every later generation, and it is never stepped. REQUIRES: not
  // registered in this run, no step in progress.
  Status RetireParam(const std::string& name);

  // One full step over the given parameters; commits one generation unless
  // *d_found_inf != 0 (then nothing changes; last_step_skipped() is true).
  // d_grad_scale (device pointer; host pointer on the host backend; may be
  // null): this step's gradient scale, e.g. GradScaler's scale tensor;
  // null = grad_scale().
  Status Step(std::span<const ParamGrad> grads, const float* d_found_inf = nullptr,
              const float* d_grad_scale = nullptr);

  // Incremental form: BeginStep(); StepParam(g) for each param as its grad is
  // final (the pipeline starts at once and runs during later StepParam
  // calls); EndStep() drains, commits and returns the new generation (or the
  // current one when the step was skipped by found_inf); with
  // commit_lag_steps 1 that generation's commit may still be in flight (it
  // is last_generation() once waited for). Flags as for Step.
  Status BeginStep(const float* d_found_inf = nullptr, const float* d_grad_scale = nullptr);
  Status StepParam(const ParamGrad& g);
  Result<uint64_t> EndStep();

  // The gradient scale of the steps from the next one on (gradients are
  // multiplied by 1/grad_scale), until set again; a step's d_grad_scale
  // overrides it for that step. kInvalidArgument unless finite and > 0;
  // kFailedPrecondition while a step is in progress; either changes nothing.
  Status SetGradScale(float grad_scale);
  float grad_scale() const;

  // Replaces a param's fp32 mains from model weights (checkpoint-load path).
  Status LoadMainFrom(const std::string& name, const void* d_weights, DType type);

  // Writes steps held only in the host cache (durable_every_steps > 1) and
  // commits them, with any registrations and LoadMainFrom not yet committed;
  // returns the latest generation (unchanged when nothing was pending).
  Result<uint64_t> MakeDurable();
  // Steps taken since the last commit (0 unless durable_every_steps > 1).
  uint64_t uncommitted_steps() const;

  // Waits for the commit of the last step when it runs in the background
  // (commit_lag_steps 1); its error, if it failed (docs/STREAMED_ADAM.md,
  // "Pipelined commits").
  // OK at once when none is in flight.
  Status WaitForCommit();
  // A step's commit runs in the background now (it may have finished; the
  // optimizer learns so at the next wait).
  bool commit_in_flight() const;

  // Starts reading the next step's state into host memory on a thread of
  // the optimizer and returns at once: call it when forward/backward starts,
  // so that the next Step finds the state in RAM (the host cache tier, or
  // staging buffers that step adopts). A hint: it never changes a result
  // and never fails for a read; safe at any time. docs/STREAMED_ADAM.md
  // ("Prefetch") says what it reads, when it stops and what memory it uses.
  Status Prefetch();
  // A prefetch runs (or ran and was not yet stopped by a wait point).
  bool prefetch_running() const;

  // Steps in which any param of the group stepped (0 for an unknown group).
  uint64_t step_count(uint32_t group) const;
  // The param's own step count: the steps it took (had a gradient in) over
  // the store's life, the count its next update's bias correction follows
  // (+ 1). Counts this run's steps not yet committed (see step_count).
  // kNotFound for a name that is not a param of this run.
  Result<uint64_t> param_step_count(const std::string& name) const;
  uint64_t last_generation() const;
  bool last_step_skipped() const;
  // Global (trainer) step stored with the next commit minus one.
  uint64_t global_step() const;
  void set_global_step(uint64_t s);

  using StepStats = StreamedAdamStepStats;
  const StepStats& last_step_stats() const;

 private:
  explicit StreamedAdam(std::unique_ptr<internal::StreamedEngine> engine);
  std::unique_ptr<internal::StreamedEngine> engine_;
};

}  // namespace optstate::memmgr
