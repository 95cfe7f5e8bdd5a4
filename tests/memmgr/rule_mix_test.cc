// One StreamedAdam with several update rules (ParamSpec::rule): AdamW and
// Lion params in one optimizer, and a whole-tensor rule (SliceUnit::kTensor:
// AdamW wrapped so that the engine gathers every field of a tensor and calls
// the kernel once) beside Lion's slices. Each tensor's state equals its
// rule's kernel applied to the whole, resident tensor bit for bit (on the
// cuda backend the reference is still the CPU kernel: they are
// bit-identical), across a close and reopen, with and without the host
// cache tier and Prefetch; a group's hyperparameters give each rule its own
// defaults; whole tensors of many sizes beside slices never take more than
// the device budget, and many small ones hold more than two windows at once
// within it; a param re-registered under another rule, and a whole
// tensor the device window cannot hold, are refused. Built into memmgr_test (host)
// and memmgr_gpu_test (cuda).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "kernels/momentum.h"
#include "memmgr/internal/adamw_rule.h"
#include "memmgr/memory_manager.h"
#include "memmgr/momentum_rules.h"
#include "memmgr/muon_rule.h"
#include "memmgr/streamed_adam.h"
#include "tests/common/kernel_failures.h"
#include "tests/common/sync_point_flag.h"
#include "tests/memmgr/memmgr_test_util.h"
#include "vfs/store.h"

namespace optstate::memmgr {
namespace {

using namespace testing;  // NOLINT

// A rule updated as a whole tensor: AdamW's fields and kernel, with
// SliceUnit::kTensor and a workspace; it records every kernel call.
struct UnitCall {
  std::string shape;  // as "r x c"
  uint64_t count = 0;
  uint64_t first_elem = 0;
  bool workspace_ok = false;
};

class WholeTensorAdamW : public UpdateRule {
 public:
  WholeTensorAdamW(MomentDType m, uint64_t workspace, std::vector<UnitCall>* calls)
      : inner_(internal::NewAdamWRule(m)), workspace_(workspace), calls_(calls) {}
  std::string_view name() const override { return "WholeAdamW"; }
  const std::vector<RuleField>& Fields() const override { return inner_->Fields(); }
  const Hyperparams& Hyperparameters() const override { return inner_->Hyperparameters(); }
  SliceUnit unit() const override { return SliceUnit::kTensor; }
  uint64_t WorkspaceBytes(const vfs::TensorInfo& t) const override { return workspace_ + t.numel % 7; }
  Status CheckHyperparams(uint32_t group, const Hyperparams& h) const override {
    return inner_->CheckHyperparams(group, h);
  }
  Status CheckStored(const std::string& store_path, const vfs::TensorInfo& t) const override {
    return inner_->CheckStored(store_path, t);
  }
  Status MakeArgs(const Hyperparams& group, uint64_t counter, float grad_scale, RuleArgs* out) const override {
    return inner_->MakeArgs(group, counter, grad_scale, out);
  }
  Status RunCpu(const SliceOperands& o, const RuleArgs& a, int threads) const override {
    Note(o);
    if (o.workspace != nullptr) std::memset(o.workspace, 0xAB, workspace_);  // the scratch is ours
    return inner_->RunCpu(o, a, threads);
  }
  int RunCuda(const SliceOperands& o, const RuleArgs& a, void* stream) const override {
    Note(o);
    return inner_->RunCuda(o, a, stream);
  }

 private:
  void Note(const SliceOperands& o) const {
    UnitCall c;
    if (o.shape != nullptr) {
      for (uint64_t d : *o.shape) c.shape += (c.shape.empty() ? "" : " x ") + std::to_string(d);
    }
    c.count = o.count;
    c.first_elem = o.first_elem;
    c.workspace_ok = o.workspace != nullptr && reinterpret_cast<uintptr_t>(o.workspace) % 256 == 0;
    calls_->push_back(c);
  }
  std::unique_ptr<UpdateRule> inner_;
  uint64_t workspace_;
  std::vector<UnitCall>* calls_;
};

enum class RuleKind { kAdamW, kLion };

struct Def {
  std::string name;
  RuleKind kind;
  uint32_t rule;  // index into the optimizer's rules
  uint64_t rows, cols;
  uint32_t group;
  int every;  // steps in which it has a grad: those divisible by `every`
  uint64_t numel() const { return rows * cols; }
};

// Group 0 sets no beta2: AdamW takes 0.999 and Lion 0.99 (each rule's own
// default, also after a reopen); group 1 sets it for both.
Hyperparams GroupHyper(uint32_t g) {
  return g == 0 ? Hyperparams{{"lr", 1e-2}, {"beta1", 0.85}, {"weight_decay", 0.01}}
                : Hyperparams{{"lr", 3e-3}, {"beta2", 0.98}, {"eps", 1e-6}};
}

double Get(const Hyperparams& h, const char* k, double def) {
  auto it = h.find(k);
  return it == h.end() ? def : it->second;
}

struct HostParam {
  std::vector<float> main;
  std::vector<uint8_t> m, v;    // moments (f32 or bf16 values); Lion: m only
  std::vector<uint16_t> param;  // bf16 model copy
  uint64_t count = 0;
};

// The CPU kernel of the tensor's rule on the whole tensor.
void RefStep(RuleKind k, MomentDType md, const Hyperparams& h, HostParam* p, const std::vector<uint16_t>& grad) {
  ++p->count;
  const uint64_t n = p->main.size();
  if (k == RuleKind::kAdamW) {
    kernels::AdamTensors t;
    t.main = p->main.data();
    t.exp_avg = p->m.data();
    t.exp_avg_sq = p->v.data();
    t.moment_type = md;
    t.grad = grad.data();
    t.grad_type = DType::kBF16;
    t.param = p->param.data();
    t.param_type = DType::kBF16;
    kernels::AdamParams ap;
    ap.lr = Get(h, "lr", 1e-3);
    ap.beta1 = Get(h, "beta1", 0.9);
    ap.beta2 = Get(h, "beta2", 0.999);
    ap.eps = Get(h, "eps", 1e-8);
    ap.weight_decay = Get(h, "weight_decay", 0.0);
    ap.step = p->count;
    ASSERT_TRUE(kernels::AdamStepCpu(t, n, ap, 1));
  } else {
    kernels::MomentumTensors t;
    t.main = p->main.data();
    t.moment = p->m.data();
    t.moment_type = md;
    t.grad = grad.data();
    t.grad_type = DType::kBF16;
    t.param = p->param.data();
    t.param_type = DType::kBF16;
    kernels::LionParams lp;
    lp.lr = Get(h, "lr", 1e-4);
    lp.beta1 = Get(h, "beta1", 0.9);
    lp.beta2 = Get(h, "beta2", 0.99);
    lp.weight_decay = Get(h, "weight_decay", 0.0);
    ASSERT_TRUE(kernels::LionStepCpu(t, n, lp));
  }
}

// Runs `steps` steps over defs with an optimizer made by open(), reopening
// the store before step `reopen_at` (groups restored from the store, not set
// again), and checks every tensor against RefStep.
struct MixRun {
  std::vector<Def> defs;
  MomentDType moments = MomentDType::kF32;
  uint64_t host_cache = 0;
  uint32_t durable_every = 1;
  bool prefetch = false;
  uint64_t budget = 16 * kChunk;
  std::vector<UnitCall>* calls = nullptr;  // whole-tensor rule's calls (when defs use one)
  bool whole_adamw = false;                // rule 0 is WholeTensorAdamW, else AdamW
  bool check_budget = false;               // the manager's peak device bytes <= budget after each step
  // Every step's reads held until it drains (ReapPolicy::kHoldUntilDrain), so
  // whole-tensor units start as far as windows and staging allow before any
  // completes; each step then held more than windows_above unit windows at
  // once (StepStats::peak_unit_windows).
  bool hold_completions = false;
  uint32_t windows_above = 0;
  // Each step ended with this many device slots (StepStats::device_slots;
  // 0: not checked): those lent to units' windows came back whole.
  uint32_t device_slots = 0;
  // Step fail_step's fail_launch-th kernel launch fails first (the step
  // then runs again with the same gradients); 0: none. REQUIRES:
  // durable_every 1 (a failed step would drop the steps held in the tier).
  uint64_t fail_step = 0, fail_launch = 0;

  std::unique_ptr<StreamedAdam> Open(StoreEnv* env, bool set_groups) const {
    std::vector<std::unique_ptr<UpdateRule>> rules;
    if (whole_adamw) {
      rules.push_back(std::make_unique<WholeTensorAdamW>(moments, 1000, calls));
    } else {
      rules.push_back(internal::NewAdamWRule(moments));
    }
    rules.push_back(NewLionRule(moments));
    StreamedAdamOptions o;
    o.moment_dtype = moments;
    o.durable_every_steps = durable_every;
    auto sa = StreamedAdam::Create(env->store.get(), env->mm.get(), o, std::move(rules));
    EXPECT_TRUE(sa.ok()) << sa.status().ToString();
    if (!sa.ok()) return nullptr;
    if (set_groups) {
      for (uint32_t g = 0; g < 2; ++g) {
        Status gs = (*sa)->SetGroupHyperparams(g, GroupHyper(g));
        EXPECT_TRUE(gs.ok()) << gs.ToString();
      }
    }
    return std::move(*sa);
  }

  void Run(uint64_t steps, uint64_t reopen_at) {
    const uint32_t mbytes = moments == MomentDType::kBF16 ? 2 : 4;
    std::optional<test_util::SyncPointFlag> hold;
    if (hold_completions) hold.emplace("streamed_adam.hold_completions");
    StoreEnv env;
    env.Open(/*create=*/true, budget, host_cache);
    auto sa = Open(&env, /*set_groups=*/true);
    ASSERT_NE(sa, nullptr);
    std::vector<HostParam> ref(defs.size());
    std::vector<StreamedAdam::ParamSpec> specs;
    std::vector<std::unique_ptr<DeviceBuffer>> inits;
    for (size_t d = 0; d < defs.size(); ++d) {
      const uint64_t n = defs[d].numel();
      ref[d].main.resize(n);
      for (uint64_t i = 0; i < n; ++i) ref[d].main[i] = RandF(d + 1, i);
      ref[d].m.assign(n * mbytes, 0);
      if (defs[d].kind == RuleKind::kAdamW) ref[d].v.assign(n * mbytes, 0);
      ref[d].param.assign(n, 0);
      inits.push_back(std::make_unique<DeviceBuffer>(env.mm.get(), n * 4));
      inits.back()->Upload(ref[d].main.data());
      StreamedAdam::ParamSpec s;
      s.name = defs[d].name;
      s.numel = n;
      s.group = defs[d].group;
      s.d_initial = inits.back()->get();
      s.shard.shape = {defs[d].rows, defs[d].cols};
      s.rule = defs[d].rule;
      specs.push_back(s);
    }
    ASSERT_OK(sa->RegisterParams(specs, nullptr));
    inits.clear();  // the mains are written (and the manager is replaced at the reopen)
    for (uint64_t step = 1; step <= steps; ++step) {
      if (step == reopen_at) {  // resume from the store: groups come from it
        ASSERT_OK(sa->MakeDurable().status());
        sa.reset();
        env.Close();
        env.Open(/*create=*/false, budget, host_cache);
        sa = Open(&env, /*set_groups=*/false);
        ASSERT_NE(sa, nullptr);
        for (auto& s : specs) s.d_initial = nullptr;
        std::vector<bool> existed;
        ASSERT_OK(sa->RegisterParams(specs, &existed));
        for (size_t d = 0; d < defs.size(); ++d) EXPECT_TRUE(existed[d]) << defs[d].name;
        for (uint32_t g = 0; g < 2; ++g) {
          const Hyperparams h = MUST(sa->GetGroupHyperparams(g));
          for (const auto& [k, v] : GroupHyper(g)) EXPECT_EQ(Get(h, k.c_str(), -1), v) << "group " << g << " " << k;
          // Defaults the rules disagree on are not the group's: each rule keeps its own.
          if (g == 0) {
            EXPECT_EQ(h.count("beta2"), 0u);
          }
        }
      }
      if (prefetch) ASSERT_OK(sa->Prefetch());
      std::vector<std::unique_ptr<DeviceBuffer>> bufs;
      std::vector<ParamGrad> list;
      std::vector<size_t> stepped;
      for (size_t d = 0; d < defs.size(); ++d) {
        if (step % defs[d].every != 0) continue;
        const uint64_t n = defs[d].numel();
        std::vector<uint16_t> gh(n);
        for (uint64_t i = 0; i < n; ++i) gh[i] = kernels::FloatToBf16(RandF(step * 17 + d, i));
        RefStep(defs[d].kind, moments, GroupHyper(defs[d].group), &ref[d], gh);
        bufs.push_back(std::make_unique<DeviceBuffer>(env.mm.get(), n * 2));
        bufs.back()->Upload(gh.data());
        auto grad = bufs.back()->get();
        bufs.push_back(std::make_unique<DeviceBuffer>(env.mm.get(), n * 2));
        ParamGrad pg;
        pg.name = defs[d].name;
        pg.d_grad = grad;
        pg.grad_type = DType::kBF16;
        pg.d_param = bufs.back()->get();
        pg.param_type = DType::kBF16;
        pg.numel = n;
        list.push_back(pg);
        stepped.push_back(d);
      }
      if (step == fail_step && test_util::KernelFailures::Available()) {
        // An aborted step leaves the last commit: the step below equals it run once.
        test_util::KernelFailures failures;
        failures.FailAfter(fail_launch);
        Status fs = sa->Step(list);
        EXPECT_FALSE(fs.ok()) << "step " << step;
        EXPECT_NE(fs.ToString().find("injected kernel failure"), std::string::npos) << fs.ToString();
      }
      const size_t calls_before = calls ? calls->size() : 0;
      Status ss = sa->Step(list);
      ASSERT_TRUE(ss.ok()) << "step " << step << ": " << ss.ToString();
      if (check_budget) {
        const MemoryStats ms = env.mm->stats();
        EXPECT_LE(ms.peak_resident_bytes, budget) << "step " << step;
        EXPECT_GT(ms.peak_resident_bytes, 0u);
      }
      if (hold_completions) {
        EXPECT_GT(sa->last_step_stats().peak_unit_windows, windows_above) << "step " << step;
      }
      if (device_slots != 0) {
        EXPECT_EQ(sa->last_step_stats().device_slots, device_slots) << "step " << step;
      }
      for (size_t k = 0; k < stepped.size(); ++k) {
        std::vector<uint16_t> copy(defs[stepped[k]].numel());
        bufs[2 * k + 1]->Download(copy.data());
        EXPECT_EQ(copy, ref[stepped[k]].param) << defs[stepped[k]].name << " param copy, step " << step;
      }
      if (calls != nullptr) {
        // Once per whole tensor stepped, on all of it.
        std::vector<const Def*> whole;
        for (size_t d : stepped) {
          if (defs[d].rule == 0 && whole_adamw) whole.push_back(&defs[d]);
        }
        ASSERT_EQ(calls->size() - calls_before, whole.size()) << "step " << step;
        for (size_t k = 0; k < whole.size(); ++k) {
          const UnitCall& c = (*calls)[calls_before + k];
          EXPECT_EQ(c.count, whole[k]->numel()) << whole[k]->name;
          EXPECT_EQ(c.first_elem, 0u);
          EXPECT_EQ(c.shape, std::to_string(whole[k]->rows) + " x " + std::to_string(whole[k]->cols));
          EXPECT_TRUE(c.workspace_ok) << whole[k]->name;
        }
      }
    }
    ASSERT_OK(sa->MakeDurable().status());
    for (size_t d = 0; d < defs.size(); ++d) {
      const std::string& n = defs[d].name;
      ExpectBytes(FieldBytes(env.store.get(), n, "main"), ref[d].main, n + "/main");
      ExpectBytes(FieldBytes(env.store.get(), n, "exp_avg"), ref[d].m, n + "/exp_avg");
      auto view = MUST(env.store->OpenGeneration(vfs::kLatest));
      const vfs::TensorInfo t = MUST(view->FindTensor(n));
      if (defs[d].kind == RuleKind::kAdamW) {
        ExpectBytes(FieldBytes(env.store.get(), n, "exp_avg_sq"), ref[d].v, n + "/exp_avg_sq");
        EXPECT_EQ(t.fields.size(), 3u) << n;
      } else {
        EXPECT_EQ(t.fields.size(), 2u) << n;
      }
      EXPECT_EQ(MUST(sa->param_step_count(n)), ref[d].count) << n;
    }
  }
};

const uint64_t kPer = kChunk / 4;  // f32 elements per chunk

class RuleMixTest : public ::testing::TestWithParam<std::tuple<MomentDType, bool>> {
 protected:
  // The parameters' moments, and with the host cache tier (steps held in it
  // two at a time, Prefetch) or from disk; calls: a whole-tensor rule's
  // calls (rule 0 is then WholeTensorAdamW).
  MixRun MakeRun(std::vector<UnitCall>* calls = nullptr) const {
    MixRun r;
    r.moments = std::get<0>(GetParam());
    if (std::get<1>(GetParam())) {
      r.host_cache = 256ull << 20;
      r.durable_every = 2;
      r.prefetch = true;
    }
    r.whole_adamw = calls != nullptr;
    r.calls = calls;
    return r;
  }
  // A whole-tensor rule's run whose steps hold their completions until they
  // drain, within budget (checked), each step with more than windows_above
  // unit windows at once and ending with device_slots slots.
  MixRun MakeHeldRun(std::vector<UnitCall>* calls, uint64_t budget, uint32_t windows_above,
                     uint32_t device_slots) const {
    MixRun r = MakeRun(calls);
    r.check_budget = true;
    r.hold_completions = true;
    r.budget = budget;
    r.windows_above = windows_above;
    r.device_slots = device_slots;
    return r;
  }
};

TEST_P(RuleMixTest, AdamWAndLionParamsEqualTheirKernelsAcrossReopen) {
  MEMMGR_REQUIRE_BACKEND();
  MixRun r = MakeRun();
  r.defs = {{"a.weight", RuleKind::kAdamW, 0, 2, kPer + 389, 0, 1},
            {"b.weight", RuleKind::kLion, 1, 1000, 3, 1, 1},
            {"c.bias", RuleKind::kAdamW, 0, 1, kPer, 1, 2},
            {"d.weight", RuleKind::kLion, 1, 3, kPer / 2 + 5, 0, 3}};
  r.Run(/*steps=*/6, /*reopen_at=*/4);
}

TEST_P(RuleMixTest, WholeTensorRuleEqualsItsKernelBesideSlicesAcrossReopen) {
  MEMMGR_REQUIRE_BACKEND();
  std::vector<UnitCall> calls;
  MixRun r = MakeRun(&calls);
  // w: several chunks of every field (several slices of the elementwise
  // layout); s: smaller than a chunk.
  r.defs = {{"w.weight", RuleKind::kAdamW, 0, 1536, 1025, 0, 1},
            {"l.weight", RuleKind::kLion, 1, 2, kPer + 9, 1, 1},
            {"s.weight", RuleKind::kAdamW, 0, 40, 25, 1, 2},
            {"l.bias", RuleKind::kLion, 1, 1, 77, 0, 1}};
  r.Run(/*steps=*/5, /*reopen_at=*/3);
}

TEST_P(RuleMixTest, WholeTensorsOfManySizesOverlapWithinTheBudgetAcrossReopen) {
  MEMMGR_REQUIRE_BACKEND();
  std::vector<UnitCall> calls;
  MixRun r = MakeRun(&calls);
  r.check_budget = true;
  // 40 chunks: the units hold most of the state's bytes, so the slots'
  // window is two slices' (6 pages with f32 moments, 8 with bf16), and the
  // rest is for the units; "big" needs more than half the budget (33 pages
  // with f32 moments, 22 with bf16), so no other unit's window fits beside
  // it, and with f32 moments it takes the slots' pages too. The others
  // have several chunks per field (u1, u3), one (u2) or a few KiB (u4), odd
  // lengths, and sit between elementwise (Lion) params.
  r.budget = 40 * kChunk;
  r.device_slots = 2;
  r.defs = {{"u1.weight", RuleKind::kAdamW, 0, 1000, 1049, 0, 1},
            {"l.bias", RuleKind::kLion, 1, 1, 77, 0, 1},
            {"big.weight", RuleKind::kAdamW, 0, 3000, 1901, 1, 1},
            {"u2.weight", RuleKind::kAdamW, 0, 700, 333, 1, 1},
            {"l.weight", RuleKind::kLion, 1, 2, kPer + 9, 1, 1},
            {"u3.weight", RuleKind::kAdamW, 0, 1537, 771, 0, 2},
            {"u4.weight", RuleKind::kAdamW, 0, 31, 17, 0, 1},
            {"l2.weight", RuleKind::kLion, 1, 3, kPer / 2 + 5, 0, 1},
            {"u5.weight", RuleKind::kAdamW, 0, 999, 1051, 1, 1}};
  if (r.durable_every == 1) {
    // A kernel failure with units in flight aborts the step and leaves
    // nothing of it behind (windows, staging sets, cache entries).
    r.fail_step = 2;
    r.fail_launch = 4;
  }
  r.Run(/*steps=*/5, /*reopen_at=*/3);
}

TEST_P(RuleMixTest, ManySmallWholeTensorsHoldMoreThanTwoWindowsWithinTheBudgetAcrossReopen) {
  MEMMGR_REQUIRE_BACKEND();
  if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
  // 40 chunks: the units hold most of the state's bytes, so the slots'
  // window is two slices' (6 pages with f32 moments, 8 with bf16) and
  // leaves 34 or 32 pages, a one-page window for each of the 12 matrices
  // (each field under a chunk, of odd sizes): more than two gather at once,
  // beside Lion's slices.
  std::vector<UnitCall> calls;
  MixRun r = MakeHeldRun(&calls, 40 * kChunk, /*windows_above=*/2, /*device_slots=*/2);
  for (uint32_t k = 0; k < 12; ++k) {
    r.defs.push_back({"m" + std::to_string(k) + ".weight", RuleKind::kAdamW, 0, 37 + 13 * k, 211 - 7 * k, k % 2, 1});
    if (k % 4 == 1) r.defs.push_back({"l" + std::to_string(k) + ".bias", RuleKind::kLion, 1, 1, 301 + k, 1, 1});
  }
  r.Run(/*steps=*/4, /*reopen_at=*/3);
}

TEST_P(RuleMixTest, SlotsLentToUnitsComeBackWholeAcrossReopen) {
  MEMMGR_REQUIRE_BACKEND();
  if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
  // 16 chunks: Lion's slices hold most of the state's bytes, so the slots'
  // window is as many slices as the budget holds (5 of 3 chunks with f32
  // moments, 4 of 4 with bf16), with no room for a unit's window (4 or 3
  // pages) beside it. a's window takes the slots' pages, b's the free pages
  // beside it; once a's window goes back, b's still holds the pages the
  // slots need, and they come back whole only after it: every step ends
  // with all of them.
  std::vector<UnitCall> calls;
  const bool bf16 = std::get<0>(GetParam()) == MomentDType::kBF16;
  MixRun r = MakeHeldRun(&calls, 16 * kChunk, /*windows_above=*/1, /*device_slots=*/bf16 ? 4 : 5);
  r.defs = {{"a.weight", RuleKind::kAdamW, 0, 600, 1001, 0, 1},
            {"b.weight", RuleKind::kAdamW, 0, 599, 1003, 1, 1},
            {"l.weight", RuleKind::kLion, 1, 2, 5 * kPer / 4 * 2 + 11, 0, 1},
            {"l.bias", RuleKind::kLion, 1, 1, 301, 1, 1}};
  r.Run(/*steps=*/3, /*reopen_at=*/2);
}

INSTANTIATE_TEST_SUITE_P(Moments, RuleMixTest,
                         ::testing::Combine(::testing::Values(MomentDType::kF32, MomentDType::kBF16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == MomentDType::kBF16 ? "Bf16" : "F32") +
                                  (std::get<1>(info.param) ? "HostCache" : "Disk");
                         });

TEST(RuleMixChecks, AParamRegisteredUnderAnotherRuleIsRefused) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  env.Open(/*create=*/true, 16 * kChunk);
  auto make = [&] {
    std::vector<std::unique_ptr<UpdateRule>> rules;
    rules.push_back(internal::NewAdamWRule(MomentDType::kF32));
    rules.push_back(NewLionRule(MomentDType::kF32));
    return MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{}, std::move(rules)));
  };
  {
    auto sa = make();
    ASSERT_OK(sa->RegisterParam("adam.w", 100, 0, nullptr, DType::kF32));
    ASSERT_OK(sa->RegisterParam("lion.w", 100, 0, nullptr, DType::kF32, {}, /*rule=*/1));
    EXPECT_EQ(sa->RegisterParam("x", 100, 0, nullptr, DType::kF32, {}, /*rule=*/2).code(),
              StatusCode::kInvalidArgument);
    // Names of either rule are the group's; one no rule knows is refused.
    EXPECT_TRUE(sa->SetGroupHyperparams(0, {{"eps", 1e-6}, {"beta2", 0.95}}).ok());
    EXPECT_EQ(sa->SetGroupHyperparams(0, {{"momentum", 0.9}}).code(), StatusCode::kInvalidArgument);
    ASSERT_OK(sa->MakeDurable().status());
  }
  env.Close();
  env.Open(/*create=*/false, 16 * kChunk);
  auto sa = make();
  Status s = sa->RegisterParam("lion.w", 100, 0, nullptr, DType::kF32);  // rule 0: AdamW
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  for (const char* want : {"lion.w", "AdamW", "Lion"}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << ": " << s.ToString();
  }
  EXPECT_NE(s.message().find(env.store->path()), std::string::npos) << s.ToString();
  s = sa->RegisterParam("adam.w", 100, 0, nullptr, DType::kF32, {}, /*rule=*/1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  // The stored rules are kept: both register under their own.
  ASSERT_OK(sa->RegisterParam("lion.w", 100, 0, nullptr, DType::kF32, {}, 1));
  ASSERT_OK(sa->RegisterParam("adam.w", 100, 0, nullptr, DType::kF32));
}

// A rule's shape check runs at registration, before anything changes (Muon
// steps only matrices): the C++ API refuses what the C ABI and Python refuse.
TEST(RuleMixChecks, AParamOfAShapeItsRuleCannotStepIsRefusedAtRegistration) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  env.Open(/*create=*/true, 16 * kChunk);
  std::vector<std::unique_ptr<UpdateRule>> rules;
  rules.push_back(internal::NewAdamWRule(MomentDType::kF32));
  rules.push_back(NewMuonRule(MomentDType::kF32));
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{}, std::move(rules)));
  Status s = sa->RegisterParam("ln.weight", 64, 0, nullptr, DType::kF32, {}, /*rule=*/1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  for (const std::string& want : {std::string("ln.weight"), env.store->path(), std::string("[64]")}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << ": " << s.ToString();
  }
  EXPECT_FALSE(sa->HasParam("ln.weight"));
  EXPECT_FALSE(env.store->LookupTensor("ln.weight").has_value());
  // The same param under AdamW, and a matrix under Muon, register.
  ASSERT_OK(sa->RegisterParam("ln.weight", 64, 0, nullptr, DType::kF32));
  ShardInfo matrix;
  matrix.shape = {8, 8};
  ASSERT_OK(sa->RegisterParam("w", 64, 0, nullptr, DType::kF32, matrix, /*rule=*/1));
}

TEST(RuleMixChecks, AWholeTensorTheWindowCannotHoldIsRefused) {
  MEMMGR_REQUIRE_BACKEND();
  std::vector<UnitCall> calls;
  StoreEnv env;
  auto make = [&]() -> Result<std::unique_ptr<StreamedAdam>> {
    std::vector<std::unique_ptr<UpdateRule>> rules;
    rules.push_back(std::make_unique<WholeTensorAdamW>(MomentDType::kF32, 4096, &calls));
    return StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{}, std::move(rules));
  };
  // 3 fields of 2 chunks each and a workspace: 7 pages of the window.
  const uint64_t n = 2 * kPer;
  env.Open(/*create=*/true, 16 * kChunk);
  {
    auto sa = MUST(make());
    ASSERT_OK(sa->RegisterParam("big", n, 0, nullptr, DType::kF32));
    ASSERT_OK(sa->MakeDurable().status());
  }
  env.Close();
  env.Open(/*create=*/false, 6 * kChunk);
  auto stored = make();
  ASSERT_FALSE(stored.ok());
  EXPECT_EQ(stored.status().code(), StatusCode::kResourceExhausted);
  for (const std::string& want : {std::string("big"), env.store->path(), std::to_string(6 * kChunk)}) {
    EXPECT_NE(stored.status().message().find(want), std::string::npos) << want << ": " << stored.status().ToString();
  }
  env.Close();
  StoreEnv fresh;
  fresh.Open(/*create=*/true, 6 * kChunk);
  std::vector<std::unique_ptr<UpdateRule>> rules;
  rules.push_back(std::make_unique<WholeTensorAdamW>(MomentDType::kF32, 4096, &calls));
  rules.push_back(NewLionRule(MomentDType::kF32));
  auto sa = MUST(StreamedAdam::Create(fresh.store.get(), fresh.mm.get(), StreamedAdamOptions{}, std::move(rules)));
  StreamedAdam::ParamSpec ok{"small", kPer, 0, nullptr, DType::kF32, {}, 0};
  StreamedAdam::ParamSpec big{"big", n, 0, nullptr, DType::kF32, {}, 0};
  std::vector<StreamedAdam::ParamSpec> specs = {ok, big};
  Status s = sa->RegisterParams(specs, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  // Fields 3 x 4 MiB, the workspace 4096 + numel % 7 bytes (256-aligned).
  const uint64_t need = 3 * n * 4 + 4352;
  for (const std::string& want : {std::string("big"), fresh.store->path(), std::to_string(need),
                                  std::to_string(6 * kChunk)}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << ": " << s.ToString();
  }
  // Nothing changed: neither param is registered; a big Lion param is fine.
  EXPECT_FALSE(sa->HasParam("small"));
  EXPECT_FALSE(sa->HasParam("big"));
  ASSERT_OK(sa->RegisterParam("big", n, 0, nullptr, DType::kF32, {}, /*rule=*/1));
  ASSERT_OK(sa->RegisterParam("small", kPer, 0, nullptr, DType::kF32));
}

}  // namespace
}  // namespace optstate::memmgr
