// Lion and SGD with momentum as UpdateRules (memmgr/update_rule.h): the
// single-moment elementwise rules. Internal to memmgr: the kernels are
// kernels/momentum.h's, bit-identical on CPU and CUDA.
//
// Lion: fields main and exp_avg (f32 or bf16: 8 or 6 bytes per param read
// and written per step); hyperparameters lr, beta1, beta2, weight_decay
// (decoupled). SGD: fields main and, with a momentum buffer, momentum_buffer
// (f32 or bf16); hyperparameters lr, momentum, dampening, weight_decay (L2),
// nesterov and maximize (nonzero: true). Its counter is the param's step count
// after the update: 1 starts the buffer as the gradient, as torch.optim.SGD.
#pragma once

#include <memory>

#include "base/dtype.h"
#include "memmgr/update_rule.h"

namespace optstate::memmgr {

// REQUIRES: moments kF32 or kBF16 (the factories' callers check it: q8 is
// AdamW's alone).
std::unique_ptr<UpdateRule> NewLionRule(MomentDType moments);
// momentum_buffer false: plain SGD (4 bytes per param per step); a group
// with momentum != 0 is then kInvalidArgument.
std::unique_ptr<UpdateRule> NewSgdRule(MomentDType moments, bool momentum_buffer);

}  // namespace optstate::memmgr
