// MemoryManager + StreamedAdam tests. Built twice: memmgr_test (host backend,
// label unit) and memmgr_gpu_test (cuda backend, label gpu, skips without a
// GPU). References are independent of the manager: plain arrays for pins, the
// Adam kernel on fully resident arrays for StreamedAdam.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <latch>
#include <limits>
#include <map>
#include <random>
#include <thread>

#include "memmgr_test_util.h"
#include "memmgr/internal/engine_memory.h"
#include "tests/common/kernel_failures.h"
#include "tests/common/sync_point_flag.h"
#include "vfs/fault_injection.h"
#include "base/sync_point.h"

namespace optstate::memmgr::testing {
namespace {

using test_util::SyncPointFlag;

// A step's I/O modes, set while a SyncPointFlag of the point lives (the step's
// pipeline is set from the point's bool; memmgr/streamed_adam_step.cc).
constexpr const char* kHoldCompletions = "streamed_adam.hold_completions";
constexpr const char* kReapOnlyWhenBlocked = "streamed_adam.reap_only_when_blocked";

#define REQUIRE_SYNC_POINTS()                                                               \
  do {                                                                                      \
    if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS"; \
  } while (0)

struct Env {
  TempDir dir;
  std::unique_ptr<vfs::Store> store;
  std::unique_ptr<MemoryManager> mm;
  uint32_t read_ahead_chunks = 0;  // MemoryManagerOptions::read_ahead_chunks of the next Open

  void Open(uint64_t budget, bool create, uint64_t host_cache_bytes = 0, bool huge_page_staging = false,
            uint32_t hash_threads = MemoryManagerOptions::kAutoHashThreads, vfs::FileSystem* fs = nullptr) {
    std::string p = dir.path() + "/store";
    vfs::StoreOptions so = TestStoreOptions();
    so.fs = fs;
    if (create) {
      store = MUST(vfs::Store::Create(p, so));
    } else {
      store = MUST(vfs::Store::Open(p, so));
    }
    MemoryManagerOptions o = TestMmOptions(budget);
    o.host_cache_bytes = host_cache_bytes;
    o.staging_pages = huge_page_staging ? MemoryManagerOptions::StagingPages::kHuge
                                        : MemoryManagerOptions::StagingPages::kBase;
    o.hash_threads = hash_threads;
    o.read_ahead_chunks = read_ahead_chunks;
    o.staging_buffers = read_ahead_chunks == 0 ? 0 : 3 * read_ahead_chunks + 4;
    mm = MUST(MemoryManager::Create(store.get(), o));
  }
  void Close() {
    mm.reset();
    store.reset();
  }
};

// ------------------------------------------------------------------ pin/unpin

TEST(MemoryManager, PinWriteReadBackAfterEvictionAndReopen) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(2 * kChunk, true);
  EXPECT_EQ(env.mm->backend(), kTestBackend);
  const uint64_t numel = 3 * kChunk / 4 + 12345;  // 4 chunks, last partial
  vfs::TensorSpec spec;
  spec.name = "layer.0/weight";
  spec.numel = numel;
  MUST(env.store->CreateTensor(spec));

  std::vector<float> ref(numel, 0.0f);
  // Write a pattern through pins that straddle chunk boundaries.
  const uint64_t step = kChunk / 4 / 3 + 7;
  for (uint64_t first = 0; first < numel; first += step) {
    uint64_t n = std::min(step, numel - first);
    std::vector<float> vals(n);
    for (uint64_t i = 0; i < n; ++i) vals[i] = RandF(1, first + i);
    auto pin = MUST(env.mm->Pin(spec.name, "exp_avg", first, n, Access::kReadWrite));
    ASSERT_EQ(pin.size_bytes(), n * 4);
    ASSERT_OK(env.mm->CopyToDevice(pin.data(), vals.data(), n * 4));
    std::copy(vals.begin(), vals.end(), ref.begin() + static_cast<long>(first));
  }
  // Never-written field reads as zeros.
  EXPECT_EQ(ReadField(env.mm.get(), spec.name, "main", numel), std::vector<float>(numel, 0.0f));
  // The budget holds 2 of the 4 chunks: reading everything back evicts.
  EXPECT_EQ(ReadField(env.mm.get(), spec.name, "exp_avg", numel), ref);
  MemoryStats st = env.mm->stats();
  EXPECT_LE(st.peak_resident_bytes, 2 * kChunk);
  EXPECT_GT(st.evictions, 0u);
  EXPECT_GT(st.nvme_write_bytes, 0u);

  ASSERT_OK(env.mm->Flush());
  MUST(env.store->Commit(vfs::CommitInfo{}));
  env.Close();
  env.Open(2 * kChunk, false);
  EXPECT_EQ(ReadField(env.mm.get(), spec.name, "exp_avg", numel), ref);
  EXPECT_EQ(ReadField(env.mm.get(), spec.name, "exp_avg_sq", numel), std::vector<float>(numel, 0.0f));
}

TEST(MemoryManager, WriteOnlyPinKeepsNeighbours) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(2 * kChunk, true);
  const uint64_t numel = kChunk / 4 * 2;
  vfs::TensorSpec spec;
  spec.name = "t";
  spec.numel = numel;
  MUST(env.store->CreateTensor(spec));
  std::vector<float> ref(numel);
  for (uint64_t i = 0; i < numel; ++i) ref[i] = RandF(7, i);
  {
    auto pin = MUST(env.mm->Pin("t", "main", 0, numel, Access::kWrite));
    ASSERT_OK(env.mm->CopyToDevice(pin.data(), ref.data(), numel * 4));
  }
  ASSERT_OK(env.mm->ReleaseAll());
  EXPECT_EQ(env.mm->stats().resident_bytes, 0u);
  // A kWrite pin of part of a chunk must still load the rest of it.
  {
    auto pin = MUST(env.mm->Pin("t", "main", 100, 50, Access::kWrite));
    std::vector<float> v(50, 42.0f);
    ASSERT_OK(env.mm->CopyToDevice(pin.data(), v.data(), 200));
    std::fill(ref.begin() + 100, ref.begin() + 150, 42.0f);
  }
  ASSERT_OK(env.mm->ReleaseAll());
  EXPECT_EQ(ReadField(env.mm.get(), "t", "main", numel), ref);
}

TEST(MemoryManager, ClearErrors) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(2 * kChunk, true);
  vfs::TensorSpec spec;
  spec.name = "t";
  spec.numel = kChunk;  // 4 chunks per field
  MUST(env.store->CreateTensor(spec));
  auto unknown = env.mm->Pin("nope", "main", 0, 1, Access::kRead);
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound) << unknown.status().ToString();
  auto bad_field = env.mm->Pin("t", "nofield", 0, 1, Access::kRead);
  EXPECT_FALSE(bad_field.ok());
  auto out_of_range = env.mm->Pin("t", "main", kChunk - 1, 2, Access::kRead);
  EXPECT_EQ(out_of_range.status().code(), StatusCode::kInvalidArgument);
  auto too_big = env.mm->Pin("t", "main", 0, kChunk, Access::kRead);  // 4 chunks > 2-chunk budget
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("budget"), std::string::npos) << too_big.status().ToString();
  // ReleaseAll refuses while pinned.
  auto pin = MUST(env.mm->Pin("t", "main", 0, 10, Access::kRead));
  EXPECT_EQ(env.mm->ReleaseAll().code(), StatusCode::kFailedPrecondition);
  ASSERT_OK(pin.Unpin());
  ASSERT_OK(env.mm->ReleaseAll());
  // A budget below one chunk fails at Create.
  auto small = MemoryManager::Create(env.store.get(), TestMmOptions(kChunk / 2));
  EXPECT_EQ(small.status().code(), StatusCode::kResourceExhausted);
}

// Two threads that grow an automatic staging pool to the same total at once
// (a pin's load and the worker's write-back both do) leave it at that total:
// each counts the pool before either adds to it, and the second must not add
// its buffers on top of the first's.
TEST(MemoryManager, ConcurrentGrowStagingStopsAtTheTotal) {
  MEMMGR_REQUIRE_BACKEND();
  REQUIRE_SYNC_POINTS();
  Env e;
  e.Open(8 * kChunk, true);  // staging_buffers 0: an automatic pool
  internal::EngineMemory* em = internal::EngineMemoryOf(*e.mm);
  const size_t initial = em->staging_count();
  const size_t total = initial + 3;
  std::latch both_allocated(2);
  SyncPoint* sp = SyncPoint::Get();
  sp->SetCallBack("memmgr.grow_staging.allocated", [&](void*) { both_allocated.arrive_and_wait(); });
  sp->EnableProcessing();
  std::thread a([&] { em->GrowStaging(total); });
  std::thread b([&] { em->GrowStaging(total); });
  a.join();
  b.join();
  sp->Reset();
  EXPECT_EQ(em->staging_count(), total);
  EXPECT_EQ(e.mm->stats().staging_buffers, total);
  // Every buffer of the pool can be taken, and they are distinct.
  std::vector<void*> bufs = em->AcquireStaging(total, total);
  ASSERT_EQ(bufs.size(), total);
  std::sort(bufs.begin(), bufs.end());
  EXPECT_EQ(std::unique(bufs.begin(), bufs.end()), bufs.end());
  em->ReleaseStaging(bufs);
}

TEST(MemoryManager, ConcurrentRandomPinsNeverExceedBudgetNorCorrupt) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  const uint64_t budget = 6 * kChunk;
  env.Open(budget, true);
  const int kThreads = 4;
  const uint64_t numel = 5 * kChunk / 4 + 333;  // ~10 chunks per tensor
  const std::vector<std::string> names = {"a", "b"};
  for (const auto& n : names) {
    vfs::TensorSpec spec;
    spec.name = n;
    spec.numel = numel;
    MUST(env.store->CreateTensor(spec));
  }
  // Element blocks are owned by threads round-robin (block not chunk aligned,
  // so threads share chunks); each thread checks and writes only its blocks.
  const uint64_t kBlock = 100003;
  auto owner = [&](uint64_t e) { return static_cast<int>((e / kBlock) % kThreads); };
  std::map<std::string, std::vector<float>> ref;
  for (const auto& n : names) ref[n] = std::vector<float>(numel, 0.0f);

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> max_seen{0};
  std::thread monitor([&] {
    while (!stop) {
      uint64_t r = env.mm->stats().resident_bytes;
      uint64_t m = max_seen.load();
      while (r > m && !max_seen.compare_exchange_weak(m, r)) {
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::atomic<int> failures{0};
  auto worker = [&](int t) {
    std::mt19937_64 rng(1000 + t);
    for (int op = 0; op < 60; ++op) {
      const std::string& name = names[rng() % names.size()];
      // A block this thread owns, and a sub-range of it.
      uint64_t nblocks = (numel + kBlock - 1) / kBlock;
      uint64_t b = (rng() % ((nblocks + kThreads - 1) / kThreads)) * kThreads + t;
      if (b >= nblocks) b = t;
      uint64_t lo = b * kBlock, hi = std::min(numel, lo + kBlock);
      if (lo >= hi) continue;
      uint64_t first = lo + rng() % (hi - lo);
      uint64_t count = 1 + rng() % (hi - first);
      int kind = static_cast<int>(rng() % 4);
      if (kind == 0) {
        if (!env.mm->Prefetch(name, "main", first, count).ok()) ++failures;
        continue;
      }
      Access acc = kind == 1 ? Access::kRead : Access::kReadWrite;
      auto pin = env.mm->Pin(name, "main", first, count, acc);
      if (!pin.ok()) {
        ADD_FAILURE() << pin.status().ToString();
        ++failures;
        continue;
      }
      std::vector<float> got(count);
      if (!env.mm->CopyToHost(got.data(), pin->data(), count * 4).ok()) ++failures;
      std::vector<float>& r = ref[name];
      for (uint64_t i = 0; i < count; ++i) {
        if (owner(first + i) != t) continue;
        if (got[i] != r[first + i]) {
          ++failures;
          ADD_FAILURE() << "thread " << t << " " << name << "[" << first + i << "] = " << got[i] << " want "
                        << r[first + i];
          break;
        }
      }
      if (acc == Access::kReadWrite) {
        for (uint64_t i = 0; i < count; ++i) {
          if (owner(first + i) != t) continue;
          got[i] = RandF(op * 131 + t, first + i);
          r[first + i] = got[i];
        }
        if (!env.mm->CopyToDevice(pin->data(), got.data(), count * 4).ok()) ++failures;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  stop = true;
  monitor.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(max_seen.load(), budget);
  EXPECT_LE(env.mm->stats().peak_resident_bytes, budget);
  ASSERT_OK(env.mm->Flush());
  for (const auto& n : names) EXPECT_EQ(ReadField(env.mm.get(), n, "main", numel), ref[n]) << n;
  ASSERT_OK(env.mm->ReleaseAll());
  for (const auto& n : names) EXPECT_EQ(ReadField(env.mm.get(), n, "main", numel), ref[n]) << n;
}

// ---------------------------------------------------------------- StreamedAdam

struct ParamDef {
  std::string name;
  uint64_t numel;
  uint32_t group;
  DType init_type;
  DType grad_type;
  std::optional<DType> param_type;
};

uint32_t Size(std::optional<DType> t) { return !t ? 0 : *t == DType::kF32 ? 4 : 2; }

void Encode(const std::vector<float>& src, DType t, std::vector<uint8_t>* out) {
  out->resize(src.size() * Size(t));
  for (size_t i = 0; i < src.size(); ++i) {
    if (t == DType::kF32) {
      std::memcpy(out->data() + 4 * i, &src[i], 4);
    } else {
      uint16_t h = t == DType::kBF16 ? kernels::FloatToBf16(src[i]) : kernels::FloatToHalf(src[i]);
      std::memcpy(out->data() + 2 * i, &h, 2);
    }
  }
}

float Decode(const std::vector<uint8_t>& b, DType t, size_t i) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, b.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, b.data() + 2 * i, 2);
  return t == DType::kBF16 ? kernels::Bf16ToFloat(h) : kernels::HalfToFloat(h);
}

std::vector<ParamGroup> TestGroups() {
  ParamGroup g0;
  g0.id = 0;
  g0.lr = 1e-2;
  g0.weight_decay = 0.01;
  g0.adamw = true;
  ParamGroup g1;
  g1.id = 1;
  g1.lr = 3e-3;
  g1.beta1 = 0.8;
  g1.beta2 = 0.99;
  g1.eps = 1e-6;
  g1.weight_decay = 0.05;
  g1.adamw = false;
  return {g0, g1};
}

// The independent run: the kernel over fully resident arrays.
class Reference {
 public:
  Reference(MemoryManager* mm, const std::vector<ParamDef>& defs) : mm_(mm), defs_(defs) {
    for (const auto& d : defs) {
      P p;
      std::vector<float> init = Init(d);
      std::vector<uint8_t> enc;
      Encode(init, d.init_type, &enc);
      for (size_t i = 0; i < init.size(); ++i) init[i] = Decode(enc, d.init_type, i);
      p.main = std::make_unique<DeviceBuffer>(mm, d.numel * 4);
      p.m = std::make_unique<DeviceBuffer>(mm, d.numel * 4);
      p.v = std::make_unique<DeviceBuffer>(mm, d.numel * 4);
      p.main->Upload(init.data());
      std::vector<float> z(d.numel, 0.0f);
      p.m->Upload(z.data());
      p.v->Upload(z.data());
      if (d.param_type.has_value()) p.param = std::make_unique<DeviceBuffer>(mm, d.numel * Size(d.param_type));
      params_.push_back(std::move(p));
    }
  }
  static std::vector<float> Init(const ParamDef& d) {
    std::vector<float> v(d.numel);
    for (uint64_t i = 0; i < d.numel; ++i) v[i] = RandF(std::hash<std::string>()(d.name), i);
    return v;
  }
  void Step(size_t i, const void* d_grad, uint64_t step, const ParamGroup& g, float grad_scale) {
    const ParamDef& d = defs_[i];
    P& p = params_[i];
    kernels::AdamTensors t;
    t.main = static_cast<float*>(p.main->get());
    t.exp_avg = p.m->get();
    t.exp_avg_sq = p.v->get();
    t.grad = d_grad;
    t.grad_type = d.grad_type;
    t.param = p.param ? p.param->get() : nullptr;
    t.param_type = d.param_type;
    kernels::AdamParams ap = AdamParamsOf(g, step);
    ap.grad_scale = grad_scale;
    if (mm_->backend() == Backend::kCuda) {
      ASSERT_EQ(kernels::AdamStepCuda(t, d.numel, ap, nullptr), 0);
    } else {
      ASSERT_TRUE(kernels::AdamStepCpu(t, d.numel, ap, 1));
    }
  }
  std::vector<float> Field(size_t i, int f) const {
    std::vector<float> out(defs_[i].numel);
    const DeviceBuffer* b = f == 0 ? params_[i].main.get() : f == 1 ? params_[i].m.get() : params_[i].v.get();
    b->Download(out.data());
    return out;
  }
  std::vector<uint8_t> ParamCopy(size_t i) const {
    std::vector<uint8_t> out(defs_[i].numel * Size(defs_[i].param_type));
    if (params_[i].param) params_[i].param->Download(out.data());
    return out;
  }

 private:
  struct P {
    std::unique_ptr<DeviceBuffer> main, m, v, param;
  };
  MemoryManager* mm_;
  std::vector<ParamDef> defs_;
  std::vector<P> params_;
};

// Grads for one step, uploaded once and shared by the streamed run and the reference.
struct StepGrads {
  std::vector<std::unique_ptr<DeviceBuffer>> grad, param;
  // scale: the gradients are the step's gradients times scale (loss scaling).
  StepGrads(MemoryManager* mm, const std::vector<ParamDef>& defs, uint64_t step, float scale = 1.0f) {
    for (const auto& d : defs) {
      // A per-param random base, rotated per step (cheap under ASan, still
      // different every step).
      static std::map<std::string, std::vector<float>> bases;
      auto& base = bases[d.name + "/" + std::to_string(d.numel)];
      if (base.size() != d.numel) {
        base.resize(d.numel);
        for (uint64_t i = 0; i < d.numel; ++i) base[i] = RandF(d.numel, i) * 4.0f;
      }
      std::vector<float> g(d.numel);
      uint64_t rot = (step * 7919) % d.numel;
      std::copy(base.begin() + static_cast<long>(rot), base.end(), g.begin());
      std::copy(base.begin(), base.begin() + static_cast<long>(rot), g.begin() + static_cast<long>(d.numel - rot));
      for (float& x : g) x *= scale;
      std::vector<uint8_t> enc;
      Encode(g, d.grad_type, &enc);
      grad.push_back(std::make_unique<DeviceBuffer>(mm, enc.size()));
      grad.back()->Upload(enc.data());
      param.push_back(!d.param_type ? nullptr : std::make_unique<DeviceBuffer>(mm, d.numel * Size(d.param_type)));
    }
  }
  std::vector<ParamGrad> List(const std::vector<ParamDef>& defs) const {
    std::vector<ParamGrad> out;
    for (size_t i = 0; i < defs.size(); ++i) {
      ParamGrad pg;
      pg.name = defs[i].name;
      pg.d_grad = grad[i]->get();
      pg.grad_type = defs[i].grad_type;
      pg.d_param = param[i] ? param[i]->get() : nullptr;
      pg.param_type = defs[i].param_type;
      out.push_back(pg);
    }
    return out;
  }
};

void RegisterAll(StreamedAdam* sa, MemoryManager* mm, const std::vector<ParamDef>& defs) {
  for (const auto& g : TestGroups()) ASSERT_OK(sa->SetGroup(g));
  for (const auto& d : defs) {
    std::vector<float> init = Reference::Init(d);
    std::vector<uint8_t> enc;
    Encode(init, d.init_type, &enc);
    DeviceBuffer buf(mm, enc.size());
    buf.Upload(enc.data());
    ASSERT_OK(sa->RegisterParam(d.name, d.numel, d.group, buf.get(), d.init_type));
  }
}

// One step of sa and of the reference, with the same gradients (returned:
// they hold the parameter copies sa wrote).
std::unique_ptr<StepGrads> StepWithReference(StreamedAdam* sa, MemoryManager* mm, const std::vector<ParamDef>& defs,
                                             Reference* ref, uint64_t step, float grad_scale) {
  auto sg = std::make_unique<StepGrads>(mm, defs, step);
  auto list = sg->List(defs);
  Status st = sa->Step(list);
  EXPECT_TRUE(st.ok()) << "step " << step << ": " << st.ToString();
  auto groups = TestGroups();
  for (size_t i = 0; i < defs.size(); ++i) ref->Step(i, sg->grad[i]->get(), step, groups[defs[i].group], grad_scale);
  return sg;
}

void ExpectStateEquals(MemoryManager* mm, const Reference& ref, const std::vector<ParamDef>& defs) {
  static const char* kFields[] = {"main", "exp_avg", "exp_avg_sq"};
  for (size_t i = 0; i < defs.size(); ++i) {
    for (int f = 0; f < 3; ++f) {
      std::vector<float> got = ReadField(mm, defs[i].name, kFields[f], defs[i].numel);
      std::vector<float> want = ref.Field(i, f);
      ASSERT_EQ(got.size(), want.size());
      // Bit-for-bit (memcmp: NaN-safe and -0 vs +0 sensitive).
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << defs[i].name << "/" << kFields[f];
    }
  }
}

std::vector<ParamDef> BigMix() {
  const uint64_t ce = kChunk / 4;  // elements per chunk
  return {
      {"embed.weight", 9 * ce + 1234, 0, DType::kBF16, DType::kBF16, DType::kBF16},
      {"layers.0.attn.qkv", 7 * ce, 0, DType::kF32, DType::kF32, DType::kF32},
      {"layers.0.norm", 1000, 1, DType::kF32, DType::kF32, std::nullopt},
      {"layers.0.mlp.up", 20 * ce + 17, 1, DType::kF16, DType::kF16, DType::kF16},
      {"layers.0.mlp.down", 14 * ce - 5, 0, DType::kBF16, DType::kF32, DType::kBF16},
      {"head.bias", ce, 1, DType::kF32, DType::kBF16, DType::kF32},
  };
}

uint64_t StateBytes(const std::vector<ParamDef>& defs) {
  uint64_t b = 0;
  for (const auto& d : defs) b += d.numel * 12;
  return b;
}

// Ten steps through a one-slice budget; staging in base or huge pages;
// chunks hashed by the pipeline's thread or by hash_threads of their own.
void TenStepsUnderTinyBudget(bool huge_page_staging, uint32_t hash_threads = 0) {
  Env env;
  const uint64_t budget = 3 * kChunk;  // one slice
  env.Open(budget, true, 0, huge_page_staging, hash_threads);
  std::vector<ParamDef> defs = BigMix();
  ASSERT_GE(StateBytes(defs), 50 * budget) << "state must be >= 50x the budget";
  StreamedAdamOptions so;
  so.grad_scale = 2.0f;
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  for (uint64_t step = 1; step <= 10; ++step) {
    auto sg = StepWithReference(sa.get(), env.mm.get(), defs, &ref, step, so.grad_scale);
    EXPECT_FALSE(sa->last_step_skipped());
    for (size_t i = 0; i < defs.size(); ++i) {
      if (!defs[i].param_type) continue;
      std::vector<uint8_t> got(defs[i].numel * Size(defs[i].param_type));
      sg->param[i]->Download(got.data());
      EXPECT_EQ(got, ref.ParamCopy(i)) << "param copy of " << defs[i].name << " at step " << step;
    }
    EXPECT_EQ(sa->step_count(0), step);
    EXPECT_EQ(sa->step_count(1), step);
    ASSERT_OK(sa->WaitForCommit());  // the step's commit may still run (commit_lag_steps 1)
    EXPECT_EQ(env.store->LatestGeneration().step, step);
    // The norm and the short last chunks of embed and mlp.up go through
    // small staging sets; bytes in flight stay within the depths.
    const StreamedAdam::StepStats& st = sa->last_step_stats();
    EXPECT_GT(st.small_sets, 0u);
    EXPECT_EQ(st.small_slices, 3u);
    EXPECT_LE(st.peak_read_bytes_in_flight, MemoryManagerOptions{}.queue_depth * kChunk);
    EXPECT_LE(st.peak_write_bytes_in_flight, MemoryManagerOptions{}.write_queue_depth * kChunk);
    EXPECT_GT(st.peak_read_bytes_in_flight, 0u);
    if (step % 4 == 0) {
      ASSERT_OK(env.mm->ReleaseAll());  // sleep between steps changes nothing
      EXPECT_EQ(env.mm->stats().resident_bytes, 0u);
    }
    EXPECT_LE(env.mm->stats().peak_resident_bytes, budget);
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
  MemoryStats st = env.mm->stats();
  EXPECT_LE(st.peak_resident_bytes, budget);
  EXPECT_GE(st.nvme_write_bytes, 10 * StateBytes(defs));
  // Groups and hyperparameters are persisted with the generation.
  vfs::GenerationInfo gen = env.store->LatestGeneration();
  ASSERT_EQ(gen.groups.size(), 2u);
  EXPECT_EQ(gen.groups[1].step_count, 10u);
  EXPECT_DOUBLE_EQ(gen.groups[1].hyper.at("lr"), 3e-3);
  EXPECT_DOUBLE_EQ(gen.groups[1].hyper.at("adamw"), 0.0);
  // Every published checksum is that of the bytes on disk (the hashers hash
  // a written chunk while its write is in flight).
  auto rep = MUST(env.store->Verify());
  EXPECT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaked slots" : rep.problems[0]);
  EXPECT_GT(rep.chunks_checked, 3 * defs.size());
}

TEST(StreamedAdam, TenStepsUnderTinyBudgetEqualResidentKernelBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  TenStepsUnderTinyBudget(false);
}

// MemoryManagerOptions::staging_pages kHuge: the same results from staging in
// 2 MiB pages (cuda: cudaHostRegister'd instead of cudaHostAlloc'd).
TEST(StreamedAdam, HugePageStagingStepsEqualResidentKernelBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  TenStepsUnderTinyBudget(true);
}

// MemoryManagerOptions::hash_threads: the chunks' checksums and read
// verification on threads of their own give the same state, bit for bit, and
// checksums that match the disk.
TEST(StreamedAdam, HashThreadsStepsEqualResidentKernelBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  TenStepsUnderTinyBudget(false, 3);
}

// A trainer's mix alternates small tensors (norms, biases) with big ones. The
// pipeline's depths count bytes and small slices go through small staging
// sets, so a step's first pass fills the read depth with the big slices'
// bytes. (With depths counted in requests every small slice took a big set
// and three of the depth's requests: half the depth moved KiB and the disk's
// queue ran half empty.) Checked by what the depth admits, with completions
// held until the step drains (so the disk's speed does not matter), and the
// state against the resident kernel, bit for bit.
TEST(StreamedAdam, ReadDepthHoldsBytesWhenSmallTensorsInterleave) {
  MEMMGR_REQUIRE_BACKEND();
  REQUIRE_SYNC_POINTS();
  Env env;
  env.Open(3 * kChunk, true);
  const uint64_t ce = kChunk / 4;
  std::vector<ParamDef> defs;
  for (int l = 0; l < 16; ++l) {
    defs.push_back({"l" + std::to_string(100 + l) + ".norm", 1024, 0, DType::kF32, DType::kF32,
                    std::nullopt});
    defs.push_back({"l" + std::to_string(100 + l) + ".w", ce, 0, DType::kF32, DType::kF32,
                    DType::kF32});
  }
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  SyncPointFlag hold(kHoldCompletions);
  const uint64_t depth = TestMmOptions(0).queue_depth * kChunk;  // bytes the read depth allows
  // What a depth counted in bytes admits: slices in order while their bytes
  // fit (10 of the 16 big slices, 3 chunks each, and the 11 small ones
  // before the 11th big one). Counted in requests, 32 of them held at most
  // ~5 big slices here: 16 chunks.
  uint64_t admitted = 0;
  for (const auto& d : defs) {
    if (admitted + 3 * d.numel * 4 > depth) break;
    admitted += 3 * d.numel * 4;
  }
  ASSERT_GE(admitted, 30 * kChunk);
  for (uint64_t step = 1; step <= 3; ++step) {
    StepWithReference(sa.get(), env.mm.get(), defs, &ref, step, 1.0f);
    const StreamedAdam::StepStats& st = sa->last_step_stats();
    EXPECT_EQ(st.small_slices, 16u) << "step " << step;
    EXPECT_LE(st.peak_read_bytes_in_flight, depth) << "step " << step;
    // The first pass (StepParam, nothing reaped) admits exactly `admitted`;
    // the drain may top the depth up further as completions free bytes.
    EXPECT_GE(st.peak_read_bytes_in_flight, admitted) << "step " << step;
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
}

std::vector<ParamDef> SmallMix() {
  const uint64_t ce = kChunk / 4;
  return {
      {"w1", 3 * ce + 99, 0, DType::kF32, DType::kBF16, DType::kBF16},
      {"w2", 2 * ce, 1, DType::kBF16, DType::kF32, DType::kF32},
      {"b", 777, 1, DType::kF32, DType::kF32, std::nullopt},
  };
}

TEST(StreamedAdam, ReopenAfterStepKAndContinueEqualsUninterruptedRun) {
  MEMMGR_REQUIRE_BACKEND();
  // The reference and the gradients live in a scratch manager's memory that
  // outlives the reopened store's manager.
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  std::vector<ParamDef> defs = SmallMix();
  Reference ref(smm, defs);
  auto groups = TestGroups();
  std::vector<std::unique_ptr<StepGrads>> grads;
  for (uint64_t step = 1; step <= 6; ++step) {
    grads.push_back(std::make_unique<StepGrads>(smm, defs, step));
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, grads.back()->grad[i]->get(), step, groups[defs[i].group], 1.0f);
  }
  Env env;
  const uint64_t budget = 6 * kChunk;
  env.Open(budget, true);
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    RegisterAll(sa.get(), env.mm.get(), defs);
    for (uint64_t step = 1; step <= 3; ++step) {
      auto list = grads[step - 1]->List(defs);
      ASSERT_OK(sa->Step(list));
    }
  }
  env.Close();
  env.Open(budget, false);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  EXPECT_EQ(sa->step_count(0), 3u);
  EXPECT_EQ(sa->step_count(1), 3u);
  EXPECT_EQ(sa->global_step(), 3u);
  EXPECT_EQ(sa->ParamNames().size(), defs.size());
  auto g1 = MUST(sa->GetGroup(1));
  EXPECT_DOUBLE_EQ(g1.beta1, 0.8);
  EXPECT_FALSE(g1.adamw);
  // Registering again with the same geometry keeps the stored state; with another numel is an error.
  for (const auto& d : defs) ASSERT_OK(sa->RegisterParam(d.name, d.numel, d.group, nullptr, d.init_type));
  auto bad = sa->RegisterParam("w1", defs[0].numel + 1, 0, nullptr, DType::kF32);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("w1"), std::string::npos);
  for (uint64_t step = 4; step <= 6; ++step) {
    auto list = grads[step - 1]->List(defs);
    ASSERT_OK(sa->Step(list));
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
}

TEST(StreamedAdam, FoundInfAndKernelFailureCommitNothing) {
  MEMMGR_REQUIRE_BACKEND();
  test_util::KernelFailures kernel_failures;
  Env env;
  env.Open(6 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  auto groups = TestGroups();
  StepGrads sg1(env.mm.get(), defs, 1);
  ASSERT_OK(sa->Step(sg1.List(defs)));
  ASSERT_OK(sa->WaitForCommit());  // the step's commit may run in the background (commit_lag_steps 1)
  for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, sg1.grad[i]->get(), 1, groups[defs[i].group], 1.0f);
  const uint64_t gen1 = env.store->LatestGeneration().generation;

  // found-inf set: skipped, nothing committed, counts unchanged.
  DeviceBuffer flag(env.mm.get(), 4);
  float one = 1.0f, zero = 0.0f;
  flag.Upload(&one);
  StepGrads sg2(env.mm.get(), defs, 2);
  ASSERT_OK(sa->Step(sg2.List(defs), static_cast<const float*>(flag.get())));
  EXPECT_TRUE(sa->last_step_skipped());
  EXPECT_EQ(env.store->LatestGeneration().generation, gen1);
  EXPECT_EQ(sa->step_count(0), 1u);
  ExpectStateEquals(env.mm.get(), ref, defs);

  // Incremental form, flag raised after BeginStep: dropped as a whole.
  flag.Upload(&zero);
  ASSERT_OK(sa->BeginStep(static_cast<const float*>(flag.get())));
  flag.Upload(&one);
  for (const auto& g : sg2.List(defs)) ASSERT_OK(sa->StepParam(g));
  auto gen = sa->EndStep();
  ASSERT_TRUE(gen.ok()) << gen.status().ToString();
  EXPECT_EQ(*gen, gen1);
  EXPECT_TRUE(sa->last_step_skipped());
  EXPECT_EQ(env.store->LatestGeneration().generation, gen1);
  ExpectStateEquals(env.mm.get(), ref, defs);

  // A device error mid-step (injected): error returned, nothing committed.
  if (!test_util::KernelFailures::Available()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
  kernel_failures.FailAfter(3);
  Status st = sa->Step(sg2.List(defs));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("injected"), std::string::npos) << st.ToString();
  EXPECT_EQ(env.store->LatestGeneration().generation, gen1);
  EXPECT_EQ(sa->step_count(0), 1u);
  ExpectStateEquals(env.mm.get(), ref, defs);

  // And the next real step still equals the reference.
  flag.Upload(&zero);
  ASSERT_OK(sa->Step(sg2.List(defs), static_cast<const float*>(flag.get())));
  EXPECT_FALSE(sa->last_step_skipped());
  for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, sg2.grad[i]->get(), 2, groups[defs[i].group], 1.0f);
  ExpectStateEquals(env.mm.get(), ref, defs);
  EXPECT_EQ(env.store->LatestGeneration().step, 2u);
}

TEST(StreamedAdam, IncrementalFormEqualsStep) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(9 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  auto groups = TestGroups();
  for (uint64_t step = 1; step <= 3; ++step) {
    StepGrads sg(env.mm.get(), defs, step);
    ASSERT_OK(sa->BeginStep());
    // Reverse order: the pipeline does not depend on registration order.
    auto list = sg.List(defs);
    for (auto it = list.rbegin(); it != list.rend(); ++it) ASSERT_OK(sa->StepParam(*it));
    auto gen = sa->EndStep();
    ASSERT_TRUE(gen.ok()) << gen.status().ToString();
    ASSERT_OK(sa->WaitForCommit());  // EndStep names the generation its commit publishes
    EXPECT_EQ(*gen, sa->last_generation());
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, sg.grad[i]->get(), step, groups[defs[i].group], 1.0f);
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
}

TEST(StreamedAdam, MissingGradKeepsStateAndPinsSeeStepResults) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(6 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  auto groups = TestGroups();
  StepGrads sg(env.mm.get(), defs, 1);
  auto list = sg.List(defs);
  list.erase(list.begin() + 1);  // w2 (group 1) gets no grad; b (group 1) does
  // Read w2 through a pin before the step (resident clean pages get dropped at Step).
  auto before = ReadField(env.mm.get(), "w2", "main", defs[1].numel);
  ASSERT_OK(sa->Step(list));
  ref.Step(0, sg.grad[0]->get(), 1, groups[0], 1.0f);
  ref.Step(2, sg.grad[2]->get(), 1, groups[1], 1.0f);
  ExpectStateEquals(env.mm.get(), ref, defs);
  EXPECT_EQ(ReadField(env.mm.get(), "w2", "main", defs[1].numel), before);
  EXPECT_EQ(sa->step_count(1), 1u);
  EXPECT_EQ(MUST(sa->param_step_count("w2")), 0u);
  EXPECT_EQ(MUST(sa->param_step_count("b")), 1u);
  // Step 2 with every grad: w2's first update, bias-corrected as torch's first (its own count 1).
  StepGrads sg2(env.mm.get(), defs, 2);
  ASSERT_OK(sa->Step(sg2.List(defs)));
  ref.Step(0, sg2.grad[0]->get(), 2, groups[0], 1.0f);
  ref.Step(1, sg2.grad[1]->get(), 1, groups[1], 1.0f);
  ref.Step(2, sg2.grad[2]->get(), 2, groups[1], 1.0f);
  ExpectStateEquals(env.mm.get(), ref, defs);
  EXPECT_EQ(MUST(sa->param_step_count("w2")), 1u);
  EXPECT_EQ(sa->step_count(1), 2u);
}

// Host cache tier holding the whole state with durable_every_steps = 3:
// steps 1-2 touch no disk and are visible to pins, step 3 commits; a failure
// drops the uncommitted steps and returns to the last commit; the destructor
// commits what is left. The reference and grads live in a scratch manager.
TEST(StreamedAdam, CachedStepsCommitEveryNthAndRevertToLastCommitOnFailure) {
  MEMMGR_REQUIRE_BACKEND();
  test_util::KernelFailures kernel_failures;
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  std::vector<ParamDef> defs = SmallMix();
  auto groups = TestGroups();
  std::vector<std::unique_ptr<StepGrads>> grads;
  for (uint64_t step = 1; step <= 7; ++step) grads.push_back(std::make_unique<StepGrads>(smm, defs, step));
  Reference ref(smm, defs);
  // Each param's own step count, as torch counts it: w2 skips steps below.
  std::vector<uint64_t> counts(defs.size(), 0);
  auto ref_step = [&](const StepGrads& sg, const std::vector<size_t>& which) {
    for (size_t i : which) ref.Step(i, sg.grad[i]->get(), ++counts[i], groups[defs[i].group], 1.0f);
  };
  const std::vector<size_t> all = {0, 1, 2};
  Env env;
  const uint64_t state_chunks = 3 * (4 + 2 + 1);  // w1 4 chunks, w2 2, b 1; x3 fields
  env.Open(6 * kChunk, true, (state_chunks + 2) * kChunk);
  StreamedAdamOptions so;
  so.durable_every_steps = 3;
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    RegisterAll(sa.get(), env.mm.get(), defs);
    for (uint64_t step = 1; step <= 3; ++step) {
      const uint64_t writes_before = env.mm->stats().nvme_write_bytes;
      ASSERT_OK(sa->Step(grads[step - 1]->List(defs)));
      ref_step(*grads[step - 1], all);
      EXPECT_EQ(sa->step_count(0), step);
      if (step < 3) {
        EXPECT_EQ(sa->uncommitted_steps(), step);
        EXPECT_EQ(env.store->LatestGeneration().step, 0u) << "cached step " << step << " was committed";
        EXPECT_EQ(env.mm->stats().nvme_write_bytes, writes_before) << "cached step " << step << " wrote to disk";
      } else {
        EXPECT_EQ(sa->uncommitted_steps(), 0u);
        ASSERT_OK(sa->WaitForCommit());  // the commit may run in the background (commit_lag_steps 1)
        EXPECT_EQ(env.store->LatestGeneration().step, 3u);
        EXPECT_EQ(env.store->LatestGeneration().groups[1].step_count, 3u);
      }
      ExpectStateEquals(env.mm.get(), ref, defs);  // pins see the newest state
    }
    // Two more cached steps (step 4 without w2's grad), then a device error.
    auto partial = grads[3]->List(defs);
    partial.erase(partial.begin() + 1);
    ASSERT_OK(sa->Step(partial));
    ASSERT_OK(sa->Step(grads[4]->List(defs)));
    EXPECT_EQ(sa->uncommitted_steps(), 2u);
    if (!test_util::KernelFailures::Available()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
    kernel_failures.FailAfter(2);
    Status st = sa->Step(grads[5]->List(defs));
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.message().find("2 step(s) held only in the host cache were lost"), std::string::npos)
        << st.ToString();
    EXPECT_EQ(sa->uncommitted_steps(), 0u);
    EXPECT_EQ(sa->step_count(0), 3u);
    EXPECT_EQ(MUST(sa->param_step_count("w2")), 3u);  // the lost cached steps do not count
    EXPECT_EQ(sa->global_step(), 3u);
    ExpectStateEquals(env.mm.get(), ref, defs);  // the step-3 commit, read back from the store
    // Continue: steps 4..7 again (4 and 5 cached, 6 commits, 7 cached), with
    // w2 missing from step 6 so the commit must also write w2's cached chunks.
    for (uint64_t step = 4; step <= 7; ++step) {
      auto list = grads[step - 1]->List(defs);
      if (step == 6) list.erase(list.begin() + 1);
      ASSERT_OK(sa->Step(list));
      ref_step(*grads[step - 1], step == 6 ? std::vector<size_t>{0, 2} : all);
    }
    EXPECT_EQ(env.store->LatestGeneration().step, 6u);
    EXPECT_EQ(sa->uncommitted_steps(), 1u);
  }  // the destructor commits step 7
  EXPECT_EQ(env.store->LatestGeneration().step, 7u);
  env.Close();
  env.Open(6 * kChunk, false);  // no cache: everything comes from the store
  ExpectStateEquals(env.mm.get(), ref, defs);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  EXPECT_EQ(sa->step_count(0), 7u);
  EXPECT_EQ(sa->step_count(1), 7u);  // group 1 (w2, b): b stepped every step
  EXPECT_EQ(MUST(sa->param_step_count("w2")), 6u);  // w2 had no grad in step 6
  EXPECT_EQ(MUST(sa->param_step_count("b")), 7u);
}

// ------------------------------------------------- export from the host cache tier

// Every file under root, by relative path, with its bytes.
std::map<std::string, std::string> FileTree(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[std::filesystem::relative(e.path(), root).string()] =
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

// The chunks of the latest committed generation that hold written bytes.
uint64_t WrittenChunks(vfs::Store* store) {
  auto view = MUST(store->OpenGeneration(vfs::kLatest));
  uint64_t n = 0;
  for (const vfs::TensorInfo& t : view->tensors()) {
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      for (uint64_t c = 0; c < view->ChunkCount(t, f); ++c) {
        n += MUST(view->Chunk(vfs::ChunkRef{t.id, f, c})).zero ? 0 : 1;
      }
    }
  }
  return n;
}

// Steps a StreamedAdam of SmallMix with a host cache tier of cache_chunks
// chunks and durable_every_steps `durable`, `steps` times (the last without
// w2's grad), waits for the commit, then exports the latest committed
// generation twice: from the store alone (the reference) and through the
// manager (from the tier). Checks that both wrote the same files and returns
// the tier's export.
vfs::ExportResult StepAndExportBothWays(uint64_t cache_chunks, uint32_t durable, uint64_t steps,
                                        uint64_t* written_chunks, uint64_t* committed_step) {
  Env scratch;
  scratch.Open(3 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  Env env;
  env.Open(6 * kChunk, true, cache_chunks * kChunk);
  StreamedAdamOptions so;
  so.durable_every_steps = durable;
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
  RegisterAll(sa.get(), env.mm.get(), defs);
  for (uint64_t step = 1; step <= steps; ++step) {
    StepGrads g(scratch.mm.get(), defs, step);
    auto list = g.List(defs);
    if (step == steps) list.erase(list.begin() + 1);
    const Status st = sa->Step(list);
    EXPECT_TRUE(st.ok()) << "step " << step << ": " << st.ToString();
  }
  const Status wait = sa->WaitForCommit();  // the last commit may run in the background (commit_lag_steps 1)
  EXPECT_TRUE(wait.ok()) << wait.ToString();
  *written_chunks = WrittenChunks(env.store.get());
  *committed_step = env.store->LatestGeneration().step;
  const std::string plain = env.dir.path() + "/plain", ram = env.dir.path() + "/ram";
  vfs::ExportOptions o;
  o.queue_depth = 3;
  auto rp = vfs::ExportCheckpoint(env.store.get(), plain, o);
  EXPECT_TRUE(rp.ok()) << rp.status().ToString();
  auto rr = env.mm->ExportCheckpoint(ram, o);
  EXPECT_TRUE(rr.ok()) << rr.status().ToString();
  if (!rp.ok() || !rr.ok()) return {};
  EXPECT_EQ(rp->disk_chunks, *written_chunks);
  EXPECT_EQ(rr->generation, rp->generation);
  EXPECT_TRUE(FileTree(ram) == FileTree(plain)) << "the export through the host cache tier wrote other bytes";
  EXPECT_EQ(rr->source_chunks + rr->disk_chunks, *written_chunks);
  EXPECT_EQ(rr->source_bytes + rr->disk_bytes, rp->disk_bytes);
  return *rr;
}

// A tier that holds the whole state: every chunk of the checkpoint comes from
// RAM, none from the disk, and the files are the store's.
TEST(StreamedAdam, ExportTakesTheStateFromAHostCacheThatHoldsIt) {
  MEMMGR_REQUIRE_BACKEND();
  uint64_t written = 0, step = 0;
  const uint64_t state_chunks = 3 * (4 + 2 + 1);  // w1 4 chunks, w2 2, b 1; x3 fields
  vfs::ExportResult r = StepAndExportBothWays(state_chunks + 2, 1, 2, &written, &step);
  EXPECT_EQ(step, 2u);
  EXPECT_EQ(written, state_chunks);
  EXPECT_EQ(r.source_chunks, written);
  EXPECT_EQ(r.disk_chunks, 0u);
  EXPECT_EQ(r.source_mismatches, 0u);
}

// A tier that holds part of the state: those chunks from RAM, the rest from
// the disk, the same files.
TEST(StreamedAdam, ExportTakesWhatAPartialHostCacheHoldsAndReadsTheRest) {
  MEMMGR_REQUIRE_BACKEND();
  uint64_t written = 0, step = 0;
  vfs::ExportResult r = StepAndExportBothWays(8, 1, 2, &written, &step);
  EXPECT_EQ(step, 2u);
  EXPECT_GT(r.source_chunks, 0u);
  EXPECT_LE(r.source_chunks, 8u);
  EXPECT_GT(r.disk_chunks, 0u);
}

// durable_every_steps 3, four steps: the tier holds step 4 (cached, newer than
// the commit) for w1 and b, and step 3's bytes for w2, which step 4 left out.
// The checkpoint is step 3's generation: w2 from RAM, the newer chunks from
// the disk (counted as mismatches), never step 4's bytes.
TEST(StreamedAdam, ExportOfAHostCacheHoldingNewerStepsWritesTheCommittedGeneration) {
  MEMMGR_REQUIRE_BACKEND();
  uint64_t written = 0, step = 0;
  const uint64_t state_chunks = 3 * (4 + 2 + 1);
  vfs::ExportResult r = StepAndExportBothWays(state_chunks + 2, 3, 4, &written, &step);
  EXPECT_EQ(step, 3u);
  EXPECT_EQ(written, state_chunks);
  EXPECT_EQ(r.source_chunks, 3u * 2);  // w2's 2 chunks of each field
  EXPECT_EQ(r.source_mismatches, 3u * (4 + 1));
  EXPECT_EQ(r.disk_chunks, 3u * (4 + 1));
}

// Every byte of every field of every tensor in the latest committed
// generation, read through a GenerationView (independent of the optimizer
// and of the manager's pins), keyed "tensor/field"; plus "#generation".
std::map<std::string, std::vector<uint8_t>> CommittedBytes(vfs::Store* store) {
  std::map<std::string, std::vector<uint8_t>> out;
  auto view = store->OpenGeneration(vfs::kLatest);
  if (!view.ok()) {
    ADD_FAILURE() << "open latest generation: " << view.status().ToString();
    return out;
  }
  const uint64_t chunk = store->chunk_size_bytes();
  void* buf = std::aligned_alloc(4096, chunk);
  for (const vfs::TensorInfo& t : (*view)->tensors()) {
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      std::vector<uint8_t>& bytes = out[t.name + "/" + t.fields[f].name];
      const uint64_t total = t.field_bytes(f);
      for (uint64_t c = 0, off = 0; off < total; ++c, off += chunk) {
        Status st = (*view)->ReadChunk(vfs::ChunkRef{t.id, f, c}, buf);
        if (!st.ok()) ADD_FAILURE() << t.name << " chunk " << c << ": " << st.ToString();
        const uint8_t* p = static_cast<const uint8_t*>(buf);
        bytes.insert(bytes.end(), p, p + std::min(chunk, total - off));
      }
    }
  }
  std::free(buf);
  const uint64_t g = (*view)->info().generation;
  out["#generation"] = std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(&g),
                                            reinterpret_cast<const uint8_t*>(&g) + sizeof(g));
  return out;
}

bool Contains(const Status& s, const std::string& part) { return s.message().find(part) != std::string::npos; }

// The keys of two CommittedBytes results that differ ("" when none): short
// failure messages instead of the bytes.
std::string DiffKeys(const std::map<std::string, std::vector<uint8_t>>& a,
                     const std::map<std::string, std::vector<uint8_t>>& b) {
  std::string out;
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end() || it->second != v) out += (out.empty() ? "" : ", ") + k;
  }
  for (const auto& [k, v] : b) {
    if (!a.count(k)) out += (out.empty() ? "" : ", ") + k;
  }
  return out;
}

// Loss scaling that changes every step (torch's GradScaler): steps given
// gradients g * s with the scale s through SetGradScale, through a step's
// d_grad_scale (which overrides SetGradScale for that step only) and through
// the incremental form equal the unscaled reference steps on g bit for bit
// (power-of-two scales: g * s and (g * s) / s are exact in f32 and bf16).
// A scale that is not finite and > 0 is refused and changes nothing.
TEST(StreamedAdam, PerStepGradScaleEqualsUnscaledStepsBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  const std::vector<ParamDef> defs = SmallMix();  // f32 and bf16 grads: |g| * 65536 fits both
  const auto groups = TestGroups();
  Reference ref(smm, defs);
  Env env;
  env.Open(6 * kChunk, true);
  StreamedAdamOptions so;
  so.grad_scale = 4.0f;  // the first step's scale
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
  RegisterAll(sa.get(), env.mm.get(), defs);
  EXPECT_EQ(sa->grad_scale(), 4.0f);

  DeviceBuffer d_scale(env.mm.get(), 4);
  // step: (scale through SetGradScale before it or 0 = keep, scale in d_grad_scale or 0 = none, incremental)
  struct Plan {
    float set, device;
    bool incremental;
  };
  const Plan plan[] = {{0, 0, false},   {65536, 0, false}, {65536, 1024, false}, {0, 0, true},
                       {0.125f, 0, false}, {0, 8, true},  {1, 0, false}};
  uint64_t step = 0;
  for (const Plan& pl : plan) {
    ++step;
    SCOPED_TRACE("step " + std::to_string(step));
    if (pl.set != 0) ASSERT_OK(sa->SetGradScale(pl.set));
    const float scale = pl.device != 0 ? pl.device : sa->grad_scale();
    if (pl.device != 0) d_scale.Upload(&pl.device);
    const float* dp = pl.device != 0 ? static_cast<const float*>(d_scale.get()) : nullptr;
    StepGrads scaled(smm, defs, step, scale);
    StepGrads plain(smm, defs, step);
    auto list = scaled.List(defs);
    if (pl.incremental) {
      ASSERT_OK(sa->BeginStep(nullptr, dp));
      for (const ParamGrad& g : list) ASSERT_OK(sa->StepParam(g));
      ASSERT_TRUE(sa->EndStep().ok());
    } else {
      ASSERT_OK(sa->Step(list, nullptr, dp));
    }
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, plain.grad[i]->get(), step, groups[defs[i].group], 1.0f);
    if (pl.device != 0) {
      EXPECT_NE(sa->grad_scale(), pl.device) << "d_grad_scale applies to its step only";
    }
  }
  ASSERT_OK(sa->WaitForCommit());
  EXPECT_EQ(env.store->LatestGeneration().step, step);
  ExpectStateEquals(env.mm.get(), ref, defs);

  // Refused scales change nothing: not the scale, not the state, no commit.
  const uint64_t gen = sa->last_generation();
  const float bad[] = {0.0f, -2.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  StepGrads next(smm, defs, step + 1);
  for (float b : bad) {
    Status st = sa->SetGradScale(b);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b << ": " << st.ToString();
    EXPECT_TRUE(Contains(st, env.store->path())) << st.ToString();
    EXPECT_EQ(sa->grad_scale(), 1.0f);
    d_scale.Upload(&b);
    st = sa->Step(next.List(defs), nullptr, static_cast<const float*>(d_scale.get()));
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b << ": " << st.ToString();
    EXPECT_TRUE(Contains(st, "d_grad_scale")) << st.ToString();
  }
  EXPECT_EQ(sa->last_generation(), gen);
  EXPECT_EQ(env.store->LatestGeneration().generation, gen);
  ExpectStateEquals(env.mm.get(), ref, defs);
  // A step in progress keeps its scale.
  ASSERT_OK(sa->BeginStep());
  EXPECT_EQ(sa->SetGradScale(2.0f).code(), StatusCode::kFailedPrecondition);
  for (const ParamGrad& g : next.List(defs)) ASSERT_OK(sa->StepParam(g));
  ASSERT_TRUE(sa->EndStep().ok());
  for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, next.grad[i]->get(), step + 1, groups[defs[i].group], 1.0f);
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// Every field of every param of the reference, keyed like CommittedBytes.
std::map<std::string, std::vector<uint8_t>> ReferenceBytes(const Reference& ref, const std::vector<ParamDef>& defs) {
  static const char* kFields[] = {"main", "exp_avg", "exp_avg_sq"};
  std::map<std::string, std::vector<uint8_t>> out;
  for (size_t i = 0; i < defs.size(); ++i) {
    for (int f = 0; f < 3; ++f) {
      std::vector<float> v = ref.Field(i, f);
      const uint8_t* b = reinterpret_cast<const uint8_t*>(v.data());
      out[defs[i].name + "/" + kFields[f]] = std::vector<uint8_t>(b, b + v.size() * 4);
    }
  }
  return out;
}

// A MakeDurable whose chunk writes fail (an injected EIO on the nth write of
// the data file, so the writes before it completed and went with the dropped
// generation) keeps the cached steps; the retry writes every one of them and
// the committed generation equals the reference run of all the steps, read
// back through a GenerationView (not through the optimizer or its cache).
TEST(StreamedAdam, FailedMakeDurableKeepsCachedStepsAndTheRetryCommitsAllOfThem) {
  MEMMGR_REQUIRE_BACKEND();
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  const std::vector<ParamDef> defs = SmallMix();
  const auto groups = TestGroups();
  constexpr uint64_t kSteps = 3;
  std::vector<std::unique_ptr<StepGrads>> grads;
  for (uint64_t step = 1; step <= kSteps; ++step) grads.push_back(std::make_unique<StepGrads>(smm, defs, step));
  Reference ref(smm, defs);
  for (uint64_t step = 1; step <= kSteps; ++step) {
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, grads[step - 1]->grad[i]->get(), step, groups[defs[i].group], 1.0f);
  }
  const auto want = ReferenceBytes(ref, defs);
  // 21 dirty chunks (w1 4 chunks, w2 2, b 1; x3 fields) in 16 writes: the 15
  // whole chunks' and one of the 6 short ones (w1's tails and b: adjacent
  // pieces go to the disk as one write, vfs/chunk_io.cc).
  const uint64_t state_chunks = 3 * (4 + 2 + 1);
  const uint64_t state_writes = 3 * (3 + 2) + 1;
  // The first, a middle and the last of the 16 writes fails.
  for (uint64_t nth : {uint64_t{1}, uint64_t{9}, state_writes}) {
    SCOPED_TRACE("write " + std::to_string(nth) + " of " + std::to_string(state_writes) + " fails");
    vfs::FaultInjectionFileSystem fs(vfs::FileSystem::Default());
    Env env;
    env.Open(6 * kChunk, true, (state_chunks + 2) * kChunk, false, MemoryManagerOptions::kAutoHashThreads, &fs);
    StreamedAdamOptions so;
    so.durable_every_steps = 100;
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), so));
    RegisterAll(sa.get(), env.mm.get(), defs);
    const uint64_t registered_gen = MUST(sa->MakeDurable());
    for (uint64_t step = 1; step <= kSteps; ++step) ASSERT_OK(sa->Step(grads[step - 1]->List(defs)));
    ASSERT_EQ(sa->uncommitted_steps(), kSteps);

    vfs::FaultRule rule = vfs::FaultRule::FailNth(vfs::OpClass::kWrite, nth);
    rule.path_contains = ".chunks";
    fs.AddRule(rule);
    auto failed = sa->MakeDurable();
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(fs.InjectedCount(), 1u);
    EXPECT_TRUE(Contains(failed.status(), "injected fault")) << failed.status().ToString();
    EXPECT_TRUE(Contains(failed.status(), "3 step(s) stay in the host cache")) << failed.status().ToString();
    EXPECT_TRUE(Contains(failed.status(), env.store->path())) << failed.status().ToString();
    EXPECT_EQ(sa->uncommitted_steps(), kSteps);
    EXPECT_EQ(sa->global_step(), kSteps);
    EXPECT_EQ(env.store->LatestGeneration().generation, registered_gen);

    fs.ClearRules();
    const uint64_t gen = MUST(sa->MakeDurable());
    EXPECT_GT(gen, registered_gen);
    EXPECT_EQ(sa->uncommitted_steps(), 0u);
    EXPECT_EQ(env.store->LatestGeneration().step, kSteps);
    auto got = CommittedBytes(env.store.get());
    got.erase("#generation");
    EXPECT_EQ(DiffKeys(got, want), "") << "committed fields that differ from the reference of all steps";
    sa.reset();
    // Reopened without the cache: the store alone holds all the steps.
    env.Close();
    env.Open(6 * kChunk, false);
    ExpectStateEquals(env.mm.get(), ref, defs);
  }
}

// commit_lag_steps 1 (the write tail and the commit in the background) gives
// the same params and the same committed state as commit_lag_steps 0 (commit
// inside Step), bit for bit, step after step, and both equal the resident
// reference.
TEST(StreamedAdam, PipelinedCommitsEqualCommitInsideStepBitForBit) {
  MEMMGR_REQUIRE_BACKEND();
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  const std::vector<ParamDef> defs = SmallMix();
  const auto groups = TestGroups();
  Reference ref(smm, defs);
  Env env0, env1;
  env0.Open(3 * kChunk, true);
  env1.Open(3 * kChunk, true);
  StreamedAdamOptions o0, o1;
  o0.commit_lag_steps = 0;
  EXPECT_EQ(o1.commit_lag_steps, 1u) << "the default";
  auto sa0 = MUST(StreamedAdam::Create(env0.store.get(), env0.mm.get(), o0));
  auto sa1 = MUST(StreamedAdam::Create(env1.store.get(), env1.mm.get(), o1));
  RegisterAll(sa0.get(), env0.mm.get(), defs);
  RegisterAll(sa1.get(), env1.mm.get(), defs);
  constexpr uint64_t kSteps = 12;
  for (uint64_t step = 1; step <= kSteps; ++step) {
    StepGrads g0(env0.mm.get(), defs, step), g1(env1.mm.get(), defs, step);
    ASSERT_OK(sa0->Step(g0.List(defs)));
    if (step % 3 == 0) {  // the incremental form too
      ASSERT_OK(sa1->BeginStep());
      for (const ParamGrad& g : g1.List(defs)) ASSERT_OK(sa1->StepParam(g));
      ASSERT_TRUE(sa1->EndStep().ok());
    } else {
      ASSERT_OK(sa1->Step(g1.List(defs)));
    }
    EXPECT_FALSE(sa0->commit_in_flight());
    EXPECT_TRUE(sa1->commit_in_flight());
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, g0.grad[i]->get(), step, groups[defs[i].group], 1.0f);
    // The params are final when Step returns, whatever the commit does.
    for (size_t i = 0; i < defs.size(); ++i) {
      if (!defs[i].param_type) continue;
      std::vector<uint8_t> p0(defs[i].numel * Size(defs[i].param_type)), p1(p0.size());
      g0.param[i]->Download(p0.data());
      g1.param[i]->Download(p1.data());
      EXPECT_EQ(p1, p0) << defs[i].name << " at step " << step;
      EXPECT_EQ(p1, ref.ParamCopy(i)) << defs[i].name << " at step " << step;
    }
    EXPECT_EQ(sa1->step_count(0), step);
    EXPECT_EQ(sa1->global_step(), step);
  }
  ASSERT_OK(sa1->WaitForCommit());
  EXPECT_FALSE(sa1->commit_in_flight());
  auto c0 = CommittedBytes(env0.store.get());
  auto c1 = CommittedBytes(env1.store.get());
  EXPECT_EQ(DiffKeys(c0, c1), "") << "committed state of lag 0 vs lag 1";
  c1.erase("#generation");
  EXPECT_EQ(DiffKeys(c1, ReferenceBytes(ref, defs)), "");
  EXPECT_EQ(env1.store->LatestGeneration().step, kSteps);
  EXPECT_EQ(env1.store->LatestGeneration().groups[1].step_count, kSteps);
}

// With commit_lag_steps 1 the optimizer names the generation a step commits
// as, counts the step at once, and the store publishes it by the next wait
// point: the next Step (its BeginStep), MakeDurable, WaitForCommit, a pin
// through the manager, the destructor. Checked on generation numbers and
// step counts, not on time.
TEST(StreamedAdam, PipelinedCommitIsPublishedByTheNextWaitPoint) {
  MEMMGR_REQUIRE_BACKEND();
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  const std::vector<ParamDef> defs = SmallMix();
  const auto groups = TestGroups();
  Reference ref(smm, defs);
  std::vector<std::unique_ptr<StepGrads>> grads;
  for (uint64_t step = 1; step <= 5; ++step) grads.push_back(std::make_unique<StepGrads>(smm, defs, step));
  auto ref_step = [&](uint64_t step) {
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, grads[step - 1]->grad[i]->get(), step, groups[defs[i].group], 1.0f);
  };
  Env env;
  env.Open(6 * kChunk, true);
  StreamedAdamOptions bad;
  bad.commit_lag_steps = 2;
  auto refused = StreamedAdam::Create(env.store.get(), env.mm.get(), bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(refused.status(), "commit_lag_steps")) << refused.status().ToString();
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    RegisterAll(sa.get(), env.mm.get(), defs);
    const uint64_t g0 = MUST(sa->MakeDurable());
    EXPECT_EQ(env.store->LatestGeneration().generation, g0);
    // Step 1 (incremental): EndStep names generation g0 + 1; until a wait the
    // optimizer reports g0 and the store holds g0 or g0 + 1.
    ASSERT_OK(sa->BeginStep());
    for (const ParamGrad& g : grads[0]->List(defs)) ASSERT_OK(sa->StepParam(g));
    auto gen1 = sa->EndStep();
    ASSERT_TRUE(gen1.ok()) << gen1.status().ToString();
    ref_step(1);
    EXPECT_EQ(*gen1, g0 + 1);
    EXPECT_TRUE(sa->commit_in_flight());
    EXPECT_EQ(sa->last_generation(), g0);
    EXPECT_EQ(sa->step_count(0), 1u);
    EXPECT_EQ(sa->step_count(1), 1u);
    EXPECT_EQ(sa->global_step(), 1u);
    const uint64_t seen = env.store->LatestGeneration().generation;
    EXPECT_TRUE(seen == g0 || seen == g0 + 1) << seen;
    // Step 2 waits for step 1's commit before it starts.
    ASSERT_OK(sa->Step(grads[1]->List(defs)));
    ref_step(2);
    EXPECT_EQ(sa->last_generation(), g0 + 1);
    EXPECT_GE(sa->last_step_stats().commit_wait_seconds, 0.0);
    EXPECT_GE(env.store->LatestGeneration().generation, g0 + 1);
    // MakeDurable waits for step 2's commit and returns its generation.
    EXPECT_EQ(MUST(sa->MakeDurable()), g0 + 2);
    EXPECT_FALSE(sa->commit_in_flight());
    vfs::GenerationInfo latest = env.store->LatestGeneration();
    EXPECT_EQ(latest.generation, g0 + 2);
    EXPECT_EQ(latest.step, 2u);
    EXPECT_EQ(latest.groups[0].step_count, 2u);
    EXPECT_EQ(latest.groups[1].step_count, 2u);
    EXPECT_EQ(sa->last_step_stats().write_bytes, StateBytes(defs)) << "the step's stats, once its commit was waited for";
    // A pin waits for the commit in flight: it sees step 3's state, never a
    // mix of the pending and the committed generation.
    ASSERT_OK(sa->Step(grads[2]->List(defs)));
    ref_step(3);
    ExpectStateEquals(env.mm.get(), ref, defs);
    EXPECT_EQ(env.store->LatestGeneration().generation, g0 + 3);
    EXPECT_EQ(sa->last_generation(), g0 + 2) << "the optimizer learns of the commit at its own next wait";
    ASSERT_OK(sa->WaitForCommit());
    EXPECT_EQ(sa->last_generation(), g0 + 3);
    // Sleep (ReleaseAll) waits too; the destructor commits nothing twice.
    ASSERT_OK(sa->Step(grads[3]->List(defs)));
    ref_step(4);
    ASSERT_OK(env.mm->ReleaseAll());
    EXPECT_EQ(env.store->LatestGeneration().generation, g0 + 4);
    ASSERT_OK(sa->Step(grads[4]->List(defs)));
    ref_step(5);
  }  // the destructor waits for step 5's commit
  vfs::GenerationInfo latest = env.store->LatestGeneration();
  EXPECT_EQ(latest.step, 5u);
  auto got = CommittedBytes(env.store.get());
  got.erase("#generation");
  EXPECT_EQ(DiffKeys(got, ReferenceBytes(ref, defs)), "");
}

// A background commit that fails (an injected fdatasync error on the data
// files, which only the commit issues here) is returned by the next call
// that waits, naming the step, the generation, the store and the cause; the
// optimizer is back at the last commit and the store at its generation, bit
// for bit; after a reopen the run continues from there.
TEST(StreamedAdam, FailedBackgroundCommitSurfacesAtTheNextCallAndKeepsTheLastGeneration) {
  MEMMGR_REQUIRE_BACKEND();
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  const std::vector<ParamDef> defs = SmallMix();
  const auto groups = TestGroups();
  std::vector<std::unique_ptr<StepGrads>> grads;
  for (uint64_t step = 1; step <= 2; ++step) grads.push_back(std::make_unique<StepGrads>(smm, defs, step));
  Reference ref(smm, defs);
  for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, grads[0]->grad[i]->get(), 1, groups[defs[i].group], 1.0f);
  const auto want1 = ReferenceBytes(ref, defs);
  for (const char* next_call : {"Step", "MakeDurable"}) {
    SCOPED_TRACE(std::string("the next call is ") + next_call);
    vfs::FaultInjectionFileSystem fs(vfs::FileSystem::Default());
    Env env;
    env.Open(6 * kChunk, true, 0, false, MemoryManagerOptions::kAutoHashThreads, &fs);
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    RegisterAll(sa.get(), env.mm.get(), defs);
    ASSERT_OK(sa->Step(grads[0]->List(defs)));
    ASSERT_OK(sa->WaitForCommit());
    const vfs::GenerationInfo good = env.store->LatestGeneration();
    ASSERT_EQ(good.step, 1u);

    vfs::FaultRule rule = vfs::FaultRule::FailNth(vfs::OpClass::kSync, 1);
    rule.path_contains = ".chunks";
    fs.AddRule(rule);
    ASSERT_OK(sa->Step(grads[1]->List(defs)));  // the step succeeds; its commit fails later
    EXPECT_EQ(sa->step_count(0), 2u);
    Status st;
    if (std::string(next_call) == "Step") {
      st = sa->Step(grads[1]->List(defs));
    } else {
      st = sa->MakeDurable().status();
    }
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(fs.InjectedCount(), 1u);
    for (const std::string& part : {std::string("background commit of step 2"),
                                    "generation " + std::to_string(good.generation + 1), env.store->path(),
                                    std::string("injected fault"),
                                    "at generation " + std::to_string(good.generation) + " (step 1)"}) {
      EXPECT_TRUE(Contains(st, part)) << "'" << part << "' missing from: " << st.ToString();
    }
    EXPECT_FALSE(sa->commit_in_flight());
    EXPECT_EQ(sa->step_count(0), 1u);
    EXPECT_EQ(sa->step_count(1), 1u);
    EXPECT_EQ(sa->global_step(), 1u);
    EXPECT_EQ(sa->last_generation(), good.generation);
    EXPECT_EQ(env.store->LatestGeneration().generation, good.generation);
    auto got = CommittedBytes(env.store.get());
    got.erase("#generation");
    EXPECT_EQ(DiffKeys(got, want1), "") << "the store must hold step 1 exactly";
    // A failed fdatasync poisons the store until reopened: resume from it.
    sa.reset();
    fs.ClearRules();
    env.Close();
    env.Open(6 * kChunk, false);
    sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    EXPECT_EQ(sa->step_count(0), 1u);
    ExpectStateEquals(env.mm.get(), ref, defs);
  }
}

// Resuming with a changed model: a store made by a run of two tensors
// param.0/param.1 of 3,000,017 parameters, then a run of 999 parameters
// (500 + 499 elements) on it. Registering the new sizes is refused, naming the
// store, the tensor and both numels; a trainer that skips registration and
// steps anyway (as optstate-bench did) is refused before any kernel runs: the
// committed generation and every byte of it are unchanged.
TEST(StreamedAdam, ResumeWithChangedModelIsRefusedBeforeAnyKernel) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(6 * kChunk, true);
  const uint64_t big[2] = {1500009, 1500008};
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    std::vector<std::unique_ptr<DeviceBuffer>> grads;
    std::vector<ParamGrad> list;
    for (int k = 0; k < 2; ++k) {
      const std::string name = "param." + std::to_string(k);
      ASSERT_OK(sa->RegisterParam(name, big[k], 0, nullptr, DType::kF32));
      std::vector<float> g(big[k]);
      for (uint64_t i = 0; i < big[k]; ++i) g[i] = RandF(k, i);
      grads.push_back(std::make_unique<DeviceBuffer>(env.mm.get(), big[k] * 4));
      grads.back()->Upload(g.data());
      ParamGrad pg;
      pg.name = name;
      pg.d_grad = grads.back()->get();
      pg.numel = big[k];
      list.push_back(pg);
    }
    ASSERT_OK(sa->Step(list));
  }
  env.Close();
  env.Open(6 * kChunk, false);
  const auto before = CommittedBytes(env.store.get());
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  const uint64_t small[2] = {500, 499};
  Status reg = sa->RegisterParam("param.0", small[0], 0, nullptr, DType::kF32);
  EXPECT_EQ(reg.code(), StatusCode::kInvalidArgument) << reg.ToString();
  for (const std::string& part : {env.store->path(), std::string("param.0"), std::string("1500009"),
                                  std::string("500")}) {
    EXPECT_TRUE(Contains(reg, part)) << "'" << part << "' missing from: " << reg.ToString();
  }
  // The trainer steps without registering: gradients of the new sizes, with
  // a model-parameter copy that a kernel would overwrite.
  std::vector<std::unique_ptr<DeviceBuffer>> grads, params;
  std::vector<ParamGrad> list;
  const std::vector<float> sentinel(small[0], 7.0f);
  for (int k = 0; k < 2; ++k) {
    std::vector<float> g(small[k], 0.5f);
    grads.push_back(std::make_unique<DeviceBuffer>(env.mm.get(), small[k] * 4));
    grads.back()->Upload(g.data());
    params.push_back(std::make_unique<DeviceBuffer>(env.mm.get(), small[k] * 4));
    params.back()->Upload(sentinel.data());
    ParamGrad pg;
    pg.name = "param." + std::to_string(k);
    pg.d_grad = grads.back()->get();
    pg.d_param = params.back()->get();
    pg.param_type = DType::kF32;
    pg.numel = small[k];
    list.push_back(pg);
  }
  Status st = sa->Step(list);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  for (const std::string& part : {env.store->path(), std::string("param.0"), std::string("1500009"),
                                  std::string("500")}) {
    EXPECT_TRUE(Contains(st, part)) << "'" << part << "' missing from: " << st.ToString();
  }
  std::vector<float> p0(small[0]);
  params[0]->Download(p0.data());
  EXPECT_EQ(p0, sentinel) << "a kernel ran";
  EXPECT_EQ(sa->step_count(0), 1u);
  EXPECT_EQ(DiffKeys(CommittedBytes(env.store.get()), before), "");
  // The same through the incremental form: refused at StepParam, nothing committed.
  ASSERT_OK(sa->BeginStep());
  EXPECT_EQ(sa->StepParam(list[0]).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sa->EndStep().status().code(), StatusCode::kFailedPrecondition);  // the step was aborted
  EXPECT_EQ(DiffKeys(CommittedBytes(env.store.get()), before), "");
}

// Registering an existing param with any other geometry is kInvalidArgument
// naming the store, the tensor, the field and both values, and changes
// nothing; the same geometry keeps the stored state.
TEST(StreamedAdam, ReregisterWithOtherGeometryIsRefused) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(6 * kChunk, true);
  const uint64_t numel = 6 * 1000;
  ShardInfo shard;
  shard.shape = {6, 1000};
  shard.global_shape = {12, 1000};
  shard.shard_offset = {6, 0};
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    std::vector<uint16_t> w(numel, kernels::FloatToBf16(0.25f));
    DeviceBuffer dw(env.mm.get(), numel * 2);
    dw.Upload(w.data());
    ASSERT_OK(sa->RegisterParam("layer.w", numel, 1, dw.get(), DType::kBF16, shard));
    std::vector<float> g(numel, 0.125f);
    DeviceBuffer dg(env.mm.get(), numel * 4);
    dg.Upload(g.data());
    ParamGrad pg;
    pg.name = "layer.w";
    pg.d_grad = dg.get();
    pg.numel = numel;
    ASSERT_OK(sa->Step(std::span<const ParamGrad>(&pg, 1)));
  }
  env.Close();
  env.Open(6 * kChunk, false);
  const auto before = CommittedBytes(env.store.get());
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  struct Case {
    const char* what;
    uint64_t numel;
    uint32_t group;
    DType type;
    ShardInfo shard;
    std::vector<std::string> parts;  // besides the store path and the tensor
  };
  ShardInfo other_shape = shard, other_global = shard, other_offset = shard;
  other_shape.shape = {1000, 6};
  other_global.global_shape = {18, 1000};
  other_offset.shard_offset = {0, 0};
  const std::vector<Case> cases = {
      {"numel", numel + 1, 1, DType::kBF16, shard, {"numel 6000", "numel 6001"}},
      {"group", numel, 0, DType::kBF16, shard, {"group 1", "group 0"}},
      {"dtype", numel, 1, DType::kF16, shard, {"dtype bf16", "dtype f16"}},
      {"shape", numel, 1, DType::kBF16, other_shape, {"shape [6, 1000]", "shape [1000, 6]"}},
      {"global shape", numel, 1, DType::kBF16, other_global, {"global shape [12, 1000]", "[18, 1000]"}},
      {"shard offset", numel, 1, DType::kBF16, other_offset, {"shard offset [6, 0]", "[0, 0]"}},
      {"no shard info", numel, 1, DType::kBF16, ShardInfo{}, {"shape [6, 1000]", "shape [6000]"}},
  };
  for (const Case& c : cases) {
    Status st = sa->RegisterParam("layer.w", c.numel, c.group, nullptr, c.type, c.shard);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.what << ": " << st.ToString();
    std::vector<std::string> parts = c.parts;
    parts.push_back(env.store->path());
    parts.push_back("layer.w");
    for (const auto& part : parts) {
      EXPECT_TRUE(Contains(st, part)) << c.what << ": '" << part << "' missing from: " << st.ToString();
    }
  }
  // The matching registration (dtype not given: not compared) keeps the state.
  ASSERT_OK(sa->RegisterParam("layer.w", numel, 1, nullptr, std::nullopt, shard));
  ASSERT_OK(sa->RegisterParam("layer.w", numel, 1, nullptr, DType::kBF16, shard));
  EXPECT_EQ(sa->step_count(1), 1u);
  EXPECT_EQ(DiffKeys(CommittedBytes(env.store.get()), before), "");
}

// A step whose gradients do not match the registered params fails before any
// kernel runs and commits nothing: not the step, and not the registrations
// still pending from before it (they stay pending for the next good step).
TEST(StreamedAdam, StepWithWrongGradsCommitsNothing) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(6 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);  // pending: no generation yet
  Reference ref(env.mm.get(), defs);
  auto groups = TestGroups();
  StepGrads sg(env.mm.get(), defs, 1);
  std::vector<uint8_t> w1_param_before(defs[0].numel * Size(defs[0].param_type), 0xA5);
  sg.param[0]->Upload(w1_param_before.data());
  DeviceBuffer other(env.mm.get(), 4 * 4);
  using Edit = std::function<void(std::vector<ParamGrad>*)>;
  const std::vector<std::pair<std::string, Edit>> bad = {
      {"wrong numel", [](std::vector<ParamGrad>* l) { l->back().numel = 776; }},
      {"null gradient", [](std::vector<ParamGrad>* l) { l->back().d_grad = nullptr; }},
      {"gradient dtype", [](std::vector<ParamGrad>* l) { l->back().grad_type = DType::kQ8S; }},
      {"param dtype",
       [&](std::vector<ParamGrad>* l) {
         l->back().d_param = other.get();
         l->back().param_type = std::nullopt;
       }},
      {"unknown name", [](std::vector<ParamGrad>* l) { l->back().name = "w3"; }},
      {"given twice", [](std::vector<ParamGrad>* l) { l->push_back(l->front()); }},
  };
  for (int round = 0; round < 2; ++round) {
    // Round 0: registrations pending; round 1: after a committed step.
    const auto before = CommittedBytes(env.store.get());
    const uint64_t gen = env.store->LatestGeneration().generation;
    for (const auto& [what, edit] : bad) {
      std::vector<ParamGrad> list = sg.List(defs);
      for (size_t i = 0; i < defs.size(); ++i) list[i].numel = defs[i].numel;
      edit(&list);
      Status st = sa->Step(list);
      EXPECT_FALSE(st.ok()) << what;
      EXPECT_TRUE(Contains(st, list.back().name)) << what << ": " << st.ToString();
      EXPECT_EQ(env.store->LatestGeneration().generation, gen) << what << " committed";
      EXPECT_EQ(DiffKeys(CommittedBytes(env.store.get()), before), "") << what;
      std::vector<uint8_t> w1_param(w1_param_before.size());
      sg.param[0]->Download(w1_param.data());
      EXPECT_EQ(w1_param, w1_param_before) << what << ": a kernel ran";
      for (const auto& d : defs) EXPECT_TRUE(sa->HasParam(d.name)) << what << ": " << d.name << " was dropped";
    }
    if (round == 0) {
      // The next good step commits the registrations with it and equals the reference.
      auto sg1 = StepWithReference(sa.get(), env.mm.get(), defs, &ref, 1, 1.0f);
      ASSERT_OK(sa->WaitForCommit());
      EXPECT_EQ(env.store->LatestGeneration().step, 1u);
      ExpectStateEquals(env.mm.get(), ref, defs);
      sg.param[0]->Upload(w1_param_before.data());
    }
  }
  (void)groups;
}

// A step that fails after new params were registered commits nothing at all:
// the registrations were only pending, so they are dropped (the error names
// them) and registering them again takes over their index entries.
TEST(StreamedAdam, AbortedStepAfterNewRegistrationsCommitsNothing) {
  MEMMGR_REQUIRE_BACKEND();
  test_util::KernelFailures kernel_failures;
  // The reference and the gradients live in a scratch manager that outlives
  // the reopened store's manager.
  Env scratch;
  scratch.Open(3 * kChunk, true);
  MemoryManager* smm = scratch.mm.get();
  Env env;
  env.Open(6 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  std::vector<ParamDef> first(defs.begin(), defs.begin() + 1), added(defs.begin() + 1, defs.end());
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), first);
  Reference ref(smm, defs);
  auto groups = TestGroups();
  StepGrads sg1(smm, defs, 1);
  ASSERT_OK(sa->Step(sg1.List(first)));
  ASSERT_OK(sa->WaitForCommit());
  ref.Step(0, sg1.grad[0]->get(), 1, groups[defs[0].group], 1.0f);
  const auto before = CommittedBytes(env.store.get());
  const uint64_t gen1 = env.store->LatestGeneration().generation;

  RegisterAll(sa.get(), env.mm.get(), added);  // w2 and b, pending
  StepGrads sg2(smm, defs, 2);
  if (!test_util::KernelFailures::Available()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
  kernel_failures.FailAfter(2);
  Status st = sa->Step(sg2.List(defs));
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(Contains(st, "injected")) << st.ToString();
  EXPECT_TRUE(Contains(st, "'w2'") && Contains(st, "'b'") && Contains(st, "register them again")) << st.ToString();
  EXPECT_EQ(env.store->LatestGeneration().generation, gen1) << "the aborted step committed something";
  EXPECT_EQ(DiffKeys(CommittedBytes(env.store.get()), before), "");
  EXPECT_FALSE(sa->HasParam("w2"));
  EXPECT_FALSE(sa->HasParam("b"));
  EXPECT_TRUE(sa->HasParam("w1"));
  EXPECT_EQ(sa->step_count(0), 1u);

  // The store dropped the aborted registrations with the pending
  // generation: a new optimizer (after a restart) finds neither entry, and
  // registering them again writes their initial weights.
  EXPECT_EQ(env.store->FindTensor("b").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(env.store->FindTensor("w2").status().code(), StatusCode::kNotFound);
  sa.reset();
  env.Close();
  env.Open(6 * kChunk, false);
  sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  EXPECT_EQ(sa->ParamNames(), std::vector<std::string>{"w1"});
  RegisterAll(sa.get(), env.mm.get(), defs);
  for (uint64_t step = 2; step <= 3; ++step) {
    StepGrads sg(smm, defs, step);
    ASSERT_OK(sa->Step(sg.List(defs)));
    // w1 is at its step `step`; w2 and b start now (group 1 counts from here).
    ref.Step(0, sg.grad[0]->get(), step, groups[0], 1.0f);
    for (size_t i = 1; i < defs.size(); ++i) ref.Step(i, sg.grad[i]->get(), step - 1, groups[1], 1.0f);
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// Registrations still pending when the optimizer is destroyed are committed
// then (like cached steps), so a new optimizer on the store restores them
// with their initial weights.
TEST(StreamedAdam, RegistrationsPendingAtDestructionAreCommitted) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(6 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    RegisterAll(sa.get(), env.mm.get(), defs);
    EXPECT_EQ(env.store->LatestGeneration().generation, 0u);
  }
  EXPECT_EQ(env.store->LatestGeneration().generation, 1u);
  EXPECT_EQ(env.store->LatestGeneration().step, 0u);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  EXPECT_EQ(sa->ParamNames().size(), defs.size());
  Reference ref(env.mm.get(), defs);
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// A model that lost a tensor: the store's param that this run did not
// register stops the step with an error naming it, until the run registers it
// or retires it; a retired param keeps its state, unchanged, in every later
// generation. A run that registers nothing steps every restored param.
TEST(StreamedAdam, StoredParamMissingFromModelIsAnErrorUntilRetired) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(6 * kChunk, true);
  std::vector<ParamDef> defs = SmallMix();
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    RegisterAll(sa.get(), env.mm.get(), defs);
    StepGrads sg(env.mm.get(), defs, 1);
    ASSERT_OK(sa->Step(sg.List(defs)));
  }
  env.Close();
  env.Open(6 * kChunk, false);
  const auto before = CommittedBytes(env.store.get());
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  EXPECT_TRUE(sa->UnregisteredParams().empty());  // nothing registered yet: all in use
  std::vector<ParamDef> kept = {defs[0], defs[2]};  // the model lost w2
  RegisterAll(sa.get(), env.mm.get(), kept);
  EXPECT_EQ(sa->UnregisteredParams(), std::vector<std::string>{"w2"});
  StepGrads sg(env.mm.get(), kept, 2);
  Status st = sa->Step(sg.List(kept));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_TRUE(Contains(st, env.store->path()) && Contains(st, "'w2' (" + std::to_string(defs[1].numel) + " elements)"))
      << st.ToString();
  EXPECT_EQ(DiffKeys(CommittedBytes(env.store.get()), before), "");
  EXPECT_EQ(sa->BeginStep().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(sa->RetireParam("w1").code(), StatusCode::kFailedPrecondition);  // registered in this run
  ASSERT_OK(sa->RetireParam("w2"));
  EXPECT_FALSE(sa->HasParam("w2"));
  EXPECT_EQ(sa->RegisterParam("w2", defs[1].numel, 1, nullptr, DType::kBF16).code(),
            StatusCode::kFailedPrecondition);
  ASSERT_OK(sa->Step(sg.List(kept)));
  ASSERT_OK(sa->WaitForCommit());
  EXPECT_EQ(env.store->LatestGeneration().step, 2u);
  auto after = CommittedBytes(env.store.get());
  for (const char* f : {"main", "exp_avg", "exp_avg_sq"}) {
    const std::string k = std::string("w2/") + f;
    ASSERT_EQ(after.count(k), 1u) << k << " dropped from the store";
    EXPECT_EQ(after[k], before.at(k)) << k << " changed";
    EXPECT_NE(after["w1/" + std::string(f)], before.at("w1/" + std::string(f))) << "w1 did not step";
  }
  // A gradient for the retired param is refused, naming it.
  StepGrads sg3(env.mm.get(), defs, 3);
  st = sa->Step(sg3.List(defs));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_TRUE(Contains(st, "w2") && Contains(st, "retired")) << st.ToString();
}

TEST(StreamedAdam, ClearErrors) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  env.Open(2 * kChunk, true);
  // Budget below one chunk per field in flight.
  auto small = StreamedAdam::Create(env.store.get(), env.mm.get(), {});
  EXPECT_EQ(small.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(small.status().message().find("one chunk per field"), std::string::npos) << small.status().ToString();
  env.mm.reset();
  env.mm = MUST(MemoryManager::Create(env.store.get(), TestMmOptions(3 * kChunk)));
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  std::vector<float> w(100, 1.0f);
  DeviceBuffer dw(env.mm.get(), 400);
  dw.Upload(w.data());
  ASSERT_OK(sa->RegisterParam("p", 100, 0, dw.get(), DType::kF32));
  EXPECT_EQ(sa->RegisterParam("p", 101, 0, dw.get(), DType::kF32).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sa->RegisterParam("q", 100, 0, dw.get(), std::nullopt).code(), StatusCode::kInvalidArgument);
  ParamGrad g;
  g.name = "unknown";
  g.d_grad = dw.get();
  Status st = sa->Step(std::span<const ParamGrad>(&g, 1));
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_NE(st.message().find("unknown"), std::string::npos);
  g.name = "p";
  g.grad_type = DType::kQ8S;
  st = sa->Step(std::span<const ParamGrad>(&g, 1));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_EQ(sa->step_count(0), 0u);
  g.grad_type = DType::kF32;
  ASSERT_OK(sa->Step(std::span<const ParamGrad>(&g, 1)));
  EXPECT_EQ(sa->step_count(0), 1u);
  ParamGroup bad;
  bad.beta1 = 1.5;
  EXPECT_EQ(sa->SetGroup(bad).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sa->EndStep().status().code(), StatusCode::kFailedPrecondition);
}

// ------------------------------------------------------------ host cache tier

// Many small tensors (norms, biases: a few KiB each) between big ones; every
// chunk a multiple of 4 KiB, so the tier's entry bytes equal the chunk bytes.
std::vector<ParamDef> ManySmallMix() {
  const uint64_t ce = kChunk / 4;
  std::vector<ParamDef> defs;
  for (int l = 0; l < 32; ++l) {
    const std::string p = "l" + std::to_string(100 + l);
    defs.push_back({p + ".norm", 1024, 1, DType::kF32, DType::kF32, std::nullopt});
    defs.push_back({p + ".bias", 2048, 0, DType::kF32, DType::kBF16, DType::kBF16});
    if (l % 8 == 0) {
      defs.push_back({p + ".w", 2 * ce + 4096, 0, DType::kBF16, DType::kF32, DType::kBF16});
    }
  }
  return defs;
}

// The tier's bytes for a state: each chunk of each field rounded up to 4 KiB.
uint64_t TierBytes(const std::vector<ParamDef>& defs) {
  uint64_t b = 0;
  for (const auto& d : defs) {
    for (uint64_t first = 0; first < d.numel; first += kChunk / 4) {
      b += 3 * ((std::min(kChunk / 4, d.numel - first) * 4 + 4095) / 4096 * 4096);
    }
  }
  return b;
}

// The policy's prediction for a tier of `capacity` bytes: a step walks the
// slices in order (params as given, chunks, then main, exp_avg, exp_avg_sq)
// and each chunk is admitted while it fits; nothing is evicted afterwards.
uint64_t AdmittedBytes(const std::vector<ParamDef>& defs, uint64_t capacity) {
  uint64_t used = 0;
  for (const auto& d : defs) {
    for (uint64_t first = 0; first < d.numel; first += kChunk / 4) {
      const uint64_t bytes = (std::min(kChunk / 4, d.numel - first) * 4 + 4095) / 4096 * 4096;
      for (int f = 0; f < 3; ++f) {
        if (used + bytes <= capacity) used += bytes;
      }
    }
  }
  return used;
}

// A tier that holds the whole state (64 tensors of a few KiB each among big
// ones; entries sized by their bytes, not by the chunk size): after the
// first step, a durable step reads nothing from the store, serves every
// chunk from RAM and still writes every byte through.
TEST(HostCacheTier, HoldsManySmallTensorsAndServesEveryReadAfterTheFirstStep) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  std::vector<ParamDef> defs = ManySmallMix();
  ASSERT_EQ(TierBytes(defs), StateBytes(defs));
  env.Open(6 * kChunk, true, TierBytes(defs));
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  for (uint64_t step = 1; step <= 4; ++step) {
    const MemoryStats before = env.mm->stats();
    StepWithReference(sa.get(), env.mm.get(), defs, &ref, step, 1.0f);
    ASSERT_OK(sa->WaitForCommit());  // its write tail and commit may run in the background (commit_lag_steps 1)
    const MemoryStats after = env.mm->stats();
    EXPECT_EQ(env.store->LatestGeneration().step, step) << "every step is durable";
    EXPECT_EQ(after.nvme_write_bytes - before.nvme_write_bytes, StateBytes(defs)) << "step " << step;
    if (step >= 2) {
      EXPECT_EQ(after.nvme_read_bytes - before.nvme_read_bytes, 0u) << "step " << step;
      EXPECT_EQ(after.cache_hit_bytes - before.cache_hit_bytes, StateBytes(defs)) << "step " << step;
    }
    EXPECT_EQ(after.cache_bytes, TierBytes(defs));
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// A tier of about half the state: the chunks admitted in the first step stay
// resident and serve the same bytes in every later step; the rest is read
// from the store. (LRU evicts, during each step's walk, exactly the chunks
// the next step reads first: it serves nothing here.)
TEST(HostCacheTier, HalfTheStateKeepsItsResidentSetAcrossSteps) {
  MEMMGR_REQUIRE_BACKEND();
  Env env;
  std::vector<ParamDef> defs = ManySmallMix();
  const uint64_t capacity = TierBytes(defs) / 2;
  const uint64_t resident = AdmittedBytes(defs, capacity);
  ASSERT_GT(resident, capacity - kChunk);
  ASSERT_LE(resident, capacity);
  env.Open(6 * kChunk, true, capacity);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  for (uint64_t step = 1; step <= 5; ++step) {
    const MemoryStats before = env.mm->stats();
    StepWithReference(sa.get(), env.mm.get(), defs, &ref, step, 1.0f);
    ASSERT_OK(sa->WaitForCommit());
    const MemoryStats after = env.mm->stats();
    EXPECT_EQ(env.store->LatestGeneration().step, step);
    EXPECT_EQ(after.nvme_write_bytes - before.nvme_write_bytes, StateBytes(defs)) << "step " << step;
    EXPECT_EQ(after.cache_bytes, resident) << "step " << step;
    if (step >= 2) {
      EXPECT_EQ(after.cache_hit_bytes - before.cache_hit_bytes, resident) << "step " << step;
      EXPECT_EQ(after.nvme_read_bytes - before.nvme_read_bytes, StateBytes(defs) - resident) << "step " << step;
    }
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// A step aborted midway (a kernel failure, or a chunk write that fails,
// after some slices were computed in their cache entries and written) leaves
// no bytes of the dropped generation in the tier: the retried step and the
// ones after equal the reference, for a tier holding the whole state and one
// holding half of it.
TEST(HostCacheTier, AbortedStepServesNoStaleBytes) {
  MEMMGR_REQUIRE_BACKEND();
  test_util::KernelFailures kernel_failures;
  std::vector<ParamDef> defs = ManySmallMix();
  for (const uint64_t capacity : {TierBytes(defs), TierBytes(defs) / 2}) {
    for (const bool io_fault : {false, true}) {
      SCOPED_TRACE("tier of " + std::to_string(capacity) + " bytes, " + (io_fault ? "write fault" : "kernel failure"));
      vfs::FaultInjectionFileSystem fs(vfs::FileSystem::Default());
      Env env;
      env.Open(6 * kChunk, true, capacity, false, MemoryManagerOptions::kAutoHashThreads, &fs);
      // The commit inside Step, so that a failed chunk write fails that Step
      // (with commit_lag_steps 1 it fails the next call: tested on its own).
      StreamedAdamOptions ao;
      ao.commit_lag_steps = 0;
      auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), ao));
      RegisterAll(sa.get(), env.mm.get(), defs);
      Reference ref(env.mm.get(), defs);
      auto groups = TestGroups();
      for (uint64_t step = 1; step <= 2; ++step) StepWithReference(sa.get(), env.mm.get(), defs, &ref, step, 1.0f);
      const uint64_t gen2 = env.store->LatestGeneration().generation;
      StepGrads sg3(env.mm.get(), defs, 3);
      if (io_fault) {
        // A write in the middle of the step: it writes the 24 whole chunks
        // and the 204 short ones in a few writes of adjacent pieces each.
        vfs::FaultRule rule = vfs::FaultRule::FailNth(vfs::OpClass::kWrite, 12);
        rule.path_contains = ".chunks";
        fs.AddRule(rule);
      } else {
        if (!test_util::KernelFailures::Available()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
        kernel_failures.FailAfter(defs.size() / 2);
      }
      Status st = sa->Step(sg3.List(defs));
      ASSERT_FALSE(st.ok());
      EXPECT_TRUE(Contains(st, io_fault ? "injected fault" : "injected")) << st.ToString();
      EXPECT_EQ(env.store->LatestGeneration().generation, gen2);
      fs.ClearRules();
      ASSERT_OK(sa->Step(sg3.List(defs)));
      for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, sg3.grad[i]->get(), 3, groups[defs[i].group], 1.0f);
      StepWithReference(sa.get(), env.mm.get(), defs, &ref, 4, 1.0f);
      ExpectStateEquals(env.mm.get(), ref, defs);
    }
  }
}

// A state of 13 slices for a pipeline of 4 staging sets (read_ahead_chunks 4).
std::vector<ParamDef> TailMix() {
  const uint64_t ce = kChunk / 4;
  return {
      {"w.0", 6 * ce + 1000, 0, DType::kBF16, DType::kBF16, DType::kBF16},
      {"norm", 3000, 1, DType::kF32, DType::kF32, std::nullopt},
      {"w.1", 5 * ce, 1, DType::kF32, DType::kBF16, DType::kF32},
      {"bias", ce / 2, 0, DType::kF32, DType::kF32, DType::kBF16},
  };
}

// The write tail: with a tier that holds the whole state and pipelined
// commits, a step gives each slice's staging set back once the slice is
// computed and leaves its writes to the background. With completions reaped
// only when the step can make no other progress, a step that had to wait for
// a write (more slices than staging sets) finds it complete when it returns;
// a step bound by its compute returns with every write still in the tail. Every commit holds
// exactly the step's state (read through a GenerationView after the wait),
// equal to the reference run bit for bit.
TEST(HostCacheTier, StepReturnsBeforeItsWritesAndTheCommitHoldsExactlyTheStep) {
  MEMMGR_REQUIRE_BACKEND();
  REQUIRE_SYNC_POINTS();
  const std::vector<ParamDef> defs = TailMix();
  Env env;
  env.read_ahead_chunks = 4;
  env.Open(6 * kChunk, true, TierBytes(defs));
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  SyncPointFlag reap(kReapOnlyWhenBlocked);
  for (uint64_t step = 1; step <= 4; ++step) {
    StepWithReference(sa.get(), env.mm.get(), defs, &ref, step, 1.0f);
    EXPECT_TRUE(sa->commit_in_flight());
    ASSERT_OK(sa->WaitForCommit());
    const StreamedAdam::StepStats& st = sa->last_step_stats();
    EXPECT_EQ(st.write_bytes, StateBytes(defs)) << "step " << step;
    if (step >= 2) {
      EXPECT_EQ(st.read_bytes, 0u) << "step " << step;
      EXPECT_EQ(st.write_tail_bytes, StateBytes(defs)) << "step " << step << ": no write held the step back";
    }
    EXPECT_EQ(env.store->LatestGeneration().step, step);
    auto got = CommittedBytes(env.store.get());
    got.erase("#generation");
    EXPECT_EQ(DiffKeys(got, ReferenceBytes(ref, defs)), "") << "step " << step;
    EXPECT_EQ(env.mm->stats().cache_bytes, TierBytes(defs)) << "the tail holds no memory beyond the tier";
    EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
  }
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// A chunk write of the write tail that fails (an injected EIO on a data file
// write that only the background finishes) fails that step's commit: the
// next call returns the error naming the step, the generation and the store;
// the store keeps the last generation bit for bit, the optimizer is back at
// it, and the retried steps equal the reference.
TEST(HostCacheTier, FailedWriteInTheTailSurfacesAtTheNextCallAndKeepsTheLastGeneration) {
  MEMMGR_REQUIRE_BACKEND();
  REQUIRE_SYNC_POINTS();
  const std::vector<ParamDef> defs = TailMix();
  const auto groups = TestGroups();
  vfs::FaultInjectionFileSystem fs(vfs::FileSystem::Default());
  Env env;
  env.read_ahead_chunks = 4;
  env.Open(6 * kChunk, true, TierBytes(defs), false, MemoryManagerOptions::kAutoHashThreads, &fs);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  RegisterAll(sa.get(), env.mm.get(), defs);
  Reference ref(env.mm.get(), defs);
  SyncPointFlag reap(kReapOnlyWhenBlocked);  // every write of step 2 is in the tail
  StepWithReference(sa.get(), env.mm.get(), defs, &ref, 1, 1.0f);
  ASSERT_OK(sa->WaitForCommit());
  const vfs::GenerationInfo good = env.store->LatestGeneration();
  const auto want1 = ReferenceBytes(ref, defs);
  vfs::FaultRule rule = vfs::FaultRule::FailNth(vfs::OpClass::kWrite, 20);
  rule.path_contains = ".chunks";
  fs.AddRule(rule);
  StepGrads g2(env.mm.get(), defs, 2);
  ASSERT_OK(sa->Step(g2.List(defs)));  // the step succeeds; a write of its tail fails later
  Status st = sa->WaitForCommit();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(fs.InjectedCount(), 1u);
  for (const std::string& part : {std::string("background commit of step 2"),
                                  "generation " + std::to_string(good.generation + 1), env.store->path(),
                                  std::string("injected fault")}) {
    EXPECT_TRUE(Contains(st, part)) << "'" << part << "' missing from: " << st.ToString();
  }
  EXPECT_EQ(sa->step_count(0), 1u);
  EXPECT_EQ(sa->last_generation(), good.generation);
  EXPECT_EQ(env.store->LatestGeneration().generation, good.generation);
  auto got = CommittedBytes(env.store.get());
  got.erase("#generation");
  EXPECT_EQ(DiffKeys(got, want1), "") << "the store must hold step 1 exactly";
  fs.ClearRules();
  ASSERT_OK(sa->Step(g2.List(defs)));
  for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, g2.grad[i]->get(), 2, groups[defs[i].group], 1.0f);
  StepWithReference(sa.get(), env.mm.get(), defs, &ref, 3, 1.0f);
  ASSERT_OK(sa->WaitForCommit());
  got = CommittedBytes(env.store.get());
  got.erase("#generation");
  EXPECT_EQ(DiffKeys(got, ReferenceBytes(ref, defs)), "");
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// Prefetch into a cold tier (a reopened store; a whole-state tier, one of
// half the state, and none: then the first slices go to staging buffers that
// the step's pipeline adopts, 3 of its 4 sets' worth): the step finds in RAM
// what the prefetch read and reads only the rest from the store, and every
// step's params, committed state and optimizer state equal a run without
// prefetch and the reference bit for bit. The manager's Flush waits for the
// prefetch to end (rather than a step stopping it midway), so the counts are
// exact.
TEST(HostCacheTier, PrefetchedStateServesTheStepAndChangesNoResult) {
  MEMMGR_REQUIRE_BACKEND();
  const std::vector<ParamDef> defs = TailMix();
  const auto groups = TestGroups();
  for (const uint64_t capacity : {TierBytes(defs), TierBytes(defs) / 2, uint64_t{0}}) {
    SCOPED_TRACE("tier of " + std::to_string(capacity) + " bytes");
    Env scratch;
    scratch.Open(3 * kChunk, true);
    Reference ref(scratch.mm.get(), defs);
    Env with, without;
    with.read_ahead_chunks = without.read_ahead_chunks = 4;
    with.Open(6 * kChunk, true, capacity);
    without.Open(6 * kChunk, true, capacity);
    for (Env* e : {&with, &without}) {
      auto sa = MUST(StreamedAdam::Create(e->store.get(), e->mm.get(), {}));
      RegisterAll(sa.get(), e->mm.get(), defs);
    }  // committed at destruction
    for (uint64_t step = 1; step <= (capacity == TierBytes(defs) ? 2u : 1u); ++step) {
      // A cold tier at every step: the optimizer and the manager reopen.
      with.Close();
      without.Close();
      with.Open(6 * kChunk, false, capacity);
      without.Open(6 * kChunk, false, capacity);
      auto sa_with = MUST(StreamedAdam::Create(with.store.get(), with.mm.get(), {}));
      auto sa_without = MUST(StreamedAdam::Create(without.store.get(), without.mm.get(), {}));
      ASSERT_OK(sa_with->Prefetch());
      EXPECT_TRUE(sa_with->prefetch_running());
      ASSERT_OK(sa_with->Prefetch());  // a second call while one runs does nothing
      ASSERT_OK(with.mm->Flush());     // waits for the prefetch to end
      const MemoryStats before = with.mm->stats();
      StepGrads gw(with.mm.get(), defs, step), go(without.mm.get(), defs, step);
      ASSERT_OK(sa_with->Step(gw.List(defs)));
      ASSERT_OK(sa_without->Step(go.List(defs)));
      for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, go.grad[i]->get(), step, groups[defs[i].group], 1.0f);
      const StreamedAdam::StepStats& st = sa_with->last_step_stats();
      EXPECT_GT(st.prefetch_read_bytes, 0u);
      EXPECT_EQ(st.prefetch_hit_bytes, st.prefetch_read_bytes) << "the step found every prefetched byte";
      EXPECT_EQ(st.read_bytes, StateBytes(defs) - st.prefetch_hit_bytes);
      if (capacity == TierBytes(defs)) {
        EXPECT_EQ(st.prefetch_hit_bytes, StateBytes(defs));
      }
      if (capacity == 0) {
        // 12 staging buffers for the pipeline less one slice: 9 chunks, the
        // first three slices in the params' order by name (a reopened
        // optimizer has no step order yet): bias, norm, w.0's first chunk.
        EXPECT_EQ(st.prefetch_hit_bytes, 3 * (kChunk / 2 + 3000 * 4 + kChunk));
      }
      EXPECT_EQ(sa_without->last_step_stats().prefetch_hit_bytes, 0u);
      for (size_t i = 0; i < defs.size(); ++i) {
        if (!defs[i].param_type) continue;
        std::vector<uint8_t> pw(defs[i].numel * Size(defs[i].param_type)), po(pw.size());
        gw.param[i]->Download(pw.data());
        go.param[i]->Download(po.data());
        EXPECT_EQ(pw, po) << defs[i].name << " at step " << step;
      }
      ASSERT_OK(sa_with->WaitForCommit());
      ASSERT_OK(sa_without->WaitForCommit());
      // The manager counts a pipelined step's reads when its background
      // commit ends: read once that commit is waited for.
      EXPECT_EQ(with.mm->stats().nvme_read_bytes - before.nvme_read_bytes, st.read_bytes);
      auto cw = CommittedBytes(with.store.get());
      auto co = CommittedBytes(without.store.get());
      EXPECT_EQ(DiffKeys(cw, co), "") << "step " << step;
      cw.erase("#generation");
      EXPECT_EQ(DiffKeys(cw, ReferenceBytes(ref, defs)), "") << "step " << step;
      EXPECT_EQ(with.mm->stats().staging_in_use, 0u);
    }
  }
}

// Prefetch is safe at any time: during a step (nothing), with a commit in
// flight (it reads after the commit), before a sleep (ReleaseAll waits for
// it), before a failed step, before a commit that fails, with no step
// following (the destructor stops it), and without a tier. Nothing
// leaks (staging buffers all back) or deadlocks, and the state equals the
// reference after each. (Without a tier it stages the first slices: its own
// test below.)
TEST(HostCacheTier, PrefetchIsSafeAtAnyTime) {
  MEMMGR_REQUIRE_BACKEND();
  test_util::KernelFailures kernel_failures;
  const std::vector<ParamDef> defs = SmallMix();
  const auto groups = TestGroups();
  vfs::FaultInjectionFileSystem fs(vfs::FileSystem::Default());
  Env env;
  env.Open(6 * kChunk, true, TierBytes(defs), false, MemoryManagerOptions::kAutoHashThreads, &fs);
  Env scratch;
  scratch.Open(3 * kChunk, true);
  Reference ref(scratch.mm.get(), defs);
  {
    auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
    RegisterAll(sa.get(), env.mm.get(), defs);
    ASSERT_OK(sa->Prefetch());  // before any step: the registrations' pending generation
    StepWithReference(sa.get(), env.mm.get(), defs, &ref, 1, 1.0f);
    // With the commit of step 1 in flight, then a sleep.
    ASSERT_OK(sa->Prefetch());
    ASSERT_OK(env.mm->ReleaseAll());
    EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
    // During a step: nothing.
    StepGrads g2(env.mm.get(), defs, 2);
    ASSERT_OK(sa->BeginStep());
    ASSERT_OK(sa->Prefetch());
    EXPECT_FALSE(sa->prefetch_running());
    for (const ParamGrad& g : g2.List(defs)) ASSERT_OK(sa->StepParam(g));
    ASSERT_TRUE(sa->EndStep().ok());
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, g2.grad[i]->get(), 2, groups[defs[i].group], 1.0f);
    // Before a failed step (a kernel failure), then the retry.
    StepGrads g3(env.mm.get(), defs, 3);
    ASSERT_OK(sa->Prefetch());
    if (!test_util::KernelFailures::Available()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
    kernel_failures.FailAfter(2);
    EXPECT_FALSE(sa->Step(g3.List(defs)).ok());
    EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
    ASSERT_OK(sa->Prefetch());
    ASSERT_OK(sa->Step(g3.List(defs)));
    for (size_t i = 0; i < defs.size(); ++i) ref.Step(i, g3.grad[i]->get(), 3, groups[defs[i].group], 1.0f);
    ASSERT_OK(sa->WaitForCommit());
    // Before a commit that fails (its data sync): the prefetch reads nothing
    // of the dropped step, and the error comes at the next call as always.
    StepGrads g4(env.mm.get(), defs, 4);
    vfs::FaultRule rule = vfs::FaultRule::FailNth(vfs::OpClass::kSync, 1);
    rule.path_contains = ".chunks";
    fs.AddRule(rule);
    ASSERT_OK(sa->Step(g4.List(defs)));
    ASSERT_OK(sa->Prefetch());
    Status st = sa->WaitForCommit();
    EXPECT_FALSE(st.ok());
    EXPECT_TRUE(Contains(st, "background commit of step 4")) << st.ToString();
    EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
    fs.ClearRules();
    // With no step following: the destructor stops it.
    ASSERT_OK(sa->Prefetch());
  }
  EXPECT_EQ(env.mm->stats().staging_in_use, 0u);
  env.Close();
  env.Open(6 * kChunk, false, TierBytes(defs));  // a failed fdatasync poisons the store until reopened
  ExpectStateEquals(env.mm.get(), ref, defs);
  env.Close();
  env.Open(6 * kChunk, false, 0);
  auto sa = MUST(StreamedAdam::Create(env.store.get(), env.mm.get(), {}));
  ASSERT_OK(sa->Prefetch());  // without a tier: into staging buffers
  StepWithReference(sa.get(), env.mm.get(), defs, &ref, 4, 1.0f);
  ASSERT_OK(sa->WaitForCommit());
  ExpectStateEquals(env.mm.get(), ref, defs);
}

// Without a tier, prefetched chunks wait in staging buffers for the next
// step only: MakeDurable, a registration, the destructor and a failed step
// give them back unread (staging_in_use returns to 0), and a write through a
// pin after the prefetch makes the step read from the store, so the step
// sees the written bytes (equal to a run that never prefetched).
TEST(StreamedAdam, StagedPrefetchServesOnlyTheNextStepAndLeaksNothing) {
  MEMMGR_REQUIRE_BACKEND();
  test_util::KernelFailures kernel_failures;
  const std::vector<ParamDef> defs = TailMix();
  Env with, without;
  with.read_ahead_chunks = without.read_ahead_chunks = 4;
  with.Open(6 * kChunk, true, 0);
  without.Open(6 * kChunk, true, 0);
  auto sa = MUST(StreamedAdam::Create(with.store.get(), with.mm.get(), {}));
  auto sb = MUST(StreamedAdam::Create(without.store.get(), without.mm.get(), {}));
  RegisterAll(sa.get(), with.mm.get(), defs);
  RegisterAll(sb.get(), without.mm.get(), defs);
  auto staged_now = [&] { return with.mm->stats().staging_in_use; };
  // Staged, then MakeDurable: dropped.
  ASSERT_OK(sa->Prefetch());
  ASSERT_OK(with.mm->Flush());
  EXPECT_EQ(staged_now(), 9u);
  MUST(sa->MakeDurable());
  MUST(sb->MakeDurable());
  EXPECT_EQ(staged_now(), 0u);
  // Staged, then a write through a pin (main of w.0, chunk 0, both runs):
  // the step reads the written bytes from the store.
  ASSERT_OK(sa->Prefetch());
  ASSERT_OK(with.mm->Flush());
  for (MemoryManager* mm : {with.mm.get(), without.mm.get()}) {
    std::vector<float> v(1000, 0.5f);
    auto pin = MUST(mm->Pin("w.0", "main", 100, v.size(), Access::kReadWrite));
    ASSERT_OK(mm->CopyToDevice(pin.data(), v.data(), v.size() * 4));
    ASSERT_OK(pin.Unpin());
    ASSERT_OK(mm->Flush());
  }
  StepGrads ga(with.mm.get(), defs, 1), gb(without.mm.get(), defs, 1);
  ASSERT_OK(sa->Step(ga.List(defs)));
  ASSERT_OK(sb->Step(gb.List(defs)));
  EXPECT_EQ(sa->last_step_stats().prefetch_hit_bytes, 0u);
  ASSERT_OK(sa->WaitForCommit());
  ASSERT_OK(sb->WaitForCommit());
  EXPECT_EQ(staged_now(), 0u);
  auto ca = CommittedBytes(with.store.get()), cb = CommittedBytes(without.store.get());
  EXPECT_EQ(DiffKeys(ca, cb), "") << "after a pin write";
  // Staged, then a failed step (a kernel failure after the adopted slices):
  // nothing leaks, and the retried step is served by a new prefetch.
  StepGrads ga2(with.mm.get(), defs, 2), gb2(without.mm.get(), defs, 2);
  ASSERT_OK(sa->Prefetch());
  if (!test_util::KernelFailures::Available()) GTEST_SKIP() << "built without OPTSTATE_TEST_HOOKS";
  kernel_failures.FailAfter(5);
  EXPECT_FALSE(sa->Step(ga2.List(defs)).ok());
  EXPECT_EQ(staged_now(), 0u);
  ASSERT_OK(sa->Prefetch());
  ASSERT_OK(with.mm->Flush());
  ASSERT_OK(sa->Step(ga2.List(defs)));
  ASSERT_OK(sb->Step(gb2.List(defs)));
  EXPECT_EQ(sa->last_step_stats().prefetch_hit_bytes, 9 * kChunk);
  ASSERT_OK(sa->WaitForCommit());
  ASSERT_OK(sb->WaitForCommit());
  ca = CommittedBytes(with.store.get());
  cb = CommittedBytes(without.store.get());
  EXPECT_EQ(DiffKeys(ca, cb), "") << "after a failed step and its retry";
  // Staged, then a registration; then staged and the destructor.
  ASSERT_OK(sa->Prefetch());
  ASSERT_OK(with.mm->Flush());
  EXPECT_EQ(staged_now(), 9u);
  ASSERT_OK(sa->RegisterParam("late", 1000, 0, nullptr, DType::kF32));
  EXPECT_EQ(staged_now(), 0u);
  ASSERT_OK(sa->Prefetch());
  ASSERT_OK(with.mm->Flush());
  sa.reset();
  EXPECT_EQ(staged_now(), 0u);
}

// A prefetch that the step stops wherever it happens to be (called right
// before each step, its reads in flight, some chunks staged or in the tier
// and some not) changes no result: with a tier of half the state and with
// none, every committed generation equals a run without prefetch.
TEST(StreamedAdam, PrefetchStoppedByTheStepChangesNoResult) {
  MEMMGR_REQUIRE_BACKEND();
  const std::vector<ParamDef> defs = TailMix();
  for (const uint64_t capacity : {TierBytes(defs) / 2, uint64_t{0}}) {
    SCOPED_TRACE("tier of " + std::to_string(capacity) + " bytes");
    Env with, without;
    with.read_ahead_chunks = without.read_ahead_chunks = 4;
    with.Open(6 * kChunk, true, capacity);
    without.Open(6 * kChunk, true, capacity);
    auto sa = MUST(StreamedAdam::Create(with.store.get(), with.mm.get(), {}));
    auto sb = MUST(StreamedAdam::Create(without.store.get(), without.mm.get(), {}));
    RegisterAll(sa.get(), with.mm.get(), defs);
    RegisterAll(sb.get(), without.mm.get(), defs);
    for (uint64_t step = 1; step <= 4; ++step) {
      StepGrads ga(with.mm.get(), defs, step), gb(without.mm.get(), defs, step);
      ASSERT_OK(sa->Prefetch());
      ASSERT_OK(sa->Step(ga.List(defs)));
      ASSERT_OK(sb->Step(gb.List(defs)));
      ASSERT_OK(sa->WaitForCommit());
      ASSERT_OK(sb->WaitForCommit());
      EXPECT_EQ(DiffKeys(CommittedBytes(with.store.get()), CommittedBytes(without.store.get())), "")
          << "step " << step;
      EXPECT_EQ(with.mm->stats().staging_in_use, 0u);
    }
  }
}

// host_cache_bytes defaults to kAutoHostCache, which Create resolves from
// MemAvailable (half of it at most); 0 stays off.
TEST(HostCacheTier, AutomaticSizeComesFromMemAvailable) {
  MEMMGR_REQUIRE_BACKEND();
  EXPECT_EQ(MemoryManagerOptions{}.host_cache_bytes, MemoryManagerOptions::kAutoHostCache);
  uint64_t avail = 0;
  std::ifstream in("/proc/meminfo");
  for (std::string key; in >> key;) {
    uint64_t kib = 0;
    in >> kib;
    if (key == "MemAvailable:") avail = kib << 10;
    in.ignore(1 << 10, '\n');
  }
  ASSERT_GT(avail, 0u);
  Env env;
  env.Open(3 * kChunk, true, MemoryManagerOptions::kAutoHostCache);
  const uint64_t chosen = env.mm->options().host_cache_bytes;
  EXPECT_NE(chosen, MemoryManagerOptions::kAutoHostCache);
  // MemAvailable moves between the two reads: allow 1 GiB of drift.
  EXPECT_LE(chosen, avail / 2 + (1ull << 30));
  if (avail > (16ull << 30) && std::getenv("LOCAL_WORLD_SIZE") == nullptr) {
    EXPECT_GT(chosen, 0u);
  }
  env.Close();
  env.Open(3 * kChunk, false, 0);
  EXPECT_EQ(env.mm->options().host_cache_bytes, 0u);
}

}  // namespace
}  // namespace optstate::memmgr::testing
