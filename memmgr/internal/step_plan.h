// The plan of a step: what the slice pipeline (internal/slice_pipeline.h)
// runs for each param stepped, made once when the param is stepped and not
// changed after (StreamedEngine::StepParam -> ParamPlan::Make). Internal to
// memmgr.
// A unit is one slice of a tensor (SliceLayout: whole chunks of every field
// of its rule, 3 to 8 of them) or, for a whole-tensor rule, the whole
// tensor. For every chunk a unit reads, the pipeline takes its buffer from,
// in this order: a host cache entry that holds it (or one admitted for it),
// a chunk a prefetch staged (StagedChunk), else a staging buffer read from
// the store; the chunk goes back to where it came from (an entry, or the
// staging buffer) and, unless the step is held in the cache only, is written
// to the store. That choice is made when the unit is read, since the tier's
// contents change as the step runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "memmgr/internal/host_cache.h"
#include "memmgr/internal/slice_layout.h"
#include "memmgr/update_rule.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

// One unit: its chunks (SliceLayout), the tensor's field index of each rule
// field, the gradient and param copy of the whole tensor, the tensor's rule,
// its layout and the rule's arguments for the tensor in this step. A
// whole-tensor unit (tensor set) has a device window of its own: every
// chunk of every field gathered into it, the kernel called once, the fields
// scattered back (SlicePipeline says when it starts).
struct PlanUnit {
  uint32_t tensor_id = 0;
  uint64_t chunk = 0;  // the slice's index in the tensor (messages)
  SliceLayout::Slice slice;
  uint32_t tensor_fields[kMaxRuleFields] = {};
  const void* grad = nullptr;
  DType grad_type = DType::kF32;
  void* param = nullptr;
  DType param_type = DType::kF32;  // of param, when param is set
  RuleArgs args;
  const UpdateRule* rule = nullptr;
  const SliceLayout* layout = nullptr;
  const vfs::TensorInfo* tensor = nullptr;  // a whole-tensor unit (outlives the step)
  uint32_t n_bufs() const { return slice.n; }
  uint64_t len(uint32_t f) const { return slice.chunks[f].len; }
  uint64_t bytes() const {
    uint64_t b = 0;
    for (uint32_t f = 0; f < slice.n; ++f) b += slice.chunks[f].len;
    return b;
  }
  uint64_t max_len() const {
    uint64_t m = 0;
    for (uint32_t f = 0; f < slice.n; ++f) m = std::max(m, slice.chunks[f].len);
    return m;
  }
};

// A chunk a prefetch read into a staging buffer (a whole chunk, as a read
// into a staging set would) for the next step's pipeline to adopt.
struct StagedChunk {
  ChunkKey key;
  uint64_t len = 0;
  void* buf = nullptr;
};

// The units of one param in one step, in the order the pipeline runs them.
class ParamPlan {
 public:
  // What a param's units are made of: its tensor, the tensor's field index
  // of each rule field, its rule and layout (these outlive the step), the
  // gradient and param copy, and the rule's arguments for it in this step.
  struct Inputs {
    const vfs::TensorInfo* tensor = nullptr;
    const uint32_t* fields = nullptr;  // kMaxRuleFields entries
    const UpdateRule* rule = nullptr;
    const SliceLayout* layout = nullptr;
    const void* grad = nullptr;
    DType grad_type = DType::kF32;
    void* param = nullptr;  // may be null
    DType param_type = DType::kF32;
    RuleArgs args;
  };
  static ParamPlan Make(const Inputs& in);

  const std::vector<PlanUnit>& units() const { return units_; }

 private:
  std::vector<PlanUnit> units_;
};

}  // namespace optstate::memmgr::internal
