// The C ABI's streamed Adam (optstate/c.h "streamed Adam") over
// memmgr/streamed_adam.h: options, registration of params and shards, the
// step entry points, and commits. A handle maps the ids it hands out to param
// names.
#include "optstate/c.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "capi/internal/c_types.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "base/status.h"
#include "vfs/store.h"

using optstate::DType;
using optstate::InvalidArgument;
using optstate::NotFound;
using optstate::ParseMomentDType;
using optstate::Status;
using optstate::capi::internal::Guard;
using optstate::capi::internal::NullArgument;
namespace memmgr = optstate::memmgr;

namespace {

bool ValidFloatType(int t) {
  return t == OPTSTATE_F32 || t == OPTSTATE_BF16 || t == OPTSTATE_F16;
}

// The DType an optstate_dtype names (its values are DType's), or none for
// OPTSTATE_NONE and any other value.
std::optional<DType> FloatDTypeOrNone(int t) {
  if (!ValidFloatType(t)) return std::nullopt;
  return static_cast<DType>(t);
}

const char* DTypeArgName(int t) {
  switch (t) {
    case OPTSTATE_F32: return "f32";
    case OPTSTATE_BF16: return "bf16";
    case OPTSTATE_F16: return "f16";
    case OPTSTATE_NONE: return "none";
    default: return "unknown";
  }
}

Status ParamId(const optstate_adam_t* adam, uint32_t id, const char* what) {
  if (id >= adam->names.size()) {
    return NotFound(std::string(what) + ": no param with id " + std::to_string(id) + " (" +
                    std::to_string(adam->names.size()) + " registered on store " + adam->store->path() + ")");
  }
  return Status::Ok();
}

}  // namespace

extern "C" {

// ---- streamed Adam ----

optstate_adam_options_t* optstate_adam_options_create(void) { return new (std::nothrow) optstate_adam_options_t; }
void optstate_adam_options_destroy(optstate_adam_options_t* opts) { delete opts; }
void optstate_adam_options_set_grad_scale(optstate_adam_options_t* opts, float grad_scale) {
  opts->rep.grad_scale = grad_scale;
}
void optstate_adam_options_set_cpu_threads(optstate_adam_options_t* opts, int threads) {
  opts->rep.cpu_threads = threads;
}
void optstate_adam_options_set_durable_every_steps(optstate_adam_options_t* opts, uint32_t n) {
  opts->rep.durable_every_steps = n;
}
void optstate_adam_options_set_commit_lag_steps(optstate_adam_options_t* opts, uint32_t n) {
  opts->rep.commit_lag_steps = n;
}
uint32_t optstate_adam_options_commit_lag_steps(const optstate_adam_options_t* opts) {
  return opts->rep.commit_lag_steps;
}
int optstate_adam_options_set_moment_dtype(optstate_adam_options_t* opts, const char* dtype, char** errptr) {
  const char* what = "optstate_adam_options_set_moment_dtype";
  return Guard(errptr, what, [&]() -> Status {
    if (dtype == nullptr) return NullArgument(what, "dtype");
    OPTSTATE_ASSIGN_OR_RETURN(opts->rep.moment_dtype, ParseMomentDType(dtype));
    return Status::Ok();
  });
}

int optstate_adam_create(optstate_store_t* store, optstate_mm_t* mm, const optstate_adam_options_t* opts,
                         optstate_adam_t** out, char** errptr) {
  const char* what = "optstate_adam_create";
  return Guard(errptr, what, [&]() -> Status {
    if (out == nullptr) return NullArgument(what, "out");
    *out = nullptr;
    if (store == nullptr) return NullArgument(what, "store");
    if (mm == nullptr) return NullArgument(what, "mm");
    memmgr::StreamedAdamOptions ao = opts == nullptr ? memmgr::StreamedAdamOptions{} : opts->rep;
    auto adam = memmgr::StreamedAdam::Create(store->rep.get(), mm->rep.get(), ao);
    if (!adam.ok()) return adam.status();
    auto h = std::make_unique<optstate_adam_t>();
    h->rep = std::move(*adam);
    h->store = store->rep.get();
    h->store_handle = store;
    h->mm = mm->rep.get();
    {
      std::lock_guard<std::mutex> lock(store->open_mu);
      store->open_adams.insert(h.get());
    }
    *out = h.release();
    return Status::Ok();
  });
}
void optstate_adam_destroy(optstate_adam_t* adam) {
  if (adam == nullptr) return;
  if (adam->store_handle != nullptr) {
    std::lock_guard<std::mutex> lock(adam->store_handle->open_mu);
    adam->store_handle->open_adams.erase(adam);
  }
  delete adam;
}

int optstate_adam_set_group(optstate_adam_t* adam, uint32_t group, double lr, double beta1, double beta2,
                            double eps, double weight_decay, int adamw, char** errptr) {
  return Guard(errptr, "optstate_adam_set_group", [&] {
    memmgr::ParamGroup g;
    g.id = group;
    g.lr = lr;
    g.beta1 = beta1;
    g.beta2 = beta2;
    g.eps = eps;
    g.weight_decay = weight_decay;
    g.adamw = adamw != 0;
    return adam->rep->SetGroup(g);
  });
}

int optstate_adam_get_group(const optstate_adam_t* adam, uint32_t group, double* lr, double* beta1,
                            double* beta2, double* eps, double* weight_decay, int* adamw, char** errptr) {
  return Guard(errptr, "optstate_adam_get_group", [&]() -> Status {
    auto g = adam->rep->GetGroup(group);
    if (!g.ok()) return g.status();
    if (lr != nullptr) *lr = g->lr;
    if (beta1 != nullptr) *beta1 = g->beta1;
    if (beta2 != nullptr) *beta2 = g->beta2;
    if (eps != nullptr) *eps = g->eps;
    if (weight_decay != nullptr) *weight_decay = g->weight_decay;
    if (adamw != nullptr) *adamw = g->adamw ? 1 : 0;
    return Status::Ok();
  });
}

int optstate_adam_register_param(optstate_adam_t* adam, const char* name, uint64_t numel, uint32_t group,
                                 const void* initial, int initial_dtype, const uint64_t* shape, size_t ndim,
                                 uint32_t* id, int* existed, char** errptr) {
  return optstate_adam_register_shard(adam, name, numel, group, initial, initial_dtype, shape, ndim, nullptr, 0,
                                      nullptr, 0, id, existed, errptr);
}

}  // extern "C"

namespace {

// The ShardInfo of one registration, checked: shape's product is numel, a
// shard lies inside its global shape. `where` names the call, param and store.
Status ShardOf(const char* what, const std::string& where, uint64_t numel, const uint64_t* shape, size_t ndim,
               const uint64_t* global_shape, size_t global_ndim, const uint64_t* shard_offset, size_t offset_ndim,
               memmgr::ShardInfo* out) {
  memmgr::ShardInfo& shard = *out;
  if (ndim > 0) {
    if (shape == nullptr) return NullArgument(what, "shape");
    uint64_t product = 1;
    for (size_t i = 0; i < ndim; ++i) product *= shape[i];
    if (product != numel) {
      return InvalidArgument(where + ": shape has " + std::to_string(product) + " elements, numel is " +
                             std::to_string(numel));
    }
    shard.shape.assign(shape, shape + ndim);
  }
  if (global_ndim > 0) {
    if (global_shape == nullptr) return NullArgument(what, "global_shape");
    if (offset_ndim > 0 && shard_offset == nullptr) return NullArgument(what, "shard_offset");
    shard.global_shape.assign(global_shape, global_shape + global_ndim);
    if (offset_ndim > 0) shard.shard_offset.assign(shard_offset, shard_offset + offset_ndim);
    const std::vector<uint64_t> local = shard.shape.empty() ? std::vector<uint64_t>{numel} : shard.shape;
    const bool flat = local.size() == 1 && offset_ndim == 1 && global_ndim > 1;
    if (!flat && offset_ndim != 0 && (offset_ndim != global_ndim || local.size() != global_ndim)) {
      return InvalidArgument(where + ": shape, global_shape and shard_offset have ranks " +
                             std::to_string(local.size()) + ", " + std::to_string(global_ndim) + " and " +
                             std::to_string(offset_ndim) +
                             " (a box: all the same; a flat range: shape and shard_offset 1)");
    }
    unsigned __int128 global_numel = 1;
    for (uint64_t d : shard.global_shape) global_numel *= d;
    bool inside = true;
    if (flat) {
      inside = static_cast<unsigned __int128>(shard.shard_offset[0]) + numel <= global_numel;
    } else if (local.size() == global_ndim) {
      for (size_t d = 0; d < global_ndim; ++d) {
        const uint64_t off = shard.shard_offset.empty() ? 0 : shard.shard_offset[d];
        inside = inside && off <= global_shape[d] && local[d] <= global_shape[d] - off;
      }
    } else {
      inside = false;
    }
    if (!inside) {
      std::string g, o, l;
      for (uint64_t d : shard.global_shape) g += (g.empty() ? "" : ", ") + std::to_string(d);
      for (uint64_t d : shard.shard_offset) o += (o.empty() ? "" : ", ") + std::to_string(d);
      for (uint64_t d : local) l += (l.empty() ? "" : ", ") + std::to_string(d);
      return InvalidArgument(where + ": the shard of shape [" + l + "] at offset [" + o +
                             "] is not inside the global shape [" + g + "]");
    }
  }
  return Status::Ok();
}

// The handle's id of a registered name (a new one for a name seen first).
uint32_t IdOf(optstate_adam_t* adam, const std::string& n) {
  auto it = adam->ids.find(n);
  if (it == adam->ids.end()) {
    it = adam->ids.emplace(n, static_cast<uint32_t>(adam->names.size())).first;
    adam->names.push_back(n);
  }
  return it->second;
}

}  // namespace

extern "C" {

int optstate_adam_register_shard(optstate_adam_t* adam, const char* name, uint64_t numel, uint32_t group,
                                 const void* initial, int initial_dtype, const uint64_t* shape, size_t ndim,
                                 const uint64_t* global_shape, size_t global_ndim, const uint64_t* shard_offset,
                                 size_t offset_ndim, uint32_t* id, int* existed, char** errptr) {
  const char* what = global_ndim > 0 ? "optstate_adam_register_shard" : "optstate_adam_register_param";
  return Guard(errptr, what, [&]() -> Status {
    if (name == nullptr) return NullArgument(what, "name");
    if (id == nullptr) return NullArgument(what, "id");
    const std::string n(name);
    const std::string where = std::string(what) + " " + n + " (store " + adam->store->path() + ")";
    if (initial != nullptr && !ValidFloatType(initial_dtype)) {
      return InvalidArgument(where + ": initial values dtype " + DTypeArgName(initial_dtype) +
                             " not supported (f32, bf16, f16)");
    }
    memmgr::ShardInfo shard;
    OPTSTATE_RETURN_IF_ERROR(
        ShardOf(what, where, numel, shape, ndim, global_shape, global_ndim, shard_offset, offset_ndim, &shard));
    const bool had = adam->rep->HasParam(n);
    OPTSTATE_RETURN_IF_ERROR(adam->rep->RegisterParam(n, numel, group, initial,
                                                      FloatDTypeOrNone(initial_dtype), shard));
    *id = IdOf(adam, n);
    if (existed != nullptr) *existed = had ? 1 : 0;
    return Status::Ok();
  });
}

int optstate_adam_register_params(optstate_adam_t* adam, size_t n, const char* const* names, const uint64_t* numels,
                                  const uint32_t* groups, const void* const* initials, const int* initial_dtypes,
                                  const size_t* ndims, const uint64_t* shapes, const size_t* global_ndims,
                                  const uint64_t* global_shapes, const size_t* offset_ndims,
                                  const uint64_t* shard_offsets, uint32_t* ids, int* existed, char** errptr) {
  const char* what = "optstate_adam_register_params";
  return Guard(errptr, what, [&]() -> Status {
    if (n == 0) return Status::Ok();
    if (names == nullptr) return NullArgument(what, "names");
    if (numels == nullptr) return NullArgument(what, "numels");
    if (groups == nullptr) return NullArgument(what, "groups");
    if (ids == nullptr) return NullArgument(what, "ids");
    if (initials != nullptr && initial_dtypes == nullptr) return NullArgument(what, "initial_dtypes");
    std::vector<memmgr::StreamedAdam::ParamSpec> specs(n);
    size_t at_shape = 0, at_global = 0, at_offset = 0;
    for (size_t i = 0; i < n; ++i) {
      if (names[i] == nullptr) return NullArgument(what, ("names[" + std::to_string(i) + "]").c_str());
      memmgr::StreamedAdam::ParamSpec& r = specs[i];
      r.name = names[i];
      r.numel = numels[i];
      r.group = groups[i];
      r.d_initial = initials != nullptr ? initials[i] : nullptr;
      const int dtype = initial_dtypes != nullptr ? initial_dtypes[i] : OPTSTATE_NONE;
      const std::string where = std::string(what) + " " + r.name + " (store " + adam->store->path() + ")";
      if (r.d_initial != nullptr && !ValidFloatType(dtype)) {
        return InvalidArgument(where + ": initial values dtype " + DTypeArgName(dtype) +
                               " not supported (f32, bf16, f16)");
      }
      r.initial_type = FloatDTypeOrNone(dtype);
      const size_t nd = ndims != nullptr ? ndims[i] : 0;
      const size_t gd = global_ndims != nullptr ? global_ndims[i] : 0;
      const size_t od = offset_ndims != nullptr ? offset_ndims[i] : 0;
      OPTSTATE_RETURN_IF_ERROR(ShardOf(what, where, r.numel, shapes == nullptr ? nullptr : shapes + at_shape, nd,
                                       global_shapes == nullptr ? nullptr : global_shapes + at_global, gd,
                                       shard_offsets == nullptr ? nullptr : shard_offsets + at_offset, od,
                                       &r.shard));
      at_shape += nd;
      at_global += gd;
      at_offset += od;
    }
    std::vector<bool> had;
    OPTSTATE_RETURN_IF_ERROR(adam->rep->RegisterParams(specs, &had));
    for (size_t i = 0; i < n; ++i) {
      ids[i] = IdOf(adam, specs[i].name);
      if (existed != nullptr) existed[i] = had[i] ? 1 : 0;
    }
    return Status::Ok();
  });
}

int optstate_adam_param_numel(const optstate_adam_t* adam, uint32_t id, uint64_t* numel, char** errptr) {
  const char* what = "optstate_adam_param_numel";
  return Guard(errptr, what, [&]() -> Status {
    if (numel == nullptr) return NullArgument(what, "numel");
    OPTSTATE_RETURN_IF_ERROR(ParamId(adam, id, what));
    auto info = adam->store->FindTensor(adam->names[id]);
    if (!info.ok()) return info.status();
    *numel = info->numel;
    return Status::Ok();
  });
}

}  // extern "C"

namespace {

// Both step entry points: builds the ParamGrad list (reused between steps),
// checks what the C side can, and runs one StreamedAdam::Step.
Status AdamStep(const char* what, optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                const int* grad_dtypes, const uint64_t* numels, void* const* params, const int* param_dtypes,
                const float* found_inf, float grad_scale, const float* d_grad_scale) {
  if (n > 0 && (ids == nullptr || grads == nullptr || grad_dtypes == nullptr)) {
    return NullArgument(what, "ids, grads or grad_dtypes");
  }
  if (params != nullptr && param_dtypes == nullptr) return NullArgument(what, "param_dtypes");
  if (!(grad_scale >= 0.0f) || !std::isfinite(grad_scale)) {
    return InvalidArgument(std::string(what) + ": store " + adam->store->path() + ": grad_scale " +
                           std::to_string(grad_scale) + " is not a finite number >= 0");
  }
  auto& pg = adam->grads;
  pg.resize(n);
  for (size_t i = 0; i < n; ++i) {
    OPTSTATE_RETURN_IF_ERROR(ParamId(adam, ids[i], what));
    memmgr::ParamGrad& g = pg[i];
    g.name = adam->names[ids[i]];
    g.d_grad = grads[i];
    g.grad_type = static_cast<DType>(grad_dtypes[i]);
    g.d_param = params == nullptr ? nullptr : params[i];
    if (params != nullptr && param_dtypes[i] != OPTSTATE_NONE) g.param_type = static_cast<DType>(param_dtypes[i]);
    // StreamedAdam checks it against the registered numel before any kernel runs.
    g.numel = numels == nullptr ? 0 : numels[i];
    if (numels != nullptr && numels[i] == 0) {
      return InvalidArgument(std::string(what) + ": param " + g.name + " (store " + adam->store->path() +
                             "): numels[" + std::to_string(i) + "] is 0; a gradient has the param's elements");
    }
    if (!ValidFloatType(grad_dtypes[i])) {
      return InvalidArgument(std::string(what) + ": param " + g.name + ": gradient dtype " +
                             DTypeArgName(grad_dtypes[i]) + " not supported (f32, bf16, f16)");
    }
    if (g.d_param != nullptr && !ValidFloatType(param_dtypes[i])) {
      return InvalidArgument(std::string(what) + ": param " + g.name + ": param dtype " +
                             DTypeArgName(param_dtypes[i]) + " not supported (f32, bf16, f16)");
    }
  }
  if (grad_scale > 0.0f) OPTSTATE_RETURN_IF_ERROR(adam->rep->SetGradScale(grad_scale));
  return adam->rep->Step(std::span<const memmgr::ParamGrad>(pg.data(), n), found_inf, d_grad_scale);
}

}  // namespace

extern "C" {

int optstate_adam_step(optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                       const int* grad_dtypes, void* const* params, const int* param_dtypes,
                       const float* found_inf, float grad_scale, char** errptr) {
  const char* what = "optstate_adam_step";
  return Guard(errptr, what, [&] {
    return AdamStep(what, adam, n, ids, grads, grad_dtypes, nullptr, params, param_dtypes, found_inf, grad_scale,
                    nullptr);
  });
}

int optstate_adam_step2(optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                        const int* grad_dtypes, const uint64_t* numels, void* const* params,
                        const int* param_dtypes, const float* found_inf, const float* grad_scale,
                        char** errptr) {
  const char* what = "optstate_adam_step2";
  return Guard(errptr, what, [&] {
    return AdamStep(what, adam, n, ids, grads, grad_dtypes, numels, params, param_dtypes, found_inf, 0.0f,
                    grad_scale);
  });
}

int optstate_adam_retire_param(optstate_adam_t* adam, const char* name, char** errptr) {
  const char* what = "optstate_adam_retire_param";
  return Guard(errptr, what, [&]() -> Status {
    if (name == nullptr) return NullArgument(what, "name");
    return adam->rep->RetireParam(name);  // its messages name the store and the param
  });
}

int optstate_adam_last_step_skipped(const optstate_adam_t* adam) { return adam->rep->last_step_skipped() ? 1 : 0; }
double optstate_adam_last_step_seconds(const optstate_adam_t* adam) { return adam->rep->last_step_stats().seconds; }

int optstate_adam_prefetch(optstate_adam_t* adam, char** errptr) {
  return Guard(errptr, "optstate_adam_prefetch", [&]() -> Status { return adam->rep->Prefetch(); });
}

void optstate_adam_last_step_prefetch(const optstate_adam_t* adam, uint64_t* hit_bytes, uint64_t* read_bytes) {
  const memmgr::StreamedAdam::StepStats& st = adam->rep->last_step_stats();
  if (hit_bytes != nullptr) *hit_bytes = st.prefetch_hit_bytes;
  if (read_bytes != nullptr) *read_bytes = st.prefetch_read_bytes;
}

int optstate_adam_load_main(optstate_adam_t* adam, uint32_t id, const void* weights, int dtype, char** errptr) {
  const char* what = "optstate_adam_load_main";
  return Guard(errptr, what, [&]() -> Status {
    OPTSTATE_RETURN_IF_ERROR(ParamId(adam, id, what));
    if (!ValidFloatType(dtype)) {
      return InvalidArgument(std::string(what) + ": param " + adam->names[id] + ": dtype " + DTypeArgName(dtype) +
                             " not supported (f32, bf16, f16)");
    }
    return adam->rep->LoadMainFrom(adam->names[id], weights, static_cast<DType>(dtype));
  });
}

int optstate_adam_make_durable(optstate_adam_t* adam, uint64_t* generation, char** errptr) {
  return Guard(errptr, "optstate_adam_make_durable", [&]() -> Status {
    auto g = adam->rep->MakeDurable();
    if (!g.ok()) return g.status();
    if (generation != nullptr) *generation = *g;
    return Status::Ok();
  });
}

int optstate_adam_commit(optstate_adam_t* adam, uint64_t* generation, char** errptr) {
  const char* what = "optstate_adam_commit";
  return Guard(errptr, what, [&]() -> Status {
    memmgr::StreamedAdam* a = adam->rep.get();
    OPTSTATE_RETURN_IF_ERROR(a->WaitForCommit());  // a step's commit in flight is not "pending" here
    const uint64_t before = a->last_generation();
    // Cached steps, registrations and loaded mains: MakeDurable flushes the
    // manager and publishes pinned writes with them.
    auto g = a->MakeDurable();
    if (!g.ok()) return g.status();
    if (*g == before) {
      OPTSTATE_RETURN_IF_ERROR(adam->mm->Flush());
      auto st = adam->store->Stats();
      if (!st.ok()) return st.status();
      if (st->pending_bytes > 0) {
        // Pinned writes alone: a step over no params flushes and commits them
        // through the optimizer (its generation and counts stay current) with
        // the step counts unchanged; it records the last commit's trainer step.
        const uint64_t step = a->global_step();
        a->set_global_step(step > 0 ? step - 1 : 0);
        Status s = a->Step(std::span<const memmgr::ParamGrad>());
        a->set_global_step(step);
        OPTSTATE_RETURN_IF_ERROR(s);
        // With durable_every_steps > 1 that step may live in the host cache only.
        if (a->last_generation() == before) {
          g = a->MakeDurable();
          if (!g.ok()) return g.status();
        }
      }
    }
    if (generation != nullptr) *generation = a->last_generation();
    return Status::Ok();
  });
}

uint64_t optstate_adam_step_count(const optstate_adam_t* adam, uint32_t group) {
  return adam->rep->step_count(group);
}
int optstate_adam_param_step_count(const optstate_adam_t* adam, const char* name, uint64_t* out, char** errptr) {
  const char* what = "optstate_adam_param_step_count";
  return Guard(errptr, what, [&]() -> Status {
    if (name == nullptr) return NullArgument(what, "name");
    if (out == nullptr) return NullArgument(what, "out");
    auto n = adam->rep->param_step_count(name);
    if (!n.ok()) return n.status();
    *out = *n;
    return Status::Ok();
  });
}
uint64_t optstate_adam_last_generation(const optstate_adam_t* adam) { return adam->rep->last_generation(); }
uint64_t optstate_adam_global_step(const optstate_adam_t* adam) { return adam->rep->global_step(); }
void optstate_adam_set_global_step(optstate_adam_t* adam, uint64_t step) { adam->rep->set_global_step(step); }
uint64_t optstate_adam_uncommitted_steps(const optstate_adam_t* adam) { return adam->rep->uncommitted_steps(); }

}  // extern "C"
