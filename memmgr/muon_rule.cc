#include "memmgr/muon_rule.h"

#include <cmath>
#include <string>

#include <fmt/format.h>

#include "kernels/muon.h"
#include "memmgr/internal/streamed_adam_util.h"

namespace optstate::memmgr {
namespace {

constexpr const char* kNames[] = {"lr",   "weight_decay", "momentum", "nesterov", "ns_eps",
                                  "ns_steps", "ns_a",     "ns_b",     "ns_c",     "adjust_lr_fn"};

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

class MuonRule final : public UpdateRule {
 public:
  explicit MuonRule(MomentDType moments)
      : moments_(moments),
        fields_{{"main", DType::kF32},
                {"momentum_buffer", moments == MomentDType::kBF16 ? DType::kBF16 : DType::kF32}} {}

  std::string_view name() const override { return "Muon"; }
  const std::vector<RuleField>& Fields() const override { return fields_; }
  SliceUnit unit() const override { return SliceUnit::kTensor; }
  const Hyperparams& Hyperparameters() const override {
    static const Hyperparams kDefaults = {
        {"lr", 1e-3},   {"weight_decay", 0.1},        {"momentum", 0.95},           {"nesterov", 1.0},
        {"ns_eps", 1e-7}, {"ns_steps", 5.0},          {"ns_a", kernels::kMuonNsA}, {"ns_b", kernels::kMuonNsB},
        {"ns_c", kernels::kMuonNsC}, {"adjust_lr_fn", 0.0}};
    return kDefaults;
  }

  uint64_t WorkspaceBytes(const vfs::TensorInfo& t) const override {
    if (t.shape.size() != 2) return 0;  // refused by CheckStored and the kernel call
    return kernels::MuonWorkspaceBytes(t.shape[0], t.shape[1]);
  }

  Status CheckHyperparams(uint32_t group, const Hyperparams& h) const override {
    const double lr = h.at("lr"), wd = h.at("weight_decay"), momentum = h.at("momentum"), eps = h.at("ns_eps"),
                 steps = h.at("ns_steps"), adjust = h.at("adjust_lr_fn");
    const bool coefficients_ok =
        std::isfinite(h.at("ns_a")) && std::isfinite(h.at("ns_b")) && std::isfinite(h.at("ns_c"));
    if (!(lr >= 0) || !std::isfinite(lr) || !(wd >= 0) || !std::isfinite(wd) || !(momentum >= 0) ||
        !std::isfinite(momentum) || !(eps >= 0) || !std::isfinite(eps) || !(steps >= 0 && steps < 100) ||
        steps != std::floor(steps) || !(adjust == 0 || adjust == 1 || adjust == 2) || !coefficients_ok) {
      return InvalidArgument(fmt::format(
          "Muon group {}: invalid hyperparameters (lr {}, weight_decay {}, momentum {}, ns_eps {}, ns_steps {} "
          "(an integer in [0, 100)), ns coefficients {}/{}/{}, adjust_lr_fn {} (0 original, 1 match_rms_adamw, "
          "2 spectral_unclamped))",
          group, lr, wd, momentum, eps, steps, h.at("ns_a"), h.at("ns_b"), h.at("ns_c"), adjust));
    }
    return Status::Ok();
  }

  Status CheckShape(const std::string& store_path, const std::string& tensor, const std::vector<uint64_t>& shape,
                    uint64_t numel) const override {
    return CheckMuonShape(store_path, tensor, shape, numel);
  }

  Status CheckStored(const std::string& store_path, const vfs::TensorInfo& t) const override {
    OPTSTATE_RETURN_IF_ERROR(CheckMuonShape(store_path, t.name, t.shape, t.numel));
    return UpdateRule::CheckStored(store_path, t);
  }

  Status MakeArgs(const Hyperparams& group, uint64_t counter, float grad_scale, RuleArgs* out) const override {
    int i = 0;
    for (const char* k : kNames) {
      auto it = group.find(k);
      out->values[i++] = it != group.end() ? it->second : Hyperparameters().at(k);
    }
    out->counter = counter;
    out->grad_scale = grad_scale;
    return Status::Ok();
  }

  Status RunCpu(const SliceOperands& o, const RuleArgs& a, int threads) const override {
    OPTSTATE_RETURN_IF_ERROR(CheckOperands(o));
    if (kernels::MuonStepCpu(Tensors(o), (*o.shape)[0], (*o.shape)[1], Params(a), o.workspace, threads)) {
      return Status::Ok();
    }
    return InvalidArgument("MuonStepCpu rejected the tensors (grad type " + std::string(DTypeName(o.grad_type)) +
                           ", param type " + internal::DTypeText(o.param_type) + ")");
  }
  int RunCuda(const SliceOperands& o, const RuleArgs& a, void* stream) const override {
    if (!CheckOperands(o).ok()) return 1;  // cudaErrorInvalidValue
    return kernels::MuonStepCuda(Tensors(o), (*o.shape)[0], (*o.shape)[1], Params(a), o.workspace, stream);
  }

 private:
  // The whole matrix in one call, with its shape and scratch.
  static Status CheckOperands(const SliceOperands& o) {
    if (o.shape == nullptr || o.shape->size() != 2 || (*o.shape)[0] * (*o.shape)[1] != o.count ||
        o.first_elem != 0 || o.workspace == nullptr) {
      return InvalidArgument(fmt::format(
          "Muon steps a whole 2-D matrix per call: got {} elements from element {} of shape {}{}", o.count,
          o.first_elem, o.shape == nullptr ? std::string("(none)") : ShapeText(*o.shape),
          o.workspace == nullptr ? " without a workspace" : ""));
    }
    return Status::Ok();
  }

  kernels::MuonTensors Tensors(const SliceOperands& o) const {
    kernels::MuonTensors t;
    t.main = static_cast<float*>(o.fields[0]);
    t.momentum = o.fields[1];
    t.moment_type = moments_;
    return WithSliceOperands(o, t);
  }

  static kernels::MuonParams Params(const RuleArgs& a) {
    kernels::MuonParams p;
    p.lr = a.values[0];
    p.weight_decay = a.values[1];
    p.momentum = a.values[2];
    p.nesterov = a.values[3] != 0.0;
    p.eps = a.values[4];
    p.norm_eps = kernels::MuonNormEps::kClamp;
    p.ns_steps = static_cast<int>(a.values[5]);
    p.ns_a = a.values[6];
    p.ns_b = a.values[7];
    p.ns_c = a.values[8];
    switch (static_cast<MuonLrAdjust>(static_cast<int>(a.values[9]))) {
      case MuonLrAdjust::kMatchRmsAdamW: p.scale = kernels::MuonScale::kMatchAdamW; break;
      case MuonLrAdjust::kSpectral: p.scale = kernels::MuonScale::kSpectral; break;
      default: p.scale = kernels::MuonScale::kShape; break;
    }
    p.grad_scale = a.grad_scale;
    return p;
  }

  const MomentDType moments_;
  const std::vector<RuleField> fields_;
};

}  // namespace

std::unique_ptr<UpdateRule> NewMuonRule(MomentDType moments) { return std::make_unique<MuonRule>(moments); }

Status CheckMuonShape(const std::string& store_path, const std::string& tensor, const std::vector<uint64_t>& shape,
                      uint64_t numel) {
  const std::vector<uint64_t> s = shape.empty() ? std::vector<uint64_t>{numel} : shape;
  if (s.size() == 2 && s[0] * s[1] == numel && numel > 0) return Status::Ok();
  return InvalidArgument("Muon: param '" + tensor + "' of store " + store_path + " has shape " + ShapeText(s) +
                         "; Muon orthogonalises 2-D matrices only (step other params with AdamW)");
}

}  // namespace optstate::memmgr
