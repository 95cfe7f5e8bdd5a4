// optstate-inspect on a small real store: every command's --json output is
// parsed back and compared with values computed here from the data written
// (the independent reference) and with the library's own answers.
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

#include <gtest/gtest.h>

#include "tests/common/scratch_mount.h"
#include "tests/tools/tools_test_util.h"
#include "vfs/io_buffer.h"
#include "vfs/store.h"

namespace optstate::tools {
namespace {

using testing::ParseJson;
using testing::TempDir;
using testing::Tool;
namespace fs = std::filesystem;

constexpr uint64_t kChunk = 2 * vfs::kMiB;
constexpr uint64_t kPerChunk = kChunk / 4;

// Reference content of tensor `k` field `f` at generation-ish `version`.
float Value(int k, uint32_t f, uint64_t i, int version) {
  return static_cast<float>(std::sin(0.001 * static_cast<double>(i) + k + 0.5 * f) * (1 + version));
}

class InspectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_ / "rank0000.dense";
    vfs::StoreOptions o;
    o.chunk_size_bytes = kChunk;
    o.preallocate_step_bytes = 8 * kChunk;
    auto s = vfs::Store::Create(path_, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
    // "layer.0.weight": 3 chunks (last partial); "layer.0.bias": tiny.
    numel_ = {{"layer.0.weight", 2 * kPerChunk + 1000}, {"layer.0.bias", 777}};
    for (auto& [name, n] : numel_) {
      vfs::TensorSpec spec;
      spec.name = name;
      spec.numel = n;
      spec.group = 0;
      auto t = store_->CreateTensor(spec);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
    }
    WriteVersion(1);
    Commit(1);
    ASSERT_TRUE(store_->CreateSnapshot("s1").ok());
    WriteVersion(2);
    Commit(2);
    ASSERT_TRUE(store_->CreateSnapshot("s2").ok());
  }

  // Writes main (field 0) and exp_avg (field 1) of every tensor; exp_avg_sq
  // stays never-written (zeros). Version 2 puts a NaN and an Inf into the bias.
  void WriteVersion(int version) {
    vfs::IoBuffer buf(kChunk);
    int k = 0;
    for (auto& [name, n] : numel_) {
      auto t = store_->FindTensor(name);
      ASSERT_TRUE(t.ok());
      for (uint32_t f = 0; f < 2; ++f) {
        for (uint64_t c = 0; c * kPerChunk < n; ++c) {
          float* p = buf.as<float>();
          for (uint64_t i = c * kPerChunk; i < std::min(n, (c + 1) * kPerChunk); ++i) {
            p[i - c * kPerChunk] = Ref(name, k, f, i, version);
          }
          ASSERT_TRUE(store_->WriteChunk({t->id, f, c}, buf.data()).ok());
        }
      }
      ++k;
    }
  }

  static float Ref(const std::string& name, int k, uint32_t f, uint64_t i, int version) {
    if (f == 2) return 0.0f;
    if (version == 2 && name == "layer.0.bias" && f == 0) {
      if (i == 5) return std::numeric_limits<float>::quiet_NaN();
      if (i == 6) return std::numeric_limits<float>::infinity();
    }
    return Value(k, f, i, version);
  }

  void Commit(uint64_t step) {
    vfs::CommitInfo ci;
    ci.step = step;
    vfs::GroupInfo g;
    g.id = 0;
    g.step_count = step;
    g.hyper = {{"lr", 1e-3}, {"beta1", 0.9}, {"adamw", 1.0}};
    ci.groups.push_back(g);
    auto r = store_->Commit(ci);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }

  int IndexOf(const std::string& name) {
    int k = 0;
    for (auto& [n, _] : numel_) {
      if (n == name) return k;
      ++k;
    }
    return -1;
  }

  TempDir dir_;
  std::string path_;
  std::unique_ptr<vfs::Store> store_;
  std::map<std::string, uint64_t> numel_;  // sorted: bias (k=0), weight (k=1)
};

TEST_F(InspectTest, LsListsTensorsLikeTheLibrary) {
  auto r = Tool("optstate-inspect", {path_, "ls", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  auto lib = store_->ListTensors();
  ASSERT_EQ(j["tensors"].size(), lib.size());
  for (size_t i = 0; i < lib.size(); ++i) {
    const auto& t = j["tensors"][i];
    EXPECT_EQ(t["name"], lib[i].name);
    EXPECT_EQ(t["numel"].get<uint64_t>(), numel_.at(lib[i].name));
    EXPECT_EQ(t["dtype"], "f32");
    ASSERT_EQ(t["fields"].size(), 3u);
    EXPECT_EQ(t["fields"][0]["name"], "main");
    EXPECT_EQ(t["fields"][2]["name"], "exp_avg_sq");
    EXPECT_EQ(t["fields"][1]["bytes"].get<uint64_t>(), numel_.at(lib[i].name) * 4);
  }
  EXPECT_EQ(j["generation"].get<uint64_t>(), store_->LatestGeneration().generation);
  // Text mode names every tensor too.
  auto text = Tool("optstate-inspect", {path_, "ls"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("layer.0.weight"), std::string::npos);
  EXPECT_NE(text.out.find("layer.0.bias"), std::string::npos);
}

TEST_F(InspectTest, LsOfAStoreRootListsStores) {
  auto r = Tool("optstate-inspect", {dir_.path(), "ls", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  ASSERT_EQ(j["stores"].size(), 1u);
  EXPECT_EQ(j["stores"][0]["name"], store_->identity().name);
  EXPECT_EQ(j["stores"][0]["generation"].get<uint64_t>(), store_->LatestGeneration().generation);
}

TEST_F(InspectTest, StatMatchesTheLibrary) {
  auto r = Tool("optstate-inspect", {path_, "stat", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  auto latest = store_->LatestGeneration();
  EXPECT_EQ(j["latest"]["generation"].get<uint64_t>(), latest.generation);
  EXPECT_EQ(j["latest"]["step"].get<uint64_t>(), 2u);
  EXPECT_EQ(j["latest"]["groups"][0]["step_count"].get<uint64_t>(), 2u);
  EXPECT_DOUBLE_EQ(j["latest"]["groups"][0]["hyper"]["lr"].get<double>(), 1e-3);
  // A flag is a JSON boolean, as in manifest.json.
  EXPECT_EQ(j["latest"]["groups"][0]["hyper"]["adamw"], true) << j["latest"]["groups"][0]["hyper"];
  EXPECT_EQ(j["identity"]["chunk_size_bytes"].get<uint64_t>(), kChunk);
  EXPECT_EQ(j["identity"]["uuid"], store_->identity().uuid);
  ASSERT_EQ(j["snapshots"].size(), 2u);
  EXPECT_EQ(j["snapshots"][0]["name"], "s1");
  EXPECT_EQ(j["snapshots"][1]["name"], "s2");
  auto st = store_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(j["lifetime_bytes_written"].get<uint64_t>(), st->lifetime_bytes_written);
  EXPECT_EQ(j["disk"]["live_bytes"].get<uint64_t>(), st->live_bytes);
  // Two versions of main + exp_avg of both tensors were written.
  uint64_t logical = 0;
  for (auto& [n, numel] : numel_) logical += 2 * numel * 4;
  EXPECT_EQ(st->live_bytes, logical);
  EXPECT_GE(j["lifetime_bytes_written"].get<uint64_t>(), 2 * logical);

  // Free space of the data dir's filesystem, although inspect opens the
  // store read-only: against statvfs here (other writers on the machine move
  // it a little between the two calls).
  ASSERT_EQ(j["disk"]["data_dirs"].size(), 1u);
  const auto& d = j["disk"]["data_dirs"][0];
  struct statvfs sv {};
  ASSERT_EQ(::statvfs(store_->identity().data_dirs[0].c_str(), &sv), 0);
  const double want = static_cast<double>(sv.f_bavail) * sv.f_frsize;
  ASSERT_TRUE(d["fs_free_bytes"].is_number()) << d;
  EXPECT_GT(d["fs_free_bytes"].get<uint64_t>(), 0u);
  EXPECT_NEAR(d["fs_free_bytes"].get<double>(), want, 1024.0 * 1024 * 1024) << d;
  EXPECT_EQ(d["fs_size_bytes"].get<uint64_t>(), static_cast<uint64_t>(sv.f_blocks) * sv.f_frsize);
  auto text = Tool("optstate-inspect", {path_, "stat"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("filesystem free"), std::string::npos) << text.out;
  const size_t row = text.out.find(store_->identity().data_dirs[0] + " ");
  ASSERT_NE(row, std::string::npos) << text.out;
  const std::string line = text.out.substr(row, text.out.find('\n', row) - row);
  EXPECT_EQ(line.find(" 0 B"), std::string::npos) << line;
  EXPECT_NE(text.out.find("adamw=true"), std::string::npos) << text.out;
}

// Bytes a step writes, derived from the store: this store's three f32 fields
// (12 B/param), in whole chunks of 2 MiB (a partial last one per field). On
// disk each short chunk takes a 4 KiB piece: the weight's tail (1000
// floats) and the bias (777 floats), in each of the three fields.
TEST_F(InspectTest, StatReportsBytesWrittenPerStep) {
  auto r = Tool("optstate-inspect", {path_, "stat", "--json", "--step-seconds", "2.5"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto p = ParseJson(r)["per_step"];
  uint64_t params = 0, chunks = 0;
  for (auto& [name, n] : numel_) {
    params += n;
    chunks += 3 * ((n * 4 + kChunk - 1) / kChunk);
  }
  EXPECT_EQ(p["params"].get<uint64_t>(), params);
  EXPECT_EQ(p["chunk_bytes"].get<uint64_t>(), params * 12);
  EXPECT_EQ(p["chunks"].get<uint64_t>(), chunks);  // weight: 3 chunks a field, bias: 1
  EXPECT_EQ(chunks, 12u);
  EXPECT_EQ(p["index_bytes"].get<uint64_t>(), chunks * 54);
  const uint64_t allocated = 3 * (2 * kChunk + 4096) + 3 * 4096;
  EXPECT_EQ(p["allocated_bytes"].get<uint64_t>(), allocated);
  EXPECT_DOUBLE_EQ(p["allocated_bytes_per_param"].get<double>(),
                   static_cast<double>(allocated) / static_cast<double>(params));
  EXPECT_EQ(p["bytes"].get<uint64_t>(), allocated + chunks * 54);
  EXPECT_DOUBLE_EQ(p["tb_per_day"].get<double>(), static_cast<double>(allocated + chunks * 54) * 86400 / 2.5 / 1e12);
  auto text = Tool("optstate-inspect", {path_, "stat", "--step-seconds", "2.5"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("drive writes per day at 2.500 s a step"), std::string::npos) << text.out;
  for (const char* bad : {"0", "-1", "nan"}) {
    auto b = Tool("optstate-inspect", {path_, "stat", "--step-seconds", bad});
    EXPECT_EQ(b.exit_code, 2) << bad << ": " << b.err;
    EXPECT_NE(b.err.find("--step-seconds"), std::string::npos) << b.err;
  }
}

// A store stepped by StreamedAdam with f32 and with bf16 moments: inspect's
// chunk bytes per step equal numel x (4 + 2 x moment size) and what one more
// step adds to the store's lifetime counter of bytes written.
TEST(InspectEnduranceTest, BytesPerStepOfF32AndBf16MomentStores) {
  TempDir dir;
  const uint64_t n = 1'100'000;
  for (const auto& [moments, bytes_per_param] : {std::pair<std::string, uint64_t>{"f32", 12}, {"bf16", 8}}) {
    const std::string store = dir / moments;
    const std::vector<std::string> step = {"step", "--store", store, "--params", std::to_string(n),
                                           "--chunk-size", "2M", "--budget", "16M", "--backend", "host",
                                           "--moments", moments};
    auto b = Tool("optstate-bench", step);
    ASSERT_EQ(b.exit_code, 0) << b.err;
    auto r = Tool("optstate-inspect", {store, "stat", "--json", "--step-seconds", "0.5"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto j = ParseJson(r);
    const auto p = j["per_step"];
    EXPECT_EQ(p["moment_dtypes"], moments);
    EXPECT_EQ(p["params"].get<uint64_t>(), n);
    EXPECT_EQ(p["chunk_bytes"].get<uint64_t>(), n * bytes_per_param) << moments;
    EXPECT_DOUBLE_EQ(p["chunk_bytes_per_param"].get<double>(), static_cast<double>(bytes_per_param));
    // main: ceil(4n / 2 MiB) chunks; each moment: ceil(size x n / 2 MiB).
    const uint64_t moment_size = (bytes_per_param - 4) / 2;
    const uint64_t chunks = (4 * n + kChunk - 1) / kChunk + 2 * ((moment_size * n + kChunk - 1) / kChunk);
    EXPECT_EQ(p["chunks"].get<uint64_t>(), chunks) << moments;
    // Each field's tail is a short chunk in a piece (at most a chunk more).
    const uint64_t allocated = p["allocated_bytes"].get<uint64_t>();
    EXPECT_GT(allocated, n * bytes_per_param) << moments;
    EXPECT_LT(allocated, n * bytes_per_param + 3 * kChunk) << moments;
    EXPECT_DOUBLE_EQ(p["tb_per_day"].get<double>(), static_cast<double>(allocated + chunks * 54) * 86400 / 0.5 / 1e12);
    const uint64_t lifetime0 = j["lifetime_bytes_written"].get<uint64_t>();
    b = Tool("optstate-bench", step);
    ASSERT_EQ(b.exit_code, 0) << b.err;
    r = Tool("optstate-inspect", {store, "stat", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(ParseJson(r)["lifetime_bytes_written"].get<uint64_t>() - lifetime0, n * bytes_per_param) << moments;
  }
}

// Many tiny tensors (10 floats: 40 bytes a chunk): the store writes each
// chunk into a whole 4 KiB piece. stat's bytes on disk per step and its
// estimate of the lifetime's equal the store allocator's own count of the
// pieces written (pending before the commit, referenced after it), which the
// data file's allocated blocks hold; the logical bytes stay beside them.
TEST(InspectPiecesTest, StatCountsTheDiskSpaceOfManyTinyTensors) {
  TempDir dir;
  const std::string path = dir / "tiny";
  std::unique_ptr<vfs::Store> store = testing::CreateTestStore(path);
  ASSERT_NE(store, nullptr);
  fs::path file = store->identity().data_dirs[0];
  if (file.is_relative()) file = fs::path(path) / file;
  file /= store->identity().uuid + ".chunks";
  auto blocks = [&] {
    struct stat sb {};
    EXPECT_EQ(::stat(file.c_str(), &sb), 0) << file;
    return static_cast<uint64_t>(sb.st_blocks) * 512;
  };
  const uint64_t blocks0 = blocks();
  constexpr uint64_t kTensors = 300, kNumel = 10;
  for (uint64_t k = 0; k < kTensors; ++k) {
    vfs::TensorSpec spec;
    spec.name = "norm." + std::to_string(k);
    spec.numel = kNumel;
    auto t = store->CreateTensor(spec);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (uint32_t f = 0; f < 3; ++f) {
      testing::WriteFloatField(store.get(), t->id, f, kNumel, [&](uint64_t i) { return static_cast<float>(k + i + f); });
    }
  }
  const uint64_t pending = store->Stats()->pending_bytes;
  vfs::CommitInfo ci;
  ci.step = 1;
  ASSERT_TRUE(store->Commit(ci).ok());
  const uint64_t referenced = store->Stats()->referenced_extent_bytes;
  EXPECT_EQ(referenced, pending);
  const uint64_t logical = kTensors * 3 * kNumel * 4;
  EXPECT_GT(pending, logical);
  EXPECT_GE(blocks() - blocks0, pending);  // the file holds the pieces' space

  auto r = Tool("optstate-inspect", {path, "stat", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = ParseJson(r);
  const auto p = j["per_step"];
  EXPECT_EQ(p["chunks"].get<uint64_t>(), kTensors * 3);
  EXPECT_EQ(p["chunk_bytes"].get<uint64_t>(), logical);
  EXPECT_EQ(p["allocated_bytes"].get<uint64_t>(), pending);
  EXPECT_EQ(p["bytes"].get<uint64_t>(), pending + kTensors * 3 * 54);
  EXPECT_DOUBLE_EQ(p["allocated_bytes_per_param"].get<double>(),
                   static_cast<double>(pending) / static_cast<double>(kTensors * kNumel));
  EXPECT_EQ(j["lifetime_bytes_written"].get<uint64_t>(), logical);
  EXPECT_EQ(j["lifetime_allocated_bytes_estimate"].get<uint64_t>(), referenced);
  auto text = Tool("optstate-inspect", {path, "stat"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  for (const char* part :
       {"(12.00 B/param logical); on disk, pieces and slots as allocated: ",
        "of chunks (logical, the store's count); on disk, pieces and slots as allocated: about "}) {
    EXPECT_NE(text.out.find(part), std::string::npos) << part << "\n" << text.out;
  }
}

TEST_F(InspectTest, ShowValuesAndStatisticsMatchTheReference) {
  const std::string name = "layer.0.weight";
  const int k = IndexOf(name);
  const uint64_t n = numel_.at(name);
  // A range that crosses the chunk 0 / chunk 1 boundary.
  const uint64_t a = kPerChunk - 10, b = kPerChunk + 20;
  auto r = Tool("optstate-inspect", {path_, "show", name, "--field", "main", "--range",
                                     std::to_string(a) + ":" + std::to_string(b), "--values",
                                     "100", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  ASSERT_EQ(j["fields"].size(), 1u);
  const auto& f = j["fields"][0];
  ASSERT_EQ(f["values"].size(), b - a);
  double mn = 1e300, mx = -1e300, sum = 0, sq = 0;
  for (uint64_t i = a; i < b; ++i) {
    float v = Ref(name, k, 0, i, 2);
    EXPECT_EQ(f["values"][i - a].get<double>(), static_cast<double>(v)) << i;
    mn = std::min<double>(mn, v);
    mx = std::max<double>(mx, v);
    sum += v;
    sq += static_cast<double>(v) * v;
  }
  EXPECT_DOUBLE_EQ(f["stats"]["min"].get<double>(), mn);
  EXPECT_DOUBLE_EQ(f["stats"]["max"].get<double>(), mx);
  EXPECT_NEAR(f["stats"]["mean"].get<double>(), sum / static_cast<double>(b - a), 1e-12);
  EXPECT_NEAR(f["stats"]["l2"].get<double>(), std::sqrt(sq), 1e-9);
  EXPECT_EQ(f["stats"]["count"].get<uint64_t>(), b - a);

  // All fields, whole tensor: exp_avg_sq was never written and reads as zeros.
  auto all = Tool("optstate-inspect", {path_, "show", name, "--json"});
  ASSERT_EQ(all.exit_code, 0) << all.err;
  auto ja = ParseJson(all);
  ASSERT_EQ(ja["fields"].size(), 3u);
  EXPECT_EQ(ja["fields"][2]["stats"]["count"].get<uint64_t>(), n);
  EXPECT_EQ(ja["fields"][2]["stats"]["l2"].get<double>(), 0.0);
  double sq_avg = 0;
  for (uint64_t i = 0; i < n; ++i) sq_avg += std::pow(static_cast<double>(Ref(name, k, 1, i, 2)), 2);
  EXPECT_NEAR(ja["fields"][1]["stats"]["l2"].get<double>(), std::sqrt(sq_avg), 1e-6);
}

TEST_F(InspectTest, ShowCountsNanAndInfAndReadsSnapshots) {
  auto r = Tool("optstate-inspect", {path_, "show", "layer.0.bias", "--field", "main", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  EXPECT_EQ(j["fields"][0]["stats"]["nan"].get<uint64_t>(), 1u);
  EXPECT_EQ(j["fields"][0]["stats"]["inf"].get<uint64_t>(), 1u);
  // JSON has no NaN or Inf: they are the strings "NaN" / "Infinity", told apart.
  EXPECT_EQ(j["fields"][0]["values"][5], "NaN") << j["fields"][0]["values"];
  EXPECT_EQ(j["fields"][0]["values"][6], "Infinity") << j["fields"][0]["values"];
  EXPECT_TRUE(j["fields"][0]["values"][4].is_number());
  EXPECT_TRUE(j["fields"][0]["stats"]["min"].is_number());  // over the finite values
  // Snapshot s1 has the version-1 values and no NaN.
  auto s1 = Tool("optstate-inspect", {path_, "show", "layer.0.bias", "--snapshot", "s1",
                                      "--field", "main", "--json"});
  ASSERT_EQ(s1.exit_code, 0) << s1.err;
  auto j1 = ParseJson(s1);
  EXPECT_EQ(j1["fields"][0]["stats"]["nan"].get<uint64_t>(), 0u);
  int k = IndexOf("layer.0.bias");
  EXPECT_EQ(j1["fields"][0]["values"][0].get<double>(),
            static_cast<double>(Ref("layer.0.bias", k, 0, 0, 1)));
}

// diff exits 3 when the two differ (docs/CLI.md), 0 when they are identical.
TEST_F(InspectTest, DiffReportsMaxAbsDifferenceAndNorms) {
  auto r = Tool("optstate-inspect", {path_, "diff", "s1", "s2", "--json"});
  ASSERT_EQ(r.exit_code, 3) << r.err;
  auto j = ParseJson(r);
  EXPECT_FALSE(j["identical"].get<bool>());
  bool found = false;
  for (const auto& t : j["tensors"]) {
    if (t["name"] != "layer.0.weight") continue;
    found = true;
    const std::string name = "layer.0.weight";
    int k = IndexOf(name);
    uint64_t n = numel_.at(name);
    for (uint32_t f = 0; f < 3; ++f) {
      double max_abs = 0, la = 0, lb = 0;
      for (uint64_t i = 0; i < n; ++i) {
        double x = Ref(name, k, f, i, 1), y = Ref(name, k, f, i, 2);
        max_abs = std::max(max_abs, std::fabs(x - y));
        la += x * x;
        lb += y * y;
      }
      EXPECT_DOUBLE_EQ(t["fields"][f]["max_abs_diff"].get<double>(), max_abs) << f;
      EXPECT_NEAR(t["fields"][f]["l2_a"].get<double>(), std::sqrt(la), 1e-6);
      EXPECT_NEAR(t["fields"][f]["l2_b"].get<double>(), std::sqrt(lb), 1e-6);
    }
    EXPECT_EQ(t["fields"][2]["differing_elements"].get<uint64_t>(), 0u);
  }
  EXPECT_TRUE(found);
  auto same = Tool("optstate-inspect", {path_, "diff", "s2", "latest", "--json"});
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_TRUE(ParseJson(same)["identical"].get<bool>());
  // The same without --json.
  auto text = Tool("optstate-inspect", {path_, "diff", "s1", "s2"});
  EXPECT_EQ(text.exit_code, 3) << text.err;
  EXPECT_NE(text.out.find("the two differ"), std::string::npos) << text.out;
  auto same_text = Tool("optstate-inspect", {path_, "diff", "s2", "latest"});
  EXPECT_EQ(same_text.exit_code, 0) << same_text.err;
  EXPECT_NE(same_text.out.find("identical"), std::string::npos) << same_text.out;
}

TEST_F(InspectTest, VerifyIsCleanThenCatchesAFlippedByte) {
  auto r = Tool("optstate-inspect", {path_, "verify", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  auto j = ParseJson(r);
  EXPECT_TRUE(j["ok"].get<bool>());
  EXPECT_GT(j["chunks_checked"].get<uint64_t>(), 0u);
  // Flip one byte of a committed extent of the latest generation.
  auto view = store_->OpenGeneration(vfs::kLatest);
  ASSERT_TRUE(view.ok());
  auto t = (*view)->FindTensor("layer.0.weight");
  ASSERT_TRUE(t.ok());
  auto ci = (*view)->Chunk({t->id, 0, 1});
  ASSERT_TRUE(ci.ok());
  ASSERT_FALSE(ci->zero);
  std::string data_file =
      store_->identity().data_dirs[ci->data_dir] + "/" + store_->identity().uuid + ".chunks";
  view->reset();
  store_.reset();  // the trainer "dies"; inspect must still work
  std::fstream fdata(data_file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(fdata.good()) << data_file;
  fdata.seekg(static_cast<std::streamoff>(ci->file_offset + 100));
  char c;
  fdata.read(&c, 1);
  c ^= 0x40;
  fdata.seekp(static_cast<std::streamoff>(ci->file_offset + 100));
  fdata.write(&c, 1);
  fdata.close();
  auto bad = Tool("optstate-inspect", {path_, "verify", "--json"});
  EXPECT_EQ(bad.exit_code, 3) << bad.err << bad.out;  // problems found (2: bad usage)
  auto jb = ParseJson(bad);
  EXPECT_FALSE(jb["ok"].get<bool>());
  ASSERT_FALSE(jb["problems"].empty());
  EXPECT_NE(jb["problems"][0].get<std::string>().find("layer.0.weight"), std::string::npos)
      << jb["problems"][0];
  // show of the damaged range fails with a message naming the tensor.
  auto show = Tool("optstate-inspect", {path_, "show", "layer.0.weight", "--field", "main"});
  EXPECT_NE(show.exit_code, 0);
  EXPECT_NE(show.err.find("layer.0.weight"), std::string::npos) << show.err;
}

TEST_F(InspectTest, UnknownNamesGetClosestMatches) {
  auto r = Tool("optstate-inspect", {path_, "show", "layer.0.wieght"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("did you mean"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("layer.0.weight"), std::string::npos) << r.err;
  auto d = Tool("optstate-inspect", {path_, "diff", "s1", "s3"});
  EXPECT_EQ(d.exit_code, 1);
  EXPECT_NE(d.err.find("'s1'"), std::string::npos) << d.err;
  auto f = Tool("optstate-inspect", {path_, "show", "layer.0.bias", "--field", "exp_avgsq"});
  EXPECT_EQ(f.exit_code, 1);
  EXPECT_NE(f.err.find("exp_avg_sq"), std::string::npos) << f.err;
  // Generation names are suggested like snapshot names; both bad names are
  // reported at once.
  auto l = Tool("optstate-inspect", {path_, "diff", "five", "lates"});
  EXPECT_EQ(l.exit_code, 1);
  EXPECT_NE(l.err.find("'five'"), std::string::npos) << l.err;
  EXPECT_NE(l.err.find("unknown snapshot 'lates'; did you mean: 'latest'"), std::string::npos) << l.err;
  const std::string g = std::to_string(store_->LatestGeneration().generation);
  auto gs = Tool("optstate-inspect", {path_, "show", "layer.0.bias", "--snapshot", "gen" + g});
  EXPECT_EQ(gs.exit_code, 1);
  EXPECT_NE(gs.err.find("'gen:" + g + "'"), std::string::npos) << gs.err;
  auto gone = Tool("optstate-inspect", {path_, "diff", "gen:999", "latest"});
  EXPECT_EQ(gone.exit_code, 1);
  EXPECT_NE(gone.err.find("generation 999 is not retained"), std::string::npos) << gone.err;
  EXPECT_NE(gone.err.find(g), std::string::npos) << gone.err;
}

TEST_F(InspectTest, WorksWhileTheWriterHoldsTheStore) {
  // store_ is open read-write in this process (holding LOCK) during every
  // test above; this one also commits a new generation and checks inspect
  // follows it.
  WriteVersion(3);
  Commit(3);
  auto r = Tool("optstate-inspect", {path_, "stat", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(ParseJson(r)["latest"]["step"].get<uint64_t>(), 3u);
}

// drop: refused while a writer holds the store (naming it), refused for an
// unknown name (with the near name, nothing changed); then the head no
// longer holds the tensor, and the snapshot it prints keeps the replaced
// head, whose values `show` still reads.
TEST_F(InspectTest, DropRemovesATensorFromTheHeadAndKeepsTheReplacedHead) {
  auto busy = Tool("optstate-inspect", {path_, "drop", "layer.0.bias"});
  EXPECT_EQ(busy.exit_code, 1);
  EXPECT_NE(busy.err.find(std::to_string(getpid())), std::string::npos) << busy.err;
  const uint64_t gen = store_->LatestGeneration().generation;
  store_.reset();
  auto typo = Tool("optstate-inspect", {path_, "drop", "layer.0.bais"});
  EXPECT_EQ(typo.exit_code, 1);
  EXPECT_NE(typo.err.find("layer.0.bias"), std::string::npos) << typo.err;
  auto snaps = ParseJson(Tool("optstate-inspect", {path_, "stat", "--json"}))["snapshots"];
  EXPECT_EQ(snaps.size(), 2u) << snaps;

  auto r = Tool("optstate-inspect", {path_, "drop", "layer.0.bias", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  EXPECT_EQ(j["generation"].get<uint64_t>(), gen + 1);
  EXPECT_EQ(j["replaced_generation"].get<uint64_t>(), gen);
  const std::string kept = j["kept_snapshot"];
  EXPECT_EQ(kept.rfind("pre-drop-" + std::to_string(gen) + "-", 0), 0u) << kept;

  auto head = ParseJson(Tool("optstate-inspect", {path_, "ls", "--json"}));
  ASSERT_EQ(head["tensors"].size(), 1u) << head;
  EXPECT_EQ(head["tensors"][0]["name"], "layer.0.weight");
  EXPECT_EQ(Tool("optstate-inspect", {path_, "show", "layer.0.bias", "--json"}).exit_code, 1);
  auto old = ParseJson(Tool("optstate-inspect", {path_, "ls", "--snapshot", kept, "--json"}));
  EXPECT_EQ(old["tensors"].size(), 2u) << old;
  auto shown = Tool("optstate-inspect", {path_, "show", "layer.0.bias", "--snapshot", kept, "--field", "main", "--json"});
  ASSERT_EQ(shown.exit_code, 0) << shown.err;
  auto sj = ParseJson(shown);
  EXPECT_EQ(sj["fields"][0]["stats"]["nan"].get<uint64_t>(), 1u);
  EXPECT_EQ(sj["fields"][0]["values"][0].get<double>(),
            static_cast<double>(Ref("layer.0.bias", IndexOf("layer.0.bias"), 0, 0, 2)));
  auto v = Tool("optstate-inspect", {path_, "verify", "--json"});
  EXPECT_EQ(v.exit_code, 0) << v.out << v.err;
  // Text mode names the kept snapshot.
  auto again = Tool("optstate-inspect", {path_, "drop", "layer.0.weight"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("pre-drop-" + std::to_string(gen + 1) + "-"), std::string::npos) << again.out;
}

// A store on a read-only filesystem: inspect reads it (no reader lease can be
// written there, and none is needed: nothing can write the store either). On
// a read-only bind mount of a writable filesystem, where a writer elsewhere
// could collect what it reads, it refuses, saying why and what to do.
TEST(InspectReadOnlyTest, ReadsAStoreOnAReadOnlyFilesystemAndRefusesAReadOnlyBindMount) {
  TempDir dir;
  test_util::ScratchMount fs = test_util::ScratchMount::Tmpfs(dir / "fs", 64);
  if (!fs.ok()) GTEST_SKIP() << fs.error();
  const std::string store = dir / "fs/rank0";
  {
    auto s = testing::MakeSmallStore(store, 1000);  // main[i] = i, committed, snapshot s1
    ASSERT_NE(s, nullptr);
  }
  // The same directory through a read-only bind mount (the tmpfs still writable).
  {
    test_util::ScratchMount bind = test_util::ScratchMount::ReadOnlyBind(dir / "fs", dir / "bind");
    if (!bind.ok()) GTEST_SKIP() << bind.error();
    auto r = Tool("optstate-inspect", {dir / "bind/rank0", "ls"});
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_NE(r.err.find("read-only bind mount"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("open it through a writable path"), std::string::npos) << r.err;
  }
  ASSERT_TRUE(fs.RemountReadOnly()) << fs.error();
  struct statvfs sv;
  ASSERT_EQ(statvfs(store.c_str(), &sv), 0);
  ASSERT_TRUE(sv.f_flag & ST_RDONLY);
  auto ls = Tool("optstate-inspect", {store, "ls", "--json"});
  EXPECT_EQ(ls.exit_code, 0) << ls.err;
  auto show = Tool("optstate-inspect", {store, "show", "w", "--field", "main", "--snapshot", "s1", "--json"});
  ASSERT_EQ(show.exit_code, 0) << show.err;
  auto j = ParseJson(show);
  const auto& f = j["fields"][0];
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(f["values"][i].get<double>(), static_cast<double>(i)) << i;
  EXPECT_EQ(f["stats"]["max"].get<double>(), 999.0);
  EXPECT_EQ(f["stats"]["mean"].get<double>(), 499.5);
  auto verify = Tool("optstate-inspect", {store, "verify"});
  EXPECT_EQ(verify.exit_code, 0) << verify.out << verify.err;
  auto stat = Tool("optstate-inspect", {store, "stat", "--json"});
  EXPECT_EQ(stat.exit_code, 0) << stat.err;
}

}  // namespace
}  // namespace optstate::tools
