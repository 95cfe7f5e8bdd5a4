// Resources: a full disk mid-StreamedAdam-step (a loop-mounted 160 MiB ext4,
// root only), and RLIMIT_NOFILE / RLIMIT_MEMLOCK too low at start (the child
// reliability_stack_child in "limits" mode sets them before opening anything).
// Expected: a clear error at start (open, memory manager, optimizer), not a
// crash or a failure in the middle of a step; a full disk fails the step with
// a clear error, the last committed step stays exact, and after space is
// freed a later step commits.
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "memmgr/internal/host_cache.h"
#include "memmgr/internal/device.h"
#include "memmgr/internal/manager_impl.h"
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tests/common/test_util.h"
#include "tests/reliability/reliability_util.h"
#include "tests/reliability/stack_check.h"

namespace optstate::reliability {
namespace {

namespace fs = std::filesystem;

struct ChildRun {
  int status = 0;
  std::string out;
};
// Runs reliability_stack_child in "limits" mode (3 steps) to its end (no kill).
ChildRun RunLimited(const std::string& store, uint64_t nofile, uint64_t memlock, bool drop_ipc_lock) {
  test_util::ChildOptions o;
  o.exe = test_util::SiblingBinary("reliability_stack_child");
  o.args = {"limits", store, std::to_string(nofile), std::to_string(memlock), drop_ipc_lock ? "1" : "0", "3"};
  o.guard_ms = -1;
  o.capture_stderr = true;
  test_util::ChildResult r = test_util::RunChild(o);
  EXPECT_EQ(r.error, "");
  return ChildRun{r.wait_status, r.output};
}

bool Mentions(const std::string& s, std::initializer_list<const char*> words) {
  for (const char* w : words) {
    if (s.find(w) != std::string::npos) return true;
  }
  return false;
}

TEST(ResourcesTest, LowFileDescriptorLimitFailsClearlyAtStart) {
#if defined(__SANITIZE_ADDRESS__)
  // The sanitizer runtimes need descriptors of their own: in an fd-starved
  // child UBSan's vptr check reports false "invalid vptr" errors and exits.
  GTEST_SKIP() << "not meaningful under ASan/UBSan (sanitizer runtime needs file descriptors)";
#endif
  wl::TempDir dir;
  const std::string store = dir / "store";
  // A store with one committed step first (no limit).
  ChildRun first = RunLimited(store, 0, 0, false);
  ASSERT_TRUE(WIFEXITED(first.status) && WEXITSTATUS(first.status) == 0) << first.out;
  std::string table;
  for (uint64_t nofile : {6, 10, 16, 24, 32, 48, 64}) {
    ChildRun r = RunLimited(store, nofile, 0, false);
    const std::string what = "RLIMIT_NOFILE=" + std::to_string(nofile);
    ASSERT_TRUE(WIFEXITED(r.status)) << what << ": child crashed (signal " << WTERMSIG(r.status) << ")\n" << r.out;
    const int code = WEXITSTATUS(r.status);
    table += what + " -> " + (code == 0 ? "ok" : code == 10 ? "clear error at start" : "error mid-step") + "; ";
    EXPECT_NE(code, 20) << what << ": the limit was not checked at start, a step failed instead:\n" << r.out;
    if (code == 10) {
      EXPECT_TRUE(Mentions(r.out, {"open files", "RLIMIT_NOFILE", "EMFILE", "Too many open files", "descriptor"}))
          << what << ": the message does not say what is missing:\n" << r.out;
    } else {
      EXPECT_EQ(code, 0) << what << "\n" << r.out;
    }
  }
  std::printf("%s\n", table.c_str());
  StackReference ref;
  uint64_t bytes = 0;
  CheckStore(store, 1, &ref, &bytes, "after the fd-limit runs");
}

TEST(ResourcesTest, LowMemlockLimitFailsClearlyAtStart) {
  wl::TempDir dir;
  const std::string store = dir / "store";
  ChildRun first = RunLimited(store, 0, 0, false);
  ASSERT_TRUE(WIFEXITED(first.status) && WEXITSTATUS(first.status) == 0) << first.out;
  std::string table;
  for (uint64_t memlock : {uint64_t{0} + 4096, uint64_t{64} << 10, uint64_t{1} << 20, uint64_t{8} << 20}) {
    ChildRun r = RunLimited(store, 0, memlock, /*drop_ipc_lock=*/true);
    const std::string what = "RLIMIT_MEMLOCK=" + std::to_string(memlock) + " without CAP_IPC_LOCK";
    ASSERT_TRUE(WIFEXITED(r.status)) << what << ": child crashed (signal " << WTERMSIG(r.status) << ")\n" << r.out;
    const int code = WEXITSTATUS(r.status);
    table += what + " -> " + (code == 0 ? "ok" : code == 10 ? "clear error at start" : "error mid-step") + "; ";
    EXPECT_NE(code, 20) << what << ": the limit was not checked at start, a step failed instead:\n" << r.out;
    if (code == 10) {
      EXPECT_TRUE(Mentions(r.out, {"MEMLOCK", "memlock", "locked memory", "ENOMEM", "pinned"}))
          << what << ": the message does not say what is missing:\n" << r.out;
    } else {
      EXPECT_EQ(code, 0) << what << "\n" << r.out;
    }
  }
  std::printf("%s\n", table.c_str());
  StackReference ref;
  uint64_t bytes = 0;
  CheckStore(store, 1, &ref, &bytes, "after the memlock runs");
}

// /proc/self/status's `key` (VmRSS, VmLck) in bytes.
uint64_t StatusBytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string k;
  uint64_t kib = 0;
  std::string unit;
  while (in >> k) {
    if (k == std::string(key) + ":") {
      in >> kib;
      return kib << 10;
    }
    std::getline(in, unit);
  }
  return 0;
}

// An optimizer of a small model (10 tensors of 1000 params: 120 KB of
// state) holds pinned staging in proportion to that state, not the
// throughput plan's dozens of chunk-sized buffers: its small slices fit
// kSmallSliceBytes pieces of one buffer, plus two buffers kept for pins.
TEST(ResourcesTest, StagingFollowsTheStateSize) {
  wl::TempDir dir;
  vfs::StoreOptions so;
  so.chunk_size_bytes = 8ull << 20;  // the default chunk size
  auto store = vfs::Store::Create(dir / "store", so);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  const uint64_t locked0 = StatusBytes("VmLck");
  memmgr::MemoryManagerOptions mo;
  mo.backend = memmgr::Backend::kHost;
  mo.host_cache_bytes = 64ull << 20;
  auto mm = memmgr::MemoryManager::Create(store->get(), mo);
  ASSERT_TRUE(mm.ok()) << mm.status().ToString();
  auto sa = memmgr::StreamedAdam::Create(store->get(), mm->get(), {});
  ASSERT_TRUE(sa.ok()) << sa.status().ToString();
  constexpr uint32_t kTensors = 10;
  constexpr uint64_t kNumel = 1000;
  std::vector<std::vector<float>> w(kTensors, std::vector<float>(kNumel, 0.5f)), g = w;
  std::vector<memmgr::ParamGrad> grads;
  for (uint32_t k = 0; k < kTensors; ++k) {
    const std::string name = "small." + std::to_string(k);
    ASSERT_OK((*sa)->RegisterParam(name, kNumel, 0, w[k].data(), DType::kF32));
    memmgr::ParamGrad pg;
    pg.name = name;
    pg.d_grad = g[k].data();
    pg.numel = kNumel;
    grads.push_back(pg);
  }
  for (int t = 0; t < 3; ++t) ASSERT_OK((*sa)->Step(grads));
  ASSERT_OK((*sa)->WaitForCommit());
  const memmgr::MemoryStats st = (*mm)->stats();
  const uint64_t chunk = (*store)->chunk_size_bytes();
  // The state's slices in kSmallSliceBytes pieces (3 a slice), in whole
  // buffers, plus the two kept for pins.
  const uint64_t pieces = 3 * kTensors;
  const uint64_t bound = 2 + (pieces * memmgr::internal::kSmallSliceBytes + chunk - 1) / chunk;
  EXPECT_LE(st.staging_buffers, bound) << "staging of " << st.staging_buffers << " buffers of " << chunk
                                       << " bytes for " << kTensors * kNumel * 12 << " bytes of state";
  // Everything pinned (staging, the host cache's entries) stays within that
  // and the state's cache entries (4 KiB each), with 1 MiB of slack.
  const uint64_t locked = StatusBytes("VmLck") - locked0;
  EXPECT_LE(locked, bound * chunk + 3 * kTensors * 4096 + (1ull << 20)) << "pinned bytes added: " << locked;
  std::printf("staging %u buffers (bound %llu), pinned added %llu bytes\n", st.staging_buffers,
              static_cast<unsigned long long>(bound), static_cast<unsigned long long>(locked));
}

// Host caches that share a budget (as every manager with the automatic host
// cache shares the process's) hold at most its capacity together.
TEST(ResourcesTest, HostCachesSharingABudgetStayWithinIt) {
  auto dev = memmgr::internal::NewHostDevice(false);
  auto budget = std::make_shared<memmgr::internal::CacheBudget>(16 * 4096);
  memmgr::internal::HostCache a(dev.get(), budget), b(dev.get(), budget);
  std::vector<char> chunk(4096, 7);
  for (uint64_t c = 0; c < 12; ++c) a.Put(memmgr::internal::ChunkKey{1, 0, c}, chunk.data(), chunk.size());
  for (uint64_t c = 0; c < 12; ++c) b.Put(memmgr::internal::ChunkKey{2, 0, c}, chunk.data(), chunk.size());
  EXPECT_EQ(a.bytes(), 12u * 4096);
  EXPECT_EQ(b.bytes(), 4u * 4096) << "the second cache took more than the budget left";
  EXPECT_LE(a.bytes() + b.bytes(), budget->capacity_bytes());
  EXPECT_EQ(b.capacity_bytes(), 4u * 4096);
}

// Two managers with the automatic host cache in one process draw from one
// budget (the documented share: half of MemAvailable, at least 4 GiB left
// free, per node divided among its ranks), not one share each.
TEST(ResourcesTest, AutoHostCacheIsOneBudgetPerProcess) {
  wl::TempDir dir;
  auto s1 = vfs::Store::Create(dir / "one", StackStoreOptions());
  auto s2 = vfs::Store::Create(dir / "two", StackStoreOptions());
  ASSERT_TRUE(s1.ok() && s2.ok());
  memmgr::MemoryManagerOptions mo;
  mo.backend = memmgr::Backend::kHost;
  auto m1 = memmgr::MemoryManager::Create(s1->get(), mo);
  ASSERT_TRUE(m1.ok()) << m1.status().ToString();
  const uint64_t share = (*m1)->options().host_cache_bytes;
  if (share < (64ull << 20)) GTEST_SKIP() << "the automatic share here is " << share << " bytes";
  // The first manager's cache holds some chunks...
  auto sa = memmgr::StreamedAdam::Create(s1->get(), m1->get(), {});
  ASSERT_TRUE(sa.ok()) << sa.status().ToString();
  std::vector<float> w(3 * kStackChunk / 4, 1.0f);
  ASSERT_OK((*sa)->RegisterParam("p", w.size(), 0, w.data(), DType::kF32));
  memmgr::ParamGrad pg;
  pg.name = "p";
  pg.d_grad = w.data();
  ASSERT_OK((*sa)->Step(std::span<const memmgr::ParamGrad>(&pg, 1)));
  ASSERT_OK((*sa)->WaitForCommit());
  const uint64_t held = (*m1)->stats().cache_bytes;
  ASSERT_GT(held, 0u);
  // ... so the second has the share less that, and both report the one share.
  auto m2 = memmgr::MemoryManager::Create(s2->get(), mo);
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_EQ((*m2)->options().host_cache_bytes, share);
  EXPECT_EQ(memmgr::internal::ImplOf(**m2)->cache()->capacity_bytes(), share - held);
}

TEST(ResourcesTest, FullDiskMidStepThenFreedSpace) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to loop-mount an ext4 image";
  wl::TempDir dir;
  const std::string mnt = dir / "mnt", img = dir / "fs.img";
  fs::create_directories(mnt);
  const std::string cmd = "truncate -s 160M " + img + " && mkfs.ext4 -q -F " + img + " >/dev/null 2>&1 && mount -o loop " +
                          img + " " + mnt + " 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "cannot loop-mount an ext4 image here (" << cmd << ")";
  struct Unmount {
    std::string m;
    ~Unmount() {
      if (::umount(m.c_str()) != 0) ::umount2(m.c_str(), MNT_DETACH);
    }
  } unmount{mnt};
  const std::string path = mnt + "/store";
  StackReference ref;
  uint64_t bytes = 0;
  uint64_t acked = 0;
  Status failure;
  {
    auto store = vfs::Store::Create(path, StackStoreOptions());
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    memmgr::MemoryManagerOptions mo;
    mo.backend = memmgr::Backend::kHost;
    mo.device_budget_bytes = 6 * kStackChunk;
    auto mm = memmgr::MemoryManager::Create(store->get(), mo);
    ASSERT_TRUE(mm.ok()) << mm.status().ToString();
    auto sa = memmgr::StreamedAdam::Create(store->get(), mm->get(), {});
    ASSERT_TRUE(sa.ok()) << sa.status().ToString();
    memmgr::ParamGroup g;
    g.lr = kLr;
    g.beta1 = kBeta1;
    g.beta2 = kBeta2;
    g.eps = kEps;
    g.weight_decay = kWeightDecay;
    ASSERT_OK((*sa)->SetGroup(g));
    const auto& ps = StackParams();
    std::vector<std::vector<float>> grads(ps.size());
    for (uint32_t k = 0; k < ps.size(); ++k) {
      std::vector<float> w0(ps[k].numel);
      for (uint64_t i = 0; i < ps[k].numel; ++i) w0[i] = InitialWeight(k, i);
      ASSERT_OK((*sa)->RegisterParam(ps[k].name, ps[k].numel, 0, w0.data(), DType::kF32));
      grads[k].resize(ps[k].numel);
    }
    auto step = [&](uint64_t t) {
      std::vector<memmgr::ParamGrad> list;
      for (uint32_t k = 0; k < ps.size(); ++k) {
        for (uint64_t i = 0; i < ps[k].numel; ++i) grads[k][i] = Gradient(t, k, i);
        memmgr::ParamGrad pg;
        pg.name = ps[k].name;
        pg.d_grad = grads[k].data();
        list.push_back(pg);
      }
      return (*sa)->Step(list);
    };
    // Every step is pinned by a snapshot, so the data file must keep growing
    // until the disk is full.
    for (uint64_t t = 1; t <= 60; ++t) {
      Status s = step(t);
      if (!s.ok()) {
        failure = s;
        break;
      }
      acked = t;
      auto snap = (*store)->CreateSnapshot("keep" + std::to_string(t));
      if (!snap.ok()) {
        failure = snap.status();
        break;
      }
    }
    std::printf("disk full after %llu committed steps: %s\n", static_cast<unsigned long long>(acked),
                failure.ToString().c_str());
    ASSERT_FALSE(failure.ok()) << "the disk never filled";
    ASSERT_GE(acked, 1u) << failure.ToString();
    EXPECT_TRUE(failure.code() == StatusCode::kNoSpace || Mentions(failure.message(), {"No space", "ENOSPC"}))
        << failure.ToString();
    EXPECT_EQ((*sa)->step_count(0), acked);
    // Free space: release every snapshot (GC frees their extents), then step again
    // with the same optimizer; if the store refuses until reopen, reopen.
    for (const auto& snap : (*store)->ListSnapshots()) (void)(*store)->ReleaseSnapshot(snap.name);
    (void)(*store)->CollectGarbage();
    Status again = step(acked + 1);
    std::printf("step after freeing space with the same objects: %s\n", again.ToString().c_str());
    if (again.ok()) acked += 1;
  }
  // Reopen (from disk): last committed step exact; then one more step commits.
  EXPECT_EQ(CheckStore(path, acked, &ref, &bytes, "after the full disk"), acked);
  ASSERT_FALSE(HasFailure());
  ChildRun more = RunLimited(path, 0, 0, false);  // 3 more steps through the child
  ASSERT_TRUE(WIFEXITED(more.status) && WEXITSTATUS(more.status) == 0) << more.out;
  EXPECT_EQ(CheckStore(path, acked + 3, &ref, &bytes, "steps after freeing space"), acked + 3);
}

}  // namespace
}  // namespace optstate::reliability
