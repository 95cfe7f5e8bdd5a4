// SyncPoint (base/sync_point.h): ordering, callbacks and pass counts, checked
// against the order the threads record themselves. The registry is called as
// the OPTSTATE_TEST_SYNC_POINT macros call it in the libraries.
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/sync_point.h"

namespace optstate {
namespace {

class SyncPointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
    SyncPoint::Get()->Reset();
  }
  void TearDown() override { SyncPoint::Get()->Reset(); }
};

// "A waits until B": the thread that reaches the successor first is held
// there until another thread passes the predecessor, whatever the scheduler does.
TEST_F(SyncPointTest, ASuccessorWaitsForItsPredecessor) {
  SyncPoint* sp = SyncPoint::Get();
  sp->LoadDependency({{"test.b", "test.a"}});
  std::mutex mu;
  std::vector<std::string> order;
  auto record = [&](const char* what) {
    std::lock_guard<std::mutex> l(mu);
    order.push_back(what);
  };
  sp->SetCallBack("test.a", [&](void*) { record("a"); });
  sp->SetCallBack("test.b", [&](void*) { record("b"); });
  sp->EnableProcessing();
  std::thread ta([] { SyncPoint::Get()->Process("test.a"); });
  std::thread tb([] { SyncPoint::Get()->Process("test.b"); });
  ta.join();
  tb.join();
  ASSERT_EQ(order, (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(sp->PassCount("test.a"), 1u);
  EXPECT_EQ(sp->PassCount("test.b"), 1u);
}

// A callback sees the macro's argument and may change what the product code
// does with it; with processing disabled nothing runs and nothing is counted.
TEST_F(SyncPointTest, CallbackGetsTheArgumentOnlyWhileEnabled) {
  SyncPoint* sp = SyncPoint::Get();
  sp->SetCallBack("test.arg", [](void* arg) { *static_cast<int*>(arg) += 1; });
  int v = 0;
  sp->Process("test.arg", &v);
  EXPECT_EQ(v, 0);
  EXPECT_EQ(sp->PassCount("test.arg"), 0u);
  sp->EnableProcessing();
  sp->Process("test.arg", &v);
  sp->Process("test.arg", &v);
  EXPECT_EQ(v, 2);
  EXPECT_EQ(sp->PassCount("test.arg"), 2u);
  sp->DisableProcessing();
  sp->Process("test.arg", &v);
  EXPECT_EQ(v, 2);
}

}  // namespace
}  // namespace optstate
