// The Muon rule (memmgr/muon_rule.h) on whole tensors: its RunCpu equals
// kernels::MuonStepCpu called directly with the parameters its group map
// means (bit for bit), one step agrees with an fp64 computation written
// here from torch.optim.Muon (lerp momentum, Nesterov, divide by
// max(||u||, eps), the given coefficients, adjust_lr_fn, decoupled weight
// decay), and it refuses what it cannot step: non-2-D shapes (naming the
// tensor), partial slices, invalid hyperparameters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/muon.h"
#include "memmgr/muon_rule.h"

namespace optstate::memmgr {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

struct Buffers {
  std::vector<float> main, momentum, grad;
  std::vector<char> workspace;
};

Buffers MakeBuffers(size_t rows, size_t cols, uint32_t seed) {
  Buffers b;
  b.main = Random(rows * cols, seed, 0.5f);
  b.momentum = Random(rows * cols, seed + 1, 0.01f);
  b.grad = Random(rows * cols, seed + 2, 0.02f);
  b.workspace.resize(kernels::MuonWorkspaceBytes(rows, cols) + 256);
  return b;
}

void* Aligned(std::vector<char>& v) {
  uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<void*>((p + 255) / 256 * 256);
}

Status RunRule(const UpdateRule& rule, const Hyperparams& h, Buffers* b, const std::vector<uint64_t>& shape,
               float grad_scale = 1.0f) {
  RuleArgs args;
  Status st = rule.MakeArgs(h, 1, grad_scale, &args);
  if (!st.ok()) return st;
  SliceOperands o;
  o.fields[0] = b->main.data();
  o.fields[1] = b->momentum.data();
  o.count = b->main.size();
  o.grad = b->grad.data();
  o.grad_type = DType::kF32;
  o.workspace = Aligned(b->workspace);
  o.shape = &shape;
  return rule.RunCpu(o, args, 2);
}

Hyperparams Group(double adjust) {
  return {{"lr", 0.03},  {"weight_decay", 0.05}, {"momentum", 0.9}, {"nesterov", 1.0}, {"ns_eps", 1e-7},
          {"ns_steps", 4}, {"ns_a", 3.0},        {"ns_b", -3.2},    {"ns_c", 1.2},      {"adjust_lr_fn", adjust}};
}

TEST(MuonRule, DeclaresWholeTensorUnitFieldsAndWorkspace) {
  auto rule = NewMuonRule(MomentDType::kBF16);
  EXPECT_EQ(rule->unit(), SliceUnit::kTensor);
  ASSERT_EQ(rule->Fields().size(), 2u);
  EXPECT_EQ(rule->Fields()[0].name, "main");
  EXPECT_EQ(rule->Fields()[1].name, "momentum_buffer");
  EXPECT_EQ(rule->Fields()[1].dtype, DType::kBF16);
  EXPECT_EQ(NewMuonRule(MomentDType::kF32)->Fields()[1].dtype, DType::kF32);
  vfs::TensorInfo t;
  t.name = "w";
  t.numel = 300;
  t.shape = {20, 15};
  EXPECT_EQ(rule->WorkspaceBytes(t), kernels::MuonWorkspaceBytes(20, 15));
  // torch.optim.Muon's defaults.
  const Hyperparams& d = rule->Hyperparameters();
  EXPECT_EQ(d.at("lr"), 1e-3);
  EXPECT_EQ(d.at("weight_decay"), 0.1);
  EXPECT_EQ(d.at("momentum"), 0.95);
  EXPECT_EQ(d.at("nesterov"), 1.0);
  EXPECT_EQ(d.at("ns_eps"), 1e-7);
  EXPECT_EQ(d.at("ns_steps"), 5.0);
  EXPECT_EQ(d.at("adjust_lr_fn"), 0.0);
}

// RunCpu is MuonStepCpu with the parameters the map names (the scale
// mapping, the clamped eps, the coefficients), bit for bit, for both
// orientations and every adjust_lr_fn.
TEST(MuonRule, RunCpuEqualsKernelDirectly) {
  auto rule = NewMuonRule(MomentDType::kF32);
  const kernels::MuonScale scales[] = {kernels::MuonScale::kShape, kernels::MuonScale::kMatchAdamW,
                                       kernels::MuonScale::kSpectral};
  for (auto [rows, cols] : {std::pair<size_t, size_t>{24, 10}, {7, 33}}) {
    for (int adjust = 0; adjust < 3; ++adjust) {
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " adjust " + std::to_string(adjust));
      Buffers via_rule = MakeBuffers(rows, cols, 11), direct = MakeBuffers(rows, cols, 11);
      ASSERT_TRUE(RunRule(*rule, Group(adjust), &via_rule, {rows, cols}, 2.0f).ok());
      kernels::MuonTensors t;
      t.main = direct.main.data();
      t.momentum = direct.momentum.data();
      t.grad = direct.grad.data();
      kernels::MuonParams p;
      p.lr = 0.03;
      p.weight_decay = 0.05;
      p.momentum = 0.9;
      p.nesterov = true;
      p.eps = 1e-7;
      p.norm_eps = kernels::MuonNormEps::kClamp;
      p.ns_steps = 4;
      p.ns_a = 3.0;
      p.ns_b = -3.2;
      p.ns_c = 1.2;
      p.scale = scales[adjust];
      p.grad_scale = 2.0f;
      ASSERT_TRUE(kernels::MuonStepCpu(t, rows, cols, p, Aligned(direct.workspace), 1));
      EXPECT_EQ(0, std::memcmp(via_rule.main.data(), direct.main.data(), rows * cols * 4));
      EXPECT_EQ(0, std::memcmp(via_rule.momentum.data(), direct.momentum.data(), rows * cols * 4));
    }
  }
}

// One step against fp64 torch.optim.Muon semantics, with an eps that the
// clamp makes matter (||u|| < eps: u / eps, not u / (||u|| + eps)).
TEST(MuonRule, MatchesTorchMuonSemanticsInFp64) {
  auto rule = NewMuonRule(MomentDType::kF32);
  for (double eps : {1e-7, 10.0}) {
    for (int adjust = 0; adjust < 3; ++adjust) {
      const size_t rows = 12, cols = 5;
      SCOPED_TRACE("eps " + std::to_string(eps) + " adjust " + std::to_string(adjust));
      Buffers b = MakeBuffers(rows, cols, 5);
      const std::vector<float> main0 = b.main, m0 = b.momentum, g = b.grad;
      Hyperparams h = Group(adjust);
      h["ns_eps"] = eps;
      ASSERT_TRUE(RunRule(*rule, h, &b, {rows, cols}).ok());
      // Reference: buf.lerp_(g, 1-mu); u = g.lerp(buf, mu); NS on the short
      // side first; p = p(1 - lr wd) - adjusted_lr * O.
      const double mu = 0.9, lr = 0.03, wd = 0.05;
      std::vector<double> buf(rows * cols), u(rows * cols);
      for (size_t i = 0; i < rows * cols; ++i) {
        buf[i] = m0[i] + (1 - mu) * (g[i] - m0[i]);
        u[i] = g[i] + mu * (buf[i] - g[i]);
      }
      // X = u^T (cols x rows), since rows > cols.
      const size_t s = cols, l = rows;
      std::vector<double> x(s * l);
      double norm = 0;
      for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < cols; ++c) x[c * rows + r] = u[r * cols + c], norm += u[r * cols + c] * u[r * cols + c];
      norm = std::max(std::sqrt(norm), eps);
      for (double& v : x) v /= norm;
      for (int it = 0; it < 4; ++it) {
        std::vector<double> a(s * s, 0), bm(s * s, 0), y(s * l, 0);
        for (size_t i = 0; i < s; ++i)
          for (size_t j = 0; j < s; ++j)
            for (size_t q = 0; q < l; ++q) a[i * s + j] += x[i * l + q] * x[j * l + q];
        for (size_t i = 0; i < s; ++i)
          for (size_t j = 0; j < s; ++j) {
            double aa = 0;
            for (size_t q = 0; q < s; ++q) aa += a[i * s + q] * a[q * s + j];
            bm[i * s + j] = -3.2 * a[i * s + j] + 1.2 * aa;
          }
        for (size_t i = 0; i < s; ++i)
          for (size_t q = 0; q < l; ++q) {
            double acc = 3.0 * x[i * l + q];
            for (size_t k = 0; k < s; ++k) acc += bm[i * s + k] * x[k * l + q];
            y[i * l + q] = acc;
          }
        x = y;
      }
      const double ratio = adjust == 0   ? std::sqrt(std::max(1.0, double(rows) / cols))
                           : adjust == 1 ? 0.2 * std::sqrt(double(std::max(rows, cols)))
                                         : std::sqrt(double(rows) / cols);
      for (size_t r = 0; r < rows; ++r) {
        for (size_t c = 0; c < cols; ++c) {
          const size_t i = r * cols + c;
          const double want = main0[i] * (1 - lr * wd) - lr * ratio * x[c * rows + r];
          EXPECT_NEAR(b.main[i], want, 2e-6 + 1e-5 * std::fabs(want - main0[i])) << "element " << i;
          EXPECT_NEAR(b.momentum[i], buf[i], 1e-7) << "element " << i;
        }
      }
    }
  }
}

TEST(MuonRule, RefusesWhatItCannotStep) {
  auto rule = NewMuonRule(MomentDType::kF32);
  Buffers b = MakeBuffers(6, 4, 3);
  const std::vector<float> main0 = b.main;
  // 1-D and 3-D shapes, and a shape that is not the slice.
  for (const std::vector<uint64_t>& shape : {std::vector<uint64_t>{24}, {2, 3, 4}, {5, 4}}) {
    Status st = RunRule(*rule, Group(0), &b, shape);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(b.main, main0);  // nothing written
  Status st = CheckMuonShape("/stores/s0", "ln_f.weight", {768}, 768);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("ln_f.weight"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("/stores/s0"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("[768]"), std::string::npos) << st.message();
  EXPECT_TRUE(CheckMuonShape("/s", "w", {3, 4}, 12).ok());
  vfs::TensorInfo t;
  t.name = "h.0.attn.bias";
  t.numel = 10;
  t.shape = {10};
  st = rule->CheckStored("/stores/s1", t);
  EXPECT_NE(st.message().find("h.0.attn.bias"), std::string::npos) << st.message();

  for (auto [k, v] : std::vector<std::pair<std::string, double>>{
           {"lr", -1}, {"ns_steps", 2.5}, {"ns_steps", 100}, {"adjust_lr_fn", 3}, {"momentum", NAN}, {"ns_eps", -1}}) {
    Hyperparams h = rule->Hyperparameters();
    h[k] = v;
    EXPECT_EQ(rule->CheckHyperparams(1, h).code(), StatusCode::kInvalidArgument) << k << " " << v;
  }
  EXPECT_TRUE(rule->CheckHyperparams(1, rule->Hyperparameters()).ok());
}

}  // namespace
}  // namespace optstate::memmgr
