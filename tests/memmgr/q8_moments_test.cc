// StreamedAdam with q8 moments (StreamedAdamOptions::moment_dtype = kQ8): a
// streamed run equals AdamStepCpuQ8 applied to whole, resident tensors bit
// for bit (on the cuda backend the reference is still the CPU kernel: the
// kernels are bit-identical), the store holds codes and absmax fields whose
// chunk c covers the same elements, a step moves ~6.03 bytes per param each
// way, and checkpoints round-trip every bit. The store's bytes are read back
// through a GenerationView, independently of the pipeline. Built into
// memmgr_test (host) and memmgr_gpu_test (cuda).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
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

// A q8 slice is kChunk elements (four main chunks, one codes chunk and one
// absmax chunk of each moment): a tensor over two slices whose numel is not a
// multiple of 256, a small one, and one of exactly one slice.
std::vector<Def> Defs() { return {{"a.weight", kChunk + 777}, {"b.bias", 1000}, {"c.weight", kChunk}}; }

struct HostParam {
  std::vector<float> main;
  std::vector<uint8_t> m, v;    // codes
  std::vector<float> ma, va;    // absmax per block
  std::vector<uint16_t> param;  // bf16 model copy
};



void ExpectStoreEquals(vfs::Store* store, const std::vector<Def>& defs, const std::vector<HostParam>& ref) {
  for (size_t k = 0; k < defs.size(); ++k) {
    const std::string& n = defs[k].name;
    ExpectBytes(FieldBytes(store, n, "main"), ref[k].main, n + "/main");
    ExpectBytes(FieldBytes(store, n, "exp_avg"), ref[k].m, n + "/exp_avg");
    ExpectBytes(FieldBytes(store, n, "exp_avg_sq"), ref[k].v, n + "/exp_avg_sq");
    ExpectBytes(FieldBytes(store, n, "exp_avg.absmax"), ref[k].ma, n + "/exp_avg.absmax");
    ExpectBytes(FieldBytes(store, n, "exp_avg_sq.absmax"), ref[k].va, n + "/exp_avg_sq.absmax");
  }
}

// Steps sa `steps` times with bf16 grads and bf16 param copies, and
// AdamStepCpuQ8 on the whole host tensors with the same grads.
void StepBoth(StreamedAdam* sa, MemoryManager* mm, const std::vector<Def>& defs, std::vector<HostParam>* ref,
              uint64_t first_step, uint64_t steps) {
  const ParamGroup g = TestGroup();
  for (uint64_t step = first_step; step < first_step + steps; ++step) {
    std::vector<std::unique_ptr<DeviceBuffer>> grads, params;
    std::vector<ParamGrad> list;
    for (size_t k = 0; k < defs.size(); ++k) {
      const uint64_t n = defs[k].numel;
      std::vector<uint16_t> gh(n);
      // Grads of magnitudes from 1e-4 to 1: blocks hold small and large moments.
      for (uint64_t i = 0; i < n; ++i) {
        const float scale = (i % 7 == 0) ? 1.0f : (i % 3 == 0 ? 1e-4f : 1e-2f);
        gh[i] = kernels::FloatToBf16(RandF(step * 31 + k, i) * scale);
      }
      grads.push_back(std::make_unique<DeviceBuffer>(mm, n * 2));
      grads.back()->Upload(gh.data());
      params.push_back(std::make_unique<DeviceBuffer>(mm, n * 2));
      list.push_back(ParamGrad{.name = defs[k].name, .d_grad = grads.back()->get(), .grad_type = DType::kBF16,
                               .d_param = params.back()->get(), .param_type = DType::kBF16, .numel = n});
      HostParam& h = (*ref)[k];
      kernels::AdamQ8Tensors t;
      t.main = h.main.data();
      t.exp_avg = h.m.data();
      t.exp_avg_sq = h.v.data();
      t.exp_avg_absmax = h.ma.data();
      t.exp_avg_sq_absmax = h.va.data();
      t.grad = gh.data();
      t.grad_type = DType::kBF16;
      t.param = h.param.data();
      t.param_type = DType::kBF16;
      kernels::AdamParams ap;
      ap.lr = g.lr;
      ap.weight_decay = g.weight_decay;
      ap.step = step;
      ASSERT_TRUE(kernels::AdamStepCpuQ8(t, n, ap, 1));
    }
    ASSERT_OK(sa->Step(list));
    for (size_t k = 0; k < defs.size(); ++k) {
      std::vector<uint16_t> got(defs[k].numel);
      params[k]->Download(got.data());
      EXPECT_EQ(got, (*ref)[k].param) << "param copy of " << defs[k].name << " at step " << step;
    }
  }
}

std::vector<HostParam> RegisterAll(StreamedAdam* sa, MemoryManager* mm, const std::vector<Def>& defs) {
  std::vector<HostParam> ref(defs.size());
  EXPECT_TRUE(sa->SetGroup(TestGroup()).ok());
  for (size_t k = 0; k < defs.size(); ++k) {
    const uint64_t n = defs[k].numel;
    HostParam& h = ref[k];
    h.main.resize(n);
    // A never-written chunk reads as zeros: codes 0 with absmax 0 decode to 0.
    h.m.assign(n, 0);
    h.v.assign(n, 0);
    h.ma.assign(Blocks(n), 0.0f);
    h.va.assign(Blocks(n), 0.0f);
    h.param.assign(n, 0);
    for (uint64_t i = 0; i < n; ++i) h.main[i] = RandF(1000 + k, i);
    DeviceBuffer init(mm, n * 4);
    init.Upload(h.main.data());
    Status s = sa->RegisterParam(defs[k].name, n, 0, init.get(), DType::kF32);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return ref;
}

// Bytes of one step each way: fp32 main, one byte per element of each
// moment, and one fp32 absmax per 256 elements of each moment.
uint64_t StepBytes(const std::vector<Def>& defs) {
  uint64_t b = 0;
  for (const Def& d : defs) b += 4 * d.numel + 2 * d.numel + 2 * 4 * Blocks(d.numel);
  return b;
}

StreamedAdamOptions Q8Options() {
  StreamedAdamOptions so;
  so.moment_dtype = MomentDType::kQ8;
  return so;
}

TEST(StreamedAdamQ8Moments, StepsUnderOneSliceBudgetEqualWholeTensorKernelBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  const uint64_t budget = 8 * kChunk;  // one q8 slice: 4 main chunks + codes and absmax chunk of each moment
  env.Open(true, budget);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
  const std::vector<Def> defs = Defs();
  std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
  StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 6);
  ASSERT_OK(sa->WaitForCommit());
  EXPECT_EQ(sa->last_step_stats().write_bytes, StepBytes(defs));
  EXPECT_EQ(sa->last_step_stats().read_bytes, StepBytes(defs));
  EXPECT_LE(env.mm->stats().peak_resident_bytes, budget);
  ExpectStoreEquals(env.store.get(), defs, ref);
  auto t = MUST(env.store->FindTensor("a.weight"));
  ASSERT_EQ(t.fields.size(), 5u);
  EXPECT_EQ(t.fields[1].dtype, DType::kQ8S);
  EXPECT_EQ(t.fields[2].dtype, DType::kQ8U);
  EXPECT_EQ(t.field_numel(3), Blocks(kChunk + 777));
  auto rep = MUST(env.store->Verify());
  EXPECT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaked slots" : rep.problems[0]);

  // Reopened with q8 moments, it continues exactly.
  sa.reset();
  env.Close();
  env.Open(false, budget);
  sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
  for (const Def& d : defs) ASSERT_OK(sa->RegisterParam(d.name, d.numel, 0, nullptr, std::nullopt));
  StepBoth(sa.get(), env.mm.get(), defs, &ref, 7, 2);
  ASSERT_OK(sa->WaitForCommit());
  ExpectStoreEquals(env.store.get(), defs, ref);
}

TEST(StreamedAdamQ8Moments, HostCacheTierStepsEqualWholeTensorKernelBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  for (uint64_t cache_mib : {64, 6}) {
    SCOPED_TRACE("host cache " + std::to_string(cache_mib) + " MiB");
    StoreEnv env;
    env.Open(true, 16 * kChunk, cache_mib << 20);
    StreamedAdamOptions so = Q8Options();
    so.durable_every_steps = 2;
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    const std::vector<Def> defs = Defs();
    std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
    StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 5);
    ASSERT_OK(sa->MakeDurable().status());
    ExpectStoreEquals(env.store.get(), defs, ref);
    EXPECT_EQ(env.store->LatestGeneration().step, 5u);
  }
}

// Prefetch reads each q8 slice's chunks by their own sizes (four main chunks,
// codes and absmax of each moment), into a tier holding all of the state,
// part of it, or staging; the step finds every prefetched byte and later
// steps (with the write tail in flight) keep every bit.
TEST(StreamedAdamQ8Moments, PrefetchAndTheWriteTailKeepEveryBit) {
  MEMMGR_REQUIRE_BACKEND();
  const std::vector<Def> defs = Defs();
  for (uint64_t cache_mib : {64, 6, 0}) {
    SCOPED_TRACE("host cache " + std::to_string(cache_mib) + " MiB");
    StoreEnv env;
    env.Open(true, 16 * kChunk, cache_mib << 20);
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
    std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
    StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 1);
    ASSERT_OK(sa->WaitForCommit());
    sa.reset();
    env.Close();

    env.Open(false, 16 * kChunk, cache_mib << 20);  // a cold tier
    sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
    for (const Def& d : defs) ASSERT_OK(sa->RegisterParam(d.name, d.numel, 0, nullptr, std::nullopt));
    ASSERT_OK(sa->Prefetch());
    ASSERT_OK(env.mm->Flush());  // waits for the prefetch to end
    StepBoth(sa.get(), env.mm.get(), defs, &ref, 2, 1);
    const StreamedAdam::StepStats& st = sa->last_step_stats();
    EXPECT_GT(st.prefetch_read_bytes, 0u);
    EXPECT_EQ(st.prefetch_hit_bytes, st.prefetch_read_bytes) << "the step found every prefetched byte";
    EXPECT_EQ(st.read_bytes, StepBytes(defs) - st.prefetch_hit_bytes);
    if (cache_mib == 64) {
      EXPECT_EQ(st.prefetch_hit_bytes, StepBytes(defs));
    }
    for (uint64_t step = 3; step <= 4; ++step) {
      ASSERT_OK(sa->Prefetch());  // with the previous commit (and its write tail) in flight
      StepBoth(sa.get(), env.mm.get(), defs, &ref, step, 1);
    }
    ASSERT_OK(sa->WaitForCommit());
    EXPECT_EQ(env.store->LatestGeneration().step, 4u);
    ExpectStoreEquals(env.store.get(), defs, ref);
    EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
  }
}

// Export (manifest q8s/q8u codes + f32 absmax fields, safetensors U8 and
// F32) and restore into a new store: the same bits, and the optimizer
// continues there exactly.
TEST(StreamedAdamQ8Moments, CheckpointRoundTripKeepsEveryBitAndResumes) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  env.Open(true, 8 * kChunk);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
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
    ASSERT_EQ(t.fields.size(), 5u);
    EXPECT_EQ(t.fields[1].dtype, DType::kQ8S) << t.name;
    EXPECT_EQ(t.fields[2].dtype, DType::kQ8U) << t.name;
    EXPECT_EQ(t.fields[1].scales, "exp_avg.absmax") << t.name;
    EXPECT_EQ(t.fields[1].block_size, 256u) << t.name;
    EXPECT_EQ(t.fields[1].bytes, t.numel) << t.name;
    EXPECT_EQ(t.fields[3].name, "exp_avg.absmax") << t.name;
    EXPECT_EQ(t.fields[3].numel, Blocks(t.numel)) << t.name;
    EXPECT_EQ(t.fields[3].chunk_bytes, kChunk / 64) << t.name;
  }
  std::ifstream st(ckpt + "/state.safetensors", std::ios::binary);
  uint64_t header_len = 0;
  st.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  st.read(header.data(), static_cast<std::streamsize>(header_len));
  EXPECT_NE(header.find("\"U8\""), std::string::npos) << header.substr(0, 300);
  const std::string absmax_entry = "\"a.weight/exp_avg.absmax\":{\"dtype\":\"F32\",\"shape\":[" +
                                   std::to_string(Blocks(kChunk + 777)) + "]";
  EXPECT_NE(header.find(absmax_entry), std::string::npos) << header.substr(0, 600);
  // The field files hold the store's bytes.
  std::ifstream codes(ckpt + "/tensors/a.weight/exp_avg", std::ios::binary);
  std::vector<uint8_t> file_codes((std::istreambuf_iterator<char>(codes)), std::istreambuf_iterator<char>());
  EXPECT_EQ(file_codes, ref[0].m);

  StoreEnv dst;
  auto restored = MUST(vfs::CreateStoreFromCheckpoint(ckpt, dst.path(), TestStoreOptions()));
  restored.reset();
  dst.Open(false, 8 * kChunk);
  ASSERT_TRUE(dst.store->Verify().ok());
  ExpectStoreEquals(dst.store.get(), defs, ref);
  auto sa2 = MUST(StreamedAdam::Create(dst.store.get(), dst.mm.get(), Q8Options()));
  for (const Def& d : defs) ASSERT_OK(sa2->RegisterParam(d.name, d.numel, 0, nullptr, std::nullopt));
  StepBoth(sa2.get(), dst.mm.get(), defs, &ref, 4, 2);
  ASSERT_OK(sa2->WaitForCommit());
  ExpectStoreEquals(dst.store.get(), defs, ref);
}

TEST(StreamedAdamQ8Moments, OtherMomentDtypeAndBudgetBelowOneSliceAreRefused) {
  MEMMGR_REQUIRE_BACKEND();
  {
    StoreEnv env;
    env.Open(true, 7 * kChunk);
    auto r = StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  }
  StoreEnv env;
  env.Open(true, 8 * kChunk);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
  const std::vector<Def> defs = {{"w", 3000}};
  std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
  StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 1);
  ASSERT_OK(sa->WaitForCommit());
  sa.reset();
  env.Close();
  env.Open(false, 8 * kChunk);
  const uint64_t gen = env.store->LatestGeneration().generation;
  for (MomentDType other : {MomentDType::kF32, MomentDType::kBF16}) {
    StreamedAdamOptions so;
    so.moment_dtype = other;
    auto r = StreamedAdam::Create(env.store.get(), env.mm.get(), so);
    ASSERT_FALSE(r.ok());
    const std::string msg = r.status().ToString();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << msg;
    for (const std::string& want : {env.path(), std::string("'w'"), std::string("exp_avg"), std::string("q8s")}) {
      EXPECT_NE(msg.find(want), std::string::npos) << "message lacks '" << want << "': " << msg;
    }
  }
  EXPECT_EQ(env.store->LatestGeneration().generation, gen);
  sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
  ExpectStoreEquals(env.store.get(), defs, ref);
}

// Pins map chunk c of a field at c whole pages. The codes of q8 moments fit
// that (chunks of the store's size), their scales do not (chunks of 1/64):
// a pin of a scales field is refused by name rather than mapping the wrong
// bytes, and the codes still pin as the store holds them.
TEST(StreamedAdamQ8Moments, PinsOfScaleFieldsAreRefusedAndCodesPinAsStored) {
  MEMMGR_REQUIRE_BACKEND();
  StoreEnv env;
  env.Open(true, 16 * kChunk);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), Q8Options()));
  const std::vector<Def> defs = {{"w", kChunk + 777}};
  std::vector<HostParam> ref = RegisterAll(sa.get(), env.mm.get(), defs);
  StepBoth(sa.get(), env.mm.get(), defs, &ref, 1, 2);
  ASSERT_OK(sa->MakeDurable().status());
  for (const char* field : {"exp_avg.absmax", "exp_avg_sq.absmax"}) {
    auto pin = env.mm->Pin("w", field, 0, 1, Access::kRead);
    ASSERT_FALSE(pin.ok()) << field;
    const std::string msg = pin.status().ToString();
    EXPECT_EQ(pin.status().code(), StatusCode::kInvalidArgument) << msg;
    for (const std::string& want : {env.path(), std::string("'w'"), std::string(field)}) {
      EXPECT_NE(msg.find(want), std::string::npos) << "message lacks '" << want << "': " << msg;
    }
  }
  const uint64_t n = defs[0].numel;
  auto pin = MUST(env.mm->Pin("w", "exp_avg", 0, n, Access::kRead));
  std::vector<uint8_t> codes(n);
  ASSERT_OK(env.mm->CopyToHost(codes.data(), pin.data(), n));
  EXPECT_EQ(codes, ref[0].m);
}

// The automatic staging pool holds enough slices of every moment dtype to
// fill both depth limits (queue_depth reads and write_queue_depth writes,
// counted in chunks' bytes) for a state with at least that many slices: a q8
// slice takes eight buffers (four of main, a codes and an absmax chunk of
// each moment) and moves six chunks' worth, so a pool sized for three-chunk
// f32 slices would leave the disk's queue part empty. (A smaller state gets
// a pool of its own size: reliability's ResourcesTest.)
TEST(StreamedAdamQ8Moments, AutomaticStagingFillsBothQueuesForEveryMomentDtype) {
  MEMMGR_REQUIRE_BACKEND();
  struct Case {
    MomentDType dtype;
    uint32_t slice_bytes_in_chunks;
    const char* name;
  };
  for (const Case& c : {Case{MomentDType::kF32, 3, "f32"}, Case{MomentDType::kBF16, 4, "bf16"},
                        Case{MomentDType::kQ8, 6, "q8"}}) {
    SCOPED_TRACE(std::string("moments ") + c.name);
    StoreEnv env;
    env.Open(true, 16 * kChunk);
    const MemoryManagerOptions& mo = env.mm->options();
    ASSERT_EQ(mo.staging_buffers, 0u);
    ASSERT_EQ(mo.read_ahead_chunks, 0u);
    StreamedAdamOptions so;
    so.moment_dtype = c.dtype;
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    ASSERT_OK(sa->SetGroup(TestGroup()));
    // As many whole slices as the plan stages at once (a slice is one chunk
    // of each moment: chunk / moment bytes elements).
    const uint64_t elems_per_slice =
        kChunk / (c.dtype == MomentDType::kF32 ? 4 : c.dtype == MomentDType::kBF16 ? 2 : 1);
    const uint64_t n = elems_per_slice * ((mo.queue_depth + mo.write_queue_depth) / c.slice_bytes_in_chunks + 4);
    std::vector<float> gh(n, 0.25f);
    DeviceBuffer grad(env.mm.get(), n * 4);
    grad.Upload(gh.data());
    ASSERT_OK(sa->RegisterParam("w", n, 0, nullptr, DType::kF32));
    const std::vector<ParamGrad> list = {
        ParamGrad{.name = "w", .d_grad = grad.get(), .grad_type = DType::kF32, .numel = n}};
    ASSERT_OK(sa->Step(list));
    ASSERT_OK(sa->WaitForCommit());
    const StreamedAdam::StepStats& st = sa->last_step_stats();
    EXPECT_GE(uint64_t{st.slices_in_flight} * c.slice_bytes_in_chunks, uint64_t{mo.queue_depth} + mo.write_queue_depth)
        << st.slices_in_flight << " staging sets of " << env.mm->stats().staging_buffers << " buffers";
    EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
  }
}

}  // namespace
}  // namespace optstate::memmgr
