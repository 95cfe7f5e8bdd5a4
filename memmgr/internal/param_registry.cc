#include "memmgr/internal/param_registry.h"

#include <algorithm>

namespace optstate::memmgr::internal {

const EngineParam* ParamRegistry::Find(std::string_view name) const {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

EngineParam* ParamRegistry::Find(std::string_view name) {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

std::vector<std::string> ParamRegistry::Names() const {
  std::vector<std::string> out;
  for (const auto& [n, p] : params_) out.push_back(n);
  return out;
}

EngineParam& ParamRegistry::AddNew(const std::string& name, EngineParam p) {
  p.committed = false;
  p.registered = true;
  any_registered_ = true;
  auto d = dropped_.find(name);
  if (d != dropped_.end()) dropped_.erase(d);
  return params_.insert_or_assign(name, std::move(p)).first->second;
}

void ParamRegistry::MarkRegistered(EngineParam* p) {
  p->registered = true;
  any_registered_ = true;
}

std::vector<std::string> ParamRegistry::Unregistered() const {
  std::vector<std::string> out;
  if (!any_registered_) return out;
  for (const auto& [n, p] : params_) {
    if (!p.registered) out.push_back(n);
  }
  return out;
}

bool ParamRegistry::pending() const {
  return std::any_of(params_.begin(), params_.end(),
                     [](const auto& e) { return !e.second.committed || e.second.main_pending; });
}

void ParamRegistry::Retire(const std::string& name) {
  retired_.insert(name);
  params_.erase(name);
}

void ParamRegistry::MarkCommitted() {
  for (auto& [name, p] : params_) {
    p.committed = true;
    p.main_pending = false;
  }
  dropped_.clear();
}

ParamRegistry::Dropped ParamRegistry::DropUncommitted(const std::function<void(const EngineParam&)>& forget) {
  Dropped d;
  for (auto it = params_.begin(); it != params_.end();) {
    EngineParam& p = it->second;
    if (!p.committed) {
      d.erased.push_back(it->first);
      d.numels[it->first] = p.info.numel;
      forget(p);
      dropped_.insert(it->first);
      it = params_.erase(it);
      continue;
    }
    if (p.main_pending) {
      d.reloaded.push_back(it->first);
      p.main_pending = false;
      forget(p);
    }
    ++it;
  }
  return d;
}

}  // namespace optstate::memmgr::internal
