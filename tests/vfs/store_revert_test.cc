// Store::RevertToSnapshot: the new head reads exactly the bytes the snapshot
// read before it (chunk by chunk, zeros included), carries its step, group and
// per-tensor step counts and hyperparameters, keeps the replaced head as a
// snapshot, writes no data but the zeros of chunks the snapshot never wrote,
// survives reopen and GC with Verify clean, refuses what it cannot do, and a
// kill at any point of its commit leaves either the old head or the reverted
// one (with its kept snapshot), never a mix.
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "tests/common/test_util.h"
#include "tests/vfs/store_test_util.h"
#include "vfs/store.h"

namespace optstate::vfs {
namespace {

using namespace store_testing;  // NOLINT

// Every chunk's bytes of every field of every tensor, as `view` reads them.
using Bytes = std::map<std::tuple<std::string, uint32_t, uint64_t>, std::string>;

Bytes ReadAll(const GenerationView& view) {
  Bytes out;
  Buf buf(kTestChunk);
  for (const TensorInfo& t : view.tensors()) {
    for (uint32_t f = 0; f < 3; ++f) {
      for (uint64_t c = 0; c < view.ChunkCount(t, f); ++c) {
        const Status st = view.ReadChunk(ChunkRef{t.id, f, c}, buf.data());
        EXPECT_TRUE(st.ok()) << st.ToString();
        const ChunkInfo ci = Unwrap(view.Chunk(ChunkRef{t.id, f, c}));
        out[{t.name, f, c}] = std::string(reinterpret_cast<const char*>(buf.data()), ci.length_bytes);
      }
    }
  }
  return out;
}

Bytes ReadLatest(Store* s) {
  auto view = Unwrap(s->OpenGeneration(kLatest));
  return ReadAll(*view);
}

void Write(Store* s, const TensorInfo& t, uint32_t f, uint64_t c, uint64_t seed) {
  Buf buf(kTestChunk);
  FillPattern(buf.data(), kTestChunk, seed);
  ASSERT_OK(s->WriteChunk(ChunkRef{t.id, f, c}, buf.data()));
}

CommitInfo Info(uint64_t step, double lr, std::map<uint32_t, uint64_t> tensor_steps) {
  CommitInfo ci;
  ci.step = step;
  GroupInfo g;
  g.id = 0;
  g.step_count = step;
  g.hyper = {{"lr", lr}, {"beta1", 0.9}};
  ci.groups = {g};
  ci.tensor_steps = std::move(tensor_steps);
  return ci;
}

// A store whose generation 1 is snapshot "s1" and generation 3 the head: a
// (3 chunks a field) has exp_avg chunk 1 and exp_avg_sq unwritten at s1; b is
// one small chunk with a step count of its own.
struct Fixture {
  TempDir dir;
  std::string path = dir.path() + "/s";
  std::unique_ptr<Store> store;
  TensorInfo a, b;

  void Build() {
    store = Unwrap(Store::Create(path, TestOptions()));
    a = NewTensor(store.get(), "a", 2 * kTestChunk / 4 + 1000);
    b = NewTensor(store.get(), "b", 300);
    for (uint64_t c = 0; c < 3; ++c) Write(store.get(), a, 0, c, 100 + c);
    Write(store.get(), a, 1, 0, 110);
    Write(store.get(), b, 0, 0, 120);
    ASSERT_EQ(Unwrap(store->Commit(Info(1, 0.1, {{b.id, 7}}))), 1u);
    ASSERT_OK(store->CreateSnapshot("s1").status());
    for (uint64_t g = 2; g <= 3; ++g) {
      for (uint64_t c = 0; c < 3; ++c) {
        for (uint32_t f = 0; f < 3; ++f) Write(store.get(), a, f, c, 1000 * g + 10 * f + c);
      }
      if (g == 3) Write(store.get(), b, 2, 0, 3000);
      ASSERT_EQ(Unwrap(store->Commit(Info(g, 0.1 * g, {{b.id, 9}}))), g);
    }
  }
};

TEST(StoreRevertTest, HeadReadsTheSnapshotsBytesCountsAndHyperparameters) {
  Fixture fx;
  fx.Build();
  Store* s = fx.store.get();
  const Bytes want = ReadAll(*Unwrap(s->OpenSnapshot("s1")));
  const Bytes head3 = ReadLatest(s);
  ASSERT_NE(want, head3);  // else the test could not tell them apart
  const uint64_t written_before = Unwrap(s->Stats()).lifetime_bytes_written;

  const RevertResult r = Unwrap(s->RevertToSnapshot("s1"));
  EXPECT_EQ(r.generation, 4u);
  ASSERT_FALSE(r.kept_snapshot.empty());
  EXPECT_EQ(r.kept_snapshot.rfind("pre-revert-3-", 0), 0u) << r.kept_snapshot;

  EXPECT_EQ(ReadLatest(s), want);
  const GenerationInfo g = s->LatestGeneration();
  EXPECT_EQ(g.generation, 4u);
  EXPECT_EQ(g.step, 1u);
  ASSERT_EQ(g.groups.size(), 1u);
  EXPECT_EQ(g.groups[0].step_count, 1u);
  EXPECT_EQ(g.groups[0].hyper.at("lr"), 0.1);
  EXPECT_EQ(TensorStepCount(g, fx.b), 7u);
  EXPECT_EQ(TensorStepCount(g, fx.a), 1u);
  // The replaced head is kept, as it was.
  std::map<std::string, uint64_t> snaps;
  for (const SnapshotInfo& si : s->ListSnapshots()) snaps[si.name] = si.generation;
  EXPECT_EQ(snaps.at(r.kept_snapshot), 3u);
  EXPECT_EQ(ReadAll(*Unwrap(s->OpenSnapshot(r.kept_snapshot))), head3);
  // No data copied: only the chunks s1 never wrote and the head did were
  // written, as zeros (a's exp_avg chunks 1 and 2, exp_avg_sq 0..2, b's exp_avg_sq).
  const uint64_t tail = (2 * kTestChunk / 4 + 1000) * 4 - 2 * kTestChunk;
  const uint64_t zeros = kTestChunk + tail + 2 * kTestChunk + tail + 300 * 4;
  EXPECT_EQ(Unwrap(s->Stats()).lifetime_bytes_written - written_before, zeros);
  const VerifyReport v = Unwrap(s->Verify());
  EXPECT_TRUE(v.ok()) << (v.problems.empty() ? "leaked slots" : v.problems[0]);

  // Reopen (free space is derived from shared extents), then let GC drop the
  // generations and snapshots that shared extents with the head.
  fx.store.reset();
  fx.store = Unwrap(Store::Open(fx.path, TestOptions()));
  s = fx.store.get();
  EXPECT_EQ(ReadLatest(s), want);
  EXPECT_TRUE(Unwrap(s->Verify()).ok());
  ASSERT_OK(s->ReleaseSnapshot("s1"));
  ASSERT_OK(s->ReleaseSnapshot(r.kept_snapshot));
  ASSERT_OK(s->CollectGarbage());
  EXPECT_EQ(ReadLatest(s), want);
  const VerifyReport v2 = Unwrap(s->Verify());
  EXPECT_TRUE(v2.ok()) << (v2.problems.empty() ? "leaked slots" : v2.problems[0]);
  // A step after the revert supersedes the shared extents; their space comes back.
  for (uint64_t c = 0; c < 3; ++c) {
    for (uint32_t f = 0; f < 3; ++f) Write(s, fx.a, f, c, 5000 + 10 * f + c);
  }
  Write(s, fx.b, 0, 0, 5100);
  Write(s, fx.b, 1, 0, 5101);
  Write(s, fx.b, 2, 0, 5102);
  ASSERT_EQ(Unwrap(s->Commit(Info(2, 0.2, {}))), 5u);
  ASSERT_OK(s->CollectGarbage());
  const StoreStats st = Unwrap(s->Stats());
  EXPECT_EQ(st.generations_retained, 1u);
  const VerifyReport v3 = Unwrap(s->Verify());
  EXPECT_TRUE(v3.ok()) << (v3.problems.empty() ? "leaked slots" : v3.problems[0]);
  uint64_t free_bytes = 0, file_bytes = 0;
  for (uint64_t x : st.data_free_bytes) free_bytes += x;
  for (uint64_t x : st.data_file_bytes) file_bytes += x;
  EXPECT_EQ(file_bytes - free_bytes, st.referenced_extent_bytes);
}

TEST(StoreRevertTest, RefusesWhatItCannotDo) {
  Fixture fx;
  fx.Build();
  Store* s = fx.store.get();
  auto unknown = s->RevertToSnapshot("nope");
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("s1"), std::string::npos) << unknown.status().ToString();

  Write(s, fx.a, 0, 0, 42);
  auto pending = s->RevertToSnapshot("s1");
  EXPECT_EQ(pending.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(pending.status().message().find("uncommitted"), std::string::npos) << pending.status().ToString();
  ASSERT_OK(s->AbortPending());

  NewTensor(s, "late", 10);
  ASSERT_EQ(Unwrap(s->Commit(Info(4, 0.4, {}))), 4u);
  auto late = s->RevertToSnapshot("s1");
  EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(late.status().message().find("'late'"), std::string::npos) << late.status().ToString();
  EXPECT_EQ(s->LatestGeneration().generation, 4u);

  // A snapshot of the head: nothing to do.
  ASSERT_OK(s->CreateSnapshot("head").status());
  const RevertResult r = Unwrap(s->RevertToSnapshot("head"));
  EXPECT_EQ(r.generation, 4u);
  EXPECT_EQ(r.kept_snapshot, "");
  EXPECT_EQ(s->LatestGeneration().generation, 4u);
}

// A kill before the revert's batch leaves the old head and no kept snapshot;
// a kill after it leaves the reverted head and its kept snapshot.
TEST(StoreRevertTest, KillDuringTheRevertLeavesOneHeadOrTheOther) {
  for (const char* point : {"revert.before_commit", "commit.before_sync", "commit.before_batch",
                            "commit.after_batch"}) {
    SCOPED_TRACE(point);
    Fixture fx;
    fx.Build();
    const Bytes want = ReadAll(*Unwrap(fx.store->OpenSnapshot("s1")));
    const Bytes head3 = ReadLatest(fx.store.get());
    fx.store.reset();
    test_util::ChildOptions o;
    o.exe = test_util::SiblingBinary("store_crash_child");
    o.args = {"revert", fx.path, "s1"};
    o.crash_at = point;
    o.kill_after_ms = -1;
    o.guard_ms = 60000;
    const test_util::ChildResult cr = test_util::RunChild(o);
    ASSERT_EQ(cr.error, "");
    ASSERT_TRUE(WIFSIGNALED(cr.wait_status)) << cr.output;  // it died at the point

    auto s = Unwrap(Store::Open(fx.path, TestOptions()));
    std::vector<std::string> kept;
    for (const SnapshotInfo& si : s->ListSnapshots()) {
      if (si.name.rfind("pre-revert-", 0) == 0) kept.push_back(si.name);
    }
    const bool reverted = std::string(point) == "commit.after_batch";
    if (reverted) {
      EXPECT_EQ(s->LatestGeneration().generation, 4u);
      EXPECT_EQ(ReadLatest(s.get()), want);
      ASSERT_EQ(kept.size(), 1u);
      EXPECT_EQ(ReadAll(*Unwrap(s->OpenSnapshot(kept[0]))), head3);
    } else {
      EXPECT_EQ(s->LatestGeneration().generation, 3u);
      EXPECT_EQ(ReadLatest(s.get()), head3);
      EXPECT_TRUE(kept.empty());
    }
    const VerifyReport v = Unwrap(s->Verify());
    EXPECT_TRUE(v.ok()) << (v.problems.empty() ? "leaked slots" : v.problems[0]);
    // Either way the revert can be done (again) after the reopen.
    EXPECT_EQ(ReadLatest(s.get()) == want, reverted);
    if (!reverted) {
      ASSERT_OK(s->RevertToSnapshot("s1").status());
      EXPECT_EQ(ReadLatest(s.get()), want);
      EXPECT_TRUE(Unwrap(s->Verify()).ok());
    }
  }
}

}  // namespace
}  // namespace optstate::vfs
