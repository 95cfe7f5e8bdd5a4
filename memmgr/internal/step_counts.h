// StepCounts: the step counts of a streamed engine, as they are now and as
// the last committed generation holds them: the global step, each group's
// count, each tensor's count (every param's, and every other tensor of the
// last commit, so that each commit carries all of them), the steps held only
// in the host cache and the last committed generation. Internal to memmgr.
// Contract: Advance moves the counts on by one kept step; Committed makes
// the current counts the committed ones; Revert goes back to them.
// Thread-safety: the trainer's thread only.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "vfs/store.h"

namespace optstate::memmgr::internal {

class StepCounts {
 public:
  // Restores the counts of generation gen (all committed). Tensor counts
  // come one by one (RestoreTensor).
  void Restore(const vfs::GenerationInfo& gen);
  void RestoreTensor(uint32_t id, uint64_t count) { tensors_[id] = Count{count, count}; }

  uint64_t global_step() const { return global_; }
  void set_global_step(uint64_t s) { global_ = s; }
  uint64_t last_generation() const { return last_generation_; }
  uint64_t committed_global_step() const { return committed_global_; }
  uint64_t uncommitted_steps() const { return uncommitted_; }

  // A group's count (0 for one never stepped); AddGroup makes it known at 0.
  uint64_t group(uint32_t id) const;
  void AddGroup(uint32_t id) { groups_.emplace(id, 0); }
  // A tensor's count now (nullopt: unknown tensor).
  std::optional<uint64_t> tensor(uint32_t id) const;
  // A new param: no step taken; EraseTensor: its registration was dropped.
  void AddTensor(uint32_t id) { tensors_[id] = Count{}; }
  void EraseTensor(uint32_t id) { tensors_.erase(id); }

  // A commit's counts: the step, each group's and each tensor's (advance:
  // after one more step of `groups` and `tensors`).
  void Fill(bool advance, const std::set<uint32_t>& groups, const std::set<uint32_t>& tensors,
            vfs::CommitInfo* ci) const;

  // A kept step: one more for the global step and for each group and tensor
  // that stepped; `cached`: the step is held only in the host cache.
  void Advance(const std::set<uint32_t>& groups, const std::set<uint32_t>& tensors, bool cached);
  // The cached steps go to a background commit with the step that ends now:
  // they are no longer counted as held only in the cache.
  void HandOffCached() { uncommitted_ = 0; }

  // Generation gen was committed with the current counts.
  void Committed(uint64_t gen);
  // Generation gen was committed with info's counts (a background commit:
  // set_global_step may have moved on meanwhile).
  void CommittedAs(uint64_t gen, const vfs::CommitInfo& info);
  // Back to the last commit's counts, unconditionally.
  void RevertAll();
  // Back to the last commit's counts when steps were held only in the host
  // cache; a sentence for messages ("" when nothing was lost).
  std::string Revert();

 private:
  struct Count {
    uint64_t now = 0;        // with the steps not yet committed (cached, in flight)
    uint64_t committed = 0;  // in the last committed generation
  };
  uint64_t global_ = 0;
  uint64_t committed_global_ = 0;
  uint64_t last_generation_ = 0;
  uint64_t uncommitted_ = 0;  // steps only in the host cache
  std::map<uint32_t, uint64_t> groups_;
  std::map<uint32_t, uint64_t> committed_groups_;
  std::map<uint32_t, Count> tensors_;  // by tensor id
};

}  // namespace optstate::memmgr::internal
