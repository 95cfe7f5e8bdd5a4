// SyncPoint (base/sync_point.h): the registry behind the test sync points.
#include "base/sync_point.h"

namespace optstate {

SyncPoint* SyncPoint::Get() {
  static SyncPoint* instance = new SyncPoint();  // never deleted: points may run during exit
  return instance;
}

bool SyncPoint::CompiledIn() {
#ifdef OPTSTATE_TEST_HOOKS
  return true;
#else
  return false;
#endif
}

void SyncPoint::LoadDependency(const std::vector<std::pair<std::string, std::string>>& dependencies) {
  std::lock_guard<std::mutex> l(mu_);
  predecessors_.clear();
  for (const auto& [pred, succ] : dependencies) predecessors_[succ].push_back(pred);
  cv_.notify_all();
}

void SyncPoint::SetCallBack(const std::string& point, std::function<void(void*)> callback) {
  std::lock_guard<std::mutex> l(mu_);
  callbacks_[point] = std::move(callback);
}

void SyncPoint::ClearAllCallBacks() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return running_callbacks_ == 0; });
  callbacks_.clear();
}

void SyncPoint::EnableProcessing() { enabled_.store(true, std::memory_order_relaxed); }

void SyncPoint::DisableProcessing() {
  std::lock_guard<std::mutex> l(mu_);
  enabled_.store(false, std::memory_order_relaxed);
  cv_.notify_all();  // threads waiting for a predecessor go on
}

void SyncPoint::ClearTrace() {
  std::lock_guard<std::mutex> l(mu_);
  passed_.clear();
}

void SyncPoint::Reset() {
  DisableProcessing();
  ClearAllCallBacks();
  std::lock_guard<std::mutex> l(mu_);
  predecessors_.clear();
  passed_.clear();
  cv_.notify_all();
}

uint64_t SyncPoint::PassCount(const std::string& point) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = passed_.find(point);
  return it == passed_.end() ? 0 : it->second;
}

void SyncPoint::ProcessEnabled(std::string_view point, void* arg) {
  std::unique_lock<std::mutex> l(mu_);
  auto pred = predecessors_.find(point);
  if (pred != predecessors_.end()) {
    // Waits until every predecessor has been passed, or processing is turned
    // off (a test that gives up must not leave threads parked here).
    cv_.wait(l, [&] {
      if (!enabled_.load(std::memory_order_relaxed)) return true;
      auto it = predecessors_.find(point);
      if (it == predecessors_.end()) return true;
      for (const std::string& p : it->second) {
        if (passed_.find(p) == passed_.end()) return false;
      }
      return true;
    });
  }
  auto cb = callbacks_.find(point);
  if (cb != callbacks_.end()) {
    std::function<void(void*)> f = cb->second;
    ++running_callbacks_;
    l.unlock();
    f(arg);
    l.lock();
    --running_callbacks_;
  }
  ++passed_[std::string(point)];
  cv_.notify_all();
}

}  // namespace optstate
