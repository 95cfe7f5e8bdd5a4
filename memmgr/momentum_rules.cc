#include "memmgr/momentum_rules.h"

#include <cmath>
#include <string>

#include <fmt/format.h>

#include "kernels/momentum.h"
#include "memmgr/internal/streamed_adam_util.h"

namespace optstate::memmgr {
namespace {

DType MomentElement(MomentDType m) { return m == MomentDType::kBF16 ? DType::kBF16 : DType::kF32; }

double Get(const Hyperparams& group, const Hyperparams& defaults, const char* k) {
  auto it = group.find(k);
  return it != group.end() ? it->second : defaults.at(k);
}

kernels::MomentumTensors Tensors(const SliceOperands& o, MomentDType moments, bool has_moment) {
  kernels::MomentumTensors t;
  t.main = static_cast<float*>(o.fields[0]);
  t.moment = has_moment ? o.fields[1] : nullptr;
  t.moment_type = moments;
  return WithSliceOperands(o, t);
}

Status Rejected(const char* kernel, const SliceOperands& o) {
  return InvalidArgument(std::string(kernel) + " rejected the tensors (grad type " + DTypeName(o.grad_type) +
                         ", param type " + internal::DTypeText(o.param_type) + ")");
}

class LionRule final : public UpdateRule {
 public:
  explicit LionRule(MomentDType moments)
      : moments_(moments), fields_{{"main", DType::kF32}, {"exp_avg", MomentElement(moments)}} {}

  std::string_view name() const override { return "Lion"; }
  const std::vector<RuleField>& Fields() const override { return fields_; }
  const Hyperparams& Hyperparameters() const override {
    static const Hyperparams kDefaults = {{"lr", 1e-4}, {"beta1", 0.9}, {"beta2", 0.99}, {"weight_decay", 0.0}};
    return kDefaults;
  }

  Status CheckHyperparams(uint32_t group, const Hyperparams& h) const override {
    const double lr = h.at("lr"), beta1 = h.at("beta1"), beta2 = h.at("beta2"), wd = h.at("weight_decay");
    if (!(lr >= 0) || !std::isfinite(lr) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) ||
        !(wd >= 0) || !std::isfinite(wd)) {
      return InvalidArgument(fmt::format("Lion group {}: invalid hyperparameters (lr {}, betas {}/{}, weight_decay {})",
                                         group, lr, beta1, beta2, wd));
    }
    return Status::Ok();
  }

  Status MakeArgs(const Hyperparams& group, uint64_t counter, float grad_scale, RuleArgs* out) const override {
    int i = 0;
    for (const char* k : {"lr", "beta1", "beta2", "weight_decay"}) out->values[i++] = Get(group, Hyperparameters(), k);
    out->counter = counter;
    out->grad_scale = grad_scale;
    return Status::Ok();
  }

  Status RunCpu(const SliceOperands& o, const RuleArgs& a, int threads) const override {
    if (kernels::LionStepCpu(Tensors(o, moments_, true), o.count, Params(a), threads)) return Status::Ok();
    return Rejected("LionStepCpu", o);
  }
  int RunCuda(const SliceOperands& o, const RuleArgs& a, void* stream) const override {
    return kernels::LionStepCuda(Tensors(o, moments_, true), o.count, Params(a), stream);
  }

 private:
  static kernels::LionParams Params(const RuleArgs& a) {
    kernels::LionParams p;
    p.lr = a.values[0];
    p.beta1 = a.values[1];
    p.beta2 = a.values[2];
    p.weight_decay = a.values[3];
    p.grad_scale = a.grad_scale;
    return p;
  }

  const MomentDType moments_;
  const std::vector<RuleField> fields_;
};

class SgdRule final : public UpdateRule {
 public:
  SgdRule(MomentDType moments, bool momentum_buffer) : moments_(moments), buffer_(momentum_buffer) {
    fields_.push_back({"main", DType::kF32});
    if (buffer_) fields_.push_back({"momentum_buffer", MomentElement(moments)});
  }

  std::string_view name() const override { return "SGD"; }
  const std::vector<RuleField>& Fields() const override { return fields_; }
  const Hyperparams& Hyperparameters() const override {
    static const Hyperparams kDefaults = {{"lr", 1e-3},         {"momentum", 0.0}, {"dampening", 0.0},
                                          {"weight_decay", 0.0}, {"nesterov", 0.0}, {"maximize", 0.0}};
    return kDefaults;
  }

  Status CheckHyperparams(uint32_t group, const Hyperparams& h) const override {
    const double lr = h.at("lr"), momentum = h.at("momentum"), dampening = h.at("dampening"),
                 wd = h.at("weight_decay");
    const bool nesterov = h.at("nesterov") != 0.0;
    if (!(lr >= 0) || !std::isfinite(lr) || !(momentum >= 0) || !std::isfinite(momentum) ||
        !std::isfinite(dampening) || !(wd >= 0) || !std::isfinite(wd)) {
      return InvalidArgument(fmt::format(
          "SGD group {}: invalid hyperparameters (lr {}, momentum {}, dampening {}, weight_decay {})", group, lr,
          momentum, dampening, wd));
    }
    if (nesterov && (momentum <= 0 || dampening != 0)) {
      return InvalidArgument(fmt::format(
          "SGD group {}: Nesterov momentum requires a momentum and zero dampening (momentum {}, dampening {})",
          group, momentum, dampening));
    }
    if (!buffer_ && momentum != 0) {
      return InvalidArgument(fmt::format(
          "SGD group {}: momentum {} but this optimizer keeps no momentum_buffer (it was made with momentum 0 in "
          "every group)",
          group, momentum));
    }
    return Status::Ok();
  }

  Status MakeArgs(const Hyperparams& group, uint64_t counter, float grad_scale, RuleArgs* out) const override {
    int i = 0;
    for (const char* k : {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"}) {
      out->values[i++] = Get(group, Hyperparameters(), k);
    }
    out->counter = counter;
    out->grad_scale = grad_scale;
    return Status::Ok();
  }

  Status RunCpu(const SliceOperands& o, const RuleArgs& a, int threads) const override {
    if (kernels::SgdStepCpu(Tensors(o, moments_, buffer_), o.count, Params(a), threads)) return Status::Ok();
    return Rejected("SgdStepCpu", o);
  }
  int RunCuda(const SliceOperands& o, const RuleArgs& a, void* stream) const override {
    return kernels::SgdStepCuda(Tensors(o, moments_, buffer_), o.count, Params(a), stream);
  }

 private:
  static kernels::SgdParams Params(const RuleArgs& a) {
    kernels::SgdParams p;
    p.lr = a.values[0];
    p.momentum = a.values[1];
    p.dampening = a.values[2];
    p.weight_decay = a.values[3];
    p.nesterov = a.values[4] != 0.0;
    p.maximize = a.values[5] != 0.0;
    p.step = a.counter;
    p.grad_scale = a.grad_scale;
    return p;
  }

  const MomentDType moments_;
  const bool buffer_;
  std::vector<RuleField> fields_;
};

}  // namespace

std::unique_ptr<UpdateRule> NewLionRule(MomentDType moments) { return std::make_unique<LionRule>(moments); }
std::unique_ptr<UpdateRule> NewSgdRule(MomentDType moments, bool momentum_buffer) {
  return std::make_unique<SgdRule>(moments, momentum_buffer);
}

}  // namespace optstate::memmgr
