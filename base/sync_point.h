// SyncPoint: named points in the product code where tests order threads,
// inject delays or kill the process (after rocksdb test_util/sync_point.h).
//
// A point is written as OPTSTATE_TEST_SYNC_POINT("area.event") or, to hand a
// callback a pointer to local state, OPTSTATE_TEST_SYNC_POINT_CALLBACK(name,
// arg). Both compile to nothing unless the build defines OPTSTATE_TEST_HOOKS
// (the CMake option of that name defines it for the libraries with points). Where they are compiled in, a point costs
// one relaxed atomic load until a test calls EnableProcessing().
//
// Only code calls the registry: no environment variable, command-line flag or
// C ABI function of the library or its tools arms a point, so nothing a user
// sets can trip one. Test child processes arm points from their environment
// through the test-only library tests/common/test_hooks.cc, which product
// binaries never link.
//
// Thread-safety: every method may be called from any thread. Callbacks run
// without the registry's lock held and may block (to order threads).
#ifndef OPTSTATE_BASE_SYNC_POINT_H_
#define OPTSTATE_BASE_SYNC_POINT_H_

#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace optstate {

class SyncPoint {
 public:
  // Whether the libraries were built with their points compiled in
  // (OPTSTATE_TEST_HOOKS, defined for the targets that have points).
  static bool CompiledIn();

  // The process's registry (never destroyed: points may be reached during exit).
  static SyncPoint* Get();

  // Each pair {predecessor, successor}: a thread that reaches successor waits
  // there until some thread has passed predecessor since the last
  // ClearTrace() (rocksdb's LoadDependency). Replaces earlier pairs.
  void LoadDependency(const std::vector<std::pair<std::string, std::string>>& dependencies);

  // `callback(arg)` runs each time a thread passes `point`, after its
  // predecessors (arg: the macro's argument; null for OPTSTATE_TEST_SYNC_POINT).
  void SetCallBack(const std::string& point, std::function<void(void*)> callback);
  // Removes every callback, waiting for those running to return.
  void ClearAllCallBacks();

  // Points do nothing until EnableProcessing (the default is disabled).
  void EnableProcessing();
  void DisableProcessing();
  // Forgets which points have been passed.
  void ClearTrace();
  // Disable, clear callbacks, dependencies and trace: what a test's TearDown calls.
  void Reset();

  // How many times `point` has been passed since the last ClearTrace.
  uint64_t PassCount(const std::string& point);

  // Called by the macros.
  void Process(std::string_view point, void* arg = nullptr) {
    if (__builtin_expect(!enabled_.load(std::memory_order_relaxed), 1)) return;
    ProcessEnabled(point, arg);
  }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

 private:
  SyncPoint() = default;
  void ProcessEnabled(std::string_view point, void* arg);

  std::atomic<bool> enabled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  // All guarded by mu_.
  std::map<std::string, std::vector<std::string>, std::less<>> predecessors_;
  std::map<std::string, std::function<void(void*)>, std::less<>> callbacks_;
  std::map<std::string, uint64_t, std::less<>> passed_;
  int running_callbacks_ = 0;
};

}  // namespace optstate

#ifdef OPTSTATE_TEST_HOOKS
#define OPTSTATE_TEST_SYNC_POINT(name) ::optstate::SyncPoint::Get()->Process(name)
#define OPTSTATE_TEST_SYNC_POINT_CALLBACK(name, arg) ::optstate::SyncPoint::Get()->Process(name, arg)
// True while a test has enabled processing: code that must drop a lock around
// a point (so that a callback may wait for another thread) asks this first.
#define OPTSTATE_TEST_SYNC_POINTS_ENABLED() (::optstate::SyncPoint::Get()->enabled())
#else
#define OPTSTATE_TEST_SYNC_POINT(name) static_cast<void>(0)
#define OPTSTATE_TEST_SYNC_POINT_CALLBACK(name, arg) static_cast<void>(0)
#define OPTSTATE_TEST_SYNC_POINTS_ENABLED() false
#endif

#endif  // OPTSTATE_BASE_SYNC_POINT_H_
