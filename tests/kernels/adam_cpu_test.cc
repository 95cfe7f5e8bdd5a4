// kernels_test: AdamStepCpu against a plain fp64 loop (adam_test_util.h), the
// dtype conversions against independent decoders, and the CUDA launcher's
// argument checks (which run before any CUDA call, so they need no GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/adam.h"
#include "tests/kernels/adam_test_util.h"

namespace optstate::kernels {
namespace {

using testing::Decode;
using testing::DecodeBf16;
using testing::DecodeHalf;
using testing::Encode;
using testing::GradValue;
using testing::RefState;
using testing::RefStep;
using testing::TypeName;
using testing::TypeSize;
using testing::Uniform;

constexpr int kSteps = 7;
const size_t kSizes[] = {0, 1, 22, 4095, (size_t{1} << 20) + 3};

// Tolerances against the fp64 reference after 7 steps (the worst element of
// any case reaches 0.37 of its tolerance; the test records these ratios):
//  - main: fp32 rounding of ~10 operations per step, accumulated:
//    |d| <= 2e-6 * |ref| + 1e-6 * lr * steps. Adam (L2) is worse conditioned:
//    where grad ~= -weight_decay * main the sum cancels, its relative error
//    grows, and m / sqrt(v) (an O(1) direction times lr) inherits it; there the
//    lr term is 1e-4 * lr * steps (observed up to ~3e-5). A wrong L2 term
//    would be off by ~lr per step, 100x above this.
//  - exp_avg: abs error relative to the gradient scale (cancellation when the
//    gradient changes sign): |d| <= 1e-6 * (|ref| + gmax).
//  - exp_avg_sq: a sum of positive terms: |d| <= 1e-5 * |ref| + 1e-30.
//  - param copy: within half an ulp of its type of the reference main
//    (bf16 2^-8, fp16 2^-11 relative, fp16 subnormal step 2^-24) plus the main
//    tolerance.
struct Tolerance {
  double main_rel = 2e-6, main_abs_per_lr_step = 1e-6, main_abs_per_lr_step_l2 = 1e-4;
  double m_rel = 1e-6, v_rel = 1e-5;
};

// GradValue(100 + step, i) for i < n, computed once per process and grown on
// demand (pow() per element is the slowest part of the test under ASan).
const std::vector<float>& CachedGrads(int step, size_t n) {
  static std::vector<std::vector<float>> cache(kSteps + 1);
  std::vector<float>& c = cache[step];
  for (size_t i = c.size(); i < n; ++i) c.push_back(GradValue(100 + step, i));
  return c;
}

double CopyRel(DType t) {
  return t == DType::kBF16 ? 0x1p-8 : t == DType::kF16 ? 0x1p-11 : 0.0;
}

struct Case {
  DType grad_type;
  std::optional<DType> param_type;
  AdamMode mode;
};

// Runs kSteps of AdamStepCpu and of the fp64 reference on the same inputs and
// checks every element of every output.
// worst_out[0..2]: running max of |error| / tolerance for main, exp_avg, exp_avg_sq.
void RunAndCompare(const Case& c, size_t n, float grad_scale, int threads, double* worst_out) {
  SCOPED_TRACE("grad=" + TypeName(c.grad_type) + " param=" + TypeName(c.param_type) +
               " mode=" + (c.mode == AdamMode::kAdam ? "adam" : "adamw") +
               " n=" + std::to_string(n) + " scale=" + std::to_string(grad_scale));
  AdamParams p;
  p.lr = 1e-2;
  p.beta1 = 0.9;
  p.beta2 = 0.999;
  p.eps = 1e-8;
  p.weight_decay = 0.1;
  p.mode = c.mode;
  p.grad_scale = grad_scale;

  std::vector<float> main(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<uint8_t> grad(n * TypeSize(c.grad_type) + 1);
  std::vector<uint8_t> param(n * TypeSize(c.param_type) + 1, 0xEE);
  RefState ref{std::vector<double>(n), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (size_t i = 0; i < n; ++i) ref.main[i] = main[i] = Uniform(1, i);
  std::vector<double> g64(n);

  double gmax = 0.0;
  for (int step = 1; step <= kSteps; ++step) {
    const std::vector<float>& gv = CachedGrads(step, n);
    for (size_t i = 0; i < n; ++i) {
      Encode(grad.data(), c.grad_type, i, gv[i] * grad_scale);
      g64[i] = Decode(grad.data(), c.grad_type, i);
      gmax = std::max(gmax, std::fabs(g64[i]) / grad_scale);
    }
    p.step = static_cast<uint64_t>(step);
    AdamTensors t;
    t.main = main.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.grad = grad.data();
    t.grad_type = c.grad_type;
    t.param = !c.param_type ? nullptr : param.data();
    t.param_type = c.param_type;
    ASSERT_TRUE(AdamStepCpu(t, n, p, threads));
    RefStep(ref, g64, p);
  }
  if (c.mode == AdamMode::kAdam) gmax += p.weight_decay * 1.5;  // L2 term in the gradient

  const Tolerance tol;
  size_t bad = 0;
  double worst[4] = {0, 0, 0, 0};
  for (size_t i = 0; i < n; ++i) {
    const double main_tol =
        tol.main_rel * std::fabs(ref.main[i]) +
        (c.mode == AdamMode::kAdam ? tol.main_abs_per_lr_step_l2 : tol.main_abs_per_lr_step) *
            p.lr * kSteps;
    const double m_tol = tol.m_rel * (std::fabs(ref.m[i]) + gmax);
    const double v_tol = tol.v_rel * std::fabs(ref.v[i]) + 1e-30;
    worst[0] = std::max(worst[0], std::fabs(main[i] - ref.main[i]) / main_tol);
    worst[1] = std::max(worst[1], std::fabs(m[i] - ref.m[i]) / m_tol);
    worst[2] = std::max(worst[2], std::fabs(v[i] - ref.v[i]) / v_tol);
    bool ok = std::fabs(main[i] - ref.main[i]) <= main_tol &&
              std::fabs(m[i] - ref.m[i]) <= m_tol && std::fabs(v[i] - ref.v[i]) <= v_tol;
    if (c.param_type.has_value()) {
      const double copy = Decode(param.data(), *c.param_type, i);
      const double copy_tol = CopyRel(*c.param_type) * std::fabs(ref.main[i]) + main_tol +
                              (c.param_type == DType::kF16 ? 0x1p-25 : 0.0);
      ok = ok && std::fabs(copy - ref.main[i]) <= copy_tol;
    }
    if (!ok && ++bad <= 5) {
      ADD_FAILURE() << "element " << i << ": main " << main[i] << " vs " << ref.main[i]
                    << ", exp_avg " << m[i] << " vs " << ref.m[i] << ", exp_avg_sq " << v[i]
                    << " vs " << ref.v[i];
    }
  }
  // Largest error as a fraction of its tolerance, for whoever tunes them.
  for (int k = 0; k < 3; ++k) worst_out[k] = std::max(worst_out[k], worst[k]);
  // The byte after the last param element is never written.
  EXPECT_EQ(param[n * TypeSize(c.param_type)], 0xEE);
}

class AdamCpuTest : public ::testing::TestWithParam<std::tuple<DType, std::optional<DType>, AdamMode>> {
};

TEST_P(AdamCpuTest, MatchesFp64ReferenceOverSevenSteps) {
  const Case c{std::get<0>(GetParam()), std::get<1>(GetParam()), std::get<2>(GetParam())};
  double worst[3] = {0, 0, 0};
  for (size_t n : kSizes) {
    RunAndCompare(c, n, 1.0f, n > 100000 ? 3 : 1, worst);
  }
  // Largest error as a fraction of its tolerance (in --gtest_output=xml).
  RecordProperty("worst_main_over_tol", std::to_string(worst[0]));
  RecordProperty("worst_exp_avg_over_tol", std::to_string(worst[1]));
  RecordProperty("worst_exp_avg_sq_over_tol", std::to_string(worst[2]));
}

TEST_P(AdamCpuTest, GradScaleDividesGradients) {
  const Case c{std::get<0>(GetParam()), std::get<1>(GetParam()), std::get<2>(GetParam())};
  double worst[3] = {0, 0, 0};
  RunAndCompare(c, 4095, 1024.0f, 1, worst);
  RunAndCompare(c, 22, 3.0f, 1, worst);
  RecordProperty("worst_main_over_tol", std::to_string(worst[0]));
}

INSTANTIATE_TEST_SUITE_P(
    AllTypes, AdamCpuTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16,
                                         std::nullopt),
                       ::testing::Values(AdamMode::kAdam, AdamMode::kAdamW)),
    [](const auto& info) {
      return "grad_" + TypeName(std::get<0>(info.param)) + "_param_" +
             TypeName(std::get<1>(info.param)) +
             (std::get<2>(info.param) == AdamMode::kAdam ? "_adam" : "_adamw");
    });

// The per-call constants (1 - beta, bias corrections, lr * weight_decay) come
// from the hyperparameters in double, rounded to fp32 once, as torch.optim.AdamW
// does with its Python floats. Rounding beta2 = 0.999 to fp32 first makes
// 1 - beta2 1.3e-5 relative off 0.001, and every exp_avg_sq with it. Against
// an fp64 loop with the exact hyperparameters (written here, not read back
// from AdamParams), over 25 steps, fp32 rounding alone stays within:
//  - exp_avg_sq after step t: relative error <= 5 t u, u = 2^-24 (per step
//    four roundings, g*g, its product with 1 - beta2, beta2*v and the sum,
//    plus beta2's own fp32 representation, all carried on with weight
//    beta2 ~ 1): 3e-7 at step 1, 44x below the offset an fp32-rounded
//    1 - beta2 gives;
//  - exp_avg: <= 1e-6 of its own magnitude plus the gradient scale;
//  - main: <= 2e-3 * lr per element over all steps, plus 2 ulps of |main|.
TEST(AdamCpuTest, ConstantsFromDoubleHyperparametersTrackFp64Over25Steps) {
  constexpr size_t kN = 4099;
  constexpr int kSteps25 = 25;
  constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWd = 0.01;
  std::vector<float> main(kN), m(kN, 0.0f), v(kN, 0.0f), grad(kN);
  std::vector<double> rm(kN), rmom(kN, 0.0), rv(kN, 0.0);
  for (size_t i = 0; i < kN; ++i) rm[i] = main[i] = Uniform(21, i);
  double worst_v = 0, worst_m = 0, worst_main = 0;
  for (int step = 1; step <= kSteps25; ++step) {
    double gmax = 0;
    for (size_t i = 0; i < kN; ++i) {
      grad[i] = GradValue(200 + step, i);
      gmax = std::max(gmax, std::fabs(static_cast<double>(grad[i])));
    }
    AdamParams p;
    p.lr = kLr;
    p.beta1 = kBeta1;
    p.beta2 = kBeta2;
    p.eps = kEps;
    p.weight_decay = kWd;
    p.mode = AdamMode::kAdamW;
    p.step = static_cast<uint64_t>(step);
    AdamTensors t;
    t.main = main.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.grad = grad.data();
    ASSERT_TRUE(AdamStepCpu(t, kN, p));
    const double bc1 = 1.0 - std::pow(kBeta1, step), bc2 = 1.0 - std::pow(kBeta2, step);
    for (size_t i = 0; i < kN; ++i) {
      const double g = grad[i];
      rm[i] *= 1.0 - kLr * kWd;
      rmom[i] = kBeta1 * rmom[i] + (1.0 - kBeta1) * g;
      rv[i] = kBeta2 * rv[i] + (1.0 - kBeta2) * g * g;
      rm[i] -= kLr * (rmom[i] / bc1) / (std::sqrt(rv[i] / bc2) + kEps);
      if (rv[i] > 0) worst_v = std::max(worst_v, std::fabs(v[i] - rv[i]) / (rv[i] * 5 * step * 0x1p-24));
      worst_m = std::max(worst_m, std::fabs(m[i] - rmom[i]) / (std::fabs(rmom[i]) + gmax));
      const double main_tol = 2e-3 * kLr + 2 * 0x1p-24 * std::fabs(rm[i]);
      worst_main = std::max(worst_main, std::fabs(main[i] - rm[i]) / main_tol);
    }
  }
  RecordProperty("worst_exp_avg_sq_over_tol", std::to_string(worst_v));
  RecordProperty("worst_exp_avg_rel", std::to_string(worst_m));
  RecordProperty("worst_main_over_tol", std::to_string(worst_main));
  EXPECT_LE(worst_v, 1.0) << "exp_avg_sq error over its fp32 rounding bound";
  EXPECT_LE(worst_m, 1e-6);
  EXPECT_LE(worst_main, 1.0);
}

struct Buffers {
  explicit Buffers(size_t n) : main(n), m(n), v(n), grad(n), param(n, 0x1234) {
    for (size_t i = 0; i < n; ++i) {
      main[i] = Uniform(7, i);
      m[i] = 0.1f * Uniform(8, i);
      v[i] = 0.01f * std::fabs(Uniform(9, i));
      grad[i] = FloatToBf16(GradValue(10, i));
    }
  }
  AdamTensors Tensors(const float* found_inf) {
    AdamTensors t;
    t.main = main.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.grad = grad.data();
    t.grad_type = DType::kBF16;
    t.param = param.data();
    t.param_type = DType::kBF16;
    t.found_inf = found_inf;
    return t;
  }
  std::vector<float> main, m, v;
  std::vector<uint16_t> grad, param;
};

TEST(AdamCpuTest, FoundInfSkipsTheWholeUpdate) {
  constexpr size_t kN = 4095;
  Buffers a(kN);
  const Buffers before = a;
  AdamParams p;
  p.step = 3;
  p.weight_decay = 0.1;
  const float inf_flag = 1.0f;
  ASSERT_TRUE(AdamStepCpu(a.Tensors(&inf_flag), kN, p));
  EXPECT_EQ(a.main, before.main);
  EXPECT_EQ(a.m, before.m);
  EXPECT_EQ(a.v, before.v);
  EXPECT_EQ(a.param, before.param);
  // A zero flag updates every element.
  const float no_inf = 0.0f;
  ASSERT_TRUE(AdamStepCpu(a.Tensors(&no_inf), kN, p));
  size_t changed = 0;
  for (size_t i = 0; i < kN; ++i) {
    changed += a.m[i] != before.m[i];
    ASSERT_EQ(a.param[i], FloatToBf16(a.main[i])) << i;
  }
  EXPECT_EQ(changed, kN);
}

TEST(AdamCpuTest, ThreadsGiveBitIdenticalResults) {
  constexpr size_t kN = (size_t{1} << 20) + 3;
  Buffers a(kN), b(kN);
  AdamParams p;
  p.step = 2;
  ASSERT_TRUE(AdamStepCpu(a.Tensors(nullptr), kN, p, 1));
  ASSERT_TRUE(AdamStepCpu(b.Tensors(nullptr), kN, p, 5));
  EXPECT_EQ(a.main, b.main);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.param, b.param);
}

TEST(AdamCpuTest, RejectsUnsupportedInputAndWritesNothing) {
  Buffers a(22);
  const Buffers before = a;
  AdamParams p;
  AdamTensors t = a.Tensors(nullptr);
  t.moment_type = MomentDType::kQ8;  // q8 moments take AdamQ8Tensors
  EXPECT_FALSE(AdamStepCpu(t, 22, p));
  t = a.Tensors(nullptr);
  t.grad_type = DType::kQ8S;  // not a float
  EXPECT_FALSE(AdamStepCpu(t, 22, p));
  t = a.Tensors(nullptr);
  p.step = 0;
  EXPECT_FALSE(AdamStepCpu(t, 22, p));
  EXPECT_EQ(a.main, before.main);
  EXPECT_TRUE(AdamStepCpu(t, 0, AdamParams{}));  // count 0 is fine, with any pointers
}

// bf16 moments (AdamTensors::moment_type kBF16): decoded to fp32, updated in
// fp32, rounded to nearest even. Stated bound: each stored moment is within a
// relative 2^-8 (the unit roundoff of bf16's 8 significand bits) of the exact
// update of the stored state it was computed from, plus the fp32 arithmetic
// tolerance of the f32 case; main uses the unrounded fp32 moments, so it stays
// within the f32 case's tolerance of that exact update.
struct Bf16MomentBuffers {
  explicit Bf16MomentBuffers(size_t n) : main(n), m(n, 0), v(n, 0), grad(n), param(n, 0) {
    for (size_t i = 0; i < n; ++i) main[i] = Uniform(21, i);
  }
  AdamTensors Tensors(DType grad_type) {
    AdamTensors t;
    t.main = main.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.moment_type = MomentDType::kBF16;
    t.grad = grad.data();
    t.grad_type = grad_type;
    t.param = param.data();
    t.param_type = DType::kBF16;
    return t;
  }
  std::vector<float> main;
  std::vector<uint16_t> m, v;
  std::vector<uint32_t> grad;  // room for f32; bf16 grads use the low half of the bytes
  std::vector<uint16_t> param;
};

class AdamBf16MomentTest : public ::testing::TestWithParam<std::tuple<DType, AdamMode>> {};

// Every step of 24: the stored bf16 moments against an fp64 update of the
// state the kernel held before that step, within the rounding bound.
TEST_P(AdamBf16MomentTest, EachStepWithinBf16RoundingOfFp64Update) {
  const DType grad_type = std::get<0>(GetParam());
  constexpr size_t kN = 40000;
  constexpr int kSteps24 = 24;
  Bf16MomentBuffers b(kN);
  AdamParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.mode = std::get<1>(GetParam());
  const Tolerance tol;
  double worst_m = 0, worst_v = 0, worst_main = 0;
  size_t bad = 0;
  for (int step = 1; step <= kSteps24; ++step) {
    p.step = static_cast<uint64_t>(step);
    RefState ref{std::vector<double>(kN), std::vector<double>(kN), std::vector<double>(kN)};
    std::vector<double> g64(kN);
    double gmax = 0;
    for (size_t i = 0; i < kN; ++i) {
      Encode(b.grad.data(), grad_type, i, GradValue(300 + step, i));
      g64[i] = Decode(b.grad.data(), grad_type, i);
      gmax = std::max(gmax, std::fabs(g64[i]));
      ref.main[i] = b.main[i];
      ref.m[i] = DecodeBf16(b.m[i]);
      ref.v[i] = DecodeBf16(b.v[i]);
    }
    if (p.mode == AdamMode::kAdam) gmax += p.weight_decay * 1.5;
    ASSERT_TRUE(AdamStepCpu(b.Tensors(grad_type), kN, p));
    RefStep(ref, g64, p);
    for (size_t i = 0; i < kN; ++i) {
      const double m = DecodeBf16(b.m[i]), v = DecodeBf16(b.v[i]);
      const double m_tol = 0x1p-8 * std::fabs(ref.m[i]) + tol.m_rel * (std::fabs(ref.m[i]) + gmax);
      const double v_tol = 0x1p-8 * std::fabs(ref.v[i]) + tol.v_rel * std::fabs(ref.v[i]) + 1e-30;
      const double main_tol = tol.main_rel * std::fabs(ref.main[i]) +
                              (p.mode == AdamMode::kAdam ? tol.main_abs_per_lr_step_l2 : tol.main_abs_per_lr_step) * p.lr;
      worst_m = std::max(worst_m, std::fabs(m - ref.m[i]) / m_tol);
      worst_v = std::max(worst_v, std::fabs(v - ref.v[i]) / v_tol);
      worst_main = std::max(worst_main, std::fabs(b.main[i] - ref.main[i]) / main_tol);
      const bool ok = std::fabs(m - ref.m[i]) <= m_tol && std::fabs(v - ref.v[i]) <= v_tol &&
                      std::fabs(b.main[i] - ref.main[i]) <= main_tol &&
                      b.param[i] == FloatToBf16(b.main[i]);
      if (!ok && ++bad <= 5) {
        ADD_FAILURE() << "step " << step << " element " << i << ": main " << b.main[i] << " vs " << ref.main[i]
                      << ", exp_avg " << m << " vs " << ref.m[i] << ", exp_avg_sq " << v << " vs " << ref.v[i];
      }
    }
  }
  // The moments really are rounded (a bound this loose would hide fp32
  // moments otherwise): the worst element uses most of the 2^-8.
  EXPECT_GT(worst_v, 0.5);
  EXPECT_LE(worst_v, 1.0);
  EXPECT_LE(worst_m, 1.0);
  RecordProperty("worst_exp_avg_over_tol", std::to_string(worst_m));
  RecordProperty("worst_exp_avg_sq_over_tol", std::to_string(worst_v));
  RecordProperty("worst_main_over_tol", std::to_string(worst_main));
}

// 24 steps against an independent fp64 run of the same algorithm (moments
// rounded to bf16 after each step, main updated with the unrounded ones).
// The two round slightly different values, so a moment may land one bf16
// ulp (2^-7 relative) apart, and an EMA carries such a difference on with
// weight beta: after T steps |d| <= 2^-7 * sum_k beta^k * max|moment| <=
// 2^-7 * min(T, 1/(1-beta)) * max|moment|, and main moves by lr * that
// relative difference per step. The run asserts these bounds (observed far
// below them: RecordProperty).
TEST_P(AdamBf16MomentTest, TracksFp64ReferenceOver24Steps) {
  const DType grad_type = std::get<0>(GetParam());
  constexpr size_t kN = 40000;
  constexpr int kT = 24;
  Bf16MomentBuffers b(kN);
  AdamParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.mode = std::get<1>(GetParam());
  RefState ref{std::vector<double>(kN), std::vector<double>(kN, 0.0), std::vector<double>(kN, 0.0)};
  for (size_t i = 0; i < kN; ++i) ref.main[i] = b.main[i];
  std::vector<double> g64(kN);
  double gmax = 0;
  for (int step = 1; step <= kT; ++step) {
    p.step = static_cast<uint64_t>(step);
    for (size_t i = 0; i < kN; ++i) {
      Encode(b.grad.data(), grad_type, i, GradValue(400 + step, i));
      g64[i] = Decode(b.grad.data(), grad_type, i);
      gmax = std::max(gmax, std::fabs(g64[i]));
    }
    ASSERT_TRUE(AdamStepCpu(b.Tensors(grad_type), kN, p));
    RefStep(ref, g64, p);
    for (size_t i = 0; i < kN; ++i) {
      ref.m[i] = testing::RoundToBf16(ref.m[i]);
      ref.v[i] = testing::RoundToBf16(ref.v[i]);
    }
  }
  if (p.mode == AdamMode::kAdam) gmax += p.weight_decay * 1.5;
  const double carry_m = 0x1p-7 * std::min<double>(kT, 1.0 / (1.0 - p.beta1));
  const double carry_v = 0x1p-7 * std::min<double>(kT, 1.0 / (1.0 - p.beta2));
  double worst[3] = {0, 0, 0};
  size_t bad = 0;
  for (size_t i = 0; i < kN; ++i) {
    const double m = DecodeBf16(b.m[i]), v = DecodeBf16(b.v[i]);
    const double m_tol = carry_m * (std::fabs(ref.m[i]) + gmax) + 1e-6 * gmax;
    const double v_tol = carry_v * std::fabs(ref.v[i]) + 1e-5 * std::fabs(ref.v[i]) + 1e-30;
    // |m_hat / sqrt(v_hat)| <= ~1 per step, off by carry_m + carry_v / 2 relative.
    const double main_tol = 2e-6 * std::fabs(ref.main[i]) + p.lr * kT * (carry_m + carry_v / 2 + 1e-4);
    worst[0] = std::max(worst[0], std::fabs(b.main[i] - ref.main[i]) / main_tol);
    worst[1] = std::max(worst[1], std::fabs(m - ref.m[i]) / m_tol);
    worst[2] = std::max(worst[2], std::fabs(v - ref.v[i]) / v_tol);
    const bool ok = std::fabs(m - ref.m[i]) <= m_tol && std::fabs(v - ref.v[i]) <= v_tol &&
                    std::fabs(b.main[i] - ref.main[i]) <= main_tol;
    if (!ok && ++bad <= 5) {
      ADD_FAILURE() << "element " << i << ": main " << b.main[i] << " vs " << ref.main[i] << ", exp_avg " << m
                    << " vs " << ref.m[i] << ", exp_avg_sq " << v << " vs " << ref.v[i];
    }
  }
  RecordProperty("worst_main_over_tol", std::to_string(worst[0]));
  RecordProperty("worst_exp_avg_over_tol", std::to_string(worst[1]));
  RecordProperty("worst_exp_avg_sq_over_tol", std::to_string(worst[2]));
}

// bf16 moments with threads and on odd offsets equal the one-thread run on
// the whole range bit for bit (the StreamedAdam slices call it on sub-ranges).
TEST(AdamBf16MomentCpuTest, SubRangesAndThreadsAreBitIdentical) {
  constexpr size_t kN = (size_t{1} << 18) + 5;
  Bf16MomentBuffers a(kN), b(kN);
  for (size_t i = 0; i < kN; ++i) {
    a.grad[i] = b.grad[i] = std::bit_cast<uint32_t>(GradValue(500, i));
    a.m[i] = b.m[i] = FloatToBf16(0.1f * Uniform(501, i));
    a.v[i] = b.v[i] = FloatToBf16(0.01f * std::fabs(Uniform(502, i)));
  }
  AdamParams p;
  p.step = 5;
  ASSERT_TRUE(AdamStepCpu(a.Tensors(DType::kF32), kN, p, 1));
  const size_t cut = 77777;
  AdamTensors lo = b.Tensors(DType::kF32), hi = lo;
  hi.main += cut;
  hi.exp_avg = b.m.data() + cut;
  hi.exp_avg_sq = b.v.data() + cut;
  hi.grad = b.grad.data() + cut;
  hi.param = b.param.data() + cut;
  ASSERT_TRUE(AdamStepCpu(lo, cut, p, 1));
  ASSERT_TRUE(AdamStepCpu(hi, kN - cut, p, 4));
  EXPECT_EQ(a.main, b.main);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.param, b.param);
}

// ---- q8 moments (AdamStepCpuQ8) ----

// The maps are bitsandbytes' dynamic maps: 256 ascending values with 0 and 1,
// the signed one symmetric without -1, their smallest positive values those
// of create_dynamic_map (0.55e-6 signed; 0.325e-6 and 0.775e-6 unsigned).
TEST(AdamQ8Test, MapsAreTheDynamicMaps) {
  std::vector<double> s(256), u(256);
  for (int c = 0; c < 256; ++c) {
    s[c] = Q8MapValue(true, static_cast<uint8_t>(c));
    u[c] = Q8MapValue(false, static_cast<uint8_t>(c));
  }
  EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
  EXPECT_TRUE(std::is_sorted(u.begin(), u.end()));
  EXPECT_EQ(std::adjacent_find(u.begin(), u.end()), u.end()) << "unsigned map has duplicates";
  EXPECT_EQ(s[255], 1.0);
  EXPECT_EQ(u[255], 1.0);
  EXPECT_EQ(u[0], 0.0);
  EXPECT_EQ(std::count(s.begin(), s.end(), 0.0), 1);
  EXPECT_FLOAT_EQ(static_cast<float>(s[0]), -0.99296875f);
  const auto first_pos = [](const std::vector<double>& m) { return *std::upper_bound(m.begin(), m.end(), 0.0); };
  EXPECT_FLOAT_EQ(static_cast<float>(first_pos(s)), 0.55e-6f);
  EXPECT_FLOAT_EQ(static_cast<float>(first_pos(u)), 0.325e-6f);
  EXPECT_FLOAT_EQ(static_cast<float>(u[2]), 0.775e-6f);
}

// Half the gap of the map around y (y in the map's range): the most a
// nearest-code rounding of y can be off, in units of the block's absmax.
double HalfGap(bool is_signed, double y) {
  double lo = Q8MapValue(is_signed, 0), hi = lo;
  for (int c = 1; c < 256; ++c) {
    hi = Q8MapValue(is_signed, static_cast<uint8_t>(c));
    if (hi >= y) return (hi - lo) / 2;
    lo = hi;
  }
  return 0;
}

// 24 steps; after each, every stored moment against an fp64 update of the
// state stored before it (decoded codes x absmax): the block's absmax is the
// fp64 max |moment| (to fp32 rounding), and each decoded moment is within
// half the map's gap around it times that absmax (nearest code), plus fp32
// rounding of the update (a value within it of a midpoint may take the other
// neighbour). Main: as in the f32 case.
TEST(AdamQ8Test, EachStepWithinNearestCodeOfFp64Update) {
  constexpr size_t kN = 256 * 40 + 77;  // a partial last block
  constexpr size_t kBlocks = (kN + kQ8BlockElems - 1) / kQ8BlockElems;
  std::vector<float> main(kN), am(kBlocks, 0.0f), av(kBlocks, 0.0f);
  std::vector<uint8_t> m(kN), v(kN);
  std::vector<uint16_t> grad(kN), param(kN);
  uint8_t code0 = 0;
  while (Q8MapValue(true, code0) != 0.0f) ++code0;
  for (size_t i = 0; i < kN; ++i) {
    main[i] = Uniform(41, i);
    m[i] = code0;
    v[i] = 0;
  }
  AdamParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  const Tolerance tol;
  double worst_m = 0, worst_v = 0;
  size_t bad = 0;
  for (int step = 1; step <= 24; ++step) {
    p.step = static_cast<uint64_t>(step);
    RefState ref{std::vector<double>(kN), std::vector<double>(kN), std::vector<double>(kN)};
    std::vector<double> g64(kN);
    for (size_t i = 0; i < kN; ++i) {
      // Blocks of very different scales, as a model's rows have.
      grad[i] = FloatToBf16(GradValue(700 + step, i) * static_cast<float>(std::pow(10.0, -static_cast<double>((i / 256) % 5))));
      g64[i] = DecodeBf16(grad[i]);
      ref.main[i] = main[i];
      ref.m[i] = static_cast<double>(Q8MapValue(true, m[i])) * am[i / 256];
      ref.v[i] = static_cast<double>(Q8MapValue(false, v[i])) * av[i / 256];
    }
    AdamQ8Tensors t;
    t.main = main.data();
    t.exp_avg = m.data();
    t.exp_avg_absmax = am.data();
    t.exp_avg_sq = v.data();
    t.exp_avg_sq_absmax = av.data();
    t.grad = grad.data();
    t.grad_type = DType::kBF16;
    t.param = param.data();
    t.param_type = DType::kBF16;
    ASSERT_TRUE(AdamStepCpuQ8(t, kN, p, 1));
    RefStep(ref, g64, p);
    for (size_t b = 0; b < kBlocks; ++b) {
      double rm = 0, rv = 0;
      for (size_t i = b * 256; i < std::min(kN, (b + 1) * 256); ++i) {
        rm = std::max(rm, std::fabs(ref.m[i]));
        rv = std::max(rv, std::fabs(ref.v[i]));
      }
      EXPECT_NEAR(am[b], rm, 1e-5 * rm + 1e-30) << "step " << step << " block " << b;
      EXPECT_NEAR(av[b], rv, 1e-5 * rv + 1e-30) << "step " << step << " block " << b;
      for (size_t i = b * 256; i < std::min(kN, (b + 1) * 256); ++i) {
        const double dm = static_cast<double>(Q8MapValue(true, m[i])) * am[b];
        const double dv = static_cast<double>(Q8MapValue(false, v[i])) * av[b];
        const double m_tol = HalfGap(true, ref.m[i] / rm) * rm + 2e-5 * rm;
        const double v_tol = HalfGap(false, ref.v[i] / rv) * rv + 2e-5 * rv;
        const double main_tol = tol.main_rel * std::fabs(ref.main[i]) + tol.main_abs_per_lr_step * p.lr;
        worst_m = std::max(worst_m, std::fabs(dm - ref.m[i]) / m_tol);
        worst_v = std::max(worst_v, std::fabs(dv - ref.v[i]) / v_tol);
        const bool ok = std::fabs(dm - ref.m[i]) <= m_tol && std::fabs(dv - ref.v[i]) <= v_tol &&
                        std::fabs(main[i] - ref.main[i]) <= main_tol && param[i] == FloatToBf16(main[i]);
        if (!ok && ++bad <= 5) {
          ADD_FAILURE() << "step " << step << " element " << i << ": main " << main[i] << " vs " << ref.main[i]
                        << ", exp_avg " << dm << " vs " << ref.m[i] << " (tol " << m_tol << "), exp_avg_sq " << dv
                        << " vs " << ref.v[i] << " (tol " << v_tol << ")";
        }
      }
    }
  }
  EXPECT_GT(worst_v, 0.3);  // the codes really are quantized
  RecordProperty("worst_exp_avg_over_tol", std::to_string(worst_m));
  RecordProperty("worst_exp_avg_sq_over_tol", std::to_string(worst_v));
}

TEST(AdamQ8Test, ThreadsAndBlockAlignedSubRangesAreBitIdentical) {
  constexpr size_t kN = 256 * 1500 + 3;
  constexpr size_t kBlocks = (kN + 255) / 256;
  struct S {
    std::vector<float> main = std::vector<float>(kN), am = std::vector<float>(kBlocks), av = std::vector<float>(kBlocks);
    std::vector<uint8_t> m = std::vector<uint8_t>(kN), v = std::vector<uint8_t>(kN);
    std::vector<float> grad = std::vector<float>(kN);
  } a, b;
  for (size_t i = 0; i < kN; ++i) {
    a.main[i] = Uniform(51, i);
    a.m[i] = static_cast<uint8_t>(testing::Mix(i) & 0xFF);
    a.v[i] = static_cast<uint8_t>(testing::Mix(i + 7) & 0xFF);
    a.grad[i] = GradValue(52, i);
  }
  for (size_t k = 0; k < kBlocks; ++k) {
    a.am[k] = 0.01f * (1.0f + static_cast<float>(k % 7));
    a.av[k] = 1e-4f * (1.0f + static_cast<float>(k % 5));
  }
  b = a;
  auto tensors = [](S& s, size_t first_block) {
    AdamQ8Tensors t;
    const size_t off = first_block * 256;
    t.main = s.main.data() + off;
    t.exp_avg = s.m.data() + off;
    t.exp_avg_absmax = s.am.data() + first_block;
    t.exp_avg_sq = s.v.data() + off;
    t.exp_avg_sq_absmax = s.av.data() + first_block;
    t.grad = s.grad.data() + off;
    return t;
  };
  AdamParams p;
  p.step = 3;
  ASSERT_TRUE(AdamStepCpuQ8(tensors(a, 0), kN, p, 1));
  ASSERT_TRUE(AdamStepCpuQ8(tensors(b, 0), 256 * 700, p, 3));
  ASSERT_TRUE(AdamStepCpuQ8(tensors(b, 700), kN - 256 * 700, p, 2));
  EXPECT_EQ(a.main, b.main);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(a.am, b.am);
  EXPECT_EQ(a.av, b.av);
}

INSTANTIATE_TEST_SUITE_P(
    GradTypes, AdamBf16MomentTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(AdamMode::kAdam, AdamMode::kAdamW)),
    [](const auto& info) {
      return "grad_" + TypeName(std::get<0>(info.param)) +
             (std::get<1>(info.param) == AdamMode::kAdam ? "_adam" : "_adamw");
    });

TEST(ConversionTest, Bf16RoundsToNearestEven) {
  // Every finite bf16 value round-trips; midpoints between neighbours go to the even one.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const double d = DecodeBf16(static_cast<uint16_t>(h));
    if (std::isnan(d)) continue;
    ASSERT_EQ(FloatToBf16(static_cast<float>(d)), h) << h;
    ASSERT_EQ(Bf16ToFloat(static_cast<uint16_t>(h)), static_cast<float>(d)) << h;
    if ((h & 0x7F80) == 0x7F80 || (h & 0x7FFF) == 0x7F7F) continue;  // next is inf/NaN
    const double next = DecodeBf16(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((d + next) / 2);  // exact in fp32
    const uint32_t even = (h & 1) ? h + 1 : h;
    ASSERT_EQ(FloatToBf16(mid), even) << h;
    ASSERT_EQ(FloatToBf16(std::nextafter(mid, static_cast<float>(d))), h) << h;
  }
  EXPECT_EQ(FloatToBf16(NAN) & 0x7FFF, 0x7FFF);
}

TEST(ConversionTest, HalfRoundsToNearestEvenWithSubnormalsAndOverflow) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const double d = DecodeHalf(static_cast<uint16_t>(h));
    if (std::isnan(d)) continue;
    ASSERT_EQ(FloatToHalf(static_cast<float>(d)), h) << h;
    ASSERT_EQ(HalfToFloat(static_cast<uint16_t>(h)), static_cast<float>(d)) << h;
    if ((h & 0x7C00) == 0x7C00) continue;
    const double next = (h & 0x7FFF) == 0x7BFF ? std::copysign(65536.0, d)
                                               : DecodeHalf(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((d + next) / 2);
    const uint32_t even = (h & 1) ? h + 1 : h;
    ASSERT_EQ(FloatToHalf(mid), even) << h;
    ASSERT_EQ(FloatToHalf(std::nextafter(mid, static_cast<float>(d))), h) << h;
  }
  EXPECT_EQ(FloatToHalf(1e6f), 0x7C00);
  EXPECT_EQ(FloatToHalf(-1e-9f), 0x8000);
  EXPECT_EQ(FloatToHalf(NAN) & 0x7C00, 0x7C00);
}

TEST(AdamCudaLauncherTest, ChecksArgumentsBeforeAnyCudaCall) {
  Buffers a(22);
  AdamParams p;
  AdamTensors t = a.Tensors(nullptr);
  if (!CudaKernelsBuilt()) {
    EXPECT_EQ(AdamStepCuda(t, 22, p, nullptr), 801);  // cudaErrorNotSupported
    return;
  }
  EXPECT_EQ(AdamStepCuda(t, 0, p, nullptr), 0);  // count 0: success, nothing launched
  t.main = reinterpret_cast<float*>(reinterpret_cast<char*>(a.main.data()) + 2);
  EXPECT_EQ(AdamStepCuda(t, 22, p, nullptr), 1);  // cudaErrorInvalidValue: misaligned fp32
  t = a.Tensors(nullptr);
  t.grad = reinterpret_cast<const char*>(a.grad.data()) + 1;
  EXPECT_EQ(AdamStepCuda(t, 22, p, nullptr), 1);  // misaligned bf16
  t = a.Tensors(nullptr);
  t.moment_type = MomentDType::kQ8;  // q8 moments take AdamQ8Tensors
  EXPECT_EQ(AdamStepCuda(t, 22, p, nullptr), 1);
  t = a.Tensors(nullptr);
  p.step = 0;
  EXPECT_EQ(AdamStepCuda(t, 22, p, nullptr), 1);
}

}  // namespace
}  // namespace optstate::kernels
