// optstate-bench step's deterministic synthetic mode, checked against an
// independent fp64 AdamW (torch.optim.AdamW semantics) of the bench's w0 and g
// formulas, read back from the store it leaves behind.
#include <cmath>

#include <gtest/gtest.h>

#include "tests/tools/tools_test_util.h"
#include "tools/internal/store_read.h"
#include "vfs/store.h"

namespace optstate::tools {
namespace {

using testing::ParseJson;
using testing::TempDir;
using testing::Tool;

TEST(BenchStepTest, SyntheticModeMatchesAnFp64AdamW) {
  TempDir dir;
  const std::string store_path = dir / "synthetic";
  const uint64_t n = 1'100'000;   // param.0 spans 2 chunks of 2 MiB
  const uint32_t tensors = 2;
  const uint64_t steps = 3;
  auto r = Tool("optstate-bench", {"step", "--store", store_path, "--params", std::to_string(n),
                                   "--steps", std::to_string(steps), "--tensors",
                                   std::to_string(tensors), "--snapshot", "after3",
                                   "--chunk-size", "2M", "--budget", "16M", "--backend", "host",
                                   "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  EXPECT_EQ(j["step_count"].get<uint64_t>(), steps);

  auto s = vfs::Store::OpenReadOnly(store_path, vfs::StoreOptions{});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto view = (*s)->OpenSnapshot("after3");
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  ASSERT_EQ((*view)->tensors().size(), tensors);
  ASSERT_EQ((*view)->info().groups.size(), 1u);
  EXPECT_EQ((*view)->info().groups[0].step_count, steps);

  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  for (uint32_t k = 0; k < tensors; ++k) {
    auto t = (*view)->FindTensor("param." + std::to_string(k));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const uint64_t numel = n / tensors + (k < n % tensors ? 1 : 0);
    ASSERT_EQ(t->numel, numel);
    std::vector<float> got[3];
    for (uint32_t f = 0; f < 3; ++f) {
      got[f].reserve(numel);
      ASSERT_TRUE(ForEachRange(**view, *t, f, 0, numel,
                               [&](uint64_t, const void* d, uint64_t cnt) -> Status {
                                 const float* p = static_cast<const float*>(d);
                                 got[f].insert(got[f].end(), p, p + cnt);
                                 return Status::Ok();
                               }).ok());
    }
    double max_err[3] = {0, 0, 0};
    for (uint64_t i = 0; i < numel; ++i) {
      double w = static_cast<float>(0.1 * std::cos(0.25 * static_cast<double>(i) + k));
      double m = 0, v = 0;
      for (uint64_t st = 1; st <= steps; ++st) {
        double g = static_cast<float>(0.01 * std::sin(0.5 * static_cast<double>(i) + 1.3 * st + k));
        w *= 1 - lr * wd;
        m = b1 * m + (1 - b1) * g;
        v = b2 * v + (1 - b2) * g * g;
        double bc1 = 1 - std::pow(b1, st), bc2 = 1 - std::pow(b2, st);
        w -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
      }
      double ref[3] = {w, m, v};
      // Relative error, with a floor at ~1% of each field's typical magnitude
      // (values crossing zero have no meaningful relative error).
      const double scale[3] = {1e-3, 1e-5, 1e-8};
      for (int f = 0; f < 3; ++f) {
        double e = std::fabs(got[f][i] - ref[f]) / (std::fabs(ref[f]) + scale[f]);
        max_err[f] = std::max(max_err[f], e);
      }
    }
    EXPECT_LT(max_err[0], 1e-4) << "main of param." << k;
    EXPECT_LT(max_err[1], 1e-4) << "exp_avg of param." << k;
    EXPECT_LT(max_err[2], 1e-3) << "exp_avg_sq of param." << k;
  }
  // The store is left behind and inspectable.
  auto v = Tool("optstate-inspect", {store_path, "verify", "--json"});
  EXPECT_EQ(v.exit_code, 0) << v.err << v.out;
}

// Continuing a store with other --params/--tensors: refused with exit 1 and
// a message naming the store, the tensor and both sizes (it used to keep the
// stored sizes silently, or crash reading past the smaller gradients); the
// store's latest generation and bytes stay as they were.
TEST(BenchStepTest, ContinuingWithOtherSizesIsRefusedAndChangesNothing) {
  TempDir dir;
  const std::string store_path = dir / "resumed";
  const std::vector<std::string> common = {"--chunk-size", "2M", "--budget", "16M", "--backend", "host"};
  auto run = [&](const std::string& params, const std::string& tensors) {
    std::vector<std::string> args = {"step", "--store", store_path, "--params", params, "--steps", "1",
                                     "--tensors", tensors};
    args.insert(args.end(), common.begin(), common.end());
    return Tool("optstate-bench", args);
  };
  auto made = run("3000017", "2");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  // The committed state, read independently of the bench.
  auto snapshot = [&](uint64_t* generation) {
    std::vector<float> all;
    auto s = vfs::Store::OpenReadOnly(store_path, vfs::StoreOptions{});
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return all;
    auto view = (*s)->OpenGeneration(vfs::kLatest);
    EXPECT_TRUE(view.ok()) << view.status().ToString();
    if (!view.ok()) return all;
    *generation = (*view)->info().generation;
    for (const vfs::TensorInfo& t : (*view)->tensors()) {
      for (uint32_t f = 0; f < 3; ++f) {
        EXPECT_TRUE(ForEachRange(**view, t, f, 0, t.numel, [&](uint64_t, const void* d, uint64_t cnt) -> Status {
                      const float* p = static_cast<const float*>(d);
                      all.insert(all.end(), p, p + cnt);
                      return Status::Ok();
                    }).ok());
      }
    }
    return all;
  };
  uint64_t gen_before = 0;
  const std::vector<float> before = snapshot(&gen_before);
  ASSERT_EQ(before.size(), 3u * 3000017u);

  struct Case {
    std::string params, tensors;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      // The reported crash: 999 params in 2 tensors (500 + 499).
      {"999", "2", {"param.0", "1500009", "500", "param.1", "1500008", "499"}},
      // A model that lost a tensor: param.1 is in the store only.
      {"1500009", "1", {"param.1", "1500008", "not in --tensors 1"}},
      // One more tensor, with other sizes.
      {"3000017", "3", {"param.2", "not in the store", "1000006"}},
  };
  for (const Case& c : cases) {
    auto r = run(c.params, c.tensors);
    const std::string what = "--params " + c.params + " --tensors " + c.tensors;
    EXPECT_EQ(r.exit_code, 1) << what << "\n" << r.err;
    EXPECT_NE(r.err.find("optstate-bench step: error:"), std::string::npos) << what << "\n" << r.err;
    EXPECT_NE(r.err.find(store_path), std::string::npos) << what << "\n" << r.err;
    for (const auto& part : c.parts) EXPECT_NE(r.err.find(part), std::string::npos) << what << ": " << part << "\n" << r.err;
    // It says how to continue the store.
    EXPECT_NE(r.err.find("--params 3000017 --tensors 2"), std::string::npos) << what << "\n" << r.err;
    uint64_t gen = 0;
    EXPECT_TRUE(snapshot(&gen) == before) << what << " changed the store";
    EXPECT_EQ(gen, gen_before) << what << " committed";
  }
  // The matching flags continue it.
  auto again = run("3000017", "2");
  EXPECT_EQ(again.exit_code, 0) << again.err;
  uint64_t gen_after = 0;
  snapshot(&gen_after);
  EXPECT_EQ(gen_after, gen_before + 1);
}

TEST(BenchStepTest, RejectsMalformedArguments) {
  TempDir dir;
  auto r = Tool("optstate-bench", {"step", "--store", dir / "x", "--params", "0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--params"), std::string::npos) << r.err;
  r = Tool("optstate-bench", {"step", "--store", dir / "x", "--params", "10", "--chunk-size", "3M"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("2 MiB"), std::string::npos) << r.err;
  r = Tool("optstate-bench", {"step", "--store", dir / "x", "--params", "10", "--backend", "tpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("tpu"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace optstate::tools
