#include "memmgr/internal/adamw_rule.h"

#include <cmath>
#include <string>

#include <fmt/format.h>

#include "kernels/adam.h"
#include "memmgr/internal/streamed_adam_util.h"

namespace optstate::memmgr::internal {
namespace {

// RuleArgs::values of AdamW.
enum Value { kLr = 0, kBeta1, kBeta2, kEps, kWeightDecay, kDecoupled };

class AdamWRule final : public UpdateRule {
 public:
  explicit AdamWRule(MomentDType moments) : moments_(moments) {
    fields_ = {{"main", DType::kF32},
               {"exp_avg", MomentFieldDType(moments, "exp_avg")},
               {"exp_avg_sq", MomentFieldDType(moments, "exp_avg_sq")}};
    if (moments == MomentDType::kQ8) {
      const uint32_t block = static_cast<uint32_t>(kernels::kQ8BlockElems);
      fields_.push_back({vfs::Q8ScalesField("exp_avg"), DType::kF32, block});
      fields_.push_back({vfs::Q8ScalesField("exp_avg_sq"), DType::kF32, block});
    }
  }

  std::string_view name() const override { return "AdamW"; }
  const std::vector<RuleField>& Fields() const override { return fields_; }
  const Hyperparams& Hyperparameters() const override {
    static const Hyperparams kDefaults = {{"lr", 1e-3},  {"beta1", 0.9},          {"beta2", 0.999},
                                          {"eps", 1e-8}, {"weight_decay", 0.0}, {"adamw", 1.0}};
    return kDefaults;
  }

  Status CheckHyperparams(uint32_t group, const Hyperparams& h) const override {
    const double lr = h.at("lr"), beta1 = h.at("beta1"), beta2 = h.at("beta2"), eps = h.at("eps"),
                 wd = h.at("weight_decay");
    if (!(lr >= 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) || !(eps > 0) || !(wd >= 0) ||
        !std::isfinite(lr) || !std::isfinite(wd)) {
      // {} is the shortest text that reads back as the same double (eps 1e-08,
      // not std::to_string's 0.000000).
      return InvalidArgument(fmt::format(
          "StreamedAdam::SetGroup {}: invalid hyperparameters (lr {}, betas {}/{}, eps {}, weight_decay {})", group,
          lr, beta1, beta2, eps, wd));
    }
    return Status::Ok();
  }

  Status CheckStored(const std::string& store_path, const vfs::TensorInfo& t) const override {
    return CheckMomentFields(t, store_path, moments_);
  }

  Status MakeArgs(const Hyperparams& group, uint64_t counter, float grad_scale, RuleArgs* out) const override {
    auto get = [&](const char* k) {
      auto it = group.find(k);
      return it != group.end() ? it->second : Hyperparameters().at(k);
    };
    out->values[kLr] = get("lr");
    out->values[kBeta1] = get("beta1");
    out->values[kBeta2] = get("beta2");
    out->values[kEps] = get("eps");
    out->values[kWeightDecay] = get("weight_decay");
    out->values[kDecoupled] = get("adamw");
    out->counter = counter;
    out->grad_scale = grad_scale;
    return Status::Ok();
  }

  Status RunCpu(const SliceOperands& o, const RuleArgs& a, int threads) const override {
    const bool ok = moments_ == MomentDType::kQ8 ? kernels::AdamStepCpuQ8(Q8(o), o.count, Params(a), threads)
                                                 : kernels::AdamStepCpu(Plain(o), o.count, Params(a), threads);
    if (ok) return Status::Ok();
    return InvalidArgument(std::string(moments_ == MomentDType::kQ8 ? "AdamStepCpuQ8" : "AdamStepCpu") +
                           " rejected the tensors (grad type " + DTypeName(o.grad_type) + ", param type " +
                           DTypeText(o.param_type) + ")");
  }

  int RunCuda(const SliceOperands& o, const RuleArgs& a, void* stream) const override {
    return moments_ == MomentDType::kQ8 ? kernels::AdamStepCudaQ8(Q8(o), o.count, Params(a), stream)
                                        : kernels::AdamStepCuda(Plain(o), o.count, Params(a), stream);
  }

 private:
  static kernels::AdamParams Params(const RuleArgs& a) {
    kernels::AdamParams p;
    p.lr = a.values[kLr];
    p.beta1 = a.values[kBeta1];
    p.beta2 = a.values[kBeta2];
    p.eps = a.values[kEps];
    p.weight_decay = a.values[kWeightDecay];
    p.mode = a.values[kDecoupled] != 0.0 ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
    p.step = a.counter;
    p.grad_scale = a.grad_scale;
    return p;
  }
  kernels::AdamTensors Plain(const SliceOperands& o) const {
    kernels::AdamTensors t;
    t.main = static_cast<float*>(o.fields[0]);
    t.exp_avg = o.fields[1];
    t.exp_avg_sq = o.fields[2];
    t.moment_type = moments_;
    return WithSliceOperands(o, t);
  }
  static kernels::AdamQ8Tensors Q8(const SliceOperands& o) {
    kernels::AdamQ8Tensors t;
    t.main = static_cast<float*>(o.fields[0]);
    t.exp_avg = static_cast<uint8_t*>(o.fields[1]);
    t.exp_avg_sq = static_cast<uint8_t*>(o.fields[2]);
    t.exp_avg_absmax = static_cast<float*>(o.fields[3]);
    t.exp_avg_sq_absmax = static_cast<float*>(o.fields[4]);
    return WithSliceOperands(o, t);
  }

  const MomentDType moments_;
  std::vector<RuleField> fields_;
};

}  // namespace

std::unique_ptr<UpdateRule> NewAdamWRule(MomentDType moments) { return std::make_unique<AdamWRule>(moments); }

}  // namespace optstate::memmgr::internal
