// Per-param step counts (StreamedAdam::param_step_count, vfs tensor_steps):
// torch's optimizers count steps per param, so a param that gets no gradient
// in a step keeps its state and its count, and its next update is
// bias-corrected with its own count. Params that skip steps in patterns
// (never, every other step, only after K steps, pseudo-random), in two groups
// with different hyperparameters, with a found-inf step and a close and reopen
// in the middle: the streamed run equals the CPU kernel on whole host tensors
// driven with each param's own count, bit for bit, for f32, bf16 and q8
// moments, with the commit inside the step, pipelined commits and cached steps
// (host cache tier, durable every 3rd step); the store persists every tensor's
// count; and for f32 moments an fp64 loop of the same steps (written from
// torch's documentation, tests/kernels/adam_test_util.h) agrees within fp32
// rounding. The store's bytes are read back through a GenerationView,
// independently of the pipeline. Built into memmgr_test (host) and
// memmgr_gpu_test (cuda).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/adam.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tests/kernels/adam_test_util.h"
#include "tests/memmgr/memmgr_test_util.h"
#include "vfs/store.h"

namespace optstate::memmgr {
namespace {

using namespace testing;  // NOLINT

struct Def {
  std::string name;
  uint64_t numel;
  uint32_t group;
};

constexpr uint64_t kLateAfter = 5;     // "late" steps only after this many steps
constexpr uint64_t kFoundInfStep = 4;  // a step skipped by found-inf: counts for no one

// Sizes that are not multiples of a q8 block (256), in both groups.
std::vector<Def> Defs() {
  return {{"every", 1000, 0}, {"even_steps", 3000, 1}, {"late", 700, 0}, {"random", 2053, 1}};
}

// Whether param k has a gradient in trainer step `step` (1-based).
bool HasGrad(size_t k, uint64_t step) {
  switch (k) {
    case 0: return true;
    case 1: return step % 2 == 0;
    case 2: return step > kLateAfter;
    default: return Mix(step * 0x9E37ull + 77) % 3 != 0;
  }
}

std::vector<ParamGroup> Groups() {
  ParamGroup g0;
  g0.id = 0;
  g0.lr = 1e-2;
  g0.weight_decay = 0.01;
  ParamGroup g1;
  g1.id = 1;
  g1.lr = 3e-3;
  g1.beta1 = 0.8;
  g1.beta2 = 0.99;
  g1.eps = 1e-6;
  g1.weight_decay = 0.1;
  return {g0, g1};
}

uint32_t MomentBytes(MomentDType md) { return md == MomentDType::kF32 ? 4 : md == MomentDType::kBF16 ? 2 : 1; }

// One param of the reference: whole host tensors in the store's layout, its
// own step count, and (f32 moments) the fp64 state.
struct HostParam {
  std::vector<float> main;
  std::vector<uint8_t> m, v;  // moments as stored: f32, bf16 or q8 codes
  std::vector<float> ma, va;  // q8: one absmax per block
  kernels::testing::RefState fp64;
  uint64_t count = 0;
};

std::vector<float> Grad(size_t k, uint64_t step, uint64_t n) {
  std::vector<float> g(n);
  for (uint64_t i = 0; i < n; ++i) g[i] = RandF(step * 31 + k, i) * ((i % 5 == 0) ? 1.0f : 0.05f);
  return g;
}

void RefStep(HostParam& h, const std::vector<float>& g, const ParamGroup& grp, MomentDType md) {
  const kernels::AdamParams ap = AdamParamsOf(grp, ++h.count);
  const uint64_t n = h.main.size();
  if (md == MomentDType::kQ8) {
    kernels::AdamQ8Tensors t;
    t.main = h.main.data();
    t.exp_avg = h.m.data();
    t.exp_avg_sq = h.v.data();
    t.exp_avg_absmax = h.ma.data();
    t.exp_avg_sq_absmax = h.va.data();
    t.grad = g.data();
    t.grad_type = DType::kF32;
    ASSERT_TRUE(kernels::AdamStepCpuQ8(t, n, ap, 1));
  } else {
    kernels::AdamTensors t;
    t.main = h.main.data();
    t.exp_avg = h.m.data();
    t.exp_avg_sq = h.v.data();
    t.moment_type = md;
    t.grad = g.data();
    t.grad_type = DType::kF32;
    ASSERT_TRUE(kernels::AdamStepCpu(t, n, ap, 1));
  }
  kernels::testing::RefStep(h.fp64, std::vector<double>(g.begin(), g.end()), ap);
}

enum class Mode { kCommitInStep, kPipelined, kCachedEvery3 };

std::string ModeName(Mode m) {
  return m == Mode::kCommitInStep ? "CommitInStep" : m == Mode::kPipelined ? "Pipelined" : "CachedEvery3";
}

class StepCountTest : public ::testing::TestWithParam<std::tuple<MomentDType, Mode>> {
 protected:
  MomentDType md() const { return std::get<0>(GetParam()); }
  Mode mode() const { return std::get<1>(GetParam()); }

  StreamedAdamOptions Options() const {
    StreamedAdamOptions so;
    so.moment_dtype = md();
    so.commit_lag_steps = mode() == Mode::kCommitInStep ? 0 : 1;
    so.durable_every_steps = mode() == Mode::kCachedEvery3 ? 3 : 1;
    return so;
  }
  void Open(bool create) {
    // A q8 slice takes 8 chunks; the host cache tier (cached mode) holds the whole state.
    env_.Open(create, 8 * kChunk, mode() == Mode::kCachedEvery3 ? 64 * kChunk : 0);
    sa_ = MUST(StreamedAdam::Create(env_.store.get(), env_.mm.get(), Options()));
  }
  void Close() {
    sa_.reset();  // commits cached steps
    env_.Close();
  }

  void RegisterAll(bool fresh) {
    for (const ParamGroup& g : Groups()) ASSERT_OK(sa_->SetGroup(g));
    if (fresh) ref_.assign(defs_.size(), HostParam{});
    for (size_t k = 0; k < defs_.size(); ++k) {
      const uint64_t n = defs_[k].numel;
      if (!fresh) {
        ASSERT_OK(sa_->RegisterParam(defs_[k].name, n, defs_[k].group, nullptr, std::nullopt));
        continue;
      }
      HostParam& h = ref_[k];
      h.main.resize(n);
      for (uint64_t i = 0; i < n; ++i) h.main[i] = RandF(1000 + k, i);
      h.m.assign(n * MomentBytes(md()), 0);  // never-written chunks read as zeros (q8: code 0, absmax 0)
      h.v.assign(n * MomentBytes(md()), 0);
      if (md() == MomentDType::kQ8) {
        h.ma.assign(Blocks(n), 0.0f);
        h.va.assign(Blocks(n), 0.0f);
      }
      h.fp64.main.assign(h.main.begin(), h.main.end());
      h.fp64.m.assign(n, 0.0);
      h.fp64.v.assign(n, 0.0);
      DeviceBuffer init(env_.mm.get(), n * 4);
      init.Upload(h.main.data());
      ASSERT_OK(sa_->RegisterParam(defs_[k].name, n, defs_[k].group, init.get(), DType::kF32));
    }
  }

  // Trainer steps [first, last]: each param has a grad where HasGrad says so.
  void RunSteps(uint64_t first, uint64_t last) {
    const std::vector<ParamGroup> groups = Groups();
    for (uint64_t step = first; step <= last; ++step) {
      std::vector<std::unique_ptr<DeviceBuffer>> grads;
      std::vector<std::vector<float>> host;
      std::vector<ParamGrad> list;
      std::vector<bool> group_stepped(groups.size(), false);
      for (size_t k = 0; k < defs_.size(); ++k) {
        host.push_back(Grad(k, step, defs_[k].numel));
        if (!HasGrad(k, step)) continue;
        grads.push_back(std::make_unique<DeviceBuffer>(env_.mm.get(), defs_[k].numel * 4));
        grads.back()->Upload(host.back().data());
        list.push_back(ParamGrad{.name = defs_[k].name, .d_grad = grads.back()->get(), .grad_type = DType::kF32,
                                 .numel = defs_[k].numel});
        group_stepped[defs_[k].group] = true;
      }
      if (step == kFoundInfStep) {
        const float one = 1.0f;
        DeviceBuffer flag(env_.mm.get(), sizeof(float));
        flag.Upload(&one);
        ASSERT_OK(sa_->Step(list, static_cast<const float*>(flag.get())));
        EXPECT_TRUE(sa_->last_step_skipped());
      } else {
        ASSERT_OK(sa_->Step(list));
        EXPECT_FALSE(sa_->last_step_skipped());
        for (size_t k = 0; k < defs_.size(); ++k) {
          if (HasGrad(k, step)) RefStep(ref_[k], host[k], groups[defs_[k].group], md());
        }
        for (size_t g = 0; g < groups.size(); ++g) group_steps_[g] += group_stepped[g] ? 1 : 0;
      }
      for (size_t k = 0; k < defs_.size(); ++k) {
        EXPECT_EQ(MUST(sa_->param_step_count(defs_[k].name)), ref_[k].count)
            << defs_[k].name << " after step " << step;
      }
      for (size_t g = 0; g < groups.size(); ++g) EXPECT_EQ(sa_->step_count(static_cast<uint32_t>(g)), group_steps_[g]);
    }
  }

  // The latest committed generation holds the reference's bytes and counts.
  void ExpectCommitted() {
    vfs::Store* store = env_.store.get();
    const vfs::GenerationInfo gen = store->LatestGeneration();
    for (size_t k = 0; k < defs_.size(); ++k) {
      const std::string& n = defs_[k].name;
      const HostParam& h = ref_[k];
      EXPECT_EQ(vfs::TensorStepCount(gen, MUST(store->FindTensor(n))), h.count) << n << " in generation "
                                                                                 << gen.generation;
      ExpectBytes(FieldBytes(store, n, "main"), h.main, n + "/main");
      ExpectBytes(FieldBytes(store, n, "exp_avg"), h.m, n + "/exp_avg");
      ExpectBytes(FieldBytes(store, n, "exp_avg_sq"), h.v, n + "/exp_avg_sq");
      if (md() == MomentDType::kQ8) {
        ExpectBytes(FieldBytes(store, n, "exp_avg.absmax"), h.ma, n + "/exp_avg.absmax");
        ExpectBytes(FieldBytes(store, n, "exp_avg_sq.absmax"), h.va, n + "/exp_avg_sq.absmax");
      }
      if (md() == MomentDType::kF32) {
        // fp32 against fp64: 20 steps of a few ulps each (|main| < 1.2); a
        // wrong bias correction moves a param by ~lr x 0.3 in one step.
        double worst = 0;
        for (size_t i = 0; i < h.main.size(); ++i) {
          worst = std::max(worst, std::abs(static_cast<double>(h.main[i]) - h.fp64.main[i]));
        }
        EXPECT_LT(worst, 1e-5) << n << ": the kernel reference left the fp64 one";
      }
    }
    for (const vfs::GroupInfo& g : gen.groups) EXPECT_EQ(g.step_count, group_steps_[g.id]) << "group " << g.id;
  }

  StoreEnv env_;
  std::unique_ptr<StreamedAdam> sa_;
  std::vector<Def> defs_ = Defs();
  std::vector<HostParam> ref_;
  std::vector<uint64_t> group_steps_ = std::vector<uint64_t>(2, 0);
};

TEST_P(StepCountTest, ParamsSkippingStepsEqualPerParamReferenceAcrossReopen) {
  MEMMGR_REQUIRE_BACKEND();
  Open(true);
  RegisterAll(true);
  ASSERT_OK(sa_->MakeDurable().status());
  RunSteps(1, 10);
  ASSERT_OK(sa_->MakeDurable().status());  // waits for the last commit; writes cached steps
  ExpectCommitted();
  // The counts the store holds are this run's; a param that skipped steps is behind its group.
  EXPECT_EQ(ref_[2].count, 10 - kLateAfter);
  EXPECT_LT(ref_[1].count, group_steps_[1]);

  Close();
  Open(false);
  // Restored from the store before this run registers anything.
  for (size_t k = 0; k < defs_.size(); ++k) {
    EXPECT_EQ(MUST(sa_->param_step_count(defs_[k].name)), ref_[k].count) << defs_[k].name << " after reopen";
  }
  RegisterAll(false);
  RunSteps(11, 20);
  ASSERT_OK(sa_->MakeDurable().status());
  ExpectCommitted();
  EXPECT_FALSE(sa_->param_step_count("no.such.param").ok());
}

INSTANTIATE_TEST_SUITE_P(
    MomentsAndCommits, StepCountTest,
    ::testing::Combine(::testing::Values(MomentDType::kF32, MomentDType::kBF16, MomentDType::kQ8),
                       ::testing::Values(Mode::kCommitInStep, Mode::kPipelined, Mode::kCachedEvery3)),
    [](const ::testing::TestParamInfo<StepCountTest::ParamType>& info) {
      return std::string(MomentDTypeName(std::get<0>(info.param))) + "_" + ModeName(std::get<1>(info.param));
    });

}  // namespace
}  // namespace optstate::memmgr
