// The C ABI's streamed Adam (optstate/c.h "streamed Adam") over
// memmgr/streamed_adam.h: options, registration of params and shards, the
// step entry points, and commits. A handle maps the ids it hands out to param
// names.
#include "optstate/c.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
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
#include "memmgr/rules.h"
#include "memmgr/streamed_adam.h"
#include "memmgr/update_rule.h"
#include "base/dtype.h"
#include "base/status.h"
#include "kernels/adam.h"
#include "vfs/reshard.h"
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

// The DType an optstate_dtype names when it is a float (f32, bf16, f16: what
// a gradient, a parameter copy or initial values may be); none for
// OPTSTATE_NONE and any other value.
std::optional<DType> FloatDTypeOrNone(int t) {
  if (t < 0 || t >= optstate::kernels::kNoDTypeCode) return std::nullopt;
  const DType d = static_cast<DType>(t);
  return optstate::IsFloat(d) ? std::optional<DType>(d) : std::nullopt;
}

bool ValidFloatType(int t) { return FloatDTypeOrNone(t).has_value(); }

// base's name of an optstate_dtype ("f32", ..., "q8u"), "none" for
// OPTSTATE_NONE, "unknown (<t>)" outside the table.
std::string DTypeArgName(int t) {
  if (t == OPTSTATE_NONE) return "none";
  const char* name = t >= 0 && t < optstate::kernels::kNoDTypeCode ? optstate::DTypeName(static_cast<DType>(t)) : "?";
  return name[0] != '?' ? std::string(name) : "unknown (" + std::to_string(t) + ")";
}

Status ParamId(const optstate_adam_t* adam, uint32_t id, const char* what) {
  if (id >= adam->names.size()) {
    return NotFound(std::string(what) + ": no param with id " + std::to_string(id) + " (" +
                    std::to_string(adam->names.size()) + " registered on store " + adam->store->path() + ")");
  }
  return Status::Ok();
}

// The update rules the options name (optstate_adam_options_add_rule, else
// the one of optstate_adam_options_set_rule); a single "adamw" is left null
// (the engine's default, with opts.moment_dtype moments).
Status MakeRules(const optstate_adam_options_t* opts, const memmgr::StreamedAdamOptions& ao,
                 std::vector<std::unique_ptr<memmgr::UpdateRule>>* rules, std::vector<std::string>* names) {
  std::vector<std::pair<std::string, std::optional<optstate::MomentDType>>> wanted;
  if (opts != nullptr && !opts->rules.empty()) {
    wanted = opts->rules;
  } else {
    wanted.emplace_back(opts == nullptr ? "adamw" : opts->rule, std::nullopt);
  }
  for (const auto& [name, dtype] : wanted) {
    names->push_back(name);
    if (wanted.size() == 1 && name == "adamw" && !dtype) {
      rules->push_back(nullptr);
      continue;
    }
    auto rule = memmgr::NewRuleByName(name, dtype.value_or(ao.moment_dtype));
    if (!rule.ok()) return InvalidArgument("optstate_adam_create: " + rule.status().message());
    rules->push_back(std::move(*rule));
  }
  return Status::Ok();
}

// The Adam-shaped group calls (lr, betas, eps, weight_decay, adamw) mean
// nothing for another rule's hyperparameters: kFailedPrecondition naming the
// rule, its store and the by-name call to use instead.
Status RequireAdamW(const optstate_adam_t* adam, const char* what, const char* instead) {
  const auto& names = adam->rule_names;
  if (std::find(names.begin(), names.end(), "adamw") != names.end()) return Status::Ok();
  std::string rules;
  for (const std::string& t : adam->rule_titles) rules += (rules.empty() ? "" : " and ") + t;
  return optstate::FailedPrecondition(std::string(what) + ": the optimizer on store " + adam->store->path() +
                                      " runs the " + rules + (names.size() == 1 ? " rule, whose" : " rules, whose") +
                                      " hyperparameters are not AdamW's (lr, betas, eps, "
                                      "weight_decay, adamw); use " + instead + " (by the rule's names)");
}

// names as a malloc'ed block of NUL-terminated strings, back to back.
char* JoinNames(const std::vector<std::string>& names) {
  size_t bytes = 0;
  for (const std::string& n : names) bytes += n.size() + 1;
  char* out = static_cast<char*>(std::malloc(std::max<size_t>(bytes, 1)));
  if (out == nullptr) return nullptr;
  char* at = out;
  for (const std::string& n : names) {
    std::memcpy(at, n.c_str(), n.size() + 1);
    at += n.size() + 1;
  }
  return out;
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

int optstate_adam_options_set_rule(optstate_adam_options_t* opts, const char* rule, char** errptr) {
  const char* what = "optstate_adam_options_set_rule";
  return Guard(errptr, what, [&]() -> Status {
    if (rule == nullptr) return NullArgument(what, "rule");
    const std::string r(rule);
    if (!memmgr::IsRuleName(r)) {
      return InvalidArgument(std::string(what) + ": rule '" + r + "' is not one of adamw, lion, sgd, sgd_plain, muon");
    }
    opts->rule = r;
    return Status::Ok();
  });
}

int optstate_adam_options_add_rule(optstate_adam_options_t* opts, const char* rule, const char* moment_dtype,
                                   char** errptr) {
  const char* what = "optstate_adam_options_add_rule";
  return Guard(errptr, what, [&]() -> Status {
    if (opts == nullptr) return NullArgument(what, "opts");
    if (rule == nullptr) return NullArgument(what, "rule");
    const std::string r(rule);
    if (!memmgr::IsRuleName(r)) {
      return InvalidArgument(std::string(what) + ": rule '" + r + "' is not one of adamw, lion, sgd, sgd_plain, muon");
    }
    if (opts->rules.size() >= memmgr::StreamedAdam::kMaxRules) {
      return InvalidArgument(std::string(what) + ": at most " + std::to_string(memmgr::StreamedAdam::kMaxRules) +
                             " rules");
    }
    std::optional<optstate::MomentDType> dtype;
    if (moment_dtype != nullptr) {
      OPTSTATE_ASSIGN_OR_RETURN(dtype, ParseMomentDType(moment_dtype));
    }
    opts->rules.emplace_back(r, dtype);
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
    std::vector<std::unique_ptr<memmgr::UpdateRule>> rules;
    std::vector<std::string> rule_names;
    OPTSTATE_RETURN_IF_ERROR(MakeRules(opts, ao, &rules, &rule_names));
    std::vector<std::string> rule_titles;  // as the rules name themselves ("AdamW", "Lion")
    for (const auto& rule : rules) rule_titles.emplace_back(rule != nullptr ? rule->name() : "AdamW");
    std::vector<std::string> fields;
    auto add_field = [&](const std::string& f) {
      if (std::find(fields.begin(), fields.end(), f) == fields.end()) fields.push_back(f);
    };
    for (const auto& rule : rules) {
      if (rule != nullptr) {
        for (const memmgr::RuleField& f : rule->Fields()) add_field(f.name);
        continue;
      }
      for (const char* f : {"main", "exp_avg", "exp_avg_sq"}) add_field(f);
      if (ao.moment_dtype == optstate::MomentDType::kQ8) {
        add_field(optstate::vfs::Q8ScalesField("exp_avg"));
        add_field(optstate::vfs::Q8ScalesField("exp_avg_sq"));
      }
    }
    auto adam = rules.size() == 1
                    ? memmgr::StreamedAdam::Create(store->rep.get(), mm->rep.get(), ao, std::move(rules[0]))
                    : memmgr::StreamedAdam::Create(store->rep.get(), mm->rep.get(), ao, std::move(rules));
    if (!adam.ok()) return adam.status();
    auto h = std::make_unique<optstate_adam_t>();
    h->rep = std::move(*adam);
    h->fields = std::move(fields);
    h->rule_names = std::move(rule_names);
    h->rule_titles = std::move(rule_titles);
    h->store = store->rep.get();
    h->mm_handle = mm;
    h->mm = mm->rep.get();
    {
      // mm->store is store: Create refused a manager of another store.
      optstate::MutexLock lock(&mm->store->open_mu);
      mm->store->open_adams.insert(h.get());
      ++mm->adams;
    }
    *out = h.release();
    return Status::Ok();
  });
}
void optstate_adam_destroy(optstate_adam_t* adam) {
  if (adam == nullptr) return;
  optstate_mm_t* mm = adam->mm_handle;
  optstate_store_t* store = mm->store;  // the optimizer's store handle (optstate_adam_create)
  {
    // Out of open_adams (nothing waits on its commits any more), but still
    // counted: its manager and store stay until it has written and committed
    // what it holds.
    optstate::MutexLock lock(&mm->store->open_mu);
    mm->store->open_adams.erase(adam);
    ++mm->store->adams_destroying;
  }
  delete adam;
  bool destroy_mm = false;
  {
    optstate::MutexLock lock(&mm->store->open_mu);
    --mm->store->adams_destroying;
    destroy_mm = --mm->adams == 0 && mm->destroy_requested;
  }
  if (destroy_mm) {
    optstate::capi::internal::DestroyManager(mm);  // closes the store too when that was requested
  } else {
    optstate::capi::internal::CloseStoreIfRequested(store);
  }
}

int optstate_adam_set_group(optstate_adam_t* adam, uint32_t group, double lr, double beta1, double beta2,
                            double eps, double weight_decay, int adamw, char** errptr) {
  const char* what = "optstate_adam_set_group";
  return Guard(errptr, what, [&]() -> Status {
    OPTSTATE_RETURN_IF_ERROR(RequireAdamW(adam, what, "optstate_adam_set_group_hyper"));
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
  const char* what = "optstate_adam_get_group";
  return Guard(errptr, what, [&]() -> Status {
    OPTSTATE_RETURN_IF_ERROR(RequireAdamW(adam, what, "optstate_adam_get_group_hyper"));
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

int optstate_adam_set_group_hyper(optstate_adam_t* adam, uint32_t group, size_t n, const char* const* names,
                                  const double* values, char** errptr) {
  const char* what = "optstate_adam_set_group_hyper";
  return Guard(errptr, what, [&]() -> Status {
    if (n > 0 && names == nullptr) return NullArgument(what, "names");
    if (n > 0 && values == nullptr) return NullArgument(what, "values");
    memmgr::Hyperparams h;
    for (size_t i = 0; i < n; ++i) {
      if (names[i] == nullptr) return NullArgument(what, "names[i]");
      h[names[i]] = values[i];
    }
    return adam->rep->SetGroupHyperparams(group, h);
  });
}

int optstate_adam_get_group_hyper(const optstate_adam_t* adam, uint32_t group, char** names, double** values,
                                  size_t* n, char** errptr) {
  const char* what = "optstate_adam_get_group_hyper";
  return Guard(errptr, what, [&]() -> Status {
    if (names == nullptr) return NullArgument(what, "names");
    if (values == nullptr) return NullArgument(what, "values");
    if (n == nullptr) return NullArgument(what, "n");
    auto h = adam->rep->GetGroupHyperparams(group);
    if (!h.ok()) return h.status();
    std::vector<std::string> keys;
    double* vals = static_cast<double*>(std::malloc(sizeof(double) * std::max<size_t>(h->size(), 1)));
    if (vals == nullptr) return optstate::ResourceExhausted(std::string(what) + ": out of memory");
    for (const auto& [k, v] : *h) {
      vals[keys.size()] = v;
      keys.push_back(k);
    }
    char* joined = JoinNames(keys);
    if (joined == nullptr) {
      std::free(vals);
      return optstate::ResourceExhausted(std::string(what) + ": out of memory");
    }
    *names = joined;
    *values = vals;
    *n = keys.size();
    return Status::Ok();
  });
}

int optstate_adam_fields(const optstate_adam_t* adam, char** names, size_t* n, char** errptr) {
  const char* what = "optstate_adam_fields";
  return Guard(errptr, what, [&]() -> Status {
    if (names == nullptr) return NullArgument(what, "names");
    if (n == nullptr) return NullArgument(what, "n");
    char* joined = JoinNames(adam->fields);
    if (joined == nullptr) return optstate::ResourceExhausted(std::string(what) + ": out of memory");
    *names = joined;
    *n = adam->fields.size();
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

// The ShardInfo of one registration, checked (vfs::CheckShardGeometry: shape's
// product is numel, a shard lies inside its global shape). `where` names the
// call, param and store.
Status ShardOf(const char* what, const std::string& where, uint64_t numel, const uint64_t* shape, size_t ndim,
               const uint64_t* global_shape, size_t global_ndim, const uint64_t* shard_offset, size_t offset_ndim,
               memmgr::ShardInfo* out) {
  memmgr::ShardInfo& shard = *out;
  if (ndim > 0 && shape == nullptr) return NullArgument(what, "shape");
  if (global_ndim > 0 && global_shape == nullptr) return NullArgument(what, "global_shape");
  if (global_ndim > 0 && offset_ndim > 0 && shard_offset == nullptr) return NullArgument(what, "shard_offset");
  if (ndim > 0) shard.shape.assign(shape, shape + ndim);
  if (global_ndim > 0) {
    shard.global_shape.assign(global_shape, global_shape + global_ndim);
    if (offset_ndim > 0) shard.shard_offset.assign(shard_offset, shard_offset + offset_ndim);
  }
  // The geometry the store will record (its defaults: the whole tensor, at 0).
  const std::vector<uint64_t> local = shard.shape.empty() ? std::vector<uint64_t>{numel} : shard.shape;
  const std::vector<uint64_t> global = shard.global_shape.empty() ? local : shard.global_shape;
  const std::vector<uint64_t> offset =
      shard.shard_offset.empty() ? std::vector<uint64_t>(global.size(), 0) : shard.shard_offset;
  Status st = optstate::vfs::CheckShardGeometry(numel, local, global, offset);
  return st.ok() ? st : InvalidArgument(where + ": " + st.message());
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

// optstate_adam_register_params(2): rules null = every param rule 0.
int RegisterParams(const char* what, optstate_adam_t* adam, size_t n, const char* const* names,
                   const uint64_t* numels, const uint32_t* groups, const uint32_t* rules,
                   const void* const* initials, const int* initial_dtypes, const size_t* ndims,
                   const uint64_t* shapes, const size_t* global_ndims, const uint64_t* global_shapes,
                   const size_t* offset_ndims, const uint64_t* shard_offsets, uint32_t* ids, int* existed,
                   char** errptr) {
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
      r.rule = rules != nullptr ? rules[i] : 0;
      if (r.rule >= adam->rule_names.size()) {
        return InvalidArgument(where + ": rule index " + std::to_string(r.rule) + " but the optimizer has " +
                               std::to_string(adam->rule_names.size()) + " rule(s)");
      }
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
  return RegisterParams("optstate_adam_register_params", adam, n, names, numels, groups, nullptr, initials,
                        initial_dtypes, ndims, shapes, global_ndims, global_shapes, offset_ndims, shard_offsets, ids,
                        existed, errptr);
}

int optstate_adam_register_params_with(optstate_adam_t* adam, const optstate_adam_register_args_t* args,
                                       char** errptr) {
  const char* what = "optstate_adam_register_params_with";
  // The fields of ABI version 4 (later versions append).
  constexpr size_t kRegisterArgsV4Bytes = offsetof(optstate_adam_register_args_t, existed) + sizeof(int*);
  if (args == nullptr || args->struct_size < kRegisterArgsV4Bytes) {
    return Guard(errptr, what, [&]() -> Status {
      if (args == nullptr) return NullArgument(what, "args");
      return InvalidArgument(std::string(what) + ": store " + adam->store->path() + ": args->struct_size " +
                             std::to_string(args->struct_size) + " is less than the " +
                             std::to_string(kRegisterArgsV4Bytes) +
                             " bytes of optstate_adam_register_args_t (set it to "
                             "sizeof(optstate_adam_register_args_t))");
    });
  }
  // Fields appended after the caller's version read as zero (not given).
  optstate_adam_register_args_t a{};
  std::memcpy(&a, args, std::min(args->struct_size, sizeof a));
  return RegisterParams(what, adam, a.n, a.names, a.numels, a.groups, a.rules, a.initials, a.initial_dtypes, a.ndims,
                        a.shapes, a.global_ndims, a.global_shapes, a.offset_ndims, a.shard_offsets, a.ids,
                        a.existed, errptr);
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

// Builds the step's ParamGrad list (adam->grads, reused between steps) and
// checks what the C side can, before anything changes.
Status BuildGrads(const char* what, optstate_adam_t* adam, const optstate_adam_step_args_t& a) {
  const size_t n = a.n;
  if (n > 0 && (a.ids == nullptr || a.grads == nullptr || a.grad_dtypes == nullptr)) {
    return NullArgument(what, "ids, grads or grad_dtypes");
  }
  if (a.params != nullptr && a.param_dtypes == nullptr) return NullArgument(what, "param_dtypes");
  auto& pg = adam->grads;
  pg.resize(n);
  for (size_t i = 0; i < n; ++i) {
    OPTSTATE_RETURN_IF_ERROR(ParamId(adam, a.ids[i], what));
    memmgr::ParamGrad& g = pg[i];
    g.name = adam->names[a.ids[i]];
    g.d_grad = a.grads[i];
    g.d_param = a.params == nullptr ? nullptr : a.params[i];
    // StreamedAdam checks it against the registered numel before any kernel runs.
    g.numel = a.numels == nullptr ? 0 : a.numels[i];
    if (a.numels != nullptr && a.numels[i] == 0) {
      return InvalidArgument(std::string(what) + ": param " + g.name + " (store " + adam->store->path() +
                             "): numels[" + std::to_string(i) + "] is 0; a gradient has the param's elements");
    }
    const std::optional<DType> grad_type = FloatDTypeOrNone(a.grad_dtypes[i]);
    if (!grad_type) {
      return InvalidArgument(std::string(what) + ": param " + g.name + ": gradient dtype " +
                             DTypeArgName(a.grad_dtypes[i]) + " not supported (f32, bf16, f16)");
    }
    g.grad_type = *grad_type;
    g.param_type = std::nullopt;
    if (g.d_param != nullptr) {
      g.param_type = FloatDTypeOrNone(a.param_dtypes[i]);
      if (!g.param_type) {
        return InvalidArgument(std::string(what) + ": param " + g.name + ": param dtype " +
                               DTypeArgName(a.param_dtypes[i]) + " not supported (f32, bf16, f16)");
      }
    }
  }
  return Status::Ok();
}

// The step over the list BuildGrads made.
Status AdamStep(const char* what, optstate_adam_t* adam, const optstate_adam_step_args_t& a) {
  OPTSTATE_RETURN_IF_ERROR(BuildGrads(what, adam, a));
  return adam->rep->Step(std::span<const memmgr::ParamGrad>(adam->grads.data(), a.n), a.found_inf, a.grad_scale);
}

// The step arguments of the two older step calls.
optstate_adam_step_args_t ArgsOf(size_t n, const uint32_t* ids, const void* const* grads, const int* grad_dtypes,
                                 const uint64_t* numels, void* const* params, const int* param_dtypes,
                                 const float* found_inf, const float* grad_scale) {
  // In the struct's field order (optstate/c.h).
  return optstate_adam_step_args_t{sizeof(optstate_adam_step_args_t), n, ids, grads, grad_dtypes, numels,
                                   params, param_dtypes, found_inf, grad_scale};
}

// The fields optstate_adam_step_args_t had when it was added (ABI version 2):
// what struct_size must at least cover.
constexpr size_t kStepArgsV1Bytes = offsetof(optstate_adam_step_args_t, grad_scale) + sizeof(const float*);

}  // namespace

extern "C" {

int optstate_adam_step_with(optstate_adam_t* adam, const optstate_adam_step_args_t* args, char** errptr) {
  const char* what = "optstate_adam_step_with";
  return Guard(errptr, what, [&]() -> Status {
    if (args == nullptr) return NullArgument(what, "args");
    if (args->struct_size < kStepArgsV1Bytes) {
      return InvalidArgument(std::string(what) + ": store " + adam->store->path() + ": args->struct_size " +
                             std::to_string(args->struct_size) + " is less than the " +
                             std::to_string(kStepArgsV1Bytes) +
                             " bytes of optstate_adam_step_args_t (set it to sizeof(optstate_adam_step_args_t))");
    }
    // Fields appended after the caller's version read as zero (not given).
    optstate_adam_step_args_t a{};
    std::memcpy(&a, args, std::min(args->struct_size, sizeof a));
    return AdamStep(what, adam, a);
  });
}

int optstate_adam_set_grad_scale(optstate_adam_t* adam, float grad_scale, char** errptr) {
  const char* what = "optstate_adam_set_grad_scale";
  return Guard(errptr, what, [&] { return adam->rep->SetGradScale(grad_scale).WithContext(what); });
}

int optstate_adam_step(optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                       const int* grad_dtypes, void* const* params, const int* param_dtypes,
                       const float* found_inf, float grad_scale, char** errptr) {
  const char* what = "optstate_adam_step";
  return Guard(errptr, what, [&]() -> Status {
    // 0 keeps the standing scale.
    if (!(grad_scale >= 0.0f) || !std::isfinite(grad_scale)) {
      return InvalidArgument(std::string(what) + ": store " + adam->store->path() + ": grad_scale " +
                             std::to_string(grad_scale) + " is not a finite number >= 0");
    }
    const optstate_adam_step_args_t a =
        ArgsOf(n, ids, grads, grad_dtypes, nullptr, params, param_dtypes, found_inf, nullptr);
    // Every input is checked before the scale changes, so a refused step
    // leaves it as it was.
    OPTSTATE_RETURN_IF_ERROR(BuildGrads(what, adam, a));
    if (grad_scale > 0.0f) OPTSTATE_RETURN_IF_ERROR(adam->rep->SetGradScale(grad_scale));
    return adam->rep->Step(std::span<const memmgr::ParamGrad>(adam->grads.data(), n), found_inf, nullptr);
  });
}

int optstate_adam_step2(optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                        const int* grad_dtypes, const uint64_t* numels, void* const* params,
                        const int* param_dtypes, const float* found_inf, const float* grad_scale,
                        char** errptr) {
  const char* what = "optstate_adam_step2";
  return Guard(errptr, what, [&] {
    return AdamStep(what, adam,
                    ArgsOf(n, ids, grads, grad_dtypes, numels, params, param_dtypes, found_inf, grad_scale));
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
