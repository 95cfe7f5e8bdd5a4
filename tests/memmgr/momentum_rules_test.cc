// StreamedAdam with the Lion and SGD rules (memmgr/momentum_rules.h): a
// streamed run equals the kernel applied to whole, resident tensors bit for
// bit (tensors spanning several slices, params that skip steps, a close and
// reopen in the middle; on the cuda backend the reference is still the CPU
// kernel: they are bit-identical), the store keeps exactly the rule's fields,
// SGD's first update per tensor starts its buffer, and a store is never
// opened with another rule's fields (nor with fields its rule does not
// keep). Built into memmgr_test (host) and memmgr_gpu_test (cuda).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "kernels/momentum.h"
#include "base/status.h"
#include "memmgr/memory_manager.h"
#include "memmgr/momentum_rules.h"
#include "memmgr/streamed_adam.h"
#include "tests/memmgr/memmgr_test_util.h"
#include "vfs/store.h"

namespace optstate::memmgr {
namespace {

using namespace testing;  // NOLINT

enum class Kind { kLion, kSgd };

struct Def {
  std::string name;
  uint64_t numel;
  uint32_t group;
  int every;  // steps in which it has a grad: those divisible by `every`
};

std::vector<Def> Defs() {
  const uint64_t per = kChunk / 4;  // f32 elements per chunk
  return {{"a.weight", 2 * per + 777, 0, 1}, {"b.bias", 1000, 1, 2}, {"c.weight", per, 0, 3}};
}

Hyperparams GroupHyper(Kind k, uint32_t g) {
  if (k == Kind::kLion) {
    return g == 0 ? Hyperparams{{"lr", 1e-3}, {"beta1", 0.9}, {"beta2", 0.99}, {"weight_decay", 0.1}}
                  : Hyperparams{{"lr", 3e-3}, {"beta1", 0.95}, {"beta2", 0.98}};
  }
  return g == 0 ? Hyperparams{{"lr", 0.05}, {"momentum", 0.9}, {"nesterov", 1.0}, {"weight_decay", 0.01}}
                : Hyperparams{{"lr", 0.02}, {"momentum", 0.8}, {"dampening", 0.25}, {"maximize", 1.0}};
}

std::unique_ptr<UpdateRule> RuleOf(Kind k, MomentDType m) {
  return k == Kind::kLion ? NewLionRule(m) : NewSgdRule(m, /*momentum_buffer=*/true);
}

const char* FieldOf(Kind k) { return k == Kind::kLion ? "exp_avg" : "momentum_buffer"; }

struct HostParam {
  std::vector<float> main;
  std::vector<uint8_t> moment;  // f32 or bf16 values
  std::vector<uint16_t> param;  // bf16 model copy
  uint64_t count = 0;
};

// The CPU kernel on one whole tensor: the reference of a streamed step.
void RefStep(Kind k, MomentDType m, const Hyperparams& h, HostParam* p, const std::vector<uint16_t>& grad) {
  ++p->count;
  kernels::MomentumTensors t;
  t.main = p->main.data();
  t.moment = p->moment.data();
  t.moment_type = m;
  t.grad = grad.data();
  t.grad_type = DType::kBF16;
  t.param = p->param.data();
  t.param_type = DType::kBF16;
  auto get = [&](const char* key, double d) {
    auto it = h.find(key);
    return it == h.end() ? d : it->second;
  };
  if (k == Kind::kLion) {
    kernels::LionParams lp;
    lp.lr = get("lr", 1e-4);
    lp.beta1 = get("beta1", 0.9);
    lp.beta2 = get("beta2", 0.99);
    lp.weight_decay = get("weight_decay", 0.0);
    ASSERT_TRUE(kernels::LionStepCpu(t, p->main.size(), lp));
  } else {
    kernels::SgdParams sp;
    sp.lr = get("lr", 1e-3);
    sp.momentum = get("momentum", 0.0);
    sp.dampening = get("dampening", 0.0);
    sp.weight_decay = get("weight_decay", 0.0);
    sp.nesterov = get("nesterov", 0.0) != 0.0;
    sp.maximize = get("maximize", 0.0) != 0.0;
    sp.step = p->count;
    ASSERT_TRUE(kernels::SgdStepCpu(t, p->main.size(), sp));
  }
}

std::unique_ptr<StreamedAdam> Open(StoreEnv* env, Kind k, MomentDType m) {
  StreamedAdamOptions o;
  o.moment_dtype = m;
  auto sa = StreamedAdam::Create(env->store.get(), env->mm.get(), o, RuleOf(k, m));
  EXPECT_TRUE(sa.ok()) << sa.status().ToString();
  if (!sa.ok()) return nullptr;
  for (uint32_t g = 0; g < 2; ++g) EXPECT_TRUE((*sa)->SetGroupHyperparams(g, GroupHyper(k, g)).ok());
  return std::move(*sa);
}

class MomentumRulesTest : public ::testing::TestWithParam<std::tuple<Kind, MomentDType>> {};

TEST_P(MomentumRulesTest, StreamedEqualsWholeTensorKernelAcrossReopen) {
  MEMMGR_REQUIRE_BACKEND();
  const auto [kind, moments] = GetParam();
  const uint32_t mbytes = moments == MomentDType::kBF16 ? 2 : 4;
  const std::vector<Def> defs = Defs();
  StoreEnv env;
  env.Open(/*create=*/true, 16 * kChunk);
  auto sa = Open(&env, kind, moments);
  ASSERT_NE(sa, nullptr);
  std::vector<HostParam> ref(defs.size());
  for (size_t d = 0; d < defs.size(); ++d) {
    const uint64_t n = defs[d].numel;
    ref[d].main.resize(n);
    for (uint64_t i = 0; i < n; ++i) ref[d].main[i] = RandF(d + 1, i);
    ref[d].moment.assign(n * mbytes, 0);
    ref[d].param.assign(n, 0);
    DeviceBuffer init(env.mm.get(), n * 4);
    init.Upload(ref[d].main.data());
    ASSERT_TRUE(sa->RegisterParam(defs[d].name, n, defs[d].group, init.get(), DType::kF32).ok());
  }
  constexpr uint64_t kSteps = 6;
  for (uint64_t step = 1; step <= kSteps; ++step) {
    if (step == 4) {  // resume from the store
      sa.reset();
      env.Close();
      env.Open(/*create=*/false, 16 * kChunk);
      sa = Open(&env, kind, moments);
      ASSERT_NE(sa, nullptr);
      for (const Def& d : defs) ASSERT_TRUE(sa->RegisterParam(d.name, d.numel, d.group, nullptr, DType::kF32).ok());
    }
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    std::vector<ParamGrad> list;
    std::vector<size_t> stepped;
    for (size_t d = 0; d < defs.size(); ++d) {
      if (step % defs[d].every != 0) continue;
      const uint64_t n = defs[d].numel;
      std::vector<uint16_t> gh(n);
      for (uint64_t i = 0; i < n; ++i) gh[i] = kernels::FloatToBf16(RandF(step * 17 + d, i));
      RefStep(kind, moments, GroupHyper(kind, defs[d].group), &ref[d], gh);
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
    ASSERT_TRUE(sa->Step(list).ok()) << "step " << step;
    for (size_t k = 0; k < stepped.size(); ++k) {
      std::vector<uint16_t> copy(defs[stepped[k]].numel);
      bufs[2 * k + 1]->Download(copy.data());
      EXPECT_EQ(copy, ref[stepped[k]].param) << defs[stepped[k]].name << " param copy, step " << step;
    }
  }
  ASSERT_TRUE(sa->WaitForCommit().ok());
  for (size_t d = 0; d < defs.size(); ++d) {
    ExpectBytes(FieldBytes(env.store.get(), defs[d].name, "main"), ref[d].main, defs[d].name + "/main");
    ExpectBytes(FieldBytes(env.store.get(), defs[d].name, FieldOf(kind)), ref[d].moment,
                defs[d].name + "/" + FieldOf(kind));
    // Exactly the rule's fields, in its dtype.
    auto view = MUST(env.store->OpenGeneration(vfs::kLatest));
    const vfs::TensorInfo t = MUST(view->FindTensor(defs[d].name));
    ASSERT_EQ(t.fields.size(), 2u) << defs[d].name;
    EXPECT_EQ(t.fields[1].name, FieldOf(kind));
    EXPECT_EQ(t.fields[1].dtype, moments == MomentDType::kBF16 ? DType::kBF16 : DType::kF32);
    EXPECT_EQ(MUST(sa->param_step_count(defs[d].name)), ref[d].count) << defs[d].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, MomentumRulesTest,
                         ::testing::Combine(::testing::Values(Kind::kLion, Kind::kSgd),
                                            ::testing::Values(MomentDType::kF32, MomentDType::kBF16)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == Kind::kLion ? "Lion" : "Sgd") +
                                  (std::get<1>(info.param) == MomentDType::kBF16 ? "Bf16" : "F32");
                         });

TEST(MomentumRulesChecks, AnotherRulesStoreAndBadHyperparametersAreRefused) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  env.Open(/*create=*/true, 16 * kChunk);
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{},
                                        NewLionRule(MomentDType::kF32)));
    std::vector<float> w(100, 1.0f);
    DeviceBuffer init(env.mm.get(), 400);
    init.Upload(w.data());
    ASSERT_TRUE(sa->RegisterParam("w", 100, 0, init.get(), DType::kF32).ok());
    ASSERT_TRUE(sa->MakeDurable().ok());
    // Lion's betas are in [0, 1); SGD's flags and Nesterov's conditions are torch's.
    Status s = sa->SetGroupHyperparams(0, {{"beta1", 1.5}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("Lion"), std::string::npos) << s.ToString();
    EXPECT_EQ(sa->SetGroupHyperparams(0, {{"momentum", 0.9}}).code(), StatusCode::kInvalidArgument);
  }
  // The store keeps exp_avg as Lion's: an AdamW or SGD optimizer on it names the field it lacks or differs in.
  env.Close();
  env.Open(/*create=*/false, 16 * kChunk);
  {
    auto sgd = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{},
                                         NewSgdRule(MomentDType::kF32, true)));
    Status s = sgd->SetGroupHyperparams(0, {{"momentum", 0.9}, {"dampening", 0.1}, {"nesterov", 1.0}});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("Nesterov"), std::string::npos) << s.ToString();
    Status r = sgd->RegisterParam("w", 100, 0, nullptr, DType::kF32);
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.ToString().find("momentum_buffer"), std::string::npos) << "[" << r.ToString() << "]";
  }
  {
    // Plain SGD keeps main alone: Lion's exp_avg is another rule's state.
    auto plain = StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{},
                                      NewSgdRule(MomentDType::kF32, false));
    ASSERT_FALSE(plain.ok());
    EXPECT_EQ(plain.status().code(), StatusCode::kInvalidArgument);
    for (const std::string& part : {env.store->path(), std::string("'w'"), std::string("exp_avg")}) {
      EXPECT_NE(plain.status().message().find(part), std::string::npos) << part << ": " << plain.status().ToString();
    }
  }
  env.Close();
  StoreEnv fresh;
  fresh.Open(/*create=*/true, 16 * kChunk);
  auto plain = MUST(StreamedAdam::Create(fresh.store.get(), fresh.mm.get(), StreamedAdamOptions{},
                                         NewSgdRule(MomentDType::kF32, false)));
  Status s = plain->SetGroupHyperparams(0, {{"momentum", 0.5}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("momentum_buffer"), std::string::npos) << s.ToString();
}

// A store written by SGD with momentum holds a momentum_buffer per tensor: an
// optimizer of plain SGD (no buffer) on it is refused at open, naming the
// store, the tensor and the field (the tensors are checked before the
// groups' values, whatever the last group's momentum), and changes nothing:
// the momentum optimizer then resumes exactly as a run that was never
// interrupted (the whole-tensor kernel).
TEST(MomentumRulesChecks, AMomentumStoreIsRefusedByPlainSgdAndResumesWithMomentum) {
  MEMMGR_REQUIRE_BACKEND();
  const uint64_t n = kChunk / 4 + 333;  // two chunks, the second partial
  const Hyperparams with = {{"lr", 0.05}, {"momentum", 0.9}, {"nesterov", 1.0}, {"weight_decay", 0.01}};
  const Hyperparams without = {{"lr", 0.05}, {"momentum", 0.0}};
  // Steps 1-2 with momentum, step 3 with momentum 0 (the buffer kept).
  auto hyper_at = [&](uint64_t step) { return step == 3 ? without : with; };
  HostParam ref;
  ref.main.resize(n);
  for (uint64_t i = 0; i < n; ++i) ref.main[i] = RandF(7, i);
  ref.moment.assign(n * 4, 0);
  ref.param.assign(n, 0);
  StoreEnv env;
  env.Open(/*create=*/true, 16 * kChunk);
  auto open_momentum = [&] {
    return MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{},
                                     NewSgdRule(MomentDType::kF32, /*momentum_buffer=*/true)));
  };
  auto step = [&](StreamedAdam* sa, uint64_t t) {
    std::vector<uint16_t> gh(n);
    for (uint64_t i = 0; i < n; ++i) gh[i] = kernels::FloatToBf16(RandF(100 + t, i));
    RefStep(Kind::kSgd, MomentDType::kF32, hyper_at(t), &ref, gh);
    ASSERT_TRUE(sa->SetGroupHyperparams(0, hyper_at(t)).ok());
    DeviceBuffer grad(env.mm.get(), n * 2), param(env.mm.get(), n * 2);
    grad.Upload(gh.data());
    ParamGrad pg;
    pg.name = "w";
    pg.d_grad = grad.get();
    pg.grad_type = DType::kBF16;
    pg.d_param = param.get();
    pg.param_type = DType::kBF16;
    pg.numel = n;
    ASSERT_TRUE(sa->Step(std::vector<ParamGrad>{pg}).ok()) << "step " << t;
    ASSERT_TRUE(sa->WaitForCommit().ok());
  };
  auto plain_is_refused = [&] {
    const uint64_t gen = env.store->LatestGeneration().generation;
    auto plain = StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{},
                                      NewSgdRule(MomentDType::kF32, /*momentum_buffer=*/false));
    ASSERT_FALSE(plain.ok()) << "plain SGD opened a store with momentum buffers";
    const Status& st = plain.status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    const std::vector<std::string> parts = {env.store->path(), "momentum_buffer", "'w'"};
    for (const std::string& part : parts) {
      EXPECT_NE(st.message().find(part), std::string::npos) << "'" << part << "' missing from: " << st.ToString();
    }
    EXPECT_EQ(env.store->LatestGeneration().generation, gen);
  };
  {
    auto sa = open_momentum();
    DeviceBuffer init(env.mm.get(), n * 4);
    init.Upload(ref.main.data());
    ASSERT_TRUE(sa->RegisterParam("w", n, 0, init.get(), DType::kF32).ok());
    for (uint64_t t = 1; t <= 2; ++t) step(sa.get(), t);
  }
  env.Close();
  env.Open(/*create=*/false, 16 * kChunk);
  plain_is_refused();  // the group's momentum is 0.9
  {
    auto sa = open_momentum();
    ASSERT_TRUE(sa->RegisterParam("w", n, 0, nullptr, DType::kF32).ok());
    step(sa.get(), 3);  // momentum 0: the group no longer needs the buffer, the tensor holds it
  }
  env.Close();
  env.Open(/*create=*/false, 16 * kChunk);
  plain_is_refused();  // the group's momentum is 0: the tensor holds the buffer
  auto sa = open_momentum();
  ASSERT_TRUE(sa->RegisterParam("w", n, 0, nullptr, DType::kF32).ok());
  for (uint64_t t = 4; t <= 5; ++t) step(sa.get(), t);
  EXPECT_EQ(MUST(sa->param_step_count("w")), 5u);
  ExpectBytes(FieldBytes(env.store.get(), "w", "main"), ref.main, "w/main");
  ExpectBytes(FieldBytes(env.store.get(), "w", "momentum_buffer"), ref.moment, "w/momentum_buffer");
}

// A store whose committed group holds a value its rule refuses (written by an
// older version, or committed through the store alone): the optimizer that
// opens it with that rule says so, naming the store, the generation, the
// group and the value, instead of stepping with it.
TEST(MomentumRulesChecks, StoredHyperparametersOutOfTheRulesRangeAreRefusedAtOpen) {
  MEMMGR_REQUIRE_BACKEND();
  struct Case {
    std::function<std::unique_ptr<UpdateRule>()> rule;
    std::map<std::string, double> hyper;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[] { return NewSgdRule(MomentDType::kF32, true); }, {{"lr", 0.1}, {"momentum", -0.5}}, "momentum -0.5"},
      {[] { return NewSgdRule(MomentDType::kF32, true); },
       {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.5}, {"nesterov", 1.0}},
       "Nesterov"},
      {[] { return NewLionRule(MomentDType::kF32); }, {{"lr", 1e-4}, {"beta1", 1.5}}, "betas 1.5/"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.want);
    StoreEnv env;
    env.Open(/*create=*/true, 16 * kChunk);
    vfs::CommitInfo info;
    info.step = 1;
    info.groups.push_back(vfs::GroupInfo{2, 1, c.hyper});
    auto gen = env.store->Commit(info);
    ASSERT_TRUE(gen.ok()) << gen.status().ToString();
    auto sa = StreamedAdam::Create(env.store.get(), env.mm.get(), StreamedAdamOptions{}, c.rule());
    ASSERT_FALSE(sa.ok()) << "opened with " << c.want;
    const Status& st = sa.status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    for (const std::string& part :
         {env.store->path(), "generation " + std::to_string(*gen), std::string("group 2"), c.want}) {
      EXPECT_NE(st.message().find(part), std::string::npos) << "'" << part << "' missing from: " << st.ToString();
    }
  }
}

}  // namespace
}  // namespace optstate::memmgr
