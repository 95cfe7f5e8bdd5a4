// AdamWRule: Adam / AdamW (torch.optim.AdamW and torch.optim.Adam numerics)
// as an UpdateRule, with its two moments stored as f32, bf16 or q8
// (block-scaled codes plus their fp32 scales). Internal to memmgr: the
// kernels are kernels/adam.h's, bit-identical on CPU and CUDA.
//
// Fields: main, exp_avg, exp_avg_sq (f32 | bf16 | q8s/q8u), and with q8
// moments exp_avg.absmax and exp_avg_sq.absmax (f32, one per kQ8BlockElems
// elements). Hyperparameters: lr, beta1, beta2, eps, weight_decay, and adamw
// (nonzero: decoupled weight decay; 0: L2 added to the gradient). The counter
// is the param's step count after the update (bias correction).
#pragma once

#include <memory>

#include "base/dtype.h"
#include "memmgr/update_rule.h"

namespace optstate::memmgr::internal {

std::unique_ptr<UpdateRule> NewAdamWRule(MomentDType moments);

}  // namespace optstate::memmgr::internal
