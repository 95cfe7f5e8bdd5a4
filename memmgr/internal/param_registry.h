// ParamRegistry: the params of a streamed engine's run: each one's stored
// tensor, its rule and the tensor's field of each rule field, and its
// registration state (committed, registered in this run, main loaded but not
// yet committed); the params retired in this run and the registrations a
// failed step dropped. Internal to memmgr.
// Contract: a param is in exactly one of: the registry (committed, or added
// in this run and not yet committed), retired(), or neither. pending() is
// true while some registration or loaded main waits for a commit;
// MarkCommitted ends that; DropUncommitted undoes it.
// Thread-safety: the trainer's thread only.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "memmgr/update_rule.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

struct EngineParam {
  vfs::TensorInfo info;
  std::array<uint32_t, kMaxRuleFields> fields = {};  // the tensor's field index of each of the rule's fields
  bool committed = true;      // in the last committed generation
  bool registered = false;    // RegisterParam'd in this run
  bool main_pending = false;  // LoadMainFrom not yet committed
  uint32_t rule = 0;          // index into the engine's rules
};

class ParamRegistry {
 public:
  using Map = std::map<std::string, EngineParam, std::less<>>;

  const Map& all() const { return params_; }
  size_t size() const { return params_.size(); }
  bool empty() const { return params_.empty(); }
  const EngineParam* Find(std::string_view name) const;
  EngineParam* Find(std::string_view name);
  bool Has(std::string_view name) const { return Find(name) != nullptr; }
  std::vector<std::string> Names() const;

  // A param restored from the store (committed, not yet registered).
  void AddRestored(const std::string& name, EngineParam p) { params_.emplace(name, std::move(p)); }
  // A param registered in this run that no generation holds yet.
  EngineParam& AddNew(const std::string& name, EngineParam p);
  // A param of the store registered (again) in this run.
  void MarkRegistered(EngineParam* p);
  // LoadMainFrom wrote p's main: pending until the next commit.
  void MarkMainPending(EngineParam* p) { p->main_pending = true; }

  // RegisterParam succeeded in this run: every param must then be
  // registered or retired before a step (Unregistered).
  bool any_registered() const { return any_registered_; }
  // Restored params this run neither registered nor retired (empty when it
  // registered none).
  std::vector<std::string> Unregistered() const;
  // A registration or loaded main waits for a commit.
  bool pending() const;

  // Retires a restored, unregistered param for this run.
  void Retire(const std::string& name);
  bool retired(std::string_view name) const { return retired_.count(name) != 0; }
  // A registration of that name was dropped by a failed step in this run
  // (its uncommitted index entry may be taken over).
  bool dropped(std::string_view name) const { return dropped_.count(name) != 0; }

  // The pending generation was committed.
  void MarkCommitted();
  // The pending generation was dropped: the params it registered go, and
  // loaded mains are forgotten. forget(p) is called for each param whose
  // state the engine must drop (erased or reloaded); the names come back.
  struct Dropped {
    std::vector<std::string> erased;
    std::map<std::string, uint64_t> numels;  // of the erased
    std::vector<std::string> reloaded;
  };
  Dropped DropUncommitted(const std::function<void(const EngineParam&)>& forget);

 private:
  Map params_;
  std::set<std::string, std::less<>> retired_;  // RetireParam'd in this run
  std::set<std::string, std::less<>> dropped_;  // registrations dropped by a failed step in this run
  bool any_registered_ = false;
};

}  // namespace optstate::memmgr::internal
