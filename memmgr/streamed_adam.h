// StreamedAdam: Adam/AdamW whose state (fp32 main, exp_avg, exp_avg_sq) lives
// in a vfs::Store on NVMe and is streamed through the MemoryManager's device
// budget during Step().
//
// Step() walks every parameter's chunk slices (a slice = one chunk index of
// exp_avg and exp_avg_sq and the main chunks of the same elements: one with
// f32 moments, two with bf16) through a pipeline: read ahead up to
// read_ahead_chunks slices (ChunkIo into staging buffers), H2D into device
// slots, the fused kernel (AdamStepCuda on cuda, AdamStepCpu on host; it also
// writes the model-parameter copy), D2H, copy-on-write write-back; then one
// Store::Commit publishes the generation with the per-group step counts and
// hyperparameters. Disk reads, disk writes, copies and compute overlap.
//
// Decisions:
//  - Step counts are per param, as torch's optimizers keep them: a param that
//    gets no gradient in a step keeps its state and its count unchanged, and
//    its bias correction uses its own count (param_step_count). A group's
//    step_count counts the steps in which any of its params stepped. The
//    store persists both with each generation (vfs::TensorStepCount); a
//    skipped step (found-inf) counts for no one.
//  - Gradient scale (loss scaling, e.g. torch's GradScaler): gradients are
//    multiplied by 1/scale. The scale starts at StreamedAdamOptions::
//    grad_scale; SetGradScale changes it from the next step on; a step given
//    d_grad_scale uses *d_grad_scale for that step only (read at BeginStep,
//    after found-inf). A scale that is not finite and > 0 is kInvalidArgument
//    and changes nothing. With a power-of-two scale and gradients g * scale
//    that did not overflow, the step equals the unscaled step on g bit for bit.
//  - found-inf (d_found_inf nonzero) skips the step: nothing is written or
//    committed, step counts stay; Step returns OK and last_step_skipped() is
//    true. The flag is read at BeginStep (no I/O then) and again at EndStep
//    (incremental form: a flag raised mid-step drops the step's state
//    updates; model-param copies of slices done before it was raised keep
//    their update, so raise it before BeginStep).
//  - cuda: gradients must be complete when StepParam/Step is called (the
//    pipeline runs on its own non-blocking streams; synchronise the stream
//    that produced them first). Param copies are complete when EndStep/Step
//    returns.
//  - Any error (I/O, CUDA, checksum) aborts the pending generation
//    (Store::AbortPending, which also drops uncommitted MemoryManager
//    write-backs) and is returned; nothing is committed. After a CUDA error the
//    optimizer is poisoned: every later call fails (sticky CUDA errors).
//  - Reopening: Create() on a store with tensors restores groups, step counts
//    (per group and per param) and every committed tensor that has
//    main/exp_avg/exp_avg_sq as a param.
//    RegisterParam of an existing param with the same geometry (numel, group,
//    dtype when initial_type is given, shape, global shape, shard offset) is a
//    no-op that keeps the stored state; any difference is kInvalidArgument
//    naming the store, the tensor, the field and both values, and changes
//    nothing. A registration that no generation committed (one a failed step
//    dropped, or a crash before the first commit) leaves nothing behind: the
//    store drops such tensors (Store::AbortPending, Store::Open), so a later
//    RegisterParam of that name registers it anew.
//  - A model that lost a tensor: a run that registers no params steps every
//    restored one. Once a run has registered a param, its model is what it
//    registered: a step fails (kFailedPrecondition, before anything runs,
//    nothing committed) while the store holds a param this run neither
//    registered nor retired, naming them. RetireParam keeps such a param's
//    state in the store, unchanged in every later generation, and leaves it
//    out of this run. State is never dropped silently.
//  - Gradients are checked before any kernel runs: Step() checks the whole
//    list (known names, each at most once, non-null f32/bf16/f16 gradients,
//    param copies of a float dtype, ParamGrad::numel equal to the registered
//    numel when given) before it starts; a mismatch fails the step and
//    commits nothing. StepParam checks its one gradient the same way before
//    queueing it (earlier params of the step may have been computed; the
//    step is aborted).
//  - New registrations and LoadMainFrom are committed with the next
//    generation: the next committed step's, or MakeDurable()'s on their own. A
//    step that fails, or is dropped because found-inf was raised after
//    BeginStep, commits nothing at all: the pending generation is dropped and
//    with it the registrations and loaded weights not yet committed. Those
//    new params are unregistered again (HasParam is false) and loaded mains
//    are back at their last commit; the returned error names them (register
//    or load them again). To make registrations independent of the first
//    step, call MakeDurable() after registering; the destructor commits
//    registrations still pending (as it commits cached steps).
//  - Host cache tier (MemoryManagerOptions::host_cache_bytes >= the whole
//    state): the cache's pinned buffers are the slices' buffers (H2D from and
//    D2H into them, no staging copies). With durable_every_steps = N > 1 a
//    step then touches no disk: it updates the cache only, and every N-th step
//    (and MakeDurable(), RegisterParam of a new param, LoadMainFrom, the
//    destructor) writes the state and commits. The store, the mount and the
//    tools show the last committed generation; a crash or an aborted step
//    loses the uncommitted steps (at most N-1; the error says how many) and
//    the optimizer returns to the last commit. With a smaller cache, every
//    step commits (logged once). Registrations and LoadMainFrom stay pending
//    until the next commit, which publishes them with the cached steps.
//  - Host cache tier smaller than the state (every step durable): it is a
//    read tier. A slice's chunk that has an entry is computed in it (no disk
//    read, no staging copy) and written through from it; a missed chunk is
//    admitted while there is room, and once the tier is full the resident
//    set stays (MemoryManagerOptions::host_cache_bytes says why), so a step
//    reads about state - capacity bytes from disk. An aborted step drops the
//    tier (its entries may hold the dropped generation's bytes).
//  - Pipelined commits (StreamedAdamOptions::commit_lag_steps = 1, the
//    default): Step/EndStep returns once every slice's kernel, param copy and
//    D2H are done (the trainer can use its params) and the remaining writes
//    are submitted; the rest of the generation (the write tail, the data
//    sync, the index batch: Store::Commit) completes on a thread of the
//    optimizer while the trainer runs its next forward/backward. Until then
//    last_generation() and the store show the previous generation, while
//    step_count() and global_step() already count the step. The next
//    BeginStep/Step, MakeDurable, WaitForCommit, RegisterParam, LoadMainFrom,
//    RetireParam and the destructor wait for that commit, as do the
//    MemoryManager's Pin, Prefetch, Flush and ReleaseAll (sleep), so nothing
//    ever sees a half-written generation; a snapshot is taken after
//    MakeDurable (the Python optimizer does). Only one step is ever in
//    flight: the next step starts its reads and writes after the previous
//    commit published, so each generation is written copy-on-write against
//    a committed one exactly as with commit_lag_steps 0. A crash loses at
//    most the step whose commit was in flight (the store reopens at that
//    step or the one before); every generation on disk stays consistent.
//    A failed background commit is returned by the next call that waits
//    (naming the step, the generation, the store and the cause; that call
//    does nothing else): the pending generation was dropped and the
//    optimizer is back at the last commit (step counts, global step,
//    uncommitted registrations dropped, as after an aborted step). The
//    params that the lost step updated are then one step ahead of the
//    store: reload them from the store's mains (e.g. read "main" and copy
//    it into the model), or treat the error as fatal and resume from the
//    store. commit_lag_steps 0 commits inside Step (durable on return).
//  - Write tail (host cache tier, pipelined commits): a slice whose three
//    chunks are host cache entries is computed in them and gives its staging
//    set back as soon as its kernel and D2H are done; its writes go out from
//    the entries in the background. Step then returns once every kernel is
//    done and the new state is in the tier, however slow the disk's writes:
//    the writes that did not finish in the step finish on the commit's
//    thread, before its data sync and index batch, and every wait point
//    above waits for them as it waits for the commit. Memory: the tail
//    holds no buffer of its own; an entry being written stays in use (never
//    evicted, reused or admitted over) until its write completes, and the
//    next step, which is the only writer of the entries, starts after the
//    commit. A failed tail write fails that commit (as above).
//  - Prefetch (see Prefetch()): reads the next step's state into the host
//    cache tier while the trainer runs forward/backward, so the step finds
//    it in RAM. It changes no result: the tier holds committed bytes, the
//    same the step would read from disk.
//
// Ownership: store and mm are not owned and must outlive the optimizer.
// Gradient/param pointers passed to StepParam must stay valid until EndStep.
// Thread-safety: not thread-safe; one trainer thread drives it.
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
#include "memmgr/memory_manager.h"
#include "memmgr/update_rule.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::memmgr {

namespace internal {
class Committer;
class EngineMemory;
class SliceLayout;
class StepPipeline;
struct SliceSize;
}

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

class StreamedAdam {
 public:
  // Fails when the manager's budget cannot hold one slice (3 chunks; 4 with
  // bf16 moments).
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
  struct ParamSpec {
    std::string name;
    uint64_t numel = 0;
    uint32_t group = 0;
    const void* d_initial = nullptr;
    std::optional<DType> initial_type = DType::kF32;
    ShardInfo shard;
    uint32_t rule = 0;  // index into Create's rules
  };
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
  float grad_scale() const { return grad_scale_; }

  // Replaces a param's fp32 mains from model weights (checkpoint-load path).
  Status LoadMainFrom(const std::string& name, const void* d_weights, DType type);

  // Writes steps held only in the host cache (durable_every_steps > 1) and
  // commits them, with any registrations and LoadMainFrom not yet committed;
  // returns the latest generation (unchanged when nothing was pending).
  Result<uint64_t> MakeDurable();
  // Steps taken since the last commit (0 unless durable_every_steps > 1).
  uint64_t uncommitted_steps() const { return uncommitted_steps_; }

  // Waits for the commit of the last step when it runs in the background
  // (commit_lag_steps 1); its error, if it failed (see "Pipelined commits").
  // OK at once when none is in flight.
  Status WaitForCommit();
  // A step's commit runs in the background now (it may have finished; the
  // optimizer learns so at the next wait).
  bool commit_in_flight() const;

  // Starts reading the next step's state into host memory in the
  // background (on a thread of the optimizer) and returns at once: call it
  // when forward/backward starts, so that the next Step finds the state in
  // RAM. It reads in the order of the last step (else the params' order by
  // name), after the commit in flight, if any, has completed:
  //  - into the host cache tier, the chunks the tier does not hold while it
  //    has room (the tier's admission: a full tier keeps its resident set,
  //    see MemoryManagerOptions::host_cache_bytes);
  //  - when the tier cannot hold the whole state (or there is none), the
  //    first chunks outside it that the step reads, into staging buffers
  //    that the next step's pipeline adopts in place of reading them: at
  //    most the pipeline's own staging (3 x read_ahead_chunks buffers) less
  //    one slice, so the step runs with the staging it would have had
  //    anyway. Only the next BeginStep/Step uses them; any other call of
  //    this optimizer (MakeDurable, WaitForCommit, RegisterParam,
  //    LoadMainFrom, RetireParam, a skipped step, the destructor) and any
  //    write-back through the MemoryManager's pins since the prefetch read
  //    them drop them unread.
  // A hint: it never changes a result (it reads the committed bytes the
  // step would read), and never fails for a read (a chunk it could not read
  // is read by the step, which reports the error). Safe at any time: a
  // second call while one runs, or during a step, does nothing; the wait
  // points above stop it (keeping what it read for the next step); the
  // MemoryManager's Pin, Prefetch, Flush and ReleaseAll wait for it to end.
  // Memory: the tier's own budget and the manager's staging buffers (at
  // most queue_depth while it reads into the tier), nothing else.
  Status Prefetch();
  // A prefetch runs (or ran and was not yet stopped by a wait point).
  bool prefetch_running() const { return prefetch_ != nullptr; }

  // Steps in which any param of the group stepped (0 for an unknown group).
  uint64_t step_count(uint32_t group) const;
  // The param's own step count: the steps it took (had a gradient in) over
  // the store's life, the count its next update's bias correction follows
  // (+ 1). Counts this run's steps not yet committed (see step_count).
  // kNotFound for a name that is not a param of this run.
  Result<uint64_t> param_step_count(const std::string& name) const;
  uint64_t last_generation() const;
  bool last_step_skipped() const { return last_step_skipped_; }
  // Global (trainer) step stored with the next commit minus one.
  uint64_t global_step() const { return global_step_; }
  void set_global_step(uint64_t s) { global_step_ = s; }

  struct StepStats {
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
  const StepStats& last_step_stats() const { return last_stats_; }

 private:
  struct Param {
    vfs::TensorInfo info;
    std::array<uint32_t, kMaxRuleFields> fields = {};  // the tensor's field index of each of the rule's fields
    bool committed = true;      // in the last committed generation
    bool registered = false;    // RegisterParam'd in this run
    bool main_pending = false;  // LoadMainFrom not yet committed
    uint32_t rule = 0;          // index into rules_
  };
  StreamedAdam(vfs::Store* store, MemoryManager* mm, const StreamedAdamOptions& opts);
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
  vfs::CommitInfo MakeCommitInfo(bool advance) const;
  // True when the host cache tier can hold every registered param's state.
  bool CacheHoldsState() const;
  // Bytes the host cache tier needs to hold every registered param's state.
  uint64_t StateCacheBytes() const;
  // Writes the cache's dirty entries not yet in the pending generation.
  Status WriteDirtyCache();
  // After a commit: the cache is clean and the committed counts are current.
  void NoteCommitted(uint64_t gen);
  // After the cache was dropped: back to the last commit's counts; returns
  // a sentence for messages ("" when nothing was lost).
  std::string RevertUncommitted();

  vfs::Store* store_;
  MemoryManager* mm_;
  internal::EngineMemory* mem_;  // mm_'s services for the engine
  StreamedAdamOptions opts_;
  // The update rules (rules_[0] the default: AdamW with opts_.moment_dtype
  // moments unless given) and each one's chunk geometry in this store.
  std::vector<std::unique_ptr<UpdateRule>> rules_;
  std::vector<std::unique_ptr<internal::SliceLayout>> layouts_;
  const internal::SliceLayout& LayoutOf(const Param& p) const { return *layouts_[p.rule]; }
  // The widest slice of any rule (staging plans).
  internal::SliceSize MaxSliceSize() const;
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
  // The group's values and the defaults every rule that knows them agrees on
  // (GetGroupHyperparams, the commit).
  Hyperparams GroupMap(const Group& g) const;
  std::map<uint32_t, uint64_t> step_counts_;
  std::map<std::string, Param, std::less<>> params_;
  uint64_t global_step_ = 0;
  uint64_t last_generation_ = 0;
  uint64_t uncommitted_steps_ = 0;                  // steps only in the host cache
  std::map<uint32_t, uint64_t> committed_step_counts_;
  // Per-tensor step counts by tensor id: every param's and every other
  // tensor's of the last commit (retired params, tensors that are not Adam
  // params), so that each commit carries all of them.
  struct TensorCount {
    uint64_t now = 0;        // with the steps not yet committed (cached, in flight)
    uint64_t committed = 0;  // in the last committed generation
  };
  std::map<uint32_t, TensorCount> tensor_counts_;
  // After a step that is kept: one more step for each group and param that
  // stepped in it (groups_stepped_, stepped_).
  void AdvanceCounts();
  uint64_t committed_global_step_ = 0;
  bool step_cache_mode_ = false;                    // the current step's slices live in the cache
  bool step_write_through_ = true;                  // the current step writes and commits
  bool warned_cache_small_ = false;
  bool warned_cache_partial_ = false;
  bool registrations_pending_ = false;              // a Param is !committed or main_pending
  bool any_registered_ = false;                     // RegisterParam succeeded in this run
  std::set<std::string> retired_;                   // RetireParam'd in this run
  std::set<std::string> dropped_;                   // registrations dropped by a failed step in this run
  bool in_step_ = false;
  bool step_skip_ = false;
  bool last_step_skipped_ = false;
  bool poisoned_ = false;
  Status poison_status_;
  const float* step_found_inf_ = nullptr;
  float grad_scale_ = 1.0f;       // SetGradScale (from StreamedAdamOptions::grad_scale)
  float step_grad_scale_ = 1.0f;  // the current step's scale
  std::map<uint32_t, bool> groups_stepped_;
  std::set<std::string> stepped_;  // params stepped in the current (or last) step
  std::unique_ptr<internal::StepPipeline> pipeline_;
  // The optimizer's ChunkIo (registers the manager's staging buffers once;
  // used by WriteMain and the step pipeline, never concurrently).
  std::unique_ptr<vfs::ChunkIo> io_;
  Status EnsureIo();
  // Staging buffers io_ registered when it was made (FitStaging makes it
  // again once the pool has grown, so that every buffer is registered).
  size_t io_staging_ = 0;
  // Grows an automatic staging pool to what the registered params' slices
  // use (internal::StateStaging) and remakes io_ for the new buffers.
  // REQUIRES: io_ idle (no step, commit or prefetch running).
  Status FitStaging();
  // The registered params' slices when FitStaging last ran (the step's
  // pipeline plans its staging sets for them).
  uint64_t state_slices_big_ = 0;
  uint64_t state_slices_small_ = 0;
  // The commit of each step: inline, or on a thread of the optimizer
  // (commit_lag_steps 1; it then owns io_, the step's pipeline and the
  // store's pending generation until FinishCommit joins it).
  std::unique_ptr<internal::Committer> committer_;
  // Hands the computed step in pipeline_ to a background commit.
  void StartBackgroundCommit();
  // The step's stats known once its kernels are done (a pipelined step's
  // writes and commit are accounted when its commit is joined).
  void NoteReadSideStats(const internal::StepPipeline& pl);
  // Joins the background commit, if any, and takes its outcome: on failure
  // the optimizer returns to the last commit and the error is returned.
  // *wait_s: seconds spent waiting (may be null). keep_staged: chunks a
  // prefetch staged stay for the step that begins now (BeginStep); every
  // other caller drops them.
  Status FinishCommit(double* wait_s = nullptr, bool keep_staged = false);
  // The background prefetch (defined in internal/streamed_adam_impl.h).
  struct PrefetchRun;
  std::unique_ptr<PrefetchRun> prefetch_;
  // Stops the prefetch, if any, joins it and notes what it read.
  void StopPrefetch();
  uint64_t prefetch_read_bytes_ = 0;  // by the prefetches since the last step began
  // Chunks a finished prefetch read into staging buffers for the next step
  // (see Prefetch); staged_write_mark_: the manager's nvme_write_bytes when
  // it started reading (a write-back since then drops them).
  struct StagedChunk {
    uint32_t tensor_id = 0;
    uint32_t field = 0;
    uint64_t chunk = 0;
    uint64_t len = 0;
    void* buf = nullptr;  // a staging buffer of the manager
  };
  std::vector<StagedChunk> staged_;
  uint64_t staged_write_mark_ = 0;
  // Gives staged_'s buffers back to the manager.
  void DropStaged();
  // The current (or last) step's params in the order it stepped them: the
  // order the next prefetch reads.
  struct StepOrderEntry {
    uint32_t tensor_id = 0;
    uint32_t rule = 0;
    std::array<uint32_t, kMaxRuleFields> fields = {};  // as Param::fields
    uint64_t numel = 0;
  };
  std::vector<StepOrderEntry> step_order_;
  // The prefetch's thread: waits until the commit in flight (after_commit) has published, then
  // reads order's chunks into the host cache tier, and up to stage_limit
  // chunks outside it into staging buffers (r->staged).
  void ReadPrefetch(PrefetchRun* r, bool after_commit, size_t stage_limit,
                    const std::vector<StepOrderEntry>& order);
  StepStats last_stats_;
};

}  // namespace optstate::memmgr
