// Crash loop: a child process (store_crash_child) commits generations of the
// deterministic workload and is SIGKILLed at random instants and at named
// crash points; after each kill the store must reopen at a generation >= the
// last one the child acknowledged, equal bit for bit to the independent
// reference (tests/vfs/store_crash_workload.h), with Verify() clean.
//
// OPTSTATE_CRASH_KILLS overrides the number of kills (default 100; the slow
// binary store_slow_test is built with 1000).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <random>

#include <gtest/gtest.h>

#include "tests/common/test_util.h"
#include "tests/vfs/store_crash_workload.h"
#include "vfs/store.h"

#ifndef OPTSTATE_CRASH_KILLS_DEFAULT
#define OPTSTATE_CRASH_KILLS_DEFAULT 100
#endif

namespace optstate::vfs {
namespace {

using namespace store_testing;  // NOLINT

// Runs store_crash_child (tests/common/test_util.h drives it); kills it after
// kill_after_ms (< 0: let it run until it exits or the 60 s guard).
// crash_at: OPTSTATE_CRASH_AT for the child.
test_util::ChildResult RunChild(const std::vector<std::string>& args, const std::string& crash_at,
                                int kill_after_ms,
                                const std::function<void(const std::string&, pid_t)>& on_line = nullptr) {
  test_util::ChildOptions o;
  o.exe = test_util::SiblingBinary("store_crash_child");
  o.args = args;
  o.crash_at = crash_at;
  o.kill_after_ms = kill_after_ms;
  o.guard_ms = 60000;
  o.on_line = on_line;
  test_util::ChildResult r = test_util::RunChild(o);
  EXPECT_EQ(r.error, "");
  return r;
}

// Compares every chunk of `view` with the reference state of generation g.
void ExpectGenerationExact(const GenerationView& view, uint64_t g, uint64_t* bytes_compared) {
  ASSERT_EQ(view.info().generation, g);
  if (g == 0) return;
  EXPECT_EQ(view.info().step, StepOf(g));
  ASSERT_EQ(view.info().groups.size(), 1u);
  EXPECT_EQ(view.info().groups[0].step_count, g);
  EXPECT_EQ(view.info().groups[0].hyper.at("lr"), 1.0 / static_cast<double>(g));
  const auto& specs = WorkloadTensors();
  ASSERT_EQ(view.tensors().size(), specs.size());
  Buf got(kTestChunk), want(kTestChunk);
  for (uint32_t ti = 0; ti < specs.size(); ++ti) {
    auto t = view.FindTensor(specs[ti].name);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_EQ(t->numel, specs[ti].numel);
    for (uint32_t f = 0; f < 3; ++f) {
      for (uint64_t c = 0; c < view.ChunkCount(*t, f); ++c) {
        const uint64_t len = std::min(kTestChunk, t->field_bytes(f) - c * kTestChunk);
        Status s = view.ReadChunk(ChunkRef{t->id, f, c}, got.data());
        ASSERT_TRUE(s.ok()) << s.ToString();
        const uint64_t w = WrittenAt(g, ti, f, c);
        if (w == 0) {
          std::memset(want.data(), 0, kTestChunk);
        } else {
          FillPattern(want.data(), kTestChunk, WorkloadSeed(w, ti, f, c));
        }
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), len))
            << "generation " << g << " tensor " << specs[ti].name << " field " << f << " chunk " << c
            << " (expected bytes of generation " << w << ")";
        *bytes_compared += len;
      }
    }
  }
}

const char* const kCrashPoints[] = {
    "commit.before_sync", "commit.before_batch", "commit.after_batch", "gc.before_batch", "gc.after_batch",
    "snapshot.create",    "snapshot.release",    "extent.before_write", "extent.after_write",
    "store.create.begin", "store.create.identity", "store.create.index", "store.create.renamed",
};

TEST(StoreCrashTest, KillLoopKeepsLastAcknowledgedGeneration) {
  const char* env = std::getenv("OPTSTATE_CRASH_KILLS");
  const int kills_wanted = env ? std::atoi(env) : OPTSTATE_CRASH_KILLS_DEFAULT;
  TempDir dir;
  const std::string store = dir / "rank0.dense";
  std::mt19937_64 rng(0xC0FFEE);
  uint64_t acked = 0;  // highest generation acknowledged by any child of this store
  int kills = 0, point_kills = 0, iterations = 0;
  uint64_t bytes_compared = 0, reopened_above_ack = 0;
  while (kills < kills_wanted) {
    ++iterations;
    ASSERT_LT(iterations, kills_wanted * 3 + 20) << "children keep finishing without being killed";
    std::string crash_at;
    int kill_after_ms = -1;
    const bool use_point = rng() % 5 < 2;
    if (use_point) {
      const auto* name = kCrashPoints[rng() % std::size(kCrashPoints)];
      crash_at = name;
      if (std::string(name).rfind("store.create.", 0) == 0) {
        std::filesystem::remove_all(store);  // creation points need a fresh store
        acked = 0;
      } else {
        crash_at += ":" + std::to_string(1 + rng() % (std::string(name).rfind("extent.", 0) == 0 ? 40 : 4));
      }
    } else {
      kill_after_ms = static_cast<int>(rng() % 250);
      if (rng() % 25 == 0) {
        std::filesystem::remove_all(store);
        acked = 0;
      }
    }
    test_util::ChildResult r = RunChild({"run", store, use_point ? "20" : "1000000"}, crash_at, kill_after_ms);
    const bool was_killed = WIFSIGNALED(r.wait_status) && WTERMSIG(r.wait_status) == SIGKILL;
    if (!was_killed) {
      ASSERT_TRUE(WIFEXITED(r.wait_status) && WEXITSTATUS(r.wait_status) == 0)
          << "child failed: " << r.output;
    } else {
      ++kills;
      if (use_point) ++point_kills;
    }
    ASSERT_EQ(r.output.find("ERROR"), std::string::npos) << r.output;
    acked = std::max(acked, r.last_ack);

    if (!std::filesystem::exists(store)) {
      ASSERT_EQ(acked, 0u) << "store vanished after acknowledged commits";
      continue;  // killed inside Create before the rename: no store, as promised
    }
    auto s = Store::Open(store, WorkloadOptions());
    ASSERT_TRUE(s.ok()) << "iteration " << iterations << " (" << crash_at << "): " << s.status().ToString();
    const uint64_t g = (*s)->LatestGeneration().generation;
    ASSERT_GE(g, acked) << "lost an acknowledged generation (crash at '" << crash_at << "')";
    ASSERT_LE(g, acked + 1);
    if (g > acked) ++reopened_above_ack;
    acked = g;
    {
      auto view = (*s)->OpenGeneration(kLatest);
      ASSERT_TRUE(view.ok()) << view.status().ToString();
      ExpectGenerationExact(**view, g, &bytes_compared);
      for (const auto& snap : (*s)->ListSnapshots()) {
        auto sv = (*s)->OpenSnapshot(snap.name);
        ASSERT_TRUE(sv.ok()) << sv.status().ToString();
        ASSERT_EQ("g" + std::to_string(snap.generation), snap.name);
        ExpectGenerationExact(**sv, snap.generation, &bytes_compared);
      }
    }
    auto rep = (*s)->Verify();
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    ASSERT_TRUE(rep->problems.empty()) << rep->problems[0];
    ASSERT_EQ(rep->leaked_slots, 0u);
    if (HasFatalFailure()) return;
  }
  std::printf("crash loop: %d kills (%d at named points) in %d runs, %llu bytes compared, "
              "%llu reopens found the unacknowledged in-flight commit\n",
              kills, point_kills, iterations, static_cast<unsigned long long>(bytes_compared),
              static_cast<unsigned long long>(reopened_above_ack));
}

TEST(StoreCrashTest, SecondProcessIsBusyNamingTheHolder) {
  TempDir dir;
  const std::string store = dir / "s";
  auto s = Store::Create(store, WorkloadOptions());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  // This process holds it: the child fails naming our pid.
  test_util::ChildResult r = RunChild({"open", store}, "", -1);
  ASSERT_TRUE(WIFEXITED(r.wait_status));
  EXPECT_EQ(WEXITSTATUS(r.wait_status), 3) << r.output;
  EXPECT_NE(r.output.find("in use by pid " + std::to_string(getpid())), std::string::npos) << r.output;
  s->reset();
  // A child holds it: we fail naming the child's pid.
  pid_t holder = 0;
  std::string message;
  RunChild({"hold", store}, "", -1, [&](const std::string& line, pid_t pid) {
    if (line != "READY") return;
    holder = pid;
    auto again = Store::Open(store, WorkloadOptions());
    EXPECT_EQ(again.status().code(), StatusCode::kBusy);
    message = again.status().message();
    ::kill(pid, SIGKILL);
  });
  ASSERT_NE(holder, 0);
  EXPECT_NE(message.find("in use by pid " + std::to_string(holder)), std::string::npos) << message;
  // The dead holder's lock is gone with it.
  auto after = Store::Open(store, WorkloadOptions());
  EXPECT_TRUE(after.ok()) << after.status().ToString();
}

}  // namespace
}  // namespace optstate::vfs
