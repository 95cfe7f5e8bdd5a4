// kernels_gpu_test (label gpu): AdamStepCuda against AdamStepCpu, element by
// element, on random data: every grad/param type, Adam and AdamW, sizes
// {0, 1, 22, 4095, 2^20+3} and one of 2^28+3 elements, aligned and misaligned
// pointers (same element phase: vector path with head/tail; 4-byte offsets on
// every array: scalar path). Skips when no GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/adam.h"
#include "kernels/internal/launch_config.h"
#include "tests/kernels/adam_test_util.h"

namespace optstate::kernels {
namespace {

using testing::Decode;
using testing::Encode;
using testing::GradValue;
using testing::ParallelFor;
using testing::TypeName;
using testing::TypeSize;
using testing::Uniform;

#define ASSERT_CUDA(expr)                                                              \
  do {                                                                                 \
    const cudaError_t err_ = (expr);                                                   \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorName(err_) << " ("   \
                                 << cudaGetErrorString(err_) << ")";                   \
  } while (0)

// Skips every test of the fixture, saying why, when no CUDA device is visible.
class AdamGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      GTEST_SKIP() << "no GPU visible: cudaGetDeviceCount failed with " << cudaGetErrorName(err)
                   << " (" << cudaGetErrorString(err) << ")";
    }
    if (n == 0) GTEST_SKIP() << "no GPU visible: cudaGetDeviceCount returned 0 devices";
    ASSERT_CUDA(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    err_ = cudaMalloc(&ptr_, std::max<size_t>(bytes, 1));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* data() const { return static_cast<char*>(ptr_); }
  cudaError_t status() const { return err_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
  cudaError_t err_;
};

// Element offsets of each array from a 256-byte-aligned allocation.
struct Offsets {
  const char* name;
  size_t main, m, v, grad, param;
};
const Offsets kAligned{"aligned", 0, 0, 0, 0, 0};
const Offsets kSamePhase{"all+1elem", 1, 1, 1, 1, 1};    // vector path, head 3
const Offsets kFourBytes{"all+4bytes", 1, 1, 1, 0, 0};   // set per type below
const Offsets kMixed{"main+1elem", 1, 0, 0, 0, 0};       // scalar path

// Host copy of one problem; Run() steps it on the CPU and on the GPU.
struct Problem {
  Problem(size_t n, DType gt, std::optional<DType> pt, uint64_t seed)
      : n(n), grad_type(gt), param_type(pt), main(n), m(n), v(n),
        grad(n * TypeSize(gt) + 8), param(n * TypeSize(pt) + 8, 0xEE) {
    ParallelFor(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        main[i] = Uniform(seed, i);
        m[i] = 0.1f * Uniform(seed + 1, i);
        v[i] = 0.01f * std::fabs(Uniform(seed + 2, i));
      }
    });
  }
  void SetGrads(uint64_t seed, float scale) {
    ParallelFor(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) Encode(grad.data(), grad_type, i, GradValue(seed, i) * scale);
    });
  }
  size_t n;
  DType grad_type;
  std::optional<DType> param_type;
  std::vector<float> main, m, v;
  std::vector<uint8_t> grad, param;
};

AdamTensors Tensors(float* main, void* m, void* v, const void* grad, DType gt, void* param,
                    std::optional<DType> pt, const float* found_inf) {
  AdamTensors t;
  t.main = main;
  t.exp_avg = m;
  t.exp_avg_sq = v;
  t.grad = grad;
  t.grad_type = gt;
  t.param = !pt ? nullptr : param;
  t.param_type = pt;
  t.found_inf = found_inf;
  return t;
}

// Two steps (grad scale 1, then 4 with grads stored x4) on both backends from
// the same state, then an elementwise comparison. Returns the number of
// elements that are not bit-identical (expected 0: see kernels/internal/adam_math.h).
void CompareCudaWithCpu(cudaStream_t stream, size_t n, DType gt, std::optional<DType> pt,
                        AdamMode mode, Offsets off, size_t* not_identical,
                        const internal::LaunchConfig* config = nullptr) {
  SCOPED_TRACE("n=" + std::to_string(n) + " grad=" + TypeName(gt) + " param=" + TypeName(pt) +
               " mode=" + (mode == AdamMode::kAdam ? "adam" : "adamw") + " offsets=" + off.name);
  if (std::string(off.name) == "all+4bytes") {
    off.grad = 4 / TypeSize(gt);
    off.param = !pt ? 0 : 4 / TypeSize(pt);
  }
  const size_t gs = TypeSize(gt), ps = TypeSize(pt);
  Problem cpu(n, gt, pt, 11);
  DeviceBuffer d_main((n + 4) * 4), d_m((n + 4) * 4), d_v((n + 4) * 4);
  DeviceBuffer d_grad((n + 4) * gs), d_param((n + 4) * std::max<size_t>(ps, 1));
  for (const DeviceBuffer* b : {&d_main, &d_m, &d_v, &d_grad, &d_param}) ASSERT_CUDA(b->status());
  float* main = reinterpret_cast<float*>(d_main.data()) + off.main;
  float* m = reinterpret_cast<float*>(d_m.data()) + off.m;
  float* v = reinterpret_cast<float*>(d_v.data()) + off.v;
  char* grad = d_grad.data() + off.grad * gs;
  char* param = d_param.data() + off.param * ps;
  ASSERT_CUDA(cudaMemcpy(main, cpu.main.data(), n * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(m, cpu.m.data(), n * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(v, cpu.v.data(), n * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(d_param.data(), 0xEE, (n + 4) * std::max<size_t>(ps, 1)));

  AdamParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.mode = mode;
  for (int step = 1; step <= 2; ++step) {
    p.step = static_cast<uint64_t>(step + 3);
    p.grad_scale = step == 1 ? 1.0f : 4.0f;
    cpu.SetGrads(200 + step, p.grad_scale);
    ASSERT_CUDA(cudaMemcpy(grad, cpu.grad.data(), n * gs, cudaMemcpyHostToDevice));
    ASSERT_TRUE(AdamStepCpu(Tensors(cpu.main.data(), cpu.m.data(), cpu.v.data(), cpu.grad.data(),
                                    gt, cpu.param.data(), pt, nullptr),
                            n, p, 8));
    const AdamTensors t = Tensors(main, m, v, grad, gt, param, pt, nullptr);
    ASSERT_CUDA(static_cast<cudaError_t>(
        config == nullptr ? AdamStepCuda(t, n, p, stream)
                          : internal::AdamStepCudaWithConfig(t, n, p, *config, stream)));
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream));

  Problem gpu(0, gt, pt, 0);
  gpu.main.resize(n);
  gpu.m.resize(n);
  gpu.v.resize(n);
  gpu.param.assign((n + 4) * std::max<size_t>(ps, 1), 0);
  ASSERT_CUDA(cudaMemcpy(gpu.main.data(), main, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(gpu.m.data(), m, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(gpu.v.data(), v, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(gpu.param.data(), d_param.data(), gpu.param.size(),
                         cudaMemcpyDeviceToHost));

  // Tolerance: 4 fp32 ulps (relative 2^-21) on the state; the param copy
  // within one step of its type. Bit-identity is counted, not required.
  auto close = [](double a, double b, double rel) {
    return std::fabs(a - b) <= rel * std::max(std::fabs(a), std::fabs(b)) + 1e-38;
  };
  size_t bad = 0, differ = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool same = gpu.main[i] == cpu.main[i] && gpu.m[i] == cpu.m[i] &&
                      gpu.v[i] == cpu.v[i] &&
                      (ps == 0 || std::memcmp(&gpu.param[(off.param + i) * ps],
                                              &cpu.param[i * ps], ps) == 0);
    if (same) continue;
    ++differ;
    bool ok = close(gpu.main[i], cpu.main[i], 0x1p-21) && close(gpu.m[i], cpu.m[i], 0x1p-21) &&
              close(gpu.v[i], cpu.v[i], 0x1p-21);
    if (ps != 0) {
      const double rel = pt == DType::kF32 ? 0x1p-21 : pt == DType::kBF16 ? 0x1p-7 : 0x1p-10;
      ok = ok && close(Decode(gpu.param.data(), *pt, off.param + i), Decode(cpu.param.data(), *pt, i),
                       rel);
    }
    if (!ok && ++bad <= 5) {
      ADD_FAILURE() << "element " << i << ": main " << gpu.main[i] << " vs cpu " << cpu.main[i]
                    << ", exp_avg " << gpu.m[i] << " vs " << cpu.m[i] << ", exp_avg_sq "
                    << gpu.v[i] << " vs " << cpu.v[i];
    }
  }
  EXPECT_EQ(bad, 0u);
  // Bytes of the param buffer around the range are untouched.
  if (ps != 0) {
    for (size_t k = 0; k < off.param * ps; ++k) EXPECT_EQ(gpu.param[k], 0xEE) << "before " << k;
    for (size_t k = (off.param + n) * ps; k < gpu.param.size(); ++k) {
      EXPECT_EQ(gpu.param[k], 0xEE) << "after " << k;
    }
  }
  *not_identical += differ;
}

class AdamGpuTypesTest
    : public AdamGpuTest,
      public ::testing::WithParamInterface<std::tuple<DType, std::optional<DType>, AdamMode>> {};

TEST_P(AdamGpuTypesTest, MatchesCpuElementwise) {
  const auto [gt, pt, mode] = GetParam();
  size_t not_identical = 0;
  for (size_t n : {size_t{0}, size_t{1}, size_t{22}, size_t{4095}, (size_t{1} << 20) + 3}) {
    for (const Offsets& off : {kAligned, kSamePhase, kFourBytes, kMixed}) {
      CompareCudaWithCpu(stream_, n, gt, pt, mode, off, &not_identical);
    }
  }
  RecordProperty("elements_not_bit_identical", std::to_string(not_identical));
  std::printf("elements not bit-identical to the CPU: %zu\n", not_identical);
}

INSTANTIATE_TEST_SUITE_P(
    AllTypes, AdamGpuTypesTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16,
                                         std::nullopt),
                       ::testing::Values(AdamMode::kAdam, AdamMode::kAdamW)),
    [](const auto& info) {
      return "grad_" + TypeName(std::get<0>(info.param)) + "_param_" +
             TypeName(std::get<1>(info.param)) +
             (std::get<2>(info.param) == AdamMode::kAdam ? "_adam" : "_adamw");
    });

// bf16 moments: CUDA and CPU are bit-identical (required, not counted):
// same decode, fp32 update and round-to-nearest-even. Every grad/param type,
// Adam and AdamW, the vector path (aligned, head of 3) and the scalar path
// (main or the moments at another element phase), 3 steps.
void CompareBf16MomentsCudaWithCpu(cudaStream_t stream, size_t n, DType gt, std::optional<DType> pt, AdamMode mode,
                                   size_t main_off, size_t moment_off, size_t other_off) {
  SCOPED_TRACE("bf16 moments n=" + std::to_string(n) + " grad=" + TypeName(gt) + " param=" + TypeName(pt) +
               " mode=" + (mode == AdamMode::kAdam ? "adam" : "adamw") + " offsets main " +
               std::to_string(main_off) + " moments " + std::to_string(moment_off) + " grad/param " +
               std::to_string(other_off));
  const size_t gs = TypeSize(gt), ps = std::max<size_t>(TypeSize(pt), 1);
  std::vector<float> main(n);
  std::vector<uint16_t> m(n), v(n);
  std::vector<uint8_t> grad(n * gs), param(n * ps, 0);
  for (size_t i = 0; i < n; ++i) {
    main[i] = Uniform(31, i);
    m[i] = FloatToBf16(0.1f * Uniform(32, i));
    v[i] = FloatToBf16(0.01f * std::fabs(Uniform(33, i)));
  }
  DeviceBuffer d_main((n + 4) * 4), d_m((n + 4) * 2), d_v((n + 4) * 2), d_grad((n + 4) * gs),
      d_param((n + 4) * ps);
  for (const DeviceBuffer* b : {&d_main, &d_m, &d_v, &d_grad, &d_param}) ASSERT_CUDA(b->status());
  float* dm = reinterpret_cast<float*>(d_main.data()) + main_off;
  uint16_t* dmo = reinterpret_cast<uint16_t*>(d_m.data()) + moment_off;
  uint16_t* dvo = reinterpret_cast<uint16_t*>(d_v.data()) + moment_off;
  char* dg = d_grad.data() + other_off * gs;
  char* dp = d_param.data() + other_off * ps;
  ASSERT_CUDA(cudaMemcpy(dm, main.data(), n * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(dmo, m.data(), n * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(dvo, v.data(), n * 2, cudaMemcpyHostToDevice));
  AdamParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.1;
  p.mode = mode;
  for (int step = 1; step <= 3; ++step) {
    p.step = static_cast<uint64_t>(step);
    for (size_t i = 0; i < n; ++i) Encode(grad.data(), gt, i, GradValue(600 + step, i));
    ASSERT_CUDA(cudaMemcpy(dg, grad.data(), n * gs, cudaMemcpyHostToDevice));
    AdamTensors c = Tensors(main.data(), m.data(), v.data(), grad.data(), gt, param.data(), pt, nullptr);
    c.moment_type = MomentDType::kBF16;
    ASSERT_TRUE(AdamStepCpu(c, n, p, 4));
    AdamTensors g = Tensors(dm, dmo, dvo, dg, gt, dp, pt, nullptr);
    g.moment_type = MomentDType::kBF16;
    ASSERT_CUDA(static_cast<cudaError_t>(AdamStepCuda(g, n, p, stream)));
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> g_main(n);
  std::vector<uint16_t> g_m(n), g_v(n);
  std::vector<uint8_t> g_param(n * ps, 0);
  ASSERT_CUDA(cudaMemcpy(g_main.data(), dm, n * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_m.data(), dmo, n * 2, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_v.data(), dvo, n * 2, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(g_param.data(), dp, n * ps, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool same = std::memcmp(&g_main[i], &main[i], 4) == 0 && g_m[i] == m[i] && g_v[i] == v[i] &&
                      (!pt || std::memcmp(&g_param[i * ps], &param[i * ps], ps) == 0);
    if (!same && ++bad <= 5) {
      ADD_FAILURE() << "element " << i << ": main " << g_main[i] << " vs cpu " << main[i] << ", exp_avg bits "
                    << g_m[i] << " vs " << m[i] << ", exp_avg_sq bits " << g_v[i] << " vs " << v[i];
    }
  }
  EXPECT_EQ(bad, 0u) << "elements not bit-identical";
}

TEST_F(AdamGpuTest, Bf16MomentsBitIdenticalToCpu) {
  for (DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::optional<DType> pt : {std::optional(DType::kF32), std::optional(DType::kBF16),
                                    std::optional(DType::kF16), std::optional<DType>()}) {
      for (AdamMode mode : {AdamMode::kAdam, AdamMode::kAdamW}) {
        for (size_t n : {size_t{1}, size_t{22}, size_t{4095}, (size_t{1} << 20) + 3}) {
          CompareBf16MomentsCudaWithCpu(stream_, n, gt, pt, mode, 0, 0, 0);  // vector path
          CompareBf16MomentsCudaWithCpu(stream_, n, gt, pt, mode, 1, 1, 1);  // vector path, head 3
          CompareBf16MomentsCudaWithCpu(stream_, n, gt, pt, mode, 0, 1, 0);  // scalar path
        }
      }
    }
  }
}

// q8 moments: CUDA and CPU bit-identical (codes, absmax, main, param copy),
// every grad/param type, 3 steps, partial last block.
TEST_F(AdamGpuTest, Q8MomentsBitIdenticalToCpu) {
  for (DType gt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::optional<DType> pt : {std::optional(DType::kF32), std::optional(DType::kBF16),
                                    std::optional(DType::kF16), std::optional<DType>()}) {
      for (size_t n : {size_t{1}, size_t{300}, (size_t{1} << 20) + 77}) {
        SCOPED_TRACE("q8 n=" + std::to_string(n) + " grad=" + TypeName(gt) + " param=" + TypeName(pt));
        const size_t blocks = (n + kQ8BlockElems - 1) / kQ8BlockElems;
        const size_t gs = TypeSize(gt), ps = std::max<size_t>(TypeSize(pt), 1);
        std::vector<float> main(n), am(blocks, 0.0f), av(blocks, 0.0f);
        std::vector<uint8_t> m(n, 0), v(n, 0), grad(n * gs), param(n * ps, 0);
        uint8_t code0 = 0;
        while (Q8MapValue(true, code0) != 0.0f) ++code0;
        for (size_t i = 0; i < n; ++i) {
          main[i] = Uniform(61, i);
          m[i] = code0;
        }
        DeviceBuffer d_main(n * 4), d_m(n), d_v(n), d_am(blocks * 4), d_av(blocks * 4), d_grad(n * gs),
            d_param(n * ps);
        for (const DeviceBuffer* b : {&d_main, &d_m, &d_v, &d_am, &d_av, &d_grad, &d_param}) ASSERT_CUDA(b->status());
        ASSERT_CUDA(cudaMemcpy(d_main.data(), main.data(), n * 4, cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemcpy(d_m.data(), m.data(), n, cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemcpy(d_v.data(), v.data(), n, cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemcpy(d_am.data(), am.data(), blocks * 4, cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemcpy(d_av.data(), av.data(), blocks * 4, cudaMemcpyHostToDevice));
        AdamParams p;
        p.lr = 1e-2;
        p.weight_decay = 0.1;
        for (int step = 1; step <= 3; ++step) {
          p.step = static_cast<uint64_t>(step);
          for (size_t i = 0; i < n; ++i) Encode(grad.data(), gt, i, GradValue(620 + step, i));
          ASSERT_CUDA(cudaMemcpy(d_grad.data(), grad.data(), n * gs, cudaMemcpyHostToDevice));
          AdamQ8Tensors c{main.data(), m.data(), am.data(), v.data(), av.data(), grad.data(), gt,
                          !pt ? nullptr : param.data(), pt, nullptr};
          ASSERT_TRUE(AdamStepCpuQ8(c, n, p, 4));
          AdamQ8Tensors g{reinterpret_cast<float*>(d_main.data()), reinterpret_cast<uint8_t*>(d_m.data()),
                          reinterpret_cast<float*>(d_am.data()), reinterpret_cast<uint8_t*>(d_v.data()),
                          reinterpret_cast<float*>(d_av.data()), d_grad.data(), gt,
                          !pt ? nullptr : d_param.data(), pt, nullptr};
          ASSERT_CUDA(static_cast<cudaError_t>(AdamStepCudaQ8(g, n, p, stream_)));
        }
        ASSERT_CUDA(cudaStreamSynchronize(stream_));
        std::vector<float> g_main(n), g_am(blocks), g_av(blocks);
        std::vector<uint8_t> g_m(n), g_v(n), g_param(n * ps);
        ASSERT_CUDA(cudaMemcpy(g_main.data(), d_main.data(), n * 4, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaMemcpy(g_m.data(), d_m.data(), n, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaMemcpy(g_v.data(), d_v.data(), n, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaMemcpy(g_am.data(), d_am.data(), blocks * 4, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaMemcpy(g_av.data(), d_av.data(), blocks * 4, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaMemcpy(g_param.data(), d_param.data(), n * ps, cudaMemcpyDeviceToHost));
        EXPECT_EQ(std::memcmp(g_main.data(), main.data(), n * 4), 0) << "main";
        EXPECT_EQ(g_m, m) << "exp_avg codes";
        EXPECT_EQ(g_v, v) << "exp_avg_sq codes";
        EXPECT_EQ(std::memcmp(g_am.data(), am.data(), blocks * 4), 0) << "exp_avg absmax";
        EXPECT_EQ(std::memcmp(g_av.data(), av.data(), blocks * 4), 0) << "exp_avg_sq absmax";
        if (pt.has_value()) {
          EXPECT_EQ(g_param, param) << "param copy";
        }
      }
    }
  }
}

TEST_F(AdamGpuTest, Over2To28ElementsMatchesCpu) {
  size_t not_identical = 0;
  CompareCudaWithCpu(stream_, (size_t{1} << 28) + 3, DType::kBF16, DType::kBF16,
                     AdamMode::kAdamW, kSamePhase, &not_identical);
  std::printf("elements not bit-identical to the CPU: %zu\n", not_identical);
}

// Every launch shape (the default adapts it to the count, so the tests above
// reach only some), with a grid small enough that the grid-stride loop and the
// unrolled tail (groups not a multiple of threads * unroll) both run.
TEST_F(AdamGpuTest, EveryLaunchShapeMatchesCpu) {
  size_t not_identical = 0;
  for (int threads : {128, 256, 512}) {
    for (int unroll : {1, 2, 4}) {
      for (int blocks_per_sm : {0, 1, 32}) {
        internal::LaunchConfig c;
        c.threads_per_block = threads;
        c.unroll = unroll;
        c.blocks_per_sm = blocks_per_sm;
        c.adaptive = false;
        SCOPED_TRACE("threads=" + std::to_string(threads) + " unroll=" + std::to_string(unroll) +
                     " blocks_per_sm=" + std::to_string(blocks_per_sm));
        CompareCudaWithCpu(stream_, 3 * 1000 * 1000 + 7, DType::kBF16, DType::kBF16,
                           AdamMode::kAdamW, kSamePhase, &not_identical, &c);
        CompareCudaWithCpu(stream_, 4095, DType::kF32, DType::kF16, AdamMode::kAdam,
                           kFourBytes, &not_identical, &c);
      }
    }
  }
  std::printf("elements not bit-identical to the CPU: %zu\n", not_identical);
}

TEST_F(AdamGpuTest, DeviceFoundInfSkipsTheUpdate) {
  constexpr size_t kN = 4095;
  Problem h(kN, DType::kBF16, DType::kBF16, 5);
  h.SetGrads(6, 1.0f);
  DeviceBuffer d_main(kN * 4), d_m(kN * 4), d_v(kN * 4), d_grad(kN * 2), d_param(kN * 2),
      d_flag(4);
  float* main = reinterpret_cast<float*>(d_main.data());
  ASSERT_CUDA(cudaMemcpy(main, h.main.data(), kN * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_m.data(), h.m.data(), kN * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_v.data(), h.v.data(), kN * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_grad.data(), h.grad.data(), kN * 2, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemset(d_param.data(), 0xEE, kN * 2));
  const float one = 1.0f, zero = 0.0f;
  ASSERT_CUDA(cudaMemcpy(d_flag.data(), &one, 4, cudaMemcpyHostToDevice));
  AdamParams p;
  p.step = 2;
  const AdamTensors t = Tensors(main, d_m.data(), d_v.data(), d_grad.data(), DType::kBF16,
                                d_param.data(), DType::kBF16,
                                reinterpret_cast<const float*>(d_flag.data()));
  ASSERT_CUDA(static_cast<cudaError_t>(AdamStepCuda(t, kN, p, stream_)));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  std::vector<float> out(kN);
  std::vector<uint16_t> param_out(kN);
  ASSERT_CUDA(cudaMemcpy(out.data(), main, kN * 4, cudaMemcpyDeviceToHost));
  ASSERT_CUDA(cudaMemcpy(param_out.data(), d_param.data(), kN * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, h.main);
  EXPECT_EQ(param_out, std::vector<uint16_t>(kN, 0xEEEE));
  ASSERT_CUDA(cudaMemcpy(out.data(), d_m.data(), kN * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, h.m);

  ASSERT_CUDA(cudaMemcpy(d_flag.data(), &zero, 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(static_cast<cudaError_t>(AdamStepCuda(t, kN, p, stream_)));
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  ASSERT_CUDA(cudaMemcpy(out.data(), d_m.data(), kN * 4, cudaMemcpyDeviceToHost));
  size_t changed = 0;
  for (size_t i = 0; i < kN; ++i) changed += out[i] != h.m[i];
  EXPECT_EQ(changed, kN);
}

}  // namespace
}  // namespace optstate::kernels
