// Shared helpers of the reliability tests (tests/reliability): the
// deterministic store workload of tests/vfs/store_crash_workload.h driven
// in-process, and an independent check of a committed generation against it.
// Generic helpers (TempDir, Buf, FillPattern, ChunkSeed, the child-process
// driver) live in tests/common/test_util.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/common/status_test_util.h"
#include "tests/common/test_util.h"
#include "tests/vfs/store_crash_workload.h"
#include "vfs/store.h"

namespace optstate::reliability {

// The store workload: temp dirs, buffers and chunk patterns from
// tests/common/test_util.h, the deterministic generations (which chunks
// generation g writes, with which bytes) from tests/vfs/store_crash_workload.h
// (the same reference the store's crash loop checks against).
namespace wl {

// A fresh directory on a real disk (/var/tmp: O_DIRECT works), removed on destruction.
class TempDir : public test_util::TempDir {
 public:
  TempDir() : test_util::TempDir("/var/tmp/optstate-rel-test-") {}
};

using test_util::Buf;
using test_util::ChunkSeed;
using test_util::FillPattern;
using vfs::store_testing::kTestChunk;
using vfs::store_testing::Mix;
using vfs::store_testing::StepOf;
using vfs::store_testing::TestOptions;
using vfs::store_testing::WorkloadOptions;
using vfs::store_testing::WorkloadSeed;
using vfs::store_testing::WorkloadTensor;
using vfs::store_testing::WorkloadTensors;
using vfs::store_testing::WrittenAt;
using vfs::store_testing::Writes;

}  // namespace wl

using wl::Buf;
using wl::kTestChunk;

// Finds or creates the workload's tensors (in the pending generation).
inline Status EnsureWorkloadTensors(vfs::Store* store, std::vector<vfs::TensorInfo>* out) {
  out->clear();
  for (const auto& w : wl::WorkloadTensors()) {
    auto t = store->FindTensor(w.name);
    if (!t.ok()) {
      vfs::TensorSpec spec;
      spec.name = w.name;
      spec.numel = w.numel;
      t = store->CreateTensor(spec);
      if (!t.ok()) return t.status();
    }
    out->push_back(*t);
  }
  return Status::Ok();
}

// Writes generation g's chunks (store_crash_workload.h) without committing.
// `max_chunks` limits how many are written (a partial, uncommitted generation).
inline Status WriteWorkloadGeneration(vfs::Store* store, const std::vector<vfs::TensorInfo>& tensors, uint64_t g,
                                      uint64_t max_chunks = UINT64_MAX) {
  Buf buf(kTestChunk);
  uint64_t n = 0;
  for (uint32_t ti = 0; ti < tensors.size(); ++ti) {
    for (uint32_t f = 0; f < 3; ++f) {
      for (uint64_t c = 0; c < store->ChunkCount(tensors[ti], f); ++c) {
        if (!wl::Writes(g, ti, f, c)) continue;
        if (n++ >= max_chunks) return Status::Ok();
        wl::FillPattern(buf.data(), kTestChunk, wl::WorkloadSeed(g, ti, f, c));
        OPTSTATE_RETURN_IF_ERROR(store->WriteChunk(vfs::ChunkRef{tensors[ti].id, f, c}, buf.data()));
      }
    }
  }
  return Status::Ok();
}

inline vfs::CommitInfo WorkloadCommitInfo(uint64_t g) {
  vfs::CommitInfo ci;
  ci.step = wl::StepOf(g);
  ci.groups = {vfs::GroupInfo{0, g, {{"lr", 1.0 / static_cast<double>(g)}}}};
  return ci;
}

// Writes and commits generation g; returns the Commit result.
inline Result<uint64_t> CommitWorkloadGeneration(vfs::Store* store, uint64_t g) {
  std::vector<vfs::TensorInfo> tensors;
  OPTSTATE_RETURN_IF_ERROR(EnsureWorkloadTensors(store, &tensors));
  OPTSTATE_RETURN_IF_ERROR(WriteWorkloadGeneration(store, tensors, g));
  return store->Commit(WorkloadCommitInfo(g));
}

// Every chunk of `view` equals the reference of generation g, bit for bit.
inline ::testing::AssertionResult GenerationMatchesReference(const vfs::GenerationView& view, uint64_t g,
                                                             uint64_t* bytes_compared) {
  using namespace wl;  // NOLINT
  if (view.info().generation != g) {
    return ::testing::AssertionFailure() << "view is generation " << view.info().generation << ", expected " << g;
  }
  if (g == 0) return ::testing::AssertionSuccess();
  if (view.info().step != StepOf(g)) return ::testing::AssertionFailure() << "generation " << g << " step " << view.info().step;
  if (view.info().groups.size() != 1 || view.info().groups[0].step_count != g ||
      view.info().groups[0].hyper.count("lr") == 0 || view.info().groups[0].hyper.at("lr") != 1.0 / static_cast<double>(g)) {
    return ::testing::AssertionFailure() << "generation " << g << ": groups differ from the reference";
  }
  const auto& specs = WorkloadTensors();
  if (view.tensors().size() != specs.size()) return ::testing::AssertionFailure() << "tensor count " << view.tensors().size();
  Buf got(kTestChunk), want(kTestChunk);
  for (uint32_t ti = 0; ti < specs.size(); ++ti) {
    auto t = view.FindTensor(specs[ti].name);
    if (!t.ok()) return ::testing::AssertionFailure() << t.status().ToString();
    if (t->numel != specs[ti].numel) return ::testing::AssertionFailure() << specs[ti].name << " numel " << t->numel;
    for (uint32_t f = 0; f < 3; ++f) {
      for (uint64_t c = 0; c < view.ChunkCount(*t, f); ++c) {
        const uint64_t len = std::min(kTestChunk, t->field_bytes(f) - c * kTestChunk);
        Status s = view.ReadChunk(vfs::ChunkRef{t->id, f, c}, got.data());
        if (!s.ok()) return ::testing::AssertionFailure() << "generation " << g << ": " << s.ToString();
        const uint64_t w = WrittenAt(g, ti, f, c);
        if (w == 0) {
          std::memset(want.data(), 0, kTestChunk);
        } else {
          FillPattern(want.data(), kTestChunk, WorkloadSeed(w, ti, f, c));
        }
        if (std::memcmp(got.data(), want.data(), len) != 0) {
          return ::testing::AssertionFailure() << "generation " << g << " tensor " << specs[ti].name << " field " << f
                                               << " chunk " << c << " differs (expected bytes of generation " << w << ")";
        }
        if (bytes_compared) *bytes_compared += len;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Opens `path` on the real file system and checks: latest in [lo, hi], equal
// to its reference, Verify clean, and after GC no leaked extent. Returns the
// latest generation (or UINT64_MAX after a failure).
inline uint64_t CheckReopenedStore(const std::string& path, uint64_t lo, uint64_t hi, uint64_t* bytes_compared,
                                   const std::string& what) {
  auto s = vfs::Store::Open(path, wl::WorkloadOptions());
  EXPECT_TRUE(s.ok()) << what << ": reopen: " << s.status().ToString();
  if (!s.ok()) return UINT64_MAX;
  const uint64_t g = (*s)->LatestGeneration().generation;
  EXPECT_GE(g, lo) << what << ": an acknowledged generation was lost";
  EXPECT_LE(g, hi) << what;
  auto view = (*s)->OpenGeneration(vfs::kLatest);
  EXPECT_TRUE(view.ok()) << what << ": " << view.status().ToString();
  if (view.ok()) {
    EXPECT_TRUE(GenerationMatchesReference(**view, g, bytes_compared)) << what;
    view->reset();
  }
  Status gc = (*s)->CollectGarbage();
  EXPECT_TRUE(gc.ok()) << what << ": " << gc.ToString();
  auto rep = (*s)->Verify();
  EXPECT_TRUE(rep.ok()) << what << ": " << rep.status().ToString();
  if (rep.ok()) {
    EXPECT_TRUE(rep->problems.empty()) << what << ": " << (rep->problems.empty() ? "" : rep->problems[0]);
    EXPECT_EQ(rep->leaked_slots, 0u) << what;
  }
  return g;
}

}  // namespace optstate::reliability
