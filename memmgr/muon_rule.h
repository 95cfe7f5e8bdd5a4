// Muon (kernels/muon.h) as an UpdateRule (memmgr/update_rule.h), with
// torch.optim.Muon's semantics: a whole matrix is one unit of work
// (SliceUnit::kTensor; Newton-Schulz needs all of it).
//
// Fields: main and momentum_buffer (f32 or bf16: 8 or 6 bytes per param read
// and written per step, as Lion). Hyperparameters, as torch.optim.Muon's
// group entries where the names do not clash with AdamW's (one optimizer
// steps Muon's matrices and AdamW's other params with one group map):
//   lr (1e-3), weight_decay (0.1, decoupled: p *= 1 - lr*wd), momentum
//   (0.95), nesterov (1: true), ns_steps (5), ns_a/ns_b/ns_c (the Newton-
//   Schulz coefficients, Keller Jordan's quintic by default), ns_eps (1e-7,
//   torch.optim.Muon's eps: the norm Newton-Schulz divides by is
//   max(||u||_F, ns_eps)) and adjust_lr_fn (MuonLrAdjust below).
// The counter is unused (Muon has no bias correction).
//
// Shapes: a tensor stepped by Muon must be 2-D (its registered local shape,
// SliceOperands::shape); a tensor-parallel shard is orthogonalised on its
// own, as Megatron-core's non-distributed Muon does. The kernel's scratch is
// MuonWorkspaceBytes of the matrix (WorkspaceBytes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "memmgr/update_rule.h"

namespace optstate::memmgr {

// torch.optim.Muon's adjust_lr_fn, as the value of the hyperparameter
// "adjust_lr_fn": the update's lr is lr times
enum class MuonLrAdjust : int {
  kOriginal = 0,       // sqrt(max(1, rows / cols)) (Keller Jordan; torch's default)
  kMatchRmsAdamW = 1,  // 0.2 * sqrt(max(rows, cols)) (Moonlight)
  kSpectral = 2,       // sqrt(rows / cols) ("spectral_unclamped", Bernstein)
};

// REQUIRES: moments kF32 or kBF16 (q8 is AdamW's alone; callers check it).
std::unique_ptr<UpdateRule> NewMuonRule(MomentDType moments);

// OK when shape is a 2-D matrix with numel elements; else kInvalidArgument
// naming the store, the tensor and its shape (Muon orthogonalises matrices:
// register other params under another rule, e.g. AdamW).
Status CheckMuonShape(const std::string& store_path, const std::string& tensor, const std::vector<uint64_t>& shape,
                      uint64_t numel);

}  // namespace optstate::memmgr
