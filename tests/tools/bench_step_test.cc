// optstate-bench step's deterministic synthetic mode, checked against an
// independent fp64 AdamW (torch.optim.AdamW semantics) of the bench's w0 and g
// formulas, read back from the store it leaves behind.
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tests/tools/tools_test_util.h"
#include "tools/bench_miles_streaming.h"
#include "tools/internal/device_buffer.h"
#include "tools/internal/store_read.h"
#include "vfs/store.h"

namespace optstate::tools {
namespace {

using testing::ParseJson;
using testing::TempDir;
using testing::Tool;

TEST(BenchStepTest, SyntheticModeMatchesAnFp64AdamW) {
  TempDir dir;
  const std::string store_path = dir / "synthetic";
  const uint64_t n = 1'100'000;   // param.0 spans 2 chunks of 2 MiB
  const uint32_t tensors = 2;
  const uint64_t steps = 3;
  auto r = Tool("optstate-bench", {"step", "--store", store_path, "--params", std::to_string(n),
                                   "--steps", std::to_string(steps), "--tensors",
                                   std::to_string(tensors), "--snapshot", "after3",
                                   "--chunk-size", "2M", "--budget", "16M", "--backend", "host",
                                   "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  EXPECT_EQ(j["step_count"].get<uint64_t>(), steps);

  auto s = vfs::Store::OpenReadOnly(store_path, vfs::StoreOptions{});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto view = (*s)->OpenSnapshot("after3");
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  ASSERT_EQ((*view)->tensors().size(), tensors);
  ASSERT_EQ((*view)->info().groups.size(), 1u);
  EXPECT_EQ((*view)->info().groups[0].step_count, steps);

  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  for (uint32_t k = 0; k < tensors; ++k) {
    auto t = (*view)->FindTensor("param." + std::to_string(k));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const uint64_t numel = n / tensors + (k < n % tensors ? 1 : 0);
    ASSERT_EQ(t->numel, numel);
    std::vector<float> got[3];
    for (uint32_t f = 0; f < 3; ++f) {
      got[f].reserve(numel);
      ASSERT_TRUE(ForEachRange(**view, *t, f, 0, numel,
                               [&](uint64_t, const void* d, uint64_t cnt) -> Status {
                                 const float* p = static_cast<const float*>(d);
                                 got[f].insert(got[f].end(), p, p + cnt);
                                 return Status::Ok();
                               }).ok());
    }
    double max_err[3] = {0, 0, 0};
    for (uint64_t i = 0; i < numel; ++i) {
      double w = static_cast<float>(0.1 * std::cos(0.25 * static_cast<double>(i) + k));
      double m = 0, v = 0;
      for (uint64_t st = 1; st <= steps; ++st) {
        double g = static_cast<float>(0.01 * std::sin(0.5 * static_cast<double>(i) + 1.3 * st + k));
        w *= 1 - lr * wd;
        m = b1 * m + (1 - b1) * g;
        v = b2 * v + (1 - b2) * g * g;
        double bc1 = 1 - std::pow(b1, st), bc2 = 1 - std::pow(b2, st);
        w -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
      }
      double ref[3] = {w, m, v};
      // Relative error, with a floor at ~1% of each field's typical magnitude
      // (values crossing zero have no meaningful relative error).
      const double scale[3] = {1e-3, 1e-5, 1e-8};
      for (int f = 0; f < 3; ++f) {
        double e = std::fabs(got[f][i] - ref[f]) / (std::fabs(ref[f]) + scale[f]);
        max_err[f] = std::max(max_err[f], e);
      }
    }
    EXPECT_LT(max_err[0], 1e-4) << "main of param." << k;
    EXPECT_LT(max_err[1], 1e-4) << "exp_avg of param." << k;
    EXPECT_LT(max_err[2], 1e-3) << "exp_avg_sq of param." << k;
  }
  // The store is left behind and inspectable.
  auto v = Tool("optstate-inspect", {store_path, "verify", "--json"});
  EXPECT_EQ(v.exit_code, 0) << v.err << v.out;
}

// Continuing a store with other --params/--tensors: refused with exit 1 and
// a message naming the store, the tensor and both sizes (it used to keep the
// stored sizes silently, or crash reading past the smaller gradients); the
// store's latest generation and bytes stay as they were.
TEST(BenchStepTest, ContinuingWithOtherSizesIsRefusedAndChangesNothing) {
  TempDir dir;
  const std::string store_path = dir / "resumed";
  const std::vector<std::string> common = {"--chunk-size", "2M", "--budget", "16M", "--backend", "host"};
  auto run = [&](const std::string& params, const std::string& tensors) {
    std::vector<std::string> args = {"step", "--store", store_path, "--params", params, "--steps", "1",
                                     "--tensors", tensors};
    args.insert(args.end(), common.begin(), common.end());
    return Tool("optstate-bench", args);
  };
  auto made = run("3000017", "2");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  // The committed state, read independently of the bench.
  auto snapshot = [&](uint64_t* generation) {
    std::vector<float> all;
    auto s = vfs::Store::OpenReadOnly(store_path, vfs::StoreOptions{});
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return all;
    auto view = (*s)->OpenGeneration(vfs::kLatest);
    EXPECT_TRUE(view.ok()) << view.status().ToString();
    if (!view.ok()) return all;
    *generation = (*view)->info().generation;
    for (const vfs::TensorInfo& t : (*view)->tensors()) {
      for (uint32_t f = 0; f < 3; ++f) {
        EXPECT_TRUE(ForEachRange(**view, t, f, 0, t.numel, [&](uint64_t, const void* d, uint64_t cnt) -> Status {
                      const float* p = static_cast<const float*>(d);
                      all.insert(all.end(), p, p + cnt);
                      return Status::Ok();
                    }).ok());
      }
    }
    return all;
  };
  uint64_t gen_before = 0;
  const std::vector<float> before = snapshot(&gen_before);
  ASSERT_EQ(before.size(), 3u * 3000017u);

  struct Case {
    std::string params, tensors;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      // The reported crash: 999 params in 2 tensors (500 + 499).
      {"999", "2", {"param.0", "1500009", "500", "param.1", "1500008", "499"}},
      // A model that lost a tensor: param.1 is in the store only.
      {"1500009", "1", {"param.1", "1500008", "not in --tensors 1"}},
      // One more tensor, with other sizes.
      {"3000017", "3", {"param.2", "not in the store", "1000006"}},
  };
  for (const Case& c : cases) {
    auto r = run(c.params, c.tensors);
    const std::string what = "--params " + c.params + " --tensors " + c.tensors;
    EXPECT_EQ(r.exit_code, 1) << what << "\n" << r.err;
    EXPECT_NE(r.err.find("optstate-bench step: error:"), std::string::npos) << what << "\n" << r.err;
    EXPECT_NE(r.err.find(store_path), std::string::npos) << what << "\n" << r.err;
    for (const auto& part : c.parts) EXPECT_NE(r.err.find(part), std::string::npos) << what << ": " << part << "\n" << r.err;
    // It says how to continue the store.
    EXPECT_NE(r.err.find("--params 3000017 --tensors 2"), std::string::npos) << what << "\n" << r.err;
    uint64_t gen = 0;
    EXPECT_TRUE(snapshot(&gen) == before) << what << " changed the store";
    EXPECT_EQ(gen, gen_before) << what << " committed";
  }
  // The matching flags continue it.
  auto again = run("3000017", "2");
  EXPECT_EQ(again.exit_code, 0) << again.err;
  uint64_t gen_after = 0;
  snapshot(&gen_after);
  EXPECT_EQ(gen_after, gen_before + 1);
}

// Miles' NVMe streaming as the bench runs it does the real work: after
// two steps (the first reads only the mains, the second all three segments)
// its bucket files hold, at the offsets of its layout ([main | exp_avg |
// exp_avg_sq] per bucket, every parameter's region 4096-aligned, buckets
// closed at the element limit), exactly what StreamedAdam's store holds for
// the same weights and gradients, and both wrote the same bf16 parameters.
// With bf16 moments (miles' streaming's moment_dtype "bf16") the moment
// segments hold bf16, and so do the store's.
class MilesStreamingBaselineTest : public ::testing::TestWithParam<MomentDType> {};

TEST_P(MilesStreamingBaselineTest, ComputesWhatStreamedAdamComputes) {
  const MomentDType moments = GetParam();
  const uint64_t moment_bytes = moments == MomentDType::kBF16 ? 2 : 4;
  TempDir dir;
  const std::vector<std::pair<std::string, uint64_t>> params = {
      {"a", 1000}, {"b", 70001}, {"c", 3}, {"d", 300000}};
  uint64_t max_numel = 0;
  for (auto& p : params) max_numel = std::max(max_numel, p.second);
  vfs::StoreOptions so;
  so.chunk_size_bytes = 2ull << 20;
  auto store = vfs::Store::Create(dir / "store", so);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  memmgr::MemoryManagerOptions mo;
  mo.backend = memmgr::Backend::kHost;
  mo.device_budget_bytes = 16ull << 20;
  auto mm = memmgr::MemoryManager::Create(store->get(), mo);
  ASSERT_TRUE(mm.ok()) << mm.status().ToString();
  memmgr::StreamedAdamOptions ao;
  ao.moment_dtype = moments;
  auto opt = memmgr::StreamedAdam::Create(store->get(), mm->get(), ao);
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  memmgr::ParamGroup g;
  g.lr = 1e-2;
  g.weight_decay = 0.1;
  ASSERT_TRUE((*opt)->SetGroup(g).ok());

  std::vector<float> w0(max_numel);
  for (uint64_t i = 0; i < max_numel; ++i) w0[i] = static_cast<float>(0.1 * std::cos(0.25 * static_cast<double>(i)));
  auto d_w0 = DeviceBuffer::Make(mm->get(), max_numel * 4);
  ASSERT_TRUE(d_w0.ok());
  ASSERT_TRUE((*mm)->CopyToDevice(d_w0->get(), w0.data(), max_numel * 4).ok());
  std::vector<DeviceBuffer> grads, ours_bf16, fv_bf16;
  for (auto& [name, n] : params) {
    ASSERT_TRUE((*opt)->RegisterParam(name, n, 0, d_w0->get(), DType::kF32).ok()) << name;
    for (auto* v : {&grads, &ours_bf16, &fv_bf16}) {
      auto d = DeviceBuffer::Make(mm->get(), n * 4);
      ASSERT_TRUE(d.ok());
      v->push_back(std::move(*d));
    }
  }
  bench::MilesStreamingOptions fo;
  fo.bucket_numel_limit = 71000;  // buckets {a, b} (closed at 71001) and {c, d}
  fo.staging_bytes = 64 << 10;    // several staging chunks per parameter
  fo.adam.lr = g.lr;
  fo.adam.weight_decay = g.weight_decay;
  fo.moment_type = moments;
  auto fv = bench::MilesStreamingBaseline::Create(dir / "fv", params, mm->get(), w0.data(), fo);
  ASSERT_TRUE(fv.ok()) << fv.status().ToString();
  ASSERT_EQ((*fv)->buckets().size(), 2u);

  for (uint64_t t = 1; t <= 2; ++t) {
    std::vector<memmgr::ParamGrad> pg;
    std::vector<const void*> fv_grads;
    std::vector<void*> fv_params;
    for (size_t p = 0; p < params.size(); ++p) {
      std::vector<float> gh(params[p].second);
      for (uint64_t i = 0; i < gh.size(); ++i) {
        gh[i] = static_cast<float>(0.01 * std::sin(0.5 * static_cast<double>(i) + 1.3 * static_cast<double>(t) + p));
      }
      ASSERT_TRUE((*mm)->CopyToDevice(grads[p].get(), gh.data(), gh.size() * 4).ok());
      memmgr::ParamGrad x;
      x.name = params[p].first;
      x.d_grad = grads[p].get();
      x.d_param = ours_bf16[p].get();
      x.param_type = DType::kBF16;
      x.numel = params[p].second;
      pg.push_back(x);
      fv_grads.push_back(grads[p].get());
      fv_params.push_back(fv_bf16[p].get());
    }
    ASSERT_TRUE((*opt)->Step(pg).ok());
    Status s = (*fv)->Step(fv_grads, fv_params);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_EQ((*fv)->step_count(), 2u);
  // Step() returns with its commit in flight (commit_lag_steps 1): the
  // second step's generation is the latest only once it is committed.
  ASSERT_TRUE((*opt)->WaitForCommit().ok());

  // The layout, computed here: bucket i holds these params; segment by
  // segment, each param's region rounded up to 4096 bytes.
  const std::vector<std::vector<size_t>> members = {{0, 1}, {2, 3}};
  auto view = (*store)->OpenGeneration(vfs::kLatest);
  ASSERT_TRUE(view.ok()) << view.status().ToString();
  for (size_t b = 0; b < members.size(); ++b) {
    char name[32];
    std::snprintf(name, sizeof(name), "bucket%05zu.bin", b);
    const std::string path = dir / ("fv/" + std::string(name));
    int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0) << path;
    uint64_t at = 0;
    for (uint32_t f = 0; f < 3; ++f) {
      for (size_t p : members[b]) {
        const uint64_t n = params[p].second;
        const uint64_t es = f == 0 ? 4 : moment_bytes;
        std::vector<char> disk(n * es);
        ASSERT_EQ(::pread(fd, disk.data(), n * es, static_cast<off_t>(at)), static_cast<ssize_t>(n * es)) << path;
        at += (n * es + 4095) / 4096 * 4096;
        auto t = (*view)->FindTensor(params[p].first);
        ASSERT_TRUE(t.ok());
        std::vector<char> ours;
        ASSERT_TRUE(ForEachRange(**view, *t, f, 0, n, [&](uint64_t, const void* d, uint64_t cnt) -> Status {
                      const char* q = static_cast<const char*>(d);
                      ours.insert(ours.end(), q, q + cnt * es);
                      return Status::Ok();
                    }).ok());
        ASSERT_EQ(ours.size(), n * es);
        EXPECT_EQ(std::memcmp(disk.data(), ours.data(), n * es), 0)
            << "field " << f << " of " << params[p].first << " in " << path;
        // The first element, decoded (a bf16 is the high half of an fp32).
        uint32_t bits = 0;
        std::memcpy(reinterpret_cast<char*>(&bits) + (4 - es), disk.data(), es);
        float first;
        std::memcpy(&first, &bits, 4);
        if (f == 0) {
          EXPECT_NE(first, w0[0]) << params[p].first << ": main not updated";
        }
        if (f == 2) {
          EXPECT_GT(first, 0.0f) << params[p].first << ": exp_avg_sq empty";
        }
      }
    }
    struct stat st;
    ASSERT_EQ(::fstat(fd, &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), at) << path << ": posix_fallocate'd to the layout's size";
    ::close(fd);
  }
  for (size_t p = 0; p < params.size(); ++p) {
    EXPECT_EQ(std::memcmp(ours_bf16[p].get(), fv_bf16[p].get(), params[p].second * 2), 0)
        << "bf16 params of " << params[p].first;
  }

  // Cold-cache emulation: after a step the files are in the page cache;
  // after DropPageCache none of them is (a tmpfs keeps everything: skipped).
  auto cached = (*fv)->ResidentBytes();
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  EXPECT_EQ(*cached, (*fv)->file_bytes());
  struct statfs sfs;
  ASSERT_EQ(::statfs(dir.path().c_str(), &sfs), 0);
  if (sfs.f_type == TMPFS_MAGIC) GTEST_SKIP() << dir.path() << " is a tmpfs: no page cache to drop";
  double sync_s = -1;
  ASSERT_TRUE((*fv)->DropPageCache(&sync_s).ok());
  EXPECT_GE(sync_s, 0.0);
  cached = (*fv)->ResidentBytes();
  ASSERT_TRUE(cached.ok());
  EXPECT_EQ(*cached, 0u);
}

INSTANTIATE_TEST_SUITE_P(Moments, MilesStreamingBaselineTest,
                         ::testing::Values(MomentDType::kF32, MomentDType::kBF16),
                         [](const ::testing::TestParamInfo<MomentDType>& i) {
                           return i.param == MomentDType::kBF16 ? std::string("Bf16") : std::string("F32");
                         });

// The comparison mode's JSON names each baseline and gives ours / baseline;
// an unknown baseline is refused by name.
TEST(BenchStepTest, CompareModeReportsEachMilesStreamingBaseline) {
  TempDir dir;
  auto r = Tool("optstate-bench", {"step", "--dir", dir.path(), "--state", "12M", "--rounds", "1", "--no-fio",
                                   "--backend", "host", "--budget", "64M", "--baselines", "warm,cold", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  for (const char* k : {"miles_warm", "miles_cold"}) {
    ASSERT_EQ(j["seconds"][k].size(), 1u) << k << " " << j["seconds"].dump();
    EXPECT_GT(j["ours_over"][k].get<double>(), 0.0) << k;
  }
  EXPECT_TRUE(j["seconds"]["sync_direct_engine"].empty());
  EXPECT_EQ(j["names"]["miles_warm"], "miles' streaming, buffered, page cache warm");
  EXPECT_EQ(j["names"]["miles_cold"], "miles' streaming, buffered, page cache cold");
  EXPECT_EQ(j["miles_streaming"]["buckets"].get<uint64_t>(), 1u);
  EXPECT_EQ(j["miles_streaming"]["staging_bytes"].get<uint64_t>(), 256ull << 20);
  EXPECT_EQ(j["miles_streaming"]["warm_resident_fraction"][0].get<double>(), 1.0);

  r = Tool("optstate-bench", {"step", "--dir", dir.path(), "--state", "12M", "--baselines", "warm,bogus"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("bogus"), std::string::npos) << r.err;
}

// Comparison mode steps a state several times its device budget (through
// 2 MiB chunks) and stays inside it; --moments, which only synthetic mode
// takes, is refused there, naming the flag and the value, instead of the run
// stepping f32 moments as if it had been honoured.
TEST(BenchStepTest, CompareModeStaysInsideItsBudgetAndRefusesMoments) {
  TempDir dir;
  const std::vector<std::string> base = {"step", "--dir", dir.path(), "--state", "96M", "--chunk-size", "2M",
                                         "--budget", "16M", "--backend", "host", "--rounds", "1", "--no-fio",
                                         "--no-baselines", "--json"};
  auto r = Tool("optstate-bench", base);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["budget_bytes"].get<uint64_t>(), 16ull << 20);
  EXPECT_GT(j["peak_resident_bytes"].get<uint64_t>(), 0u);
  EXPECT_LE(j["peak_resident_bytes"].get<uint64_t>(), j["budget_bytes"].get<uint64_t>());

  std::vector<std::string> with_moments = base;
  with_moments.insert(with_moments.end(), {"--moments", "q8"});
  r = Tool("optstate-bench", with_moments);
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.err.find("--moments q8"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--q8-moments"), std::string::npos) << r.err;
}

// The bytes a step writes of one tensor with q8 moments: main (4 B/param),
// two moments of one-byte codes, and each moment's fp32 absmax per block of
// 256 elements (a partial last block has its own).
uint64_t Q8StepBytes(uint64_t numel) { return numel * 4 + 2 * numel + 2 * 4 * ((numel + 255) / 256); }

// Bytes written per step: the bench's figure (the manager's nvme_write_bytes)
// against the bytes per parameter of each moment dtype (main 4 + two moments
// of 4 or 2; q8: 1 and a 4-byte scale per 256 elements) and against the
// store's own lifetime counter of extent bytes.
TEST(BenchStepTest, ReportsBytesWrittenPerStepForEachMomentDtype) {
  TempDir dir;
  const uint64_t n = 1'100'000;  // not a multiple of a chunk's elements: partial last chunks
  // q8: --tensors 2 splits n into two tensors of 550'000 (2148.4 blocks each:
  // a partial last block); bytes_per_param 0 = not a whole number.
  const uint64_t q8_bytes = 2 * Q8StepBytes(n / 2);
  for (const auto& [moments, bytes_per_param] :
       {std::pair<std::string, uint64_t>{"f32", 12}, {"bf16", 8}, {"q8", 0}}) {
    const std::string store = dir / moments;
    std::vector<std::string> args = {"step", "--store", store, "--params", std::to_string(n), "--tensors", "2",
                                     "--chunk-size", "2M", "--budget", "16M", "--backend", "host",
                                     "--moments", moments, "--json"};
    auto first = Tool("optstate-bench", args);
    ASSERT_EQ(first.exit_code, 0) << first.err;
    uint64_t lifetime0 = 0;
    {
      auto s = vfs::Store::OpenReadOnly(store, vfs::StoreOptions{});
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      lifetime0 = (*s)->Stats()->lifetime_bytes_written;
    }
    args.insert(args.end(), {"--steps", "2"});
    auto r = Tool("optstate-bench", args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto j = ParseJson(r);
    const uint64_t per_step = j["write_bytes_per_step"].get<uint64_t>();
    const uint64_t expected = bytes_per_param > 0 ? n * bytes_per_param : q8_bytes;
    EXPECT_EQ(per_step, expected) << moments;
    EXPECT_DOUBLE_EQ(j["write_bytes_per_param"].get<double>(),
                     static_cast<double>(expected) / static_cast<double>(n))
        << moments;
    auto s = vfs::Store::OpenReadOnly(store, vfs::StoreOptions{});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    // The store's own field geometry: a step rewrites every field of every tensor.
    uint64_t field_bytes = 0;
    const std::vector<vfs::TensorInfo> tensors = (*s)->ListTensors();
    ASSERT_EQ(tensors.size(), 2u);
    for (const auto& t : tensors) {
      ASSERT_EQ(t.fields.size(), moments == "q8" ? 5u : 3u) << moments;
      for (uint32_t f = 0; f < t.fields.size(); ++f) field_bytes += t.field_bytes(f);
    }
    EXPECT_EQ(per_step, field_bytes) << moments;
    EXPECT_EQ((*s)->Stats()->lifetime_bytes_written - lifetime0, 2 * per_step) << moments;
    EXPECT_DOUBLE_EQ(j["drive_writes_tb_per_day"].get<double>(),
                     static_cast<double>(per_step) * 86400.0 / j["step_seconds"].get<double>() / 1e12)
        << moments;
  }
  // Comparison mode: ours (f32 moments) and the bf16 store, each round.
  std::filesystem::create_directories(dir / "cmp");
  auto r = Tool("optstate-bench", {"step", "--dir", dir / "cmp", "--state", "12M", "--rounds", "2", "--no-fio",
                                   "--baselines", "none", "--bf16-moments", "--backend", "host", "--budget",
                                   "64M", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  const uint64_t params = j["params"].get<uint64_t>();
  ASSERT_EQ(j["write_bytes_per_step"]["ours"].size(), 2u) << j["write_bytes_per_step"];
  ASSERT_EQ(j["write_bytes_per_step"]["ours_bf16_moments"].size(), 2u) << j["write_bytes_per_step"];
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(j["write_bytes_per_step"]["ours"][k].get<uint64_t>(), params * 12);
    EXPECT_EQ(j["write_bytes_per_step"]["ours_bf16_moments"][k].get<uint64_t>(), params * 8);
    // StreamedAdam's own count of the step's writes agrees with the manager's.
    EXPECT_EQ(j["step_stats"][k]["write_bytes"].get<uint64_t>(), params * 12);
    EXPECT_EQ(j["step_stats_bf16_moments"][k]["write_bytes"].get<uint64_t>(), params * 8);
  }
  EXPECT_GT(j["drive_writes_tb_per_day"]["ours"].get<double>(), 0.0);
  EXPECT_GT(j["drive_writes_tb_per_day"]["ours_bf16_moments"].get<double>(), 0.0);
  EXPECT_TRUE(j["write_bytes_per_step"]["ours_q8_moments"].empty());

  // All three stores: the order rotates each round, so in 3 rounds each store
  // steps first once.
  r = Tool("optstate-bench", {"step", "--dir", dir / "cmp", "--state", "12M", "--rounds", "3", "--no-fio",
                              "--baselines", "none", "--bf16-moments", "--q8-moments", "--backend", "host",
                              "--budget", "64M", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  j = ParseJson(r);
  // The parameter mix of 12M of state at hidden 1024: ln1.weight, ln1.bias and
  // the first 1'046'528 elements of attn.qkv.weight (multiples of 256).
  const std::vector<uint64_t> numels = {1024, 1024, 1'048'576 - 2048};
  ASSERT_EQ(j["params"].get<uint64_t>(), 1'048'576u);
  ASSERT_EQ(j["tensors"].get<uint64_t>(), numels.size());
  uint64_t q8_step = 0;
  for (uint64_t numel : numels) q8_step += Q8StepBytes(numel);
  ASSERT_EQ(j["write_bytes_per_step"]["ours_q8_moments"].size(), 3u) << j["write_bytes_per_step"];
  ASSERT_EQ(j["step_stats_q8_moments"].size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(j["write_bytes_per_step"]["ours"][k].get<uint64_t>(), 1'048'576u * 12);
    EXPECT_EQ(j["write_bytes_per_step"]["ours_bf16_moments"][k].get<uint64_t>(), 1'048'576u * 8);
    EXPECT_EQ(j["write_bytes_per_step"]["ours_q8_moments"][k].get<uint64_t>(), q8_step);
    EXPECT_EQ(j["step_stats_q8_moments"][k]["write_bytes"].get<uint64_t>(), q8_step);
  }
  EXPECT_GT(j["q8_moments_over_f32"].get<double>(), 0.0);
  EXPECT_GT(j["drive_writes_tb_per_day"]["ours_q8_moments"].get<double>(), 0.0);
  ASSERT_EQ(j["step_order"].size(), 3u);
  EXPECT_EQ(j["step_order"][0], nlohmann::json({"ours", "ours_bf16_moments", "ours_q8_moments"}));
  EXPECT_EQ(j["step_order"][1], nlohmann::json({"ours_bf16_moments", "ours_q8_moments", "ours"}));
  EXPECT_EQ(j["step_order"][2], nlohmann::json({"ours_q8_moments", "ours", "ours_bf16_moments"}));

  // The text report has the q8 lines.
  r = Tool("optstate-bench", {"step", "--dir", dir / "cmp", "--state", "12M", "--rounds", "2", "--no-fio",
                              "--baselines", "none", "--q8-moments", "--backend", "host", "--budget", "64M"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* line : {"StreamedAdam step (ours), q8 moments", "q8 moments / f32 moments (same rounds): ",
                           "(bytes moved: 6.03/12 = 0.50x); q8 after f32 (even rounds) [",
                           "written per step, q8 moments: "}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }

  // A budget below one q8 slice (8 chunks) is refused up front, naming it.
  r = Tool("optstate-bench", {"step", "--dir", dir / "cmp", "--state", "12M", "--rounds", "1", "--no-fio",
                              "--baselines", "none", "--q8-moments", "--backend", "host", "--chunk-size", "8M",
                              "--budget", "56M"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--budget 56"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("8 chunks"), std::string::npos) << r.err;
}

// The bytes per param a step writes are the state's (the rule's fields: f32
// main 4 and each f32 moment 4, bf16 2), also for a small --state whose
// tensors are short chunks in pieces (--hidden 128: 512-byte layer norms):
// AdamW 12 (8 with bf16 moments), Lion 8, SGD with momentum 8, plain SGD 4,
// Muon's matrices 8 beside AdamW's 12. The disk space the store allocates
// for those chunks (4 KiB pieces) is reported apart, and is more.
TEST(BenchStepTest, BytesPerParamWrittenAreTheRulesState) {
  TempDir dir;
  for (const auto& [optimizer, bytes_per_param] :
       {std::pair<std::string, double>{"adamw", 12}, {"lion", 8}, {"sgd", 8}, {"sgd_plain", 4}, {"muon", 0}}) {
    SCOPED_TRACE(optimizer);
    std::vector<std::string> args = {"step", "--dir", dir.path(), "--optimizer", optimizer, "--state", "4M",
                                     "--hidden", "128", "--chunk-size", "2M", "--budget", "32M", "--backend",
                                     "host", "--rounds", "2", "--no-fio", "--baselines", "none", "--json"};
    if (optimizer == "adamw") args.push_back("--bf16-moments");
    auto r = Tool("optstate-bench", args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = ParseJson(r);
    const uint64_t params = j["params"].get<uint64_t>(), state = j["state_bytes"].get<uint64_t>();
    const auto& by_rule = j["state_bytes_per_param_by_rule"];
    if (optimizer == "muon") {
      EXPECT_EQ(by_rule, nlohmann::json({{"Muon", 8.0}, {"AdamW", 12.0}})) << by_rule;
      EXPECT_GT(state, 8 * params);
      EXPECT_LT(state, 12 * params);
    } else {
      ASSERT_EQ(by_rule.size(), 1u) << by_rule;
      EXPECT_DOUBLE_EQ(by_rule.begin().value().get<double>(), bytes_per_param) << by_rule;
      EXPECT_EQ(state, static_cast<uint64_t>(bytes_per_param) * params);
    }
    EXPECT_DOUBLE_EQ(j["state_bytes_per_param"].get<double>(),
                     static_cast<double>(state) / static_cast<double>(params));
    // Every timed step, the first included, writes the state once.
    ASSERT_EQ(j["write_bytes_per_step"]["ours"].size(), 2u);
    for (const auto& w : j["write_bytes_per_step"]["ours"]) EXPECT_EQ(w.get<uint64_t>(), state);
    EXPECT_GT(j["allocated_bytes_per_step"]["ours"].get<uint64_t>(), state);
    if (optimizer == "adamw") {
      for (const auto& w : j["write_bytes_per_step"]["ours_bf16_moments"]) EXPECT_EQ(w.get<uint64_t>(), 8 * params);
      EXPECT_GT(j["allocated_bytes_per_step"]["ours_bf16_moments"].get<uint64_t>(), 8 * params);
    }
  }
  // The text report: the state's bytes per param, and the disk's apart.
  auto r = Tool("optstate-bench", {"step", "--dir", dir.path(), "--optimizer", "lion", "--state", "4M", "--hidden",
                                   "128", "--chunk-size", "2M", "--budget", "32M", "--backend", "host", "--rounds",
                                   "1", "--no-fio", "--baselines", "none"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("written per step, lion, f32: 4 MiB of chunks (8.00 B/param of state); on disk, pieces "
                       "and slots as allocated: "),
            std::string::npos)
      << r.out;
}

// --optimizer muon steps the mix's weight matrices with Muon (8 B/param) and
// the rest with AdamW (12 B/param): the state it reports lies strictly
// between the two, and a budget that cannot hold a matrix whole (h = 1024:
// the 3h x h attention weights need 56 MiB with their scratch) fails naming
// the first one registered.
TEST(BenchStepTest, MuonStepsMatricesWholeAndTheRestWithAdamW) {
  TempDir dir;
  std::vector<std::string> args = {"step", "--dir", dir.path(), "--optimizer", "muon", "--state", "4M",
                                   "--hidden", "128", "--chunk-size", "2M", "--budget", "32M", "--backend",
                                   "host", "--rounds", "1", "--no-fio", "--json"};
  auto r = Tool("optstate-bench", args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["optimizer"], "muon");
  const uint64_t params = j["params"].get<uint64_t>(), state = j["state_bytes"].get<uint64_t>();
  EXPECT_GT(state, 8 * params);
  EXPECT_LT(state, 12 * params);
  EXPECT_LE(j["peak_resident_bytes"].get<uint64_t>(), j["budget_bytes"].get<uint64_t>());

  args = {"step", "--dir", dir.path(), "--optimizer", "muon", "--state", "64M", "--hidden", "1024",
          "--chunk-size", "2M", "--budget", "32M", "--backend", "host", "--rounds", "1", "--no-fio"};
  r = Tool("optstate-bench", args);
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.err.find("layer0.attn.qkv.weight"), std::string::npos) << r.err;  // the first too large
  EXPECT_NE(r.err.find("Muon"), std::string::npos) << r.err;
}

TEST(BenchStepTest, RejectsMalformedArguments) {
  TempDir dir;
  auto r = Tool("optstate-bench", {"step", "--store", dir / "x", "--params", "0"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--params"), std::string::npos) << r.err;
  r = Tool("optstate-bench", {"step", "--store", dir / "x", "--params", "10", "--chunk-size", "3M"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("2 MiB"), std::string::npos) << r.err;
  r = Tool("optstate-bench", {"step", "--store", dir / "x", "--params", "10", "--backend", "tpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("tpu"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace optstate::tools
