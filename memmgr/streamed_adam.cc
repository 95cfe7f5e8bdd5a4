// StreamedEngine: creation (restoring groups, step counts and params from the
// store's latest generation), groups and the gradient scale. The step is in
// streamed_adam_step.cc, params in streamed_adam_params.cc, commits in
// streamed_adam_commit.cc, Prefetch in streamed_adam_prefetch.cc; the chunk
// pipeline in internal/slice_pipeline.h.
#include "memmgr/internal/streamed_engine.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "memmgr/internal/adamw_rule.h"
#include "memmgr/internal/committer.h"
#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_layout.h"
#include "memmgr/internal/slice_pipeline.h"
#include "memmgr/internal/prefetcher.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr::internal {


StreamedEngine::StreamedEngine(vfs::Store* store, MemoryManager* mm, const StreamedAdamOptions& opts)
    : store_(store), mm_(mm), mem_(internal::EngineMemoryOf(*mm)), opts_(opts), grad_scale_(opts.grad_scale) {
  step_.grad_scale = opts.grad_scale;
}

StreamedEngine::~StreamedEngine() {
  // FinishCommit logs a failure; the destructor then commits what is left.
  (void)FinishCommit();
  if (!pipeline_ && !step_.in_step() && (counts_.uncommitted_steps() > 0 || params_.pending()) && poison_.ok()) {
    const uint64_t n = counts_.uncommitted_steps();
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
    (void)committer_->FinishSync();
    if (step_.phase == StepPhase::kStepping) {
      Status s = store_->AbortPending();
      if (!s.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: abort of unfinished step failed: {}", s.ToString());
      mem_->OnAbortPending();
    }
  }
}

Result<std::unique_ptr<StreamedEngine>> StreamedEngine::Create(vfs::Store* store, MemoryManager* mm,
                                                              const StreamedAdamOptions& opts,
                                                              std::vector<std::unique_ptr<UpdateRule>> rules) {
  if (store == nullptr || mm == nullptr) return InvalidArgument("StreamedAdam::Create: store or manager is null");
  if (mm->store() != store) {
    return InvalidArgument("StreamedAdam::Create: the memory manager serves store " + mm->store()->path() +
                           ", not " + store->path());
  }
  internal::EngineMemory* impl = internal::EngineMemoryOf(*mm);
  if (opts.moment_dtype != MomentDType::kF32 && opts.moment_dtype != MomentDType::kBF16 &&
      opts.moment_dtype != MomentDType::kQ8) {
    return InvalidArgument(std::string("StreamedAdam: moment_dtype must be f32, bf16 or q8, got ") +
                           MomentDTypeName(opts.moment_dtype) + " (store " + store->path() + ")");
  }
  if (rules.empty() || rules.size() > kMaxRules) {
    return InvalidArgument("StreamedAdam::Create: " + std::to_string(rules.size()) + " update rules (1 to " +
                           std::to_string(kMaxRules) + "; store " + store->path() + ")");
  }
  if (rules.size() == 1 && rules[0] == nullptr) rules[0] = internal::NewAdamWRule(opts.moment_dtype);
  std::vector<std::unique_ptr<internal::SliceLayout>> layouts;
  uint32_t slice_chunks = 0;
  for (size_t r = 0; r < rules.size(); ++r) {
    if (rules[r] == nullptr) {
      return InvalidArgument("StreamedAdam::Create: update rule " + std::to_string(r) + " is null (store " +
                             store->path() + ")");
    }
    for (size_t q = 0; q < r; ++q) {
      const auto& a = rules[q]->Fields();
      const auto& b = rules[r]->Fields();
      const bool same = a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const RuleField& x, const RuleField& y) {
                          return x.name == y.name && x.dtype == y.dtype;
                        });
      if (same) {
        return InvalidArgument("StreamedAdam::Create: update rules " + std::string(rules[q]->name()) + " and " +
                               std::string(rules[r]->name()) + " keep the same fields: a stored tensor could not "
                               "tell its rule (store " + store->path() + ")");
      }
    }
    OPTSTATE_ASSIGN_OR_RETURN(internal::SliceLayout layout, internal::SliceLayout::Make(*rules[r], impl->page_bytes()));
    slice_chunks = std::max(slice_chunks, layout.slice_chunks());
    layouts.push_back(std::make_unique<internal::SliceLayout>(layout));
  }
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
  auto sa = std::unique_ptr<StreamedEngine>(new StreamedEngine(store, mm, opts));
  sa->rules_ = std::move(rules);
  sa->layouts_ = std::move(layouts);
  StreamedEngine* self = sa.get();
  sa->committer_ = std::make_unique<internal::Committer>(store, sa->mem_, opts.background_sync_bytes,
                                                         [self] { return self->WriteDirtyCache(); });
  sa->prefetcher_ = std::make_unique<Prefetcher>(sa->mem_, sa->committer_.get(), &sa->layouts_, store->path());
  // Restore groups, step counts and params from the latest generation.
  vfs::GenerationInfo gen = store->LatestGeneration();
  sa->counts_.Restore(gen);
  // An entry no generation has committed (a registration dropped by a
  // failed step, or a crash before the first commit) holds no state: it is
  // not a param until RegisterParam takes it over with its initial weights.
  std::vector<vfs::TensorInfo> tensors = store->ListTensors();
  std::erase_if(tensors, [&](const vfs::TensorInfo& t) { return t.created_generation > gen.generation; });
  // A param of a rule has its fields (RuleOfStored); another tensor is kept
  // as it is. The params' fields are checked before the groups' values, so
  // that a store of another rule (SGD's momentum under plain SGD) is refused
  // naming the tensor and the field rather than only a group's value.
  std::vector<std::optional<uint32_t>> rule_of(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    rule_of[i] = sa->RuleOfStored(tensors[i]);
    if (rule_of[i]) OPTSTATE_RETURN_IF_ERROR(sa->rules_[*rule_of[i]]->CheckStored(store->path(), tensors[i]));
  }
  for (const vfs::GroupInfo& g : gen.groups) {
    // Names the store lacks take the rules' defaults; each rule checks its
    // view of the stored values (a hand-edited store fails here, named).
    Hyperparams given(g.hyper.begin(), g.hyper.end());
    OPTSTATE_RETURN_IF_ERROR(sa->CheckGroup(g.id, given).WithContext(
        "StreamedAdam: store " + store->path() + " generation " + std::to_string(gen.generation)));
    sa->PutGroup(g.id, std::move(given));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const vfs::TensorInfo& t = tensors[i];
    sa->counts_.RestoreTensor(t.id, vfs::TensorStepCount(gen, t));
    const std::optional<uint32_t> rule = rule_of[i];
    if (!rule) continue;
    OPTSTATE_RETURN_IF_ERROR(sa->CheckUnitFits(t.name, *rule, t.numel, t.shape));
    Param p;
    p.info = t;
    p.rule = *rule;
    OPTSTATE_RETURN_IF_ERROR(sa->ResolveFields(&p));
    sa->params_.AddRestored(t.name, std::move(p));
    if (!sa->groups_.count(t.group)) {
      sa->PutGroup(t.group, {});
      sa->counts_.AddGroup(t.group);
    }
  }
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

Status StreamedEngine::CheckUsable() const {
  return poison_;
}

Status StreamedEngine::SetGroup(const ParamGroup& g) { return SetGroupHyperparams(g.id, GroupHyper(g)); }

Result<ParamGroup> StreamedEngine::GetGroup(uint32_t id) const {
  OPTSTATE_ASSIGN_OR_RETURN(Hyperparams h, GetGroupHyperparams(id));
  return GroupOf(id, h);
}

Status StreamedEngine::SetGroupHyperparams(uint32_t id, const Hyperparams& h) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (step_.in_step()) return FailedPrecondition("StreamedAdam::SetGroup: a step is in progress");
  for (const auto& [k, v] : h) {
    const bool known = std::any_of(rules_.begin(), rules_.end(), [&](const std::unique_ptr<UpdateRule>& r) {
      return r->Hyperparameters().count(k) != 0;
    });
    if (!known) {
      return InvalidArgument("StreamedAdam::SetGroup " + std::to_string(id) + ": " + RuleNames() +
                             (rules_.size() == 1 ? " has" : " have") + " no hyperparameter '" + k + "' (store " +
                             store_->path() + "); nothing changed");
    }
  }
  OPTSTATE_RETURN_IF_ERROR(CheckGroup(id, h));
  PutGroup(id, h);
  counts_.AddGroup(id);
  return Status::Ok();
}

Result<Hyperparams> StreamedEngine::GetGroupHyperparams(uint32_t id) const {
  auto it = groups_.find(id);
  if (it == groups_.end()) return NotFound("StreamedAdam: no parameter group " + std::to_string(id));
  return GroupMap(it->second);
}

namespace {
// A rule's view of a group: its defaults, overridden by the values given.
Hyperparams RuleView(const UpdateRule& r, const Hyperparams& given) {
  Hyperparams view = r.Hyperparameters();
  for (const auto& [k, v] : given) view[k] = v;
  return view;
}
}  // namespace

void StreamedEngine::PutGroup(uint32_t id, Hyperparams given) {
  Group& g = groups_[id];
  g.per_rule.clear();
  for (const auto& r : rules_) g.per_rule.push_back(RuleView(*r, given));
  g.given = std::move(given);
}

Status StreamedEngine::CheckGroup(uint32_t id, const Hyperparams& given) const {
  for (const auto& r : rules_) OPTSTATE_RETURN_IF_ERROR(r->CheckHyperparams(id, RuleView(*r, given)));
  return Status::Ok();
}

Hyperparams StreamedEngine::GroupMap(const Group& g) const {
  // A default is kept only where every rule that knows the name agrees on
  // it, so that a reopened store gives each rule its own default again.
  Hyperparams out;
  std::set<std::string, std::less<>> conflicting;
  for (const auto& r : rules_) {
    for (const auto& [k, v] : r->Hyperparameters()) {
      auto [it, added] = out.emplace(k, v);
      if (!added && it->second != v) conflicting.insert(k);
    }
  }
  for (const std::string& k : conflicting) out.erase(k);
  for (const auto& [k, v] : g.given) out[k] = v;
  return out;
}

internal::SliceSize StreamedEngine::MaxSliceSize() const {
  internal::SliceSize z{0, 0};
  for (const auto& l : layouts_) {
    z.chunks = std::max(z.chunks, l->slice_chunks());
    z.bytes_in_chunks = std::max(z.bytes_in_chunks, l->slice_bytes_in_chunks());
  }
  return z;
}

Status StreamedEngine::CheckUnitFits(const std::string& name, uint32_t rule, uint64_t numel,
                                   const std::vector<uint64_t>& shape) const {
  const UpdateRule& r = *rules_[rule];
  if (r.unit() != SliceUnit::kTensor) return Status::Ok();
  vfs::TensorInfo t;
  t.name = name;
  t.numel = numel;
  t.shape = shape.empty() ? std::vector<uint64_t>{numel} : shape;
  const internal::TensorUnitSize u = internal::TensorUnitOf(r, *layouts_[rule], t);
  const uint64_t budget = mem_->budget_pages() * mem_->page_bytes();
  if (u.pages * mem_->page_bytes() > budget) {
    return ResourceExhausted("StreamedAdam: param '" + name + "' of store " + store_->path() + " is updated by " +
                             std::string(r.name()) + " as a whole tensor, which needs " + std::to_string(u.bytes) +
                             " bytes in the device window (its fields and " + std::to_string(u.workspace) +
                             " bytes of workspace; " + std::to_string(u.pages) + " pages of " +
                             std::to_string(mem_->page_bytes()) + " bytes); the device budget is " +
                             std::to_string(budget) + " bytes");
  }
  return Status::Ok();
}

std::string StreamedEngine::RuleNames() const {
  std::string out;
  for (const auto& r : rules_) out += (out.empty() ? "" : ", ") + std::string(r->name());
  return out;
}

std::optional<uint32_t> StreamedEngine::RuleOfStored(const vfs::TensorInfo& t) const {
  for (uint32_t r = 0; r < rules_.size(); ++r) {
    const auto& fields = rules_[r]->Fields();
    if (fields.size() != t.fields.size()) continue;
    const bool exact = std::all_of(fields.begin(), fields.end(), [&](const RuleField& f) {
      const int i = t.FieldIndexOf(f.name);
      return i >= 0 && t.fields[i].dtype == f.dtype;
    });
    if (exact) return r;
  }
  for (uint32_t r = 0; r < rules_.size(); ++r) {
    const auto& fields = rules_[r]->Fields();
    const bool has = std::all_of(fields.begin(), fields.end(), [&](const RuleField& f) {
      return f.elems_per_value != 1 || t.FieldIndexOf(f.name) >= 0;
    });
    if (has) return r;
  }
  return std::nullopt;
}

bool StreamedEngine::HasParam(const std::string& name) const { return params_.Has(name); }

std::vector<std::string> StreamedEngine::ParamNames() const { return params_.Names(); }

uint64_t StreamedEngine::step_count(uint32_t group) const { return counts_.group(group); }

Result<uint64_t> StreamedEngine::param_step_count(const std::string& name) const {
  const Param* p = params_.Find(name);
  if (p == nullptr) {
    return NotFound("StreamedAdam::param_step_count: store " + store_->path() + " has no param '" + name + "'" +
                    (params_.retired(name) ? " in this run (retired)" : ""));
  }
  return counts_.tensor(p->info.id).value_or(0);
}

uint64_t StreamedEngine::last_generation() const { return counts_.last_generation(); }

bool StreamedEngine::prefetch_running() const { return prefetcher_->running(); }

bool StreamedEngine::commit_in_flight() const { return committer_->running(); }

Status StreamedEngine::EnsureIo() {
  if (io_) return Status::Ok();
  internal::EngineMemory* impl = mem_;
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

Status StreamedEngine::FitStaging() {
  internal::EngineMemory* impl = mem_;
  const uint64_t chunk = impl->page_bytes();
  internal::StateSlices s;
  for (const auto& [name, p] : params_.all()) {
    const internal::SliceLayout& layout = LayoutOf(p);
    const uint64_t slice_elems = layout.slice_elems();
    // A slice is small when each of its buffers fits a kSmallSliceBytes
    // piece (a whole slice never does: chunks are 2 MiB or more).
    const uint64_t small_elems = layout.ElemsFitting(internal::kSmallSliceBytes);
    const uint64_t n = p.info.numel;
    const UpdateRule& rule = *rules_[p.rule];
    uint64_t bytes = 0;
    for (const RuleField& f : rule.Fields()) bytes += (n + f.elems_per_value - 1) / f.elems_per_value * DTypeSize(f.dtype);
    (rule.unit() == SliceUnit::kTensor ? s.unit_bytes : s.slice_bytes) += bytes;
    s.big += n / slice_elems;
    const uint64_t tail = n % slice_elems;
    if (tail > small_elems) {
      ++s.big;
    } else if (tail > 0) {
      ++s.small;
    }
  }
  impl->GrowStaging(internal::StateStaging(impl->options(), MaxSliceSize(), chunk, s));
  state_slices_ = s;
  if (io_ && io_staging_ < impl->staging_count() && io_->in_flight() == 0) io_.reset();  // EnsureIo registers all
  return Status::Ok();
}

Status StreamedEngine::ResolveFields(Param* p) const {
  const UpdateRule& rule = *rules_[p->rule];
  for (uint32_t f = 0; f < rule.Fields().size(); ++f) {
    OPTSTATE_ASSIGN_OR_RETURN(p->fields[f], store_->FieldIndex(p->info, rule.Fields()[f].name));
  }
  return Status::Ok();
}

Hyperparams StreamedEngine::GroupHyper(const ParamGroup& g) {
  return {{"lr", g.lr},   {"beta1", g.beta1},       {"beta2", g.beta2},
          {"eps", g.eps}, {"weight_decay", g.weight_decay}, {"adamw", g.adamw ? 1.0 : 0.0}};
}

ParamGroup StreamedEngine::GroupOf(uint32_t id, const Hyperparams& h) {
  ParamGroup pg;
  pg.id = id;
  auto get = [&](const char* k, double def) {
    auto it = h.find(k);
    return it == h.end() ? def : it->second;
  };
  pg.lr = get("lr", pg.lr);
  pg.beta1 = get("beta1", pg.beta1);
  pg.beta2 = get("beta2", pg.beta2);
  pg.eps = get("eps", pg.eps);
  pg.weight_decay = get("weight_decay", pg.weight_decay);
  pg.adamw = get("adamw", 1.0) != 0.0;
  return pg;
}

Status StreamedEngine::SetGradScale(float grad_scale) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (step_.in_step()) return FailedPrecondition("StreamedAdam::SetGradScale: a step is in progress (store " +
                                          store_->path() + ")");
  OPTSTATE_RETURN_IF_ERROR(CheckGradScale(grad_scale, "StreamedAdam::SetGradScale", store_->path()));
  grad_scale_ = grad_scale;
  return Status::Ok();
}

}  // namespace optstate::memmgr::internal
