// A test mode the product reads at a test sync point: the point hands its
// callback a bool*, which this sets to true while it lives (for example
// "chunk_io.use_sync_engine", "streamed_adam.hold_completions"). The
// destructor resets the process's sync points (SyncPoint::Reset). Needs a
// build with OPTSTATE_TEST_HOOKS (the default): SyncPoint::CompiledIn().
//
// Namespace optstate::test_util, as tests/common/test_util.h.
#pragma once

#include <cstdint>

#include "base/sync_point.h"

namespace optstate::test_util {

class SyncPointFlag {
 public:
  explicit SyncPointFlag(const char* point) : point_(point) {
    SyncPoint* sp = SyncPoint::Get();
    sp->SetCallBack(point_, [](void* arg) { *static_cast<bool*>(arg) = true; });
    sp->EnableProcessing();
  }
  ~SyncPointFlag() { SyncPoint::Get()->Reset(); }
  SyncPointFlag(const SyncPointFlag&) = delete;
  SyncPointFlag& operator=(const SyncPointFlag&) = delete;

  // Times the product reached the point since this was made.
  uint64_t passes() const { return SyncPoint::Get()->PassCount(point_); }

 private:
  const char* point_;
};

}  // namespace optstate::test_util
