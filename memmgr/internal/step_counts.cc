#include "memmgr/internal/step_counts.h"

namespace optstate::memmgr::internal {

void StepCounts::Restore(const vfs::GenerationInfo& gen) {
  global_ = committed_global_ = gen.step;
  last_generation_ = gen.generation;
  uncommitted_ = 0;
  groups_.clear();
  for (const vfs::GroupInfo& g : gen.groups) groups_[g.id] = g.step_count;
  committed_groups_ = groups_;
  tensors_.clear();
}

uint64_t StepCounts::group(uint32_t id) const {
  auto it = groups_.find(id);
  return it == groups_.end() ? 0 : it->second;
}

std::optional<uint64_t> StepCounts::tensor(uint32_t id) const {
  auto it = tensors_.find(id);
  if (it == tensors_.end()) return std::nullopt;
  return it->second.now;
}

void StepCounts::Fill(bool advance, const std::set<uint32_t>& groups, const std::set<uint32_t>& tensors,
                      vfs::CommitInfo* ci) const {
  ci->step = advance ? global_ + 1 : global_;
  for (vfs::GroupInfo& gi : ci->groups) {
    gi.step_count = group(gi.id) + (advance && groups.count(gi.id) ? 1 : 0);
  }
  // Every tensor's count (Store::Commit keeps those that differ from their
  // group's).
  for (const auto& [id, c] : tensors_) ci->tensor_steps[id] = c.now + (advance && tensors.count(id) ? 1 : 0);
}

void StepCounts::Advance(const std::set<uint32_t>& groups, const std::set<uint32_t>& tensors, bool cached) {
  for (uint32_t id : groups) groups_[id] += 1;
  for (uint32_t id : tensors) tensors_[id].now += 1;
  ++global_;
  if (cached) ++uncommitted_;
}

void StepCounts::Committed(uint64_t gen) {
  last_generation_ = gen;
  uncommitted_ = 0;
  committed_groups_ = groups_;
  for (auto& [id, c] : tensors_) c.committed = c.now;
  committed_global_ = global_;
}

void StepCounts::CommittedAs(uint64_t gen, const vfs::CommitInfo& info) {
  Committed(gen);
  committed_global_ = info.step;
  committed_groups_.clear();
  for (const vfs::GroupInfo& g : info.groups) committed_groups_[g.id] = g.step_count;
  for (auto& [id, c] : tensors_) {
    auto it = info.tensor_steps.find(id);
    if (it != info.tensor_steps.end()) c.committed = it->second;
  }
}

void StepCounts::RevertAll() {
  for (auto& [id, n] : groups_) {
    auto it = committed_groups_.find(id);
    n = it == committed_groups_.end() ? 0 : it->second;
  }
  for (auto& [id, c] : tensors_) c.now = c.committed;
  global_ = committed_global_;
  uncommitted_ = 0;
}

std::string StepCounts::Revert() {
  if (uncommitted_ == 0) return "";
  std::string msg = std::to_string(uncommitted_) +
                    " step(s) held only in the host cache were lost; the optimizer is back at generation " +
                    std::to_string(last_generation_) + " (step " + std::to_string(committed_global_) + ")";
  RevertAll();
  return msg;
}

}  // namespace optstate::memmgr::internal
