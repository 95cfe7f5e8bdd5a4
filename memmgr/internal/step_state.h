// StepState: one step of the streamed engine, from BeginStep to EndStep:
// its phase, its mode (where its slices live and whether it commits), its
// found-inf flag and gradient scale, and what it stepped (groups, params,
// the order). Made by StreamedEngine::BeginStep, read by StepParam and
// consumed by EndStep; what it stepped stays until the next BeginStep (the
// commit's counts, the next prefetch's order). Internal to memmgr.
// Thread-safety: the trainer's thread only.
#pragma once

#include <array>
#include <cstdint>
#include <set>
#include <vector>

#include "memmgr/update_rule.h"

namespace optstate::memmgr::internal {

// A param in the order a step stepped it: what a prefetch needs to read its
// slices (the rule's layout, the tensor's field index of each rule field).
struct StepOrderEntry {
  uint32_t tensor_id = 0;
  uint32_t rule = 0;
  std::array<uint32_t, kMaxRuleFields> fields = {};
  uint64_t numel = 0;
};

// Where a step's slices live and whether it ends in a commit.
enum class StepMode : uint8_t {
  // Staging buffers (or host cache entries where the tier has them); every
  // step is written and committed.
  kStaged,
  // The host cache tier holds the whole state and is the slices' buffers;
  // this step writes the dirty entries and commits (durable_every_steps
  // reached).
  kCachedCommit,
  // As kCachedCommit, but the step stays in the host cache only (deferred
  // durability: MakeDurable or a later step commits it).
  kCachedDeferred,
};

// The phase of the trainer's step.
enum class StepPhase : uint8_t {
  kIdle,      // no step begun (or the last one ended)
  kStepping,  // between BeginStep and EndStep
  kSkipping,  // found-inf was set at BeginStep: StepParam checks and ignores, EndStep skips
};

// How the last step ended (last_step_skipped).
enum class StepOutcome : uint8_t { kNone, kApplied, kSkipped };

struct StepState {
  StepPhase phase = StepPhase::kIdle;
  StepMode mode = StepMode::kStaged;
  StepOutcome last = StepOutcome::kNone;
  const float* found_inf = nullptr;  // the step's device flag (may be null)
  float grad_scale = 1.0f;           // the step's gradient scale
  std::set<uint32_t> groups;         // groups with a param stepped
  std::set<uint32_t> tensors;        // tensor ids of the params stepped
  std::vector<StepOrderEntry> order;  // the params stepped, in order

  bool in_step() const { return phase != StepPhase::kIdle; }
  bool cache_mode() const { return mode != StepMode::kStaged; }
  bool write_through() const { return mode != StepMode::kCachedDeferred; }
  // The mode of a step: cached when the tier holds the whole state; then it
  // commits when `commit_due` (durable_every_steps reached).
  static StepMode ModeOf(bool cache_holds_state, bool commit_due) {
    if (!cache_holds_state) return StepMode::kStaged;
    return commit_due ? StepMode::kCachedCommit : StepMode::kCachedDeferred;
  }
};

// A message said once per optimizer (First() is true the first time only).
class Once {
 public:
  bool First() {
    const bool first = !said_;
    said_ = true;
    return first;
  }

 private:
  bool said_ = false;
};

}  // namespace optstate::memmgr::internal
