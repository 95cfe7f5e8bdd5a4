// Checks a store of the full-stack workload (stack_workload.h) against the
// independent fp64 reference: used by the crash loop and the injection tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/reliability/stack_workload.h"
#include "vfs/store.h"

namespace optstate::reliability {

inline vfs::StoreOptions StackStoreOptions() {
  vfs::StoreOptions so;
  so.chunk_size_bytes = kStackChunk;
  so.preallocate_step_bytes = 8 * kStackChunk;
  so.retained_generations = 2;
  return so;
}

// Reads every field of every param at the latest generation and compares it
// with the reference advanced to the stored step count. Returns that count.
inline uint64_t CheckStore(const std::string& path, uint64_t min_step, StackReference* ref, uint64_t* bytes,
                    const std::string& what) {
  auto s = vfs::Store::Open(path, StackStoreOptions());
  EXPECT_TRUE(s.ok()) << what << ": reopen: " << s.status().ToString();
  if (!s.ok()) return 0;
  const auto latest = (*s)->LatestGeneration();
  uint64_t k = 0;
  for (const auto& g : latest.groups) {
    if (g.id == 0) k = g.step_count;
  }
  EXPECT_GE(k, min_step) << what << ": an acknowledged step was lost (generation " << latest.generation << ")";
  EXPECT_GE(k, ref->step()) << what << ": the store went back to an older step";
  if (k < ref->step()) return k;
  ref->AdvanceTo(k);
  auto view = (*s)->OpenGeneration(vfs::kLatest);
  EXPECT_TRUE(view.ok()) << what << ": " << view.status().ToString();
  if (!view.ok()) return k;
  const auto& ps = StackParams();
  if (k > 0) {
    EXPECT_EQ((*view)->tensors().size(), ps.size()) << what;
  }
  // ReadChunk needs a 4096-aligned buffer (O_DIRECT).
  std::unique_ptr<float, decltype(&std::free)> buf_owner(
      static_cast<float*>(std::aligned_alloc(4096, kStackChunk)), &std::free);
  float* const buf_ptr = buf_owner.get();
  double worst_main = 0;
  for (uint32_t pk = 0; pk < ps.size(); ++pk) {
    auto t = (*view)->FindTensor(ps[pk].name);
    if (!t.ok()) {
      EXPECT_EQ(k, 0u) << what << ": " << t.status().ToString();
      continue;
    }
    EXPECT_EQ(t->numel, ps[pk].numel) << what;
    const RefParam& r = ref->param(pk);
    for (uint32_t f = 0; f < 3; ++f) {
      const std::vector<double>& want = f == 0 ? r.w : f == 1 ? r.m : r.v;
      uint64_t bad = 0, first_bad = 0;
      double bad_got = 0, bad_want = 0;
      for (uint64_t c = 0; c < (*view)->ChunkCount(*t, f); ++c) {
        Status st = (*view)->ReadChunk(vfs::ChunkRef{t->id, f, c}, buf_ptr);
        EXPECT_TRUE(st.ok()) << what << ": " << st.ToString();
        if (!st.ok()) return k;
        const uint64_t first = c * (kStackChunk / 4);
        const uint64_t n = std::min<uint64_t>(kStackChunk / 4, t->numel - first);
        for (uint64_t i = 0; i < n; ++i) {
          const double w = want[first + i], got = buf_ptr[i];
          const double tol = f == 0 ? TolMain(k) : f == 1 ? TolExpAvg(w) : TolExpAvgSq(w);
          const double d = std::fabs(got - w);
          if (f == 0) worst_main = std::max(worst_main, d);
          if (!(d <= tol)) {
            if (bad++ == 0) {
              first_bad = first + i;
              bad_got = got;
              bad_want = w;
            }
          }
        }
        *bytes += n * 4;
      }
      EXPECT_EQ(bad, 0u) << what << ": " << ps[pk].name << " field " << f << " differs from the fp64 reference at step "
                         << k << " in " << bad << " elements; first [" << first_bad << "] = " << bad_got
                         << ", reference " << bad_want;
    }
  }
  Status gc = (*s)->CollectGarbage();
  EXPECT_TRUE(gc.ok()) << what << ": " << gc.ToString();
  auto rep = (*s)->Verify();
  EXPECT_TRUE(rep.ok()) << what << ": " << rep.status().ToString();
  if (rep.ok()) {
    EXPECT_TRUE(rep->problems.empty()) << what << ": " << (rep->problems.empty() ? "" : rep->problems[0]);
    EXPECT_EQ(rep->leaked_slots, 0u) << what << ": leaked extents after GC";
  }
  return k;
}

}  // namespace optstate::reliability
