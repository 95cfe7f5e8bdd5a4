// UpdateRule: what an optimizer keeps per tensor and how it updates one slice
// of it. The streamed engine (StreamedAdam's step pipeline, its prefetch and
// its registration) knows a rule only through this interface: the fields it
// keeps, their dtypes and chunk geometry, its hyperparameters by name, the
// per-tensor counter it is given, and its kernel over one slice.
//
// Fields: every tensor has "main" (fp32 master weights) as field 0; a rule
// declares it first and its own state fields after it (AdamW: exp_avg,
// exp_avg_sq; with q8 moments also their block scales). A field stores one
// value per elems_per_value tensor elements, so its chunk c covers the same
// tensor elements as chunk c of every other field of the same value size;
// the engine derives the chunk sizes and the slices from this (SliceLayout).
//
// Whole tensors: a rule whose unit() is SliceUnit::kTensor (Muon's
// Newton-Schulz needs the whole matrix) is called once per tensor and step
// with count == numel and first_elem == 0, every field contiguous in the
// device window (the engine gathers each field from its chunks and scatters
// it back after the call), its WorkspaceBytes of scratch and the tensor's
// shape. The device budget must hold the largest such tensor's fields plus
// its workspace.
//
// Slices: a slice is the element range that covers one chunk of the field
// with the most elements per chunk, and the chunks of the same elements of
// every other field (f32 moments: one chunk of each field; bf16: two of main;
// q8: four of main, one of each codes and scales field), at most
// kMaxSliceChunks chunks. The kernel runs once per piece of the slice that is
// contiguous in every field (one main chunk's elements), on device memory
// (host memory on the host backend).
//
// Hyperparameters and counters: a group's hyperparameters are a map of named
// doubles (as the store persists them, vfs::GroupInfo::hyper). Once per
// tensor and step, MakeArgs turns the group's map, the tensor's counter after
// this update (1 on its first step; torch's per-param "step") and the step's
// gradient scale into RuleArgs, which the engine hands unchanged to every
// kernel call of that tensor in the step.
//
// Thread-safety: a rule is immutable after construction; its methods are
// const and may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::memmgr {

// Fields a rule may keep per tensor, "main" included.
inline constexpr uint32_t kMaxRuleFields = 6;
// Chunks in one slice at most (q8 AdamW: four of main, one of each of the
// two codes and two scales fields).
inline constexpr uint32_t kMaxSliceChunks = 8;

// One field of a tensor's state.
struct RuleField {
  std::string name;           // "main", "exp_avg", "exp_avg.absmax", ...
  DType dtype = DType::kF32;  // storage dtype (f32, bf16, q8s, q8u)
  // Tensor elements one stored value covers: 1, or e.g. kQ8BlockElems for
  // the fp32 scales of a q8 field (field numel = ceil(numel / this)).
  uint32_t elems_per_value = 1;
};

// A group's hyperparameters by name ("lr", "beta1", ...), as persisted with
// each generation. A name a rule knows and the map lacks takes the rule's
// default (UpdateRule::Hyperparameters).
using Hyperparams = std::map<std::string, double, std::less<>>;

// What a rule derives once per tensor and step (MakeArgs) for its kernel.
// The engine copies it and never reads values.
struct RuleArgs {
  static constexpr int kMaxValues = 16;
  double values[kMaxValues] = {};
  uint64_t counter = 1;      // the tensor's counter after this update (>= 1)
  float grad_scale = 1.0f;   // gradients are multiplied by 1/grad_scale
};

// The operands of one kernel call: count elements, contiguous in every field.
struct SliceOperands {
  // fields[f]: the first element of this range in field f (the rule's
  // Fields() order, main = 0). For a field with elems_per_value > 1 the
  // range starts at a value boundary.
  void* fields[kMaxRuleFields] = {};
  uint64_t count = 0;
  uint64_t first_elem = 0;                 // index in the tensor of element 0
  const void* grad = nullptr;              // count elements of grad_type
  DType grad_type = DType::kF32;           // f32, bf16, f16
  void* param = nullptr;                   // model copy to write (may be null)
  std::optional<DType> param_type;         // with param
  const float* found_inf = nullptr;        // nonzero: write nothing (may be null)
  // Whole-tensor rules (SliceUnit::kTensor) only, else null: WorkspaceBytes
  // of scratch (device memory on CUDA, host memory on the host backend,
  // 256-byte aligned), and the tensor's local shape as registered
  // (ShardInfo::shape, or {numel}).
  void* workspace = nullptr;
  const std::vector<uint64_t>* shape = nullptr;
};

// Kernel tensors t (kernels/: AdamTensors, MomentumTensors, ...) with the
// operands every elementwise kernel takes alike set from o: the gradient,
// the model copy and the found-inf flag. A rule sets its own fields.
template <typename Tensors>
Tensors WithSliceOperands(const SliceOperands& o, Tensors t) {
  t.grad = o.grad;
  t.grad_type = o.grad_type;
  t.param = o.param;
  t.param_type = o.param_type;
  t.found_inf = o.found_inf;
  return t;
}

// The unit a rule updates at once.
enum class SliceUnit : uint8_t {
  kChunks = 0,  // elementwise: any slice of chunks (AdamW, Lion, SGD)
  kTensor = 1,  // the whole tensor in one call (Muon's Newton-Schulz)
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;

  // Short name for messages ("AdamW", "Lion").
  virtual std::string_view name() const = 0;
  // The fields of a tensor, "main" (f32, 1) first; at most kMaxRuleFields.
  virtual const std::vector<RuleField>& Fields() const = 0;
  // The hyperparameters the rule reads and their defaults.
  virtual const Hyperparams& Hyperparameters() const = 0;
  virtual SliceUnit unit() const { return SliceUnit::kChunks; }
  // Device scratch the kernel needs for tensor t (a whole-tensor rule's
  // SliceOperands::workspace); it counts against the device window.
  virtual uint64_t WorkspaceBytes(const vfs::TensorInfo& t) const {
    (void)t;
    return 0;
  }

  // Checks a group's hyperparameters (every name of Hyperparameters()
  // present): kInvalidArgument naming the group and the values. Default: OK.
  virtual Status CheckHyperparams(uint32_t group, const Hyperparams& h) const;

  // Checks a stored tensor's fields against Fields() when a store is opened
  // or a param registered again: kInvalidArgument naming the store, the
  // tensor, the field and both dtypes. The default compares the dtype of
  // every declared field the tensor has (a missing field is the engine's
  // error: it names the field) and refuses a tensor holding a field the rule
  // does not keep (another rule's state: SGD's momentum_buffer under plain
  // SGD, AdamW's exp_avg_sq under Lion), naming it.
  virtual Status CheckStored(const std::string& store_path, const vfs::TensorInfo& t) const;
  // Checks the shape of a param registered under this rule (shape: the
  // registered local shape, {numel} when none was given) before anything
  // changes: kInvalidArgument naming the store, the tensor and the shape
  // (Muon steps only matrices). Default: OK.
  virtual Status CheckShape(const std::string& store_path, const std::string& tensor,
                            const std::vector<uint64_t>& shape, uint64_t numel) const;

  // The kernel's arguments for one tensor in one step: group (the tensor's
  // group's hyperparameters; names it lacks take the defaults), counter (the
  // tensor's counter after this update, >= 1), grad_scale (> 0, finite).
  virtual Status MakeArgs(const Hyperparams& group, uint64_t counter, float grad_scale, RuleArgs* out) const = 0;

  // The kernel over one contiguous range, on the host backend (CPU
  // threads) and on CUDA (a cudaStream_t as void*; returns a cudaError_t as
  // int, 0 = success). Both are bit-identical (kernels/ holds them).
  // Nothing is written when *found_inf is nonzero.
  virtual Status RunCpu(const SliceOperands& o, const RuleArgs& a, int threads) const = 0;
  virtual int RunCuda(const SliceOperands& o, const RuleArgs& a, void* stream) const = 0;
};

}  // namespace optstate::memmgr
