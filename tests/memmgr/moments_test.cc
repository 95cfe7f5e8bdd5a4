// StreamedAdam with bf16 moments (StreamedAdamOptions::moment_dtype): a
// streamed run equals the kernel applied to whole, resident tensors bit for
// bit (on the cuda backend the reference is still AdamStepCpu: the kernels
// are bit-identical), the store records the dtype per field and moves 8 bytes
// per param per step each way, and a store is never opened with the other
// moment dtype. Built into memmgr_test (host) and memmgr_gpu_test (cuda).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tests/memmgr/memmgr_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/store.h"

namespace optstate::memmgr {
namespace {

using namespace testing;  // NOLINT

struct Def {
  std::string name;
  uint64_t numel;
};

// Slice boundaries: with bf16 moments a slice is kChunk / 2 elements (two
// main chunks); sizes around it, a tensor of one partial main chunk, and one
// whose last slice has a single, partial main chunk.
std::vector<Def> Defs() {
  const uint64_t slice = kChunk / 2;
  return {{"a.weight", 3 * slice + 777},
          {"b.bias", 1000},
          {"c.weight", slice},
          {"d.weight", 2 * slice + kChunk / 4 - 3}};
}

struct HostParam {
  std::vector<float> main;
  std::vector<uint16_t> m, v;
  std::vector<uint16_t> param;  // bf16 model copy
};

// Reads a field's stored bytes (elem_bytes each) through pins of at most one chunk.
std::vector<uint8_t> ReadBytes(MemoryManager* mm, const std::string& tensor, const std::string& field,
                               uint64_t numel, uint32_t elem_bytes) {
  std::vector<uint8_t> out(numel * elem_bytes);
  const uint64_t per = kChunk / elem_bytes;
  for (uint64_t first = 0; first < numel; first += per) {
    const uint64_t n = std::min(per, numel - first);
    auto pin = mm->Pin(tensor, field, first, n, Access::kRead);
    if (!pin.ok()) {
      ADD_FAILURE() << "pin " << tensor << "/" << field << ": " << pin.status().ToString();
      return out;
    }
    EXPECT_TRUE(mm->CopyToHost(out.data() + first * elem_bytes, pin->data(), n * elem_bytes).ok());
  }
  return out;
}


// Steps sa `steps` times with bf16 grads and bf16 param copies, and the CPU
// kernel on the whole host tensors with the same grads; ref holds the result.
void StepBoth(StreamedAdam* sa, MemoryManager* mm, const std::vector<Def>& defs, std::vector<HostParam>* ref,
              uint64_t first_step, uint64_t steps) {
  const ParamGroup g = TestGroup();
  for (uint64_t step = first_step; step < first_step + steps; ++step) {
    std::vector<std::unique_ptr<DeviceBuffer>> grads, params;
    std::vector<ParamGrad> list;
    for (size_t k = 0; k < defs.size(); ++k) {
      const uint64_t n = defs[k].numel;
      std::vector<uint16_t> gh(n);
      for (uint64_t i = 0; i < n; ++i) gh[i] = kernels::FloatToBf16(RandF(step * 31 + k, i) * 0.5f);
      grads.push_back(std::make_unique<DeviceBuffer>(mm, n * 2));
      grads.back()->Upload(gh.data());
      params.push_back(std::make_unique<DeviceBuffer>(mm, n * 2));
      list.push_back(ParamGrad{.name = defs[k].name, .d_grad = grads.back()->get(), .grad_type = DType::kBF16,
                               .d_param = params.back()->get(), .param_type = DType::kBF16, .numel = n});
      HostParam& h = (*ref)[k];
      kernels::AdamTensors t;
      t.main = h.main.data();
      t.exp_avg = h.m.data();
      t.exp_avg_sq = h.v.data();
      t.moment_type = MomentDType::kBF16;
      t.grad = gh.data();
      t.grad_type = DType::kBF16;
      t.param = h.param.data();
      t.param_type = DType::kBF16;
      kernels::AdamParams ap;
      ap.lr = g.lr;
      ap.weight_decay = g.weight_decay;
      ap.step = step;
      ASSERT_TRUE(kernels::AdamStepCpu(t, n, ap, 1));
    }
    ASSERT_OK(sa->Step(list));
    for (size_t k = 0; k < defs.size(); ++k) {
      std::vector<uint16_t> got(defs[k].numel);
      params[k]->Download(got.data());
      EXPECT_EQ(got, (*ref)[k].param) << "param copy of " << defs[k].name << " at step " << step;
    }
  }
}

void ExpectStoreEquals(MemoryManager* mm, const std::vector<Def>& defs, const std::vector<HostParam>& ref) {
  for (size_t k = 0; k < defs.size(); ++k) {
    const uint64_t n = defs[k].numel;
    auto main = ReadBytes(mm, defs[k].name, "main", n, 4);
    auto m = ReadBytes(mm, defs[k].name, "exp_avg", n, 2);
    auto v = ReadBytes(mm, defs[k].name, "exp_avg_sq", n, 2);
    EXPECT_EQ(std::memcmp(main.data(), ref[k].main.data(), n * 4), 0) << defs[k].name << "/main";
    EXPECT_EQ(std::memcmp(m.data(), ref[k].m.data(), n * 2), 0) << defs[k].name << "/exp_avg";
    EXPECT_EQ(std::memcmp(v.data(), ref[k].v.data(), n * 2), 0) << defs[k].name << "/exp_avg_sq";
  }
}

std::vector<HostParam> RegisterAll(StreamedAdam* sa, MemoryManager* mm, const std::vector<Def>& defs) {
  std::vector<HostParam> ref(defs.size());
  EXPECT_TRUE(sa->SetGroup(TestGroup()).ok());
  for (size_t k = 0; k < defs.size(); ++k) {
    const uint64_t n = defs[k].numel;
    HostParam& h = ref[k];
    h.main.resize(n);
    h.m.assign(n, 0);
    h.v.assign(n, 0);
    h.param.assign(n, 0);
    for (uint64_t i = 0; i < n; ++i) h.main[i] = RandF(1000 + k, i);
    DeviceBuffer init(mm, n * 4);
    init.Upload(h.main.data());
    Status s = sa->RegisterParam(defs[k].name, n, 0, init.get(), DType::kF32);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return ref;
}

TEST(StreamedAdamBf16Moments, StepsUnderOneSliceBudgetEqualWholeTensorKernelBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  const uint64_t budget = 4 * kChunk;  // one bf16 slice: two main chunks + one chunk of each moment
  env.Open(true, budget);
  StreamedAdamOptions so;
  so.moment_dtype = MomentDType::kBF16;
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
  const std::vector<Def> defs = Defs();
  std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
  StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 6);
  ASSERT_OK(sa->WaitForCommit());
  // 8 bytes per param per step each way: fp32 main + two bf16 moments.
  uint64_t numel = 0;
  for (const Def& d : defs) numel += d.numel;
  EXPECT_EQ(sa->last_step_stats().write_bytes, 8 * numel);
  EXPECT_EQ(sa->last_step_stats().read_bytes, 8 * numel);
  EXPECT_LE(env.mm->stats().peak_resident_bytes, budget);
  ExpectStoreEquals(env.mm.get(), defs, ref);
  // The store records the moments' dtype per field.
  auto t = MUST(env.store->FindTensor("a.weight"));
  ASSERT_EQ(t.fields.size(), 3u);
  EXPECT_EQ(t.fields[0].dtype, DType::kF32);
  EXPECT_EQ(t.fields[1].dtype, DType::kBF16);
  EXPECT_EQ(t.fields[2].dtype, DType::kBF16);
  auto rep = MUST(env.store->Verify());
  EXPECT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaked slots" : rep.problems[0]);

  // Reopened with bf16 moments, it continues exactly.
  sa.reset();
  env.Close();
  env.Open(false, budget);
  sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
  for (const Def& d : defs) ASSERT_OK(sa->RegisterParam(d.name, d.numel, 0, nullptr, std::nullopt));
  StepBoth(sa.get(), env.mm.get(), defs, &ref, 7, 2);
  ASSERT_OK(sa->WaitForCommit());
  ExpectStoreEquals(env.mm.get(), defs, ref);
}

// The host cache tier holding the whole state (steps in RAM, every 2nd one
// written and committed) and one holding part of it: the same bits.
TEST(StreamedAdamBf16Moments, HostCacheTierStepsEqualWholeTensorKernelBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  for (uint64_t cache_mib : {64, 6}) {
    SCOPED_TRACE("host cache " + std::to_string(cache_mib) + " MiB");
    StoreEnv env;
    env.Open(true, 8 * kChunk, cache_mib << 20);
    StreamedAdamOptions so;
    so.moment_dtype = MomentDType::kBF16;
    so.durable_every_steps = 2;
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    const std::vector<Def> defs = Defs();
    std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
    StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 5);
    ASSERT_OK(sa->MakeDurable().status());
    ExpectStoreEquals(env.mm.get(), defs, ref);
    EXPECT_EQ(env.store->LatestGeneration().step, 5u);
  }
}

// Export (manifest dtype bf16, safetensors BF16) and restore into a new
// store: the same bits, and the optimizer continues there exactly.
TEST(StreamedAdamBf16Moments, CheckpointRoundTripKeepsEveryBitAndResumes) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  env.Open(true, 4 * kChunk);
  StreamedAdamOptions so;
  so.moment_dtype = MomentDType::kBF16;
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
  const std::vector<Def> defs = Defs();
  std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
  StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 3);
  ASSERT_OK(sa->WaitForCommit());
  const std::string ckpt = env.dir.path() + "/ckpt";
  ASSERT_OK(vfs::ExportCheckpoint(env.store.get(), ckpt).status());
  sa.reset();
  env.Close();

  std::stringstream manifest;
  manifest << std::ifstream(ckpt + "/manifest.json").rdbuf();
  auto m = MUST(vfs::ParseManifest(manifest.str(), "manifest.json"));
  for (const vfs::ManifestTensor& t : m.tensors) {
    ASSERT_EQ(t.fields.size(), 3u);
    EXPECT_EQ(t.fields[0].dtype, DType::kF32) << t.name;
    EXPECT_EQ(t.fields[1].dtype, DType::kBF16) << t.name;
    EXPECT_EQ(t.fields[2].dtype, DType::kBF16) << t.name;
    EXPECT_EQ(t.fields[1].bytes, t.numel * 2) << t.name;
  }
  std::ifstream st(ckpt + "/state.safetensors", std::ios::binary);
  uint64_t header_len = 0;
  st.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  st.read(header.data(), static_cast<std::streamsize>(header_len));
  EXPECT_NE(header.find("\"BF16\""), std::string::npos) << header.substr(0, 300);

  StoreEnv dst;
  auto restored = MUST(vfs::CreateStoreFromCheckpoint(ckpt, dst.path(), TestStoreOptions()));
  restored.reset();
  dst.Open(false, 4 * kChunk);
  ASSERT_TRUE(dst.store->Verify().ok());
  auto sa2 = MUST(StreamedAdam::Create(dst.store.get(), dst.mm.get(), so));
  ExpectStoreEquals(dst.mm.get(), defs, ref);
  for (const Def& d : defs) ASSERT_OK(sa2->RegisterParam(d.name, d.numel, 0, nullptr, std::nullopt));
  StepBoth(sa2.get(), dst.mm.get(), defs, &ref, 4, 2);
  ASSERT_OK(sa2->WaitForCommit());
  ExpectStoreEquals(dst.mm.get(), defs, ref);
}

// Prefetch with bf16 moments reads each slice's chunks by their own sizes
// (two main chunks, one of each moment): into a cold tier that holds the whole
// state, into one that holds part of it, and into staging without a tier. The
// first step after a reopen finds every prefetched byte and reads only the
// rest; later steps (the whole tier: writes leave the step in its write tail)
// keep every bit.
TEST(StreamedAdamBf16Moments, PrefetchAndTheWriteTailKeepEveryBit) {
  MEMMGR_REQUIRE_BACKEND();
  const std::vector<Def> defs = Defs();
  uint64_t numel = 0;
  for (const Def& d : defs) numel += d.numel;
  for (uint64_t cache_mib : {64, 6, 0}) {
    SCOPED_TRACE("host cache " + std::to_string(cache_mib) + " MiB");
    StoreEnv env;
    env.Open(true, 8 * kChunk, cache_mib << 20);
    StreamedAdamOptions so;
    so.moment_dtype = MomentDType::kBF16;
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
    StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 1);
    ASSERT_OK(sa->WaitForCommit());
    sa.reset();
    env.Close();

    env.Open(false, 8 * kChunk, cache_mib << 20);  // a cold tier
    sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    for (const Def& d : defs) ASSERT_OK(sa->RegisterParam(d.name, d.numel, 0, nullptr, std::nullopt));
    ASSERT_OK(sa->Prefetch());
    ASSERT_OK(env.mm->Flush());  // waits for the prefetch to end
    StepBoth(sa.get(), env.mm.get(), defs, &ref, 2, 1);
    const StreamedAdam::StepStats& st = sa->last_step_stats();
    EXPECT_GT(st.prefetch_read_bytes, 0u);
    EXPECT_EQ(st.prefetch_hit_bytes, st.prefetch_read_bytes) << "the step found every prefetched byte";
    EXPECT_EQ(st.read_bytes, 8 * numel - st.prefetch_hit_bytes);
    if (cache_mib == 64) {
      EXPECT_EQ(st.prefetch_hit_bytes, 8 * numel);
    }
    for (uint64_t step = 3; step <= 4; ++step) {
      ASSERT_OK(sa->Prefetch());  // with the previous commit (and its write tail) in flight
      StepBoth(sa.get(), env.mm.get(), defs, &ref, step, 1);
    }
    ASSERT_OK(sa->WaitForCommit());
    EXPECT_EQ(env.store->LatestGeneration().step, 4u);
    ExpectStoreEquals(env.mm.get(), defs, ref);
    EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
  }
}

TEST(StreamedAdamBf16Moments, OtherMomentDtypeThanTheStoreIsRefusedAndChangesNothing) {
  MEMMGR_REQUIRE_BACKEND();
  for (MomentDType held : {MomentDType::kBF16, MomentDType::kF32}) {
    const MomentDType other = held == MomentDType::kBF16 ? MomentDType::kF32 : MomentDType::kBF16;
    SCOPED_TRACE(held == MomentDType::kBF16 ? "store holds bf16" : "store holds f32");
    StoreEnv env;
    env.Open(true, 8 * kChunk);
    StreamedAdamOptions so;
    so.moment_dtype = held;
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    const std::vector<Def> defs = {{"w", kChunk / 2 + 5}};
    std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
    ASSERT_OK(sa->MakeDurable().status());
    sa.reset();
    env.Close();

    env.Open(false, 8 * kChunk);
    const uint64_t gen = env.store->LatestGeneration().generation;
    StreamedAdamOptions wrong;
    wrong.moment_dtype = other;
    auto r = StreamedAdam::Create(env.store.get(), env.mm.get(), wrong);
    ASSERT_FALSE(r.ok());
    const std::string msg = r.status().ToString();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << msg;
    for (const std::string& want : {env.path(), std::string("'w'"), std::string("exp_avg"),
                                    std::string(held == MomentDType::kBF16 ? "bf16" : "f32"),
                                    std::string(other == MomentDType::kBF16 ? "bf16" : "f32")}) {
      EXPECT_NE(msg.find(want), std::string::npos) << "message lacks '" << want << "': " << msg;
    }
    EXPECT_EQ(env.store->LatestGeneration().generation, gen);
    // The right dtype still opens it, with the state intact.
    sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    auto main = ReadBytes(env.mm.get(), "w", "main", defs[0].numel, 4);
    EXPECT_EQ(std::memcmp(main.data(), ref[0].main.data(), main.size()), 0);
  }
}

TEST(StreamedAdamBf16Moments, BudgetBelowOneSliceAndUnsupportedDtypeAreRefused) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  env.Open(true, 3 * kChunk);
  StreamedAdamOptions so;
  so.moment_dtype = MomentDType::kBF16;
  auto r = StreamedAdam::Create(env.store.get(), env.mm.get(), so);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  so.moment_dtype = static_cast<MomentDType>(7);  // outside the table, as a bad integer from a C caller
  r = StreamedAdam::Create(env.store.get(), env.mm.get(), so);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
}

}  // namespace
}  // namespace optstate::memmgr
