// StreamedAdam: creation (restoring groups, step counts and params from the
// store's latest generation), groups and the gradient scale. The step is in
// streamed_adam_step.cc, params in streamed_adam_params.cc, commits in
// streamed_adam_commit.cc, Prefetch in streamed_adam_prefetch.cc; the chunk
// pipeline in internal/step_pipeline.h.
#include "memmgr/streamed_adam.h"

#include <cmath>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "memmgr/internal/manager_impl.h"
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/internal/streamed_adam_impl.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr {

using internal::CheckGradScale;
using internal::CheckMomentFields;
using internal::ImplOf;
using internal::ManagerImpl;

StreamedAdam::StreamedAdam(vfs::Store* store, MemoryManager* mm, const StreamedAdamOptions& opts)
    : store_(store), mm_(mm), opts_(opts), grad_scale_(opts.grad_scale), step_grad_scale_(opts.grad_scale) {}

StreamedAdam::~StreamedAdam() {
  // FinishCommit logs a failure; the destructor then commits what is left.
  (void)FinishCommit();
  if (!pipeline_ && !in_step_ && (uncommitted_steps_ > 0 || registrations_pending_) && !poisoned_) {
    const uint64_t n = uncommitted_steps_;
    auto g = MakeDurable();
    if (g.ok()) {
      OPTSTATE_LOG_INFO("StreamedAdam: committed {} cached step(s) and pending registrations at destruction as "
                        "generation {} of store {}",
                        n, *g, store_->path());
    } else {
      OPTSTATE_LOG_ERROR("StreamedAdam: {} step(s) held in the host cache and pending registrations were lost at "
                         "destruction of the optimizer of store {}: {}",
                         n, store_->path(), g.status().ToString());
    }
  }
  if (pipeline_) {
    pipeline_->Abort();
    pipeline_.reset();
    if (in_step_ && !step_skip_) {
      Status s = store_->AbortPending();
      if (!s.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: abort of unfinished step failed: {}", s.ToString());
      ImplOf(*mm_)->OnAbortPending();
    }
  }
}

Result<std::unique_ptr<StreamedAdam>> StreamedAdam::Create(vfs::Store* store, MemoryManager* mm,
                                                          const StreamedAdamOptions& opts) {
  if (store == nullptr || mm == nullptr) return InvalidArgument("StreamedAdam::Create: store or manager is null");
  if (mm->store() != store) {
    return InvalidArgument("StreamedAdam::Create: the memory manager serves store " + mm->store()->path() +
                           ", not " + store->path());
  }
  ManagerImpl* impl = ImplOf(*mm);
  if (opts.moment_dtype != MomentDType::kF32 && opts.moment_dtype != MomentDType::kBF16 &&
      opts.moment_dtype != MomentDType::kQ8) {
    return InvalidArgument(std::string("StreamedAdam: moment_dtype must be f32, bf16 or q8, got ") +
                           MomentDTypeName(opts.moment_dtype) + " (store " + store->path() + ")");
  }
  const uint32_t slice_chunks = internal::SliceChunks(opts.moment_dtype);
  if (impl->budget_pages() < slice_chunks) {
    return ResourceExhausted("StreamedAdam: device budget " + std::to_string(mm->options().device_budget_bytes) +
                             " bytes is smaller than one slice in flight (one chunk per field" +
                             (slice_chunks == 4   ? std::string(", two of main")
                              : slice_chunks > 4 ? std::string(", four of main, one of each absmax")
                                                 : std::string()) +
                             ": " +
                             std::to_string(slice_chunks) + " x " +
                             std::to_string(impl->page_bytes()) + " bytes = " +
                             std::to_string(slice_chunks * impl->page_bytes()) + " with " +
                             MomentDTypeName(opts.moment_dtype) + " moments)");
  }
  if (!(opts.grad_scale > 0.0f) || !std::isfinite(opts.grad_scale)) {
    return InvalidArgument("StreamedAdam: grad_scale must be finite and > 0, got " + std::to_string(opts.grad_scale));
  }
  auto sa = std::unique_ptr<StreamedAdam>(new StreamedAdam(store, mm, opts));
  // Restore groups, step counts and params from the latest generation.
  vfs::GenerationInfo gen = store->LatestGeneration();
  sa->global_step_ = gen.step;
  sa->last_generation_ = gen.generation;
  for (const vfs::GroupInfo& g : gen.groups) {
    ParamGroup pg;
    pg.id = g.id;
    auto get = [&](const char* k, double def) {
      auto it = g.hyper.find(k);
      return it == g.hyper.end() ? def : it->second;
    };
    pg.lr = get("lr", pg.lr);
    pg.beta1 = get("beta1", pg.beta1);
    pg.beta2 = get("beta2", pg.beta2);
    pg.eps = get("eps", pg.eps);
    pg.weight_decay = get("weight_decay", pg.weight_decay);
    pg.adamw = get("adamw", 1.0) != 0.0;
    sa->groups_[g.id] = pg;
    sa->step_counts_[g.id] = g.step_count;
  }
  for (const vfs::TensorInfo& t : store->ListTensors()) {
    // An entry no generation has committed (a registration dropped by a
    // failed step, or a crash before the first commit) holds no state: it is
    // not a param until RegisterParam takes it over with its initial weights.
    if (t.created_generation > gen.generation) continue;
    const uint64_t count = vfs::TensorStepCount(gen, t);
    sa->tensor_counts_[t.id] = TensorCount{count, count};
    Param p;
    p.info = t;
    auto a = store->FieldIndex(t, "main");
    auto b = store->FieldIndex(t, "exp_avg");
    auto c = store->FieldIndex(t, "exp_avg_sq");
    if (!a.ok() || !b.ok() || !c.ok()) continue;  // not an Adam tensor
    OPTSTATE_RETURN_IF_ERROR(CheckMomentFields(t, store->path(), opts.moment_dtype));
    p.f_main = *a;
    p.f_m = *b;
    p.f_v = *c;
    if (opts.moment_dtype == MomentDType::kQ8) {
      OPTSTATE_ASSIGN_OR_RETURN(p.f_ma, store->FieldIndex(t, vfs::Q8ScalesField("exp_avg")));
      OPTSTATE_ASSIGN_OR_RETURN(p.f_va, store->FieldIndex(t, vfs::Q8ScalesField("exp_avg_sq")));
    }
    sa->params_.emplace(t.name, std::move(p));
    if (!sa->groups_.count(t.group)) {
      sa->groups_[t.group] = ParamGroup{.id = t.group};
      sa->step_counts_[t.group] = 0;
    }
  }
  sa->committed_step_counts_ = sa->step_counts_;
  sa->committed_global_step_ = sa->global_step_;
  if (sa->opts_.durable_every_steps == 0) {
    return InvalidArgument("StreamedAdam: durable_every_steps must be >= 1");
  }
  if (sa->opts_.commit_lag_steps > 1) {
    return InvalidArgument("StreamedAdam: commit_lag_steps must be 0 (commit inside Step) or 1 (commit in the "
                           "background until the next call), got " + std::to_string(sa->opts_.commit_lag_steps) +
                           " (store " + store->path() + ")");
  }
  // An automatic pool grows to what the restored state's slices use, at
  // most the throughput plan (wider slices, bf16 or q8 moments, take more
  // buffers each); BeginStep grows it again for params registered later.
  OPTSTATE_RETURN_IF_ERROR(sa->FitStaging());
  if (!sa->params_.empty()) {
    OPTSTATE_LOG_INFO("StreamedAdam: store {} restored at generation {} step {}: {} params, {} groups",
                      store->path(), gen.generation, gen.step, sa->params_.size(), sa->groups_.size());
  }
  return sa;
}

Status StreamedAdam::CheckUsable() const {
  if (poisoned_) return poison_status_;
  return Status::Ok();
}

Status StreamedAdam::SetGroup(const ParamGroup& g) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::SetGroup: a step is in progress");
  if (!(g.lr >= 0) || !(g.beta1 >= 0 && g.beta1 < 1) || !(g.beta2 >= 0 && g.beta2 < 1) || !(g.eps > 0) ||
      !(g.weight_decay >= 0) || !std::isfinite(g.lr) || !std::isfinite(g.weight_decay)) {
    // {} is the shortest text that reads back as the same double (eps 1e-08,
    // not std::to_string's 0.000000).
    return InvalidArgument(fmt::format(
        "StreamedAdam::SetGroup {}: invalid hyperparameters (lr {}, betas {}/{}, eps {}, weight_decay {})", g.id,
        g.lr, g.beta1, g.beta2, g.eps, g.weight_decay));
  }
  groups_[g.id] = g;
  step_counts_.emplace(g.id, 0);
  return Status::Ok();
}

Result<ParamGroup> StreamedAdam::GetGroup(uint32_t id) const {
  auto it = groups_.find(id);
  if (it == groups_.end()) return NotFound("StreamedAdam: no parameter group " + std::to_string(id));
  return it->second;
}

bool StreamedAdam::HasParam(const std::string& name) const { return params_.count(name) != 0; }

std::vector<std::string> StreamedAdam::ParamNames() const {
  std::vector<std::string> out;
  for (const auto& [n, p] : params_) out.push_back(n);
  return out;
}

uint64_t StreamedAdam::step_count(uint32_t group) const {
  auto it = step_counts_.find(group);
  return it == step_counts_.end() ? 0 : it->second;
}

Result<uint64_t> StreamedAdam::param_step_count(const std::string& name) const {
  auto it = params_.find(name);
  if (it == params_.end()) {
    return NotFound("StreamedAdam::param_step_count: store " + store_->path() + " has no param '" + name + "'" +
                    (retired_.count(name) ? " in this run (retired)" : ""));
  }
  auto c = tensor_counts_.find(it->second.info.id);
  return c == tensor_counts_.end() ? 0 : c->second.now;
}

uint64_t StreamedAdam::last_generation() const { return last_generation_; }

Status StreamedAdam::EnsureIo() {
  if (io_) return Status::Ok();
  ManagerImpl* impl = ImplOf(*mm_);
  // One ring for the pipeline's reads and writes: room for both depth limits.
  vfs::ChunkIoOptions co = impl->ChunkIoOpts();
  co.queue_depth = internal::RingRequests(impl->options());
  co.defer_submit = impl->options().batch_submit;
  auto io = store_->NewChunkIo(co);
  if (!io.ok()) {
    vfs::ChunkIoOptions plain = co;
    plain.registered_buffers.clear();
    io = store_->NewChunkIo(plain);
  }
  if (!io.ok()) return io.status().WithContext("StreamedAdam: store " + store_->path());
  io_ = std::move(*io);
  io_staging_ = co.registered_buffers.size();
  return Status::Ok();
}

Status StreamedAdam::FitStaging() {
  ManagerImpl* impl = ImplOf(*mm_);
  const uint64_t chunk = impl->page_bytes();
  const uint64_t slice_elems = chunk / internal::MomentSize(opts_.moment_dtype);
  // A slice is small when each of its buffers fits a kSmallSliceBytes piece
  // (main, 4 bytes an element, is the widest field; a whole slice never
  // fits: chunks are 2 MiB or more).
  const uint64_t small_elems = internal::kSmallSliceBytes / 4;
  internal::StateSlices s;
  for (const auto& [name, p] : params_) {
    const uint64_t n = p.info.numel;
    s.big += n / slice_elems;
    const uint64_t tail = n % slice_elems;
    if (tail > small_elems) {
      ++s.big;
    } else if (tail > 0) {
      ++s.small;
    }
  }
  impl->GrowStaging(internal::StateStaging(impl->options(), opts_.moment_dtype, chunk, s));
  state_slices_big_ = s.big;
  state_slices_small_ = s.small;
  if (io_ && io_staging_ < impl->staging_count() && io_->in_flight() == 0) io_.reset();  // EnsureIo registers all
  return Status::Ok();
}

Status StreamedAdam::SetGradScale(float grad_scale) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::SetGradScale: a step is in progress (store " +
                                          store_->path() + ")");
  OPTSTATE_RETURN_IF_ERROR(CheckGradScale(grad_scale, "StreamedAdam::SetGradScale", store_->path()));
  grad_scale_ = grad_scale;
  return Status::Ok();
}

}  // namespace optstate::memmgr
