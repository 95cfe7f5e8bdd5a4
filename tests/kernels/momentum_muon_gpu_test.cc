// kernels_gpu_test (label gpu): LionStepCuda and SgdStepCuda against their
// CPU versions, bit for bit, every grad/param/moment type, aligned and
// shifted pointers; MuonStepCuda against MuonStepCpu: the momentum
// bit-identical, main within the bound below. Skips when no GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernels/momentum.h"
#include "kernels/muon.h"
#include "tests/kernels/adam_test_util.h"

namespace optstate::kernels {
namespace {

using testing::Decode;
using testing::Encode;
using testing::GradValue;
using testing::TypeName;
using testing::TypeSize;
using testing::Uniform;

#define ASSERT_CUDA(expr)                                                                            \
  do {                                                                                               \
    const cudaError_t err_ = static_cast<cudaError_t>(expr);                                         \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorName(err_) << " ("                  \
                                 << cudaGetErrorString(err_) << ")";                                 \
  } while (0)

class OptimizersGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) GTEST_SKIP() << "no GPU visible: cudaGetDeviceCount: " << cudaGetErrorName(err);
    if (n == 0) GTEST_SKIP() << "no GPU visible: cudaGetDeviceCount returned 0 devices";
    ASSERT_CUDA(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// A device allocation with a host mirror of the same bytes.
struct Mirror {
  explicit Mirror(size_t bytes) : host(bytes + 16) { err = cudaMalloc(&dev, bytes + 16); }
  ~Mirror() { cudaFree(dev); }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  cudaError_t Up() { return cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice); }
  cudaError_t Down(std::vector<uint8_t>* out) {
    out->resize(host.size());
    return cudaMemcpy(out->data(), dev, host.size(), cudaMemcpyDeviceToHost);
  }
  std::vector<uint8_t> host;
  void* dev = nullptr;
  cudaError_t err;
};

enum class Rule { kLion, kSgdNesterov, kSgdDampened };

// Three steps of the rule on both backends from the same state; every byte
// of main, moment and param copy must agree (kernels/internal/momentum_math.h).
void CompareElementwise(cudaStream_t stream, Rule rule, size_t n, DType gt, std::optional<DType> pt,
                        MomentDType mt, size_t shift) {
  SCOPED_TRACE("rule=" + std::to_string(static_cast<int>(rule)) + " n=" + std::to_string(n) + " grad=" +
               TypeName(gt) + " param=" + TypeName(pt) + " moment=" + TypeName(mt) + " shift=" +
               std::to_string(shift));
  const size_t ms = mt == MomentDType::kBF16 ? 2 : 4, gs = TypeSize(gt), ps = TypeSize(pt);
  Mirror main((n + shift) * 4), mom((n + shift) * ms), grad((n + shift) * gs), param((n + shift) * std::max<size_t>(ps, 1));
  for (Mirror* m : {&main, &mom, &grad, &param}) ASSERT_CUDA(m->err);
  float* h_main = reinterpret_cast<float*>(main.host.data()) + shift;
  uint8_t* h_mom = mom.host.data() + shift * ms;
  uint8_t* h_grad = grad.host.data() + shift * gs;
  uint8_t* h_param = param.host.data() + shift * ps;
  for (size_t i = 0; i < n; ++i) {
    h_main[i] = Uniform(5, i);
    Encode(h_mom, mt == MomentDType::kBF16 ? DType::kBF16 : DType::kF32, i, 0.01f * Uniform(6, i));
  }
  ASSERT_CUDA(main.Up());
  ASSERT_CUDA(mom.Up());
  ASSERT_CUDA(param.Up());
  auto tensors = [&](bool dev) {
    MomentumTensors t;
    t.main = reinterpret_cast<float*>(dev ? static_cast<char*>(main.dev) : reinterpret_cast<char*>(main.host.data())) + shift;
    t.moment = (dev ? static_cast<uint8_t*>(mom.dev) : mom.host.data()) + shift * ms;
    t.moment_type = mt;
    t.grad = (dev ? static_cast<uint8_t*>(grad.dev) : grad.host.data()) + shift * gs;
    t.grad_type = gt;
    t.param = pt ? (dev ? static_cast<uint8_t*>(param.dev) : param.host.data()) + shift * ps : nullptr;
    t.param_type = pt;
    return t;
  };
  for (int step = 1; step <= 3; ++step) {
    const float scale = step == 2 ? 8.0f : 1.0f;
    for (size_t i = 0; i < n; ++i) Encode(h_grad, gt, i, GradValue(60 + step, i) * scale);
    ASSERT_CUDA(grad.Up());
    if (rule == Rule::kLion) {
      LionParams p;
      p.lr = 1e-3 * step;
      p.weight_decay = 0.1;
      p.grad_scale = scale;
      ASSERT_TRUE(LionStepCpu(tensors(false), n, p, 4));
      ASSERT_CUDA(LionStepCuda(tensors(true), n, p, stream));
    } else {
      SgdParams p;
      p.lr = 0.1 / step;
      p.momentum = 0.9;
      p.nesterov = rule == Rule::kSgdNesterov;
      p.dampening = rule == Rule::kSgdDampened ? 0.25 : 0.0;
      p.maximize = rule == Rule::kSgdDampened;
      p.weight_decay = 1e-2;
      p.step = static_cast<uint64_t>(step);
      p.grad_scale = scale;
      ASSERT_TRUE(SgdStepCpu(tensors(false), n, p, 4));
      ASSERT_CUDA(SgdStepCuda(tensors(true), n, p, stream));
    }
    ASSERT_CUDA(cudaStreamSynchronize(stream));
  }
  std::vector<uint8_t> d_main, d_mom, d_param;
  ASSERT_CUDA(main.Down(&d_main));
  ASSERT_CUDA(mom.Down(&d_mom));
  ASSERT_CUDA(param.Down(&d_param));
  EXPECT_EQ(0, std::memcmp(d_main.data() + shift * 4, h_main, n * 4)) << "main differs";
  EXPECT_EQ(0, std::memcmp(d_mom.data() + shift * ms, h_mom, n * ms)) << "moment differs";
  if (pt) {
    EXPECT_EQ(0, std::memcmp(d_param.data() + shift * ps, h_param, n * ps)) << "param copy differs";
  }
}

TEST_F(OptimizersGpuTest, LionAndSgdBitIdenticalToCpu) {
  for (Rule rule : {Rule::kLion, Rule::kSgdNesterov, Rule::kSgdDampened}) {
    for (DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (std::optional<DType> pt : {std::optional<DType>(), std::optional<DType>(DType::kF32),
                                      std::optional<DType>(DType::kBF16), std::optional<DType>(DType::kF16)}) {
        for (MomentDType mt : {MomentDType::kF32, MomentDType::kBF16}) {
          for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, (size_t{1} << 20) + 3}) {
            for (size_t shift : {size_t{0}, size_t{1}}) CompareElementwise(stream_, rule, n, gt, pt, mt, shift);
          }
        }
      }
    }
  }
}

TEST_F(OptimizersGpuTest, FoundInfOnDeviceSkipsLion) {
  const size_t n = 1000;
  Mirror main(n * 4), mom(n * 4), grad(n * 4), flag(4);
  for (size_t i = 0; i < n; ++i) reinterpret_cast<float*>(main.host.data())[i] = 1.0f;
  reinterpret_cast<float*>(grad.host.data())[0] = 1.0f;
  reinterpret_cast<float*>(flag.host.data())[0] = 1.0f;
  for (Mirror* m : {&main, &mom, &grad, &flag}) ASSERT_CUDA(m->Up());
  MomentumTensors t;
  t.main = static_cast<float*>(main.dev);
  t.moment = mom.dev;
  t.grad = grad.dev;
  t.found_inf = static_cast<const float*>(flag.dev);
  ASSERT_CUDA(LionStepCuda(t, n, LionParams{}, stream_));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  std::vector<uint8_t> out;
  ASSERT_CUDA(main.Down(&out));
  EXPECT_EQ(0, std::memcmp(out.data(), main.host.data(), n * 4));
}

// Muon: CUDA (cuBLAS SGEMM, fp32 accumulation in its own order) against the
// CPU reference (fp64 accumulation), with each shape scale (the spectral one
// with torch.optim.Muon's clamped eps and other Newton-Schulz coefficients). Bound: |main_cuda - main_cpu| <=
// 1e-3 * max|main_cpu - main_before| + 2^-22 |main|, i.e. 1e-3 of the
// largest entry of the step (lr * scale * O plus the weight decay).
// Why 1e-3: NS5 in fp32 against fp64 differs by up to 1.2e-4 of max|O|
// (torch fp32 vs fp64 matmuls, 768x768 and 768x3072, random and rank-8 plus
// noise); the CPU reference is within 5e-7 of fp64. The momentum is
// elementwise and bit-identical.
TEST_F(OptimizersGpuTest, MuonMatchesCpuWithinBound) {
  struct Shape {
    size_t rows, cols;
    DType gt;
    MomentDType mt;
    std::optional<DType> pt;
  };
  const Shape shapes[] = {{1, 50, DType::kF32, MomentDType::kF32, std::nullopt},
                          {64, 64, DType::kBF16, MomentDType::kF32, DType::kBF16},
                          {256, 1024, DType::kF32, MomentDType::kBF16, DType::kF32},
                          {1024, 256, DType::kF16, MomentDType::kF32, DType::kF16},
                          {768, 3072, DType::kBF16, MomentDType::kF32, DType::kBF16},
                          {3072, 768, DType::kBF16, MomentDType::kBF16, DType::kBF16}};
  for (const Shape& sh : shapes) {
    for (MuonScale scale : {MuonScale::kMatchAdamW, MuonScale::kShape, MuonScale::kSpectral}) {
      SCOPED_TRACE(std::to_string(sh.rows) + "x" + std::to_string(sh.cols) + " grad=" + TypeName(sh.gt));
      const size_t n = sh.rows * sh.cols, ms = sh.mt == MomentDType::kBF16 ? 2 : 4, gs = TypeSize(sh.gt),
                   ps = TypeSize(sh.pt);
      Mirror main(n * 4), mom(n * ms), grad(n * gs), param(n * std::max<size_t>(ps, 1)),
          ws(MuonWorkspaceBytes(sh.rows, sh.cols));
      for (Mirror* m : {&main, &mom, &grad, &param, &ws}) ASSERT_CUDA(m->err);
      for (size_t i = 0; i < n; ++i) reinterpret_cast<float*>(main.host.data())[i] = 0.05f * Uniform(9, i);
      ASSERT_CUDA(main.Up());
      ASSERT_CUDA(mom.Up());
      std::vector<double> cpu_ws(MuonWorkspaceBytes(sh.rows, sh.cols) / 8 + 1);
      MuonParams p;
      p.weight_decay = 0.1;
      p.scale = scale;
      if (scale == MuonScale::kSpectral) {
        // torch.optim.Muon's eps (a floor on the norm) and other coefficients.
        p.norm_eps = MuonNormEps::kClamp;
        p.ns_a = 3.0;
        p.ns_b = -3.2;
        p.ns_c = 1.2;
        p.ns_steps = 4;
      }
      for (int step = 1; step <= 3; ++step) {
        const std::vector<uint8_t> main_before = main.host;
        p.lr = 0.02 / step;
        // Rank-4 structure plus noise: gradients of a layer are far from white.
        for (size_t i = 0; i < n; ++i) {
          const size_t r = i / sh.cols, c = i % sh.cols;
          float v = 0.1f * GradValue(80 + step, i);
          for (uint64_t k = 0; k < 4; ++k) v += Uniform(90 + k + step, r) * Uniform(95 + k, c);
          Encode(grad.host.data(), sh.gt, i, v);
        }
        ASSERT_CUDA(grad.Up());
        MuonTensors h, d;
        h.main = reinterpret_cast<float*>(main.host.data());
        h.momentum = mom.host.data();
        h.moment_type = d.moment_type = sh.mt;
        h.grad = grad.host.data();
        h.grad_type = d.grad_type = sh.gt;
        h.param = sh.pt ? param.host.data() : nullptr;
        h.param_type = d.param_type = sh.pt;
        d.main = static_cast<float*>(main.dev);
        d.momentum = mom.dev;
        d.grad = grad.dev;
        d.param = sh.pt ? param.dev : nullptr;
        ASSERT_TRUE(MuonStepCpu(h, sh.rows, sh.cols, p, cpu_ws.data(), 8));
        ASSERT_CUDA(MuonStepCuda(d, sh.rows, sh.cols, p, ws.dev, stream_));
        ASSERT_CUDA(cudaStreamSynchronize(stream_));
        // Continue both from the CPU's state, so each step is compared alone.
        std::vector<uint8_t> d_main, d_mom;
        ASSERT_CUDA(main.Down(&d_main));
        ASSERT_CUDA(mom.Down(&d_mom));
        EXPECT_EQ(0, std::memcmp(d_mom.data(), mom.host.data(), n * ms)) << "momentum differs, step " << step;
        const float* cm = reinterpret_cast<const float*>(main.host.data());
        const float* gm = reinterpret_cast<const float*>(d_main.data());
        const float* before = reinterpret_cast<const float*>(main_before.data());
        double max_delta = 0.0;
        for (size_t i = 0; i < n; ++i) max_delta = std::max(max_delta, std::fabs(double{cm[i]} - before[i]));
        double worst = 0.0;
        for (size_t i = 0; i < n; ++i) {
          const double tol = 1e-3 * max_delta + 0x1p-22 * std::fabs(cm[i]);
          worst = std::max(worst, std::fabs(gm[i] - cm[i]) / tol);
        }
        EXPECT_LE(worst, 1.0) << "step " << step;
        RecordProperty("worst_" + std::to_string(sh.rows) + "x" + std::to_string(sh.cols) + "_" +
                           std::to_string(step) + "_ppm",
                       static_cast<int>(worst * 1e6));
        ASSERT_CUDA(main.Up());
      }
    }
  }
}

}  // namespace
}  // namespace optstate::kernels
