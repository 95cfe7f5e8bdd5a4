#include "memmgr/internal/step_plan.h"

namespace optstate::memmgr::internal {

ParamPlan ParamPlan::Make(const Inputs& in) {
  ParamPlan plan;
  PlanUnit u;
  u.tensor_id = in.tensor->id;
  std::copy(in.fields, in.fields + kMaxRuleFields, u.tensor_fields);
  u.grad = in.grad;
  u.grad_type = in.grad_type;
  u.param = in.param;
  if (in.param != nullptr) u.param_type = in.param_type;
  u.args = in.args;
  u.rule = in.rule;
  u.layout = in.layout;
  const uint64_t numel = in.tensor->numel;
  if (in.rule->unit() == SliceUnit::kTensor) {
    // One unit: the whole tensor (the pipeline gathers its chunks).
    u.tensor = in.tensor;
    u.chunk = 0;
    plan.units_.push_back(u);
    return plan;
  }
  const uint64_t n = in.layout->Slices(numel);
  plan.units_.reserve(n);
  for (uint64_t c = 0; c < n; ++c) {
    u.chunk = c;
    in.layout->SliceOf(numel, c, &u.slice);
    plan.units_.push_back(u);
  }
  return plan;
}

}  // namespace optstate::memmgr::internal
