// Device-error injection for StreamedAdam tests: fails a step's kernel
// launch through the test sync point "streamed_adam.kernel_launch"
// (memmgr/internal/step_pipeline.cc, one launch per slice), as if the device
// had reported an error there. The launch fails with kInternal "injected
// kernel failure" in the step's error, before the kernel touches the slice.
// Needs a build with OPTSTATE_TEST_HOOKS (the default): tests skip without it
// (KernelFailures::Available).
//
// Namespace optstate::test_util, as tests/common/test_util.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "base/status.h"
#include "base/sync_point.h"

namespace optstate::test_util {

// Arms the point while it lives; the destructor resets the process's sync
// points (SyncPoint::Reset).
class KernelFailures {
 public:
  static constexpr const char* kPoint = "streamed_adam.kernel_launch";

  KernelFailures() = default;
  KernelFailures(const KernelFailures&) = delete;
  KernelFailures& operator=(const KernelFailures&) = delete;
  ~KernelFailures() {
    if (armed_) SyncPoint::Get()->Reset();
  }

  // Whether the libraries were built with their sync points.
  static bool Available() { return SyncPoint::CompiledIn(); }

  // The n-th kernel launch from now fails (n >= 1); the launches before and
  // after it run. Replaces an earlier FailAfter.
  void FailAfter(uint64_t n) {
    auto left = std::make_shared<std::atomic<uint64_t>>(n);
    SyncPoint* sp = SyncPoint::Get();
    sp->SetCallBack(kPoint, [left](void* arg) {
      uint64_t v = left->load();
      while (v > 0 && !left->compare_exchange_weak(v, v - 1)) {
      }
      if (v == 1) *static_cast<Status*>(arg) = Internal("injected kernel failure");
    });
    sp->EnableProcessing();
    armed_ = true;
  }

 private:
  bool armed_ = false;
};

}  // namespace optstate::test_util
