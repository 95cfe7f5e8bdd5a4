// Reshard: N ranks' checkpoints -> M ranks'. The reference is independent of
// the copy: every element's bytes are a function of (tensor, field, global
// index), so each destination field file is compared with a plain loop over
// its box. Round trips must give back the original field files byte for byte,
// restore must accept every output, and every bad input must be refused with
// nothing written (no dest, no partial directory).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/common/test_util.h"
#include "tests/vfs/checkpoint_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/reshard.h"

namespace optstate::vfs {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

constexpr const char* kChildEnv = "OPTSTATE_RESHARD_CHILD";
constexpr const char* kJob = "reshard-test-job";  // the job of the source ranks  // "<layout>|<dest>|<src>|<src>..."

struct GlobalDef {
  std::string name;
  std::vector<uint64_t> global_shape;
  uint32_t group;
  std::vector<FieldSpec> fields;
};

// A 2-D tensor whose fields span several 2 MiB chunks on every split used
// below, a 1-D one, and one with 2-byte moments (field sizes are per field).
std::vector<GlobalDef> Model() {
  return {{"layers.0/w", {1030, 2050}, 0, {}},
          {"layers.0/b", {1001}, 1, {}},
          {"emb", {300, 770}, 0, {{"main", DType::kF32}, {"exp_avg", DType::kBF16}, {"exp_avg_sq", DType::kBF16}}}};
}

std::vector<FieldSpec> FieldsOf(const GlobalDef& g) { return g.fields.empty() ? AdamFields() : g.fields; }

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The bytes of element `gi` (row-major global index) of a tensor's field.
void ElementBytes(const std::string& tensor, uint32_t field, uint64_t gi, uint32_t esize, char* out) {
  const uint64_t h = Mix(std::hash<std::string>{}(tensor) * 31 + field * 0x100000001ull + gi);
  std::memcpy(out, &h, esize);
}

// Every byte of a box of a tensor's field, by a plain loop over its elements.
std::string Expected(const std::string& tensor, uint32_t field, uint32_t esize, const std::vector<uint64_t>& gshape,
                     const std::vector<uint64_t>& offset, const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t s : shape) n *= s;
  std::string out(n * esize, '\0');
  std::vector<uint64_t> idx(shape.size(), 0);
  for (uint64_t e = 0; e < n; ++e) {
    uint64_t gi = 0;
    for (size_t d = 0; d < shape.size(); ++d) gi = gi * gshape[d] + offset[d] + idx[d];
    ElementBytes(tensor, field, gi, esize, out.data() + e * esize);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// The bytes of a checkpoint shard: a box, or (1-D offset and shape of a
// tensor of higher rank) the flat range [offset, offset + shape) of the
// row-major flattening.
std::string ExpectedShard(const std::string& tensor, uint32_t field, uint32_t esize,
                          const std::vector<uint64_t>& gshape, const std::vector<uint64_t>& offset,
                          const std::vector<uint64_t>& shape) {
  if (shape.size() != 1 || gshape.size() == 1) return Expected(tensor, field, esize, gshape, offset, shape);
  std::string out(shape[0] * esize, '\0');
  for (uint64_t e = 0; e < shape[0]; ++e) ElementBytes(tensor, field, offset[0] + e, esize, out.data() + e * esize);
  return out;
}

std::vector<GlobalTensor> Globals(const std::vector<GlobalDef>& model = Model()) {
  std::vector<GlobalTensor> out;
  for (const GlobalDef& g : model) out.push_back({g.name, g.global_shape});
  return out;
}

// Flattened parameters, in bucket order, as a distributed optimizer shards them.
std::vector<GlobalDef> FlatModel() {
  return {{"p.0", {700001}, 0, {}},
          {"p.1", {3001}, 0, {}},
          {"p.2", {1200000}, 1, {}},
          {"p.3", {17}, 1, {{"main", DType::kF32}, {"exp_avg", DType::kBF16}, {"exp_avg_sq", DType::kBF16}}},
          {"p.4", {900000}, 0, {}}};
}

// Every file under root, by relative path, with its bytes.
std::map<std::string, std::string> Tree(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) out[fs::relative(e.path(), root).string()] = ReadFile(e.path().string());
  }
  return out;
}

// Only the field files (tensors/...), which a reshard must reproduce exactly.
std::map<std::string, std::string> FieldFiles(const std::string& root) {
  std::map<std::string, std::string> out;
  for (auto& [k, v] : Tree(root)) {
    if (k.find("/tensors/") != std::string::npos) out[k] = v;
  }
  return out;
}

std::vector<std::string> RankDirs(const std::string& dest, size_t n) {
  std::vector<std::string> out;
  for (uint32_t r = 0; r < n; ++r) out.push_back(dest + "/" + ReshardRankDirName(r));
  return out;
}

void ExpectError(const Result<ReshardResult>& r, const std::vector<std::string>& parts) {
  ASSERT_FALSE(r.ok());
  for (const std::string& p : parts) {
    EXPECT_NE(r.status().message().find(p), std::string::npos) << "'" << p << "' not in: " << r.status().ToString();
  }
}

class ReshardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir("reshard");
    src_ = root_ + "/src";
    fs::create_directories(src_);
    WriteSources(MakeEvenLayout(Globals(), 4, SplitKind::kRows), src_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // A tensor's own step count in the sources (rank r's, where a test makes
  // the pieces of one tensor disagree): steps_, else its group's.
  uint64_t StepsOf(const std::string& tensor, uint32_t group, uint32_t r = 0) const {
    if (auto it = rank_steps_.find({r, tensor}); it != rank_steps_.end()) return it->second;
    if (auto it = steps_.find(tensor); it != steps_.end()) return it->second;
    return group == 0 ? 7 : 3;
  }

  // One store per rank holding its boxes (the reference bytes) and each
  // tensor's step count (StepsOf), committed at step 7 and exported as
  // <dir>/rank-NNNNN (without state.safetensors unless `safetensors`).
  void WriteSources(const TargetLayout& layout, const std::string& dir, const std::string& job = kJob,
                    bool safetensors = true) {
    for (uint32_t r = 0; r < layout.ranks.size(); ++r) {
      const std::string sp = root_ + "/store-" + std::to_string(r);
      auto store = CreateStore(sp, 2 * kMiB, job);
      ASSERT_NE(store, nullptr);
      std::map<uint32_t, uint64_t> tensor_steps;
      for (const GlobalDef& g : model_) {
        auto it = layout.ranks[r].find(g.name);
        if (it == layout.ranks[r].end()) continue;
        TensorSpec spec;
        spec.name = g.name;
        spec.numel = 1;
        for (uint64_t s : it->second.shape) spec.numel *= s;
        spec.shape = it->second.shape;
        spec.global_shape = g.global_shape;
        spec.shard_offset = it->second.offset;
        spec.group = g.group;
        spec.fields = g.fields;
        auto t = store->CreateTensor(spec);
        ASSERT_TRUE(t.ok()) << t.status().ToString();
        tensor_steps[t->id] = StepsOf(g.name, g.group, r);
        const uint64_t cs = store->chunk_size_bytes();
        AlignedChunk buf(cs);
        std::vector<FieldSpec> fields = FieldsOf(g);
        for (uint32_t f = 0; f < fields.size(); ++f) {
          const uint32_t es = DTypeSize(fields[f].dtype);
          std::string bytes = ExpectedShard(g.name, f, es, g.global_shape, it->second.offset, it->second.shape);
          for (uint64_t c = 0; c * cs < bytes.size(); ++c) {
            std::memset(buf.p, 0, buf.size);
            std::memcpy(buf.p, bytes.data() + c * cs, std::min<uint64_t>(cs, bytes.size() - c * cs));
            ASSERT_TRUE(store->WriteChunk(ChunkRef{t->id, f, c}, buf.p).ok());
          }
        }
      }
      CommitInfo ci;
      ci.step = 7;
      ci.groups = {{0, 7, {{"lr", 1e-3}, {"beta1", 0.9}, {"adamw", 1.0}}}, {1, 3, {{"lr", 2.5e-4}}}};
      ci.tensor_steps = tensor_steps;
      ASSERT_TRUE(store->Commit(ci).ok());
      ExportOptions eo;
      eo.safetensors = safetensors;
      auto e = ExportCheckpoint(store.get(), dir + "/" + ReshardRankDirName(r), eo);
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      store.reset();
      fs::remove_all(sp);
    }
  }

  // Every rank's manifest carries the sources' step, generation and groups,
  // and every field file holds the reference bytes of its box.
  void CheckAgainstReference(const std::vector<std::string>& dirs, const Manifest& like) {
    std::map<std::string, GlobalDef> model;
    for (const GlobalDef& g : model_) model[g.name] = g;
    for (const std::string& d : dirs) {
      auto m = ParseManifest(ReadFile(d + "/manifest.json"), d);
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      EXPECT_EQ(m->step, like.step) << d;
      EXPECT_EQ(m->generation, like.generation) << d;
      ASSERT_EQ(m->groups.size(), like.groups.size()) << d;
      for (size_t i = 0; i < like.groups.size(); ++i) {
        EXPECT_EQ(m->groups[i].step_count, like.groups[i].step_count);
        EXPECT_EQ(m->groups[i].hyper, like.groups[i].hyper);
      }
      for (const ManifestTensor& t : m->tensors) {
        const GlobalDef& g = model.at(t.name);
        EXPECT_EQ(t.global_shape, g.global_shape);
        EXPECT_EQ(t.step_count, StepsOf(t.name, g.group)) << d << " " << t.name;
        std::vector<FieldSpec> fields = FieldsOf(g);
        ASSERT_EQ(t.fields.size(), fields.size());
        for (uint32_t f = 0; f < fields.size(); ++f) {
          EXPECT_EQ(t.fields[f].dtype, fields[f].dtype) << t.name;
          const std::string got = ReadFile(d + "/" + t.fields[f].file);
          EXPECT_TRUE(got ==
                      ExpectedShard(t.name, f, DTypeSize(fields[f].dtype), g.global_shape, t.shard_offset, t.shape))
              << d << " " << t.fields[f].file;
        }
      }
    }
  }

  Manifest SourceManifest() {
    auto m = ParseManifest(ReadFile(src_ + "/rank-00000/manifest.json"), "src");
    EXPECT_TRUE(m.ok());
    return m.ok() ? *m : Manifest{};
  }

  // dest absent and nothing beside it: what every refused reshard leaves.
  void ExpectNothingWritten(const std::string& dest) {
    EXPECT_FALSE(fs::exists(dest)) << dest;
    for (const auto& e : fs::directory_iterator(fs::path(dest).parent_path())) {
      EXPECT_EQ(e.path().filename().string().find(fs::path(dest).filename().string() + ".partial-"),
                std::string::npos)
          << e.path();
    }
  }

  std::string root_, src_;
  std::vector<GlobalDef> model_ = Model();
  // Tensors whose own step count differs from their group's (a param that
  // had no gradient in some steps); rank_steps_: (rank, tensor) -> a count
  // that rank's piece has instead.
  std::map<std::string, uint64_t> steps_ = {{"layers.0/b", 2}, {"emb", 5}};
  std::map<std::pair<uint32_t, std::string>, uint64_t> rank_steps_;
};

TEST_F(ReshardTest, RoundTrip4To2To3To4IsByteIdentical) {
  const std::vector<std::string> s4 = RankDirs(src_, 4);
  const Manifest m0 = SourceManifest();
  ReshardOptions o;
  o.staging_bytes_per_rank = 64 * 1024;  // smaller than a chunk: stages are flushed mid-chunk
  auto r2 = Reshard(s4, MakeEvenLayout(Globals(), 2, SplitKind::kRows), root_ + "/d2", o);
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->ranks, 2u);
  CheckAgainstReference(RankDirs(root_ + "/d2", 2), m0);
  auto r3 = Reshard(RankDirs(root_ + "/d2", 2), MakeEvenLayout(Globals(), 3, SplitKind::kColumns), root_ + "/d3", o);
  ASSERT_TRUE(r3.ok()) << r3.status().ToString();
  CheckAgainstReference(RankDirs(root_ + "/d3", 3), m0);
  auto r4 = Reshard(RankDirs(root_ + "/d3", 3), MakeEvenLayout(Globals(), 4, SplitKind::kRows), root_ + "/d4");
  ASSERT_TRUE(r4.ok()) << r4.status().ToString();
  EXPECT_EQ(r4->bytes_read, r3->bytes_read);  // every source byte read once
  const auto want = FieldFiles(src_), got = FieldFiles(root_ + "/d4");
  ASSERT_EQ(want.size(), got.size());
  EXPECT_TRUE(want == got) << "4 -> 2 -> 3 -> 4 changed a field file";

  // Restore takes every output rank (it verifies each chunk and the
  // safetensors copy), and the restored store holds the reference bytes.
  for (uint32_t r = 0; r < 3; ++r) {
    const std::string dir = root_ + "/d3/" + ReshardRankDirName(r);
    auto store = CreateStoreFromCheckpoint(dir, root_ + "/restored-" + std::to_string(r), StoreOptions{});
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    EXPECT_EQ((*store)->LatestGeneration().step, 7u);
    for (const GlobalDef& g : model_) {  // the restore commits each tensor's own count
      auto t = (*store)->FindTensor(g.name);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      EXPECT_EQ(TensorStepCount((*store)->LatestGeneration(), *t), StepsOf(g.name, g.group)) << g.name;
    }
    const auto dump = DumpLatest(store->get());
    auto m = ParseManifest(ReadFile(dir + "/manifest.json"), dir);
    ASSERT_TRUE(m.ok());
    for (const ManifestTensor& t : m->tensors) {
      for (const ManifestField& f : t.fields) {
        EXPECT_TRUE(dump.at(t.name + "/" + f.name) == ReadFile(dir + "/" + f.file)) << t.name << "/" << f.name;
      }
    }
  }
}

TEST_F(ReshardTest, RowsResplitAlongColumnsAndBack) {
  auto rc = Reshard(RankDirs(src_, 4), MakeEvenLayout(Globals(), 4, SplitKind::kColumns), root_ + "/cols");
  ASSERT_TRUE(rc.ok()) << rc.status().ToString();
  CheckAgainstReference(RankDirs(root_ + "/cols", 4), SourceManifest());
  auto m = ParseManifest(ReadFile(root_ + "/cols/rank-00001/manifest.json"), "cols");
  ASSERT_TRUE(m.ok());
  for (const ManifestTensor& t : m->tensors) {
    if (t.name == "layers.0/w") {
      EXPECT_EQ(t.shard_offset, (std::vector<uint64_t>{0, 512}));
      EXPECT_EQ(t.shape, (std::vector<uint64_t>{1030, 513}));
    }
  }
  auto rr = Reshard(RankDirs(root_ + "/cols", 4), MakeEvenLayout(Globals(), 4, SplitKind::kRows), root_ + "/rows");
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_TRUE(FieldFiles(src_) == FieldFiles(root_ + "/rows"));
  // The reshard's state.safetensors is the exported one (CheckpointLayout's) of
  // the same layout: the same header but for the new store uuid, the same data.
  for (uint32_t r = 0; r < 4; ++r) {
    const std::string want = ReadFile(RankDirs(src_, 4)[r] + "/state.safetensors");
    const std::string got = ReadFile(RankDirs(root_ + "/rows", 4)[r] + "/state.safetensors");
    ASSERT_EQ(got.size(), want.size()) << r;
    uint64_t hlen = 0;
    std::memcpy(&hlen, want.data(), 8);
    EXPECT_EQ(got.compare(8 + hlen, std::string::npos, want, 8 + hlen, std::string::npos), 0) << r;
    auto header = [&](const std::string& bytes) {
      nlohmann::json j = nlohmann::json::parse(bytes.substr(8, hlen));
      j["__metadata__"].erase("optstate.store_uuid");  // new: the checkpoint of no store yet
      j["__metadata__"].erase("optstate.store");       // the first source's name
      return j;
    };
    EXPECT_EQ(header(got), header(want)) << r;
  }
}

// Sources exported without state.safetensors: the reshard reads their field
// files, as it reads any source's, and writes the same ranks (with theirs).
TEST_F(ReshardTest, SourcesWithoutSafetensors) {
  const std::string lean = root_ + "/lean";
  fs::create_directories(lean);
  WriteSources(MakeEvenLayout(Globals(), 4, SplitKind::kRows), lean, kJob, /*safetensors=*/false);
  for (const std::string& d : RankDirs(lean, 4)) ASSERT_FALSE(fs::exists(d + "/" + kSafetensorsFileName)) << d;
  auto from_lean = Reshard(RankDirs(lean, 4), MakeEvenLayout(Globals(), 3, SplitKind::kColumns), root_ + "/a");
  ASSERT_TRUE(from_lean.ok()) << from_lean.status().ToString();
  auto from_full = Reshard(RankDirs(src_, 4), MakeEvenLayout(Globals(), 3, SplitKind::kColumns), root_ + "/b");
  ASSERT_TRUE(from_full.ok()) << from_full.status().ToString();
  EXPECT_EQ(from_lean->bytes_read, from_full->bytes_read);
  CheckAgainstReference(RankDirs(root_ + "/a", 3), SourceManifest());
  EXPECT_TRUE(FieldFiles(root_ + "/a") == FieldFiles(root_ + "/b"));
  for (const std::string& d : RankDirs(root_ + "/a", 3)) {
    auto m = ReadManifestFile(d + "/" + kManifestFileName);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_TRUE(m->has_safetensors) << d;
    EXPECT_TRUE(fs::exists(d + "/" + kSafetensorsFileName)) << d;
  }
}

// 2 x 2 boxes of Model()'s 2-D tensors (writes to a destination arrive out of
// order, so they go through the page cache), its 1-D tensor on ranks 1 and 3
// only.
TargetLayout CheckerboardLayout() {
  TargetLayout t;
  t.ranks.resize(4);
  for (const GlobalDef& g : Model()) {
    if (g.global_shape.size() == 1) {
      t.ranks[1][g.name] = {{0}, {400}};
      t.ranks[3][g.name] = {{400}, {g.global_shape[0] - 400}};
      continue;
    }
    const uint64_t h = g.global_shape[0] / 2 + 1, w = g.global_shape[1] / 2 - 3;
    t.ranks[0][g.name] = {{0, 0}, {h, w}};
    t.ranks[1][g.name] = {{0, w}, {h, g.global_shape[1] - w}};
    t.ranks[2][g.name] = {{h, 0}, {g.global_shape[0] - h, w}};
    t.ranks[3][g.name] = {{h, w}, {g.global_shape[0] - h, g.global_shape[1] - w}};
  }
  return t;
}

// ReshardOptions::safetensors = false: each rank's field files and manifest
// alone, the manifest saying so, on both write paths (rows of rows arrive in
// file order and are written with O_DIRECT, a checkerboard through the page
// cache);
// the field files and manifests are the full reshard's but for that, the
// bytes written are the full reshard's less its state.safetensors (and the
// manifests' difference), and every rank restores to its field files' bytes.
TEST_F(ReshardTest, OutputWithoutSafetensors) {
  for (const std::string tag : {"rows", "checkerboard"}) {
    SCOPED_TRACE(tag);
    const TargetLayout layout = tag == "rows" ? MakeEvenLayout(Globals(), 3, SplitKind::kRows) : CheckerboardLayout();
    const size_t ranks = layout.ranks.size();
    ReshardOptions lean_opts;
    lean_opts.safetensors = false;
    auto lean = Reshard(RankDirs(src_, 4), layout, root_ + "/lean-" + tag, lean_opts);
    ASSERT_TRUE(lean.ok()) << lean.status().ToString();
    auto full = Reshard(RankDirs(src_, 4), layout, root_ + "/full-" + tag);
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    const std::vector<std::string> lean_dirs = RankDirs(root_ + "/lean-" + tag, ranks);
    CheckAgainstReference(lean_dirs, SourceManifest());
    EXPECT_TRUE(FieldFiles(root_ + "/lean-" + tag) == FieldFiles(root_ + "/full-" + tag));
    EXPECT_EQ(lean->bytes_read, full->bytes_read);
    uint64_t st_bytes = 0;
    int64_t manifest_bytes_more = 0;  // the lean manifests' bytes less the full ones' (the added key)
    for (uint32_t r = 0; r < ranks; ++r) {
      const std::string d = lean_dirs[r], f = RankDirs(root_ + "/full-" + tag, ranks)[r];
      EXPECT_FALSE(fs::exists(d + "/" + kSafetensorsFileName)) << d;
      st_bytes += fs::file_size(f + "/" + kSafetensorsFileName);
      manifest_bytes_more += static_cast<int64_t>(fs::file_size(d + "/" + kManifestFileName)) -
                             static_cast<int64_t>(fs::file_size(f + "/" + kManifestFileName));
      nlohmann::json lj = nlohmann::json::parse(ReadFile(d + "/" + kManifestFileName));
      nlohmann::json fj = nlohmann::json::parse(ReadFile(f + "/" + kManifestFileName));
      EXPECT_EQ(lj.value(kManifestSafetensorsKey, true), false) << d;
      EXPECT_FALSE(fj.contains(kManifestSafetensorsKey)) << f;
      auto m = ReadManifestFile(d + "/" + kManifestFileName);
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      EXPECT_FALSE(m->has_safetensors) << d;
      // The same manifest but for the key, the new store's uuid and the checksum of the whole.
      for (nlohmann::json* j : {&lj, &fj}) {
        j->erase(kManifestSafetensorsKey);
        j->erase(kManifestChecksumKey);
        (*j)["store"].erase("uuid");
      }
      EXPECT_EQ(lj, fj) << d;
      auto store = CreateStoreFromCheckpoint(d, root_ + "/restored-" + tag + std::to_string(r), StoreOptions{});
      ASSERT_TRUE(store.ok()) << store.status().ToString();
      const auto dump = DumpLatest(store->get());
      for (const ManifestTensor& t : m->tensors) {
        for (const ManifestField& fl : t.fields) {
          EXPECT_TRUE(dump.at(t.name + "/" + fl.name) == ReadFile(d + "/" + fl.file)) << t.name << "/" << fl.name;
        }
      }
    }
    EXPECT_EQ(static_cast<int64_t>(full->bytes_written - lean->bytes_written),
              static_cast<int64_t>(st_bytes) - manifest_bytes_more);
  }
}

TEST_F(ReshardTest, CheckerboardTarget) {
  const TargetLayout t = CheckerboardLayout();
  auto r = Reshard(RankDirs(src_, 4), t, root_ + "/cb");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  CheckAgainstReference(RankDirs(root_ + "/cb", 4), SourceManifest());
  auto back = Reshard(RankDirs(root_ + "/cb", 4), MakeEvenLayout(Globals(), 4, SplitKind::kRows), root_ + "/back");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(FieldFiles(src_) == FieldFiles(root_ + "/back"));
}

// Flat-buffer shards (a distributed optimizer's): 4 data-parallel ranks with
// 1 Mi-element buckets re-split over 3 ranks with 512 Ki-element buckets, and
// back; the ranges cut through parameters at other places each time.
class FlatReshardTest : public ReshardTest {
 protected:
  void SetUp() override {
    model_ = FlatModel();
    root_ = MakeTempDir("reshard-flat");
    src_ = root_ + "/src";
    fs::create_directories(src_);
    auto layout = MakeBucketLayout(Globals(model_), 1 << 20, 4);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    WriteSources(*layout, src_);
  }
};

TEST_F(FlatReshardTest, ResplitWithAnotherBucketSizeAndBack) {
  auto three = MakeBucketLayout(Globals(model_), 512 << 10, 3);
  ASSERT_TRUE(three.ok());
  // Bucket 0 of 512 Ki elements holds p.0 alone (700001 elements): rank 0 gets its first third.
  EXPECT_EQ(three->ranks[0].at("p.0").shape, std::vector<uint64_t>{233334});
  ASSERT_TRUE(Reshard(RankDirs(src_, 4), *three, root_ + "/three").ok());
  CheckAgainstReference(RankDirs(root_ + "/three", 3), SourceManifest());
  auto back = MakeBucketLayout(Globals(model_), 1 << 20, 4);
  ASSERT_TRUE(back.ok());
  auto r = Reshard(RankDirs(root_ + "/three", 3), *back, root_ + "/back");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(FieldFiles(src_) == FieldFiles(root_ + "/back"));
}

TEST(ReshardBucketLayout, PacksWholeTensorsAndSplitsEachBucketEvenly) {
  // Buckets of >= 10 elements: {a(6), b(5)} = 11 -> padded 12 over 3 ranks: [0,4) [4,8) [8,12);
  // {c(3)} -> padded 3: [0,1) [1,2) [2,3).
  auto l = MakeBucketLayout({{"a", {6}}, {"b", {5}}, {"c", {3}}}, 10, 3);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->ranks[0].at("a").offset, std::vector<uint64_t>{0});
  EXPECT_EQ(l->ranks[0].at("a").shape, std::vector<uint64_t>{4});
  EXPECT_EQ(l->ranks[0].count("b"), 0u);
  EXPECT_EQ(l->ranks[1].at("a").offset, std::vector<uint64_t>{4});
  EXPECT_EQ(l->ranks[1].at("a").shape, std::vector<uint64_t>{2});
  EXPECT_EQ(l->ranks[1].at("b").shape, std::vector<uint64_t>{2});
  EXPECT_EQ(l->ranks[2].at("b").offset, std::vector<uint64_t>{2});
  EXPECT_EQ(l->ranks[2].at("b").shape, std::vector<uint64_t>{3});
  for (uint32_t r = 0; r < 3; ++r) EXPECT_EQ(l->ranks[r].at("c").offset, std::vector<uint64_t>{r});
  // Tensors of any rank: flat ranges of their row-major flattening.
  auto nd = MakeBucketLayout({{"w", {2, 3}}, {"v", {5}}}, 10, 2);
  ASSERT_TRUE(nd.ok()) << nd.status().ToString();
  EXPECT_TRUE(nd->ranks[0].at("w").flat);
  EXPECT_EQ(nd->ranks[0].at("w").offset, std::vector<uint64_t>{0});
  EXPECT_EQ(nd->ranks[0].at("w").shape, std::vector<uint64_t>{6});
  EXPECT_EQ(nd->ranks[1].at("v").offset, std::vector<uint64_t>{0});
  EXPECT_EQ(nd->ranks[1].at("v").shape, std::vector<uint64_t>{5});
  EXPECT_FALSE(MakeBucketLayout({{"w", {2, 3}}}, 0, 2).ok());
}

// Every element of the global tensor, in row-major order, that a list of
// pieces covers (the reference: a plain loop over each box).
std::vector<uint64_t> Elements(const std::vector<ShardPiece>& pieces, const std::vector<uint64_t>& gshape) {
  std::vector<uint64_t> out;
  for (const ShardPiece& p : pieces) {
    EXPECT_EQ(p.first, out.size());
    EXPECT_FALSE(p.box.flat);
    uint64_t n = 1;
    for (uint64_t s : p.box.shape) n *= s;
    std::vector<uint64_t> idx(gshape.size(), 0);
    for (uint64_t e = 0; e < n; ++e) {
      uint64_t gi = 0;
      for (size_t d = 0; d < gshape.size(); ++d) gi = gi * gshape[d] + p.box.offset[d] + idx[d];
      out.push_back(gi);
      for (size_t d = gshape.size(); d-- > 0;) {
        if (++idx[d] < p.box.shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  return out;
}

TEST(ReshardShardPieces, AFlatRangeIsAtMostTwoRankMinusOneBoxesInOrder) {
  for (const std::vector<uint64_t>& gshape :
       std::vector<std::vector<uint64_t>>{{7, 5}, {3, 4, 5}, {2, 3, 1, 4}, {1, 9}, {6, 1}}) {
    uint64_t numel = 1;
    for (uint64_t s : gshape) numel *= s;
    for (uint64_t b = 0; b < numel; ++b) {
      for (uint64_t e = b + 1; e <= numel; ++e) {
        const std::vector<ShardPiece> pieces = ShardPieces(FlatRange(b, e), gshape);
        EXPECT_LE(pieces.size(), 2 * gshape.size() - 1);
        std::vector<uint64_t> want(e - b);
        for (uint64_t i = 0; i < want.size(); ++i) want[i] = b + i;
        ASSERT_EQ(Elements(pieces, gshape), want) << "[" << b << ", " << e << ") of rank " << gshape.size();
      }
    }
  }
  // A flat range of a 1-D tensor is its box.
  const auto one = ShardPieces(FlatRange(3, 8), {10});
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].box.offset, std::vector<uint64_t>{3});
  EXPECT_EQ(one[0].box.shape, std::vector<uint64_t>{5});
}

// A flat range within a box (a data-parallel shard of a tensor-parallel
// slice): the range's elements in the box's row-major order, in the tensor.
TEST(ReshardShardPieces, AFlatRangeWithinABoxIsThatBoxsElementsInOrder) {
  const std::vector<uint64_t> gshape{7, 6}, within_offset{2, 1}, within_shape{3, 4};
  for (uint64_t b = 0; b < 12; ++b) {
    for (uint64_t e = b + 1; e <= 12; ++e) {
      ShardBox s = FlatRange(b, e);
      s.within_offset = within_offset;
      s.within_shape = within_shape;
      ASSERT_TRUE(CheckShardInside(s, gshape).ok());
      std::vector<uint64_t> want;
      for (uint64_t i = b; i < e; ++i) want.push_back((2 + i / 4) * 6 + 1 + i % 4);
      ASSERT_EQ(Elements(ShardPieces(s, gshape), gshape), want) << "[" << b << ", " << e << ")";
    }
  }
  // As a checkpoint of the slice records it, moved to the slice's place.
  const ShardBox embedded = EmbedShard(ShardOf({5}, within_shape, {3}), within_shape, within_offset);
  EXPECT_TRUE(embedded.flat);
  EXPECT_EQ(embedded.within_offset, within_offset);
  EXPECT_EQ(embedded.within_shape, within_shape);
  const ShardBox box = EmbedShard(ShardOf({3, 2}, within_shape, {0, 2}), within_shape, within_offset);
  EXPECT_FALSE(box.flat);
  EXPECT_EQ(box.offset, (std::vector<uint64_t>{2, 3}));
  // Outside the tensor, or past the box: refused, saying which.
  ShardBox bad = FlatRange(0, 4);
  bad.within_offset = {5, 1};
  bad.within_shape = {3, 4};
  EXPECT_NE(CheckShardInside(bad, gshape).message().find("within a box that holds [5, 8) x [1, 5)"), std::string::npos)
      << CheckShardInside(bad, gshape).message();
  bad = FlatRange(10, 13);
  bad.within_offset = within_offset;
  bad.within_shape = within_shape;
  EXPECT_NE(CheckShardInside(bad, gshape).message().find("past the box's 12 elements"), std::string::npos)
      << CheckShardInside(bad, gshape).message();
}

// Tensor parallel 2 (column slices of the 2-D weight) x data parallel 2
// (flat halves of each slice; the other tensors split flat on the first
// tensor-parallel rank and copied as replicas on the second) and back to
// rows: the slices' checkpoints record the slice's coordinates and their
// place in global-boxes.json, and the way back is byte-identical.
TEST_F(ReshardTest, TensorParallelSlicesSplitFlatAndBackAreByteIdentical) {
  TargetLayout tp;
  tp.ranks.resize(4);  // rank = data-parallel rank x 2 + tensor-parallel rank
  for (uint32_t r = 0; r < 4; ++r) {
    const uint32_t t = r % 2, d = r / 2;
    for (const GlobalDef& g : model_) {
      uint64_t n = 1;
      for (uint64_t x : g.global_shape) n *= x;
      ShardBox b;
      if (g.name == "layers.0/w") {
        n /= 2;
        b = FlatRange(d * n / 2, (d + 1) * n / 2);
        b.within_offset = {0, t * 1025};
        b.within_shape = {1030, 1025};
      } else {
        b = FlatRange(d * n / 2, (d + 1) * n / 2);
        b.replica = t == 1;
      }
      tp.ranks[r].emplace(g.name, b);
    }
  }
  ReshardOptions o;
  o.staging_bytes_per_rank = 64 * 1024;
  auto r4 = Reshard(RankDirs(src_, 4), tp, root_ + "/tp2", o);
  ASSERT_TRUE(r4.ok()) << r4.status().ToString();
  for (uint32_t r = 0; r < 4; ++r) {
    const std::string dir = root_ + "/tp2/" + ReshardRankDirName(r);
    auto m = ParseManifest(ReadFile(dir + "/manifest.json"), dir);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    auto boxes = ParseGlobalBoxes(ReadFile(dir + "/" + kGlobalBoxesFileName), dir);
    ASSERT_TRUE(boxes.ok()) << boxes.status().ToString();
    EXPECT_EQ(boxes->at("layers.0/w").offset, (std::vector<uint64_t>{0, (r % 2) * 1025}));
    EXPECT_EQ(boxes->at("layers.0/w").global_shape, (std::vector<uint64_t>{1030, 2050}));
    EXPECT_EQ(boxes->count("emb"), r % 2);  // a replica on the second tensor-parallel rank
    if (r % 2 == 1) {
      EXPECT_TRUE(boxes->at("emb").replica);
    }
    for (const ManifestTensor& t : m->tensors) {
      const ShardBox& want = tp.ranks[r].at(t.name);
      if (t.name == "layers.0/w") {
        EXPECT_EQ(t.global_shape, (std::vector<uint64_t>{1030, 1025}));
      }
      EXPECT_EQ(t.shard_offset, want.offset) << t.name;
      for (uint32_t f = 0; f < t.fields.size(); ++f) {
        const uint32_t es = DTypeSize(t.fields[f].dtype);
        const GlobalDef& g = *std::find_if(model_.begin(), model_.end(), [&](const GlobalDef& x) {
          return x.name == t.name;
        });
        std::string bytes;
        for (uint64_t gi : Elements(ShardPieces(want, g.global_shape), g.global_shape)) {
          char e[8];
          ElementBytes(t.name, f, gi, es, e);
          bytes.append(e, es);
        }
        EXPECT_TRUE(ReadFile(dir + "/" + t.fields[f].file) == bytes) << dir << " " << t.fields[f].file;
      }
    }
  }
  // Back: the slices placed by their global-boxes.json, the replicas skipped.
  auto back = Reshard(RankDirs(root_ + "/tp2", 4), MakeEvenLayout(Globals(), 4, SplitKind::kRows), root_ + "/rows4");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(FieldFiles(src_) == FieldFiles(root_ + "/rows4"));
  // Without its global-boxes.json a slice's checkpoint is refused (another global shape), never misplaced.
  fs::remove(root_ + "/tp2/rank-00001/" + kGlobalBoxesFileName);
  ExpectError(Reshard(RankDirs(root_ + "/tp2", 4), MakeEvenLayout(Globals(), 1, SplitKind::kRows), root_ + "/one"),
              {"tensor 'layers.0/w': global_shape [1030, 2050]", "[1030, 1025]"});
}

// 2-D row boxes -> flat buckets (a data-parallel optimizer's layout of the
// same 2-D weights) -> column boxes -> row boxes: every step checked against
// the reference bytes, the last one byte-identical to the sources.
TEST_F(ReshardTest, RowBoxesToFlatBucketsToColumnsToRowsIsByteIdentical) {
  const Manifest m0 = SourceManifest();
  ReshardOptions o;
  o.staging_bytes_per_rank = 64 * 1024;
  auto buckets = MakeBucketLayout(Globals(), 1 << 20, 3);
  ASSERT_TRUE(buckets.ok()) << buckets.status().ToString();
  ASSERT_TRUE(buckets->ranks[1].at("layers.0/w").flat);
  auto r3 = Reshard(RankDirs(src_, 4), *buckets, root_ + "/flat3", o);
  ASSERT_TRUE(r3.ok()) << r3.status().ToString();
  CheckAgainstReference(RankDirs(root_ + "/flat3", 3), m0);
  // The manifests record flat ranges of the 2-D tensors: 1-D shape and offset, the real global shape.
  auto m = ParseManifest(ReadFile(root_ + "/flat3/rank-00001/manifest.json"), "flat3");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  bool seen = false;
  for (const ManifestTensor& t : m->tensors) {
    if (t.name != "layers.0/w") continue;
    seen = true;
    EXPECT_EQ(t.global_shape, (std::vector<uint64_t>{1030, 2050}));
    EXPECT_EQ(t.shape.size(), 1u);
    EXPECT_EQ(t.shard_offset, buckets->ranks[1].at("layers.0/w").offset);
  }
  EXPECT_TRUE(seen);
  // Restore takes a flat-range checkpoint and holds its bytes.
  {
    const std::string dir = root_ + "/flat3/" + ReshardRankDirName(1);
    auto store = CreateStoreFromCheckpoint(dir, root_ + "/restored-flat", StoreOptions{});
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    const auto dump = DumpLatest(store->get());
    for (const ManifestTensor& t : m->tensors) {
      for (const ManifestField& f : t.fields) {
        EXPECT_TRUE(dump.at(t.name + "/" + f.name) == ReadFile(dir + "/" + f.file)) << t.name << "/" << f.name;
      }
    }
  }
  auto r2 = Reshard(RankDirs(root_ + "/flat3", 3), MakeEvenLayout(Globals(), 2, SplitKind::kColumns),
                    root_ + "/cols2", o);
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  CheckAgainstReference(RankDirs(root_ + "/cols2", 2), m0);
  auto r4 = Reshard(RankDirs(root_ + "/cols2", 2), MakeEvenLayout(Globals(), 4, SplitKind::kRows), root_ + "/rows4");
  ASSERT_TRUE(r4.ok()) << r4.status().ToString();
  const auto want = FieldFiles(src_), got = FieldFiles(root_ + "/rows4");
  ASSERT_EQ(want.size(), got.size());
  EXPECT_TRUE(want == got) << "4 rows -> 3 flat buckets -> 2 columns -> 4 rows changed a field file";
  // And flat buckets of another size straight from flat buckets.
  auto five = MakeBucketLayout(Globals(), 300000, 5);
  ASSERT_TRUE(five.ok());
  ASSERT_TRUE(Reshard(RankDirs(root_ + "/flat3", 3), *five, root_ + "/flat5", o).ok());
  CheckAgainstReference(RankDirs(root_ + "/flat5", 5), m0);
}

TEST_F(ReshardTest, BadFlatRangesAreRefusedAndNothingIsWritten) {
  const std::string dest = root_ + "/out";
  const std::vector<std::string> s4 = RankDirs(src_, 4);
  // Rank 0: rows [0, 3) of w as a box; rank 1: the rest of w as a flat range
  // that starts 2 elements early, inside rank 0's last row.
  TargetLayout t = MakeEvenLayout(Globals(), 2, SplitKind::kRows);
  t.ranks[0]["layers.0/w"] = ShardBox{{0, 0}, {3, 2050}};
  t.ranks[1]["layers.0/w"] = FlatRange(3 * 2050 - 2, 1030 * 2050);
  ExpectError(Reshard(s4, t, dest), {"tensor 'layers.0/w'", "rank 0 ([0, 3) x [0, 2050))",
                                     "rank 1 (flat [6148, 2111500))", "overlap in [2, 3) x [2048, 2050)"});
  ExpectNothingWritten(dest);

  // A flat range past the tensor's elements.
  t.ranks[1]["layers.0/w"] = FlatRange(3 * 2050, 1030 * 2050 + 1);
  ExpectError(Reshard(s4, t, dest), {"tensor 'layers.0/w'", "rank 1", "flat [6150, 2111501)", "past", "2111500"});
  ExpectNothingWritten(dest);

  // A gap between a flat range and a box.
  t.ranks[1]["layers.0/w"] = FlatRange(3 * 2050 + 1, 1030 * 2050);
  ExpectError(Reshard(s4, t, dest), {"tensor 'layers.0/w'", "1 elements are in no shard", "[3, 4) x [0, 1)"});
  ExpectNothingWritten(dest);

  // A source whose flat range overlaps another source's box: checkpoints of
  // two layouts, each with one whole tensor but w's box or flat range.
  auto split_w = [&](const ShardBox& first, uint64_t flat_begin, const std::string& dir) {
    TargetLayout l = MakeEvenLayout(Globals(), 1, SplitKind::kRows);
    l.ranks.resize(2);
    l.ranks[0]["layers.0/w"] = first;
    l.ranks[1]["layers.0/w"] = FlatRange(flat_begin, 1030 * 2050);
    auto r = Reshard(s4, l, dir);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  };
  split_w(ShardBox{{0, 0}, {515, 2050}}, 515 * 2050, root_ + "/a");
  split_w(FlatRange(0, 514 * 2050 + 5), 514 * 2050 + 5, root_ + "/b");
  const std::string a0 = root_ + "/a/" + ReshardRankDirName(0), b1 = root_ + "/b/" + ReshardRankDirName(1);
  ExpectError(Reshard({a0, b1}, MakeEvenLayout(Globals(), 1, SplitKind::kRows), dest),
              {"sources", "tensor 'layers.0/w'", a0, b1, "flat [1053705, 2111500)", "overlap in [514, 515) x [5, 2050)"});
  ExpectNothingWritten(dest);
  // The same two checkpoints with the other halves tile, and go back to rows byte for byte.
  ASSERT_TRUE(Reshard({a0, root_ + "/a/" + ReshardRankDirName(1)}, MakeEvenLayout(Globals(), 4, SplitKind::kRows),
                      root_ + "/back").ok());
  EXPECT_TRUE(FieldFiles(src_) == FieldFiles(root_ + "/back"));
  ExpectNothingWritten(dest);
}

TEST_F(ReshardTest, BadSourcesAreRefusedAndNothingIsWritten) {
  const std::string dest = root_ + "/out";
  const TargetLayout two = MakeEvenLayout(Globals(), 2, SplitKind::kRows);
  std::vector<std::string> s4 = RankDirs(src_, 4);

  // A missing rank: rows [515, 772) of w (rank 2's) are in no source.
  ExpectError(Reshard({s4[0], s4[1], s4[3]}, two, dest),
              {"tensor 'emb'", "in no shard", "[150, 225) x [0, 770)", "missing"});
  ExpectNothingWritten(dest);

  // The same rank twice: overlap.
  fs::copy(s4[1], root_ + "/dup", fs::copy_options::recursive);
  ExpectError(Reshard({s4[0], s4[1], root_ + "/dup", s4[2], s4[3]}, two, dest),
              {"overlap", "[75, 150) x [0, 770)", root_ + "/dup"});
  ExpectNothingWritten(dest);

  // Edited copies of rank 3's manifest.
  auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
    const std::string d = root_ + "/edited";
    fs::remove_all(d);
    fs::copy(s4[3], d, fs::copy_options::recursive);
    nlohmann::json j = nlohmann::json::parse(ReadFile(d + "/manifest.json"));
    edit(j);
    std::ofstream(d + "/manifest.json", std::ios::trunc) << SealManifest(j.dump(1));
    return std::vector<std::string>{s4[0], s4[1], s4[2], d};
  };
  ExpectError(Reshard(edited([](nlohmann::json& j) { j["step"] = 8; }), two, dest),
              {"not one checkpoint", "step 7", "step 8"});
  ExpectNothingWritten(dest);
  ExpectError(Reshard(edited([](nlohmann::json& j) { j["generation"] = 99; }), two, dest),
              {"generation 99"});
  ExpectNothingWritten(dest);
  ExpectError(Reshard(edited([](nlohmann::json& j) {
                        for (auto& t : j["tensors"]) {
                          if (t["name"] == "layers.0/b") t["global_shape"] = {1002};
                        }
                      }),
                      two, dest),
              {"tensor 'layers.0/b'", "global_shape", "[1001]", "[1002]"});
  ExpectNothingWritten(dest);
  ExpectError(Reshard(edited([](nlohmann::json& j) { j["groups"][0]["hyper"]["lr"] = 0.5; }), two, dest),
              {"groups differ", "lr=0.5"});
  ExpectNothingWritten(dest);

  // A damaged field file: found by its chunk hash while reading; the partial
  // output is removed.
  const std::string d = root_ + "/damaged";
  fs::copy(s4[2], d, fs::copy_options::recursive);
  const std::string victim = d + "/tensors/emb/exp_avg";
  std::string bytes = ReadFile(victim);
  bytes[100] ^= 1;
  std::ofstream(victim, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  ExpectError(Reshard({s4[0], s4[1], d, s4[3]}, two, dest), {victim, "chunk 0", "XXH3", "tensor 'emb'"});
  ExpectNothingWritten(dest);

  // A destination that holds something is never written over.
  fs::create_directories(dest + "/x");
  ExpectError(Reshard(s4, two, dest), {"not empty"});
  fs::remove_all(dest);

  // A manifest with a flipped bit (step 7 -> 5) that still parses: its own
  // checksum refuses it, naming the file.
  {
    const std::string f = root_ + "/flipped";
    fs::copy(s4[1], f, fs::copy_options::recursive);
    std::string text = ReadFile(f + "/manifest.json");
    const size_t at = text.find("\"step\": 7");
    ASSERT_NE(at, std::string::npos);
    text[at + 8] = '5';
    std::ofstream(f + "/manifest.json", std::ios::trunc | std::ios::binary) << text;
    ExpectError(Reshard({s4[0], f, s4[2], s4[3]}, two, dest), {f + "/manifest.json", "XXH3", kManifestChecksumKey});
    ExpectNothingWritten(dest);
  }
}

// Two jobs whose ranks agree on step, generation, groups and layout: a mix of
// their ranks is refused, naming both sources and both jobs; each job's own
// ranks reshard, and the output carries their job.
TEST_F(ReshardTest, RanksOfTwoJobsAreNotMixed) {
  const TargetLayout four = MakeEvenLayout(Globals(), 4, SplitKind::kRows);
  const TargetLayout two = MakeEvenLayout(Globals(), 2, SplitKind::kRows);
  const std::string other = root_ + "/other-job";
  fs::create_directories(other);
  WriteSources(four, other, "another-job");
  std::vector<std::string> a = RankDirs(src_, 4), b = RankDirs(other, 4);
  const std::string dest = root_ + "/out";
  ExpectError(Reshard({a[0], a[1], b[2], a[3]}, two, dest),
              {"not of one job", a[0], kJob, b[2], "another-job"});
  ExpectNothingWritten(dest);
  ASSERT_TRUE(Reshard(b, two, dest).ok());
  auto m = ReadManifestFile(dest + "/" + ReshardRankDirName(1) + "/manifest.json");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->job, "another-job");
  auto restored = CreateStoreFromCheckpoint(dest + "/" + ReshardRankDirName(1), root_ + "/restored", StoreOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ((*restored)->identity().job, "another-job");
  fs::remove_all(dest);

  // Manifests written before they named a job: taken when none names one,
  // refused when only some do.
  std::vector<std::string> legacy;
  for (uint32_t r = 0; r < 4; ++r) {
    const std::string d = root_ + "/legacy-" + std::to_string(r);
    fs::copy(a[r], d, fs::copy_options::recursive);
    nlohmann::json j = nlohmann::json::parse(ReadFile(d + "/manifest.json"));
    j.erase("job");
    j.erase(kManifestChecksumKey);
    std::ofstream(d + "/manifest.json", std::ios::trunc) << j.dump(1);
    legacy.push_back(d);
  }
  ExpectError(Reshard({legacy[0], legacy[1], legacy[2], a[3]}, two, dest), {"not of one job", a[3], "records no job"});
  ExpectNothingWritten(dest);
  ASSERT_TRUE(Reshard(legacy, two, dest).ok());
}

// Adam's bias correction is per tensor: pieces of one tensor whose step
// counts differ are not one tensor's state, and the reshard says which.
TEST_F(ReshardTest, PiecesThatDisagreeOnAStepCountAreRefused) {
  const std::string src = root_ + "/src-disagree";
  fs::create_directories(src);
  rank_steps_[{2, "layers.0/w"}] = 6;
  WriteSources(MakeEvenLayout(Globals(), 4, SplitKind::kRows), src);
  const std::string dest = root_ + "/out";
  ExpectError(Reshard(RankDirs(src, 4), MakeEvenLayout(Globals(), 2, SplitKind::kRows), dest),
              {"tensor 'layers.0/w'", "step_count 7", "6 in source 2", RankDirs(src, 4)[0],
               RankDirs(src, 4)[2]});
  ExpectNothingWritten(dest);
}

TEST_F(ReshardTest, BadTargetLayoutsAreRefusedAndNothingIsWritten) {
  const std::string dest = root_ + "/out";
  const std::vector<std::string> s4 = RankDirs(src_, 4);
  TargetLayout t = MakeEvenLayout(Globals(), 2, SplitKind::kRows);
  TargetLayout gap = t;
  gap.ranks[1]["layers.0/w"].offset[0] += 5;
  gap.ranks[1]["layers.0/w"].shape[0] -= 5;
  ExpectError(Reshard(s4, gap, dest), {"target layout", "tensor 'layers.0/w'", "in no shard", "[515, 520) x [0, 2050)"});
  ExpectNothingWritten(dest);

  TargetLayout overlap = t;
  overlap.ranks[0]["layers.0/b"].shape[0] += 1;
  ExpectError(Reshard(s4, overlap, dest), {"tensor 'layers.0/b'", "rank 0", "rank 1", "overlap in [500, 501)"});
  ExpectNothingWritten(dest);

  TargetLayout outside = t;
  outside.ranks[1]["emb"].shape[1] += 1;
  ExpectError(Reshard(s4, outside, dest), {"tensor 'emb'", "rank 1", "outside the tensor in dimension 1"});
  ExpectNothingWritten(dest);

  TargetLayout unknown = t;
  unknown.ranks[1]["nope"] = {{0}, {1}};
  ExpectError(Reshard(s4, unknown, dest), {"'nope'", "no source"});
  ExpectNothingWritten(dest);

  TargetLayout missing = t;
  missing.ranks[0].erase("emb");
  missing.ranks[1].erase("emb");
  ExpectError(Reshard(s4, missing, dest), {"tensor 'emb'", "on no rank"});
  ExpectNothingWritten(dest);

  TargetLayout wrong_rank = t;
  wrong_rank.ranks[0]["emb"] = {{0}, {150}};
  ExpectError(Reshard(s4, wrong_rank, dest), {"tensor 'emb'", "rank 0", "rank 1"});
  ExpectNothingWritten(dest);
}

// A tensor without elements: its field files are empty but must be there; the
// target need not list it (it goes to rank 0, whole).
TEST_F(ReshardTest, EmptyTensorsCarryOverAndTheirMissingFilesAreReported) {
  model_.push_back({"empty", {0, 8}, 1, {}});
  TargetLayout layout = MakeEvenLayout(Globals(), 4, SplitKind::kRows);
  layout.ranks[2]["empty"] = ShardBox{{0, 0}, {0, 8}};
  const std::string src = root_ + "/src-empty";
  fs::create_directories(src);
  WriteSources(layout, src);
  const std::vector<std::string> s4 = RankDirs(src, 4);
  ASSERT_TRUE(fs::exists(s4[2] + "/tensors/empty/exp_avg"));
  auto r = Reshard(s4, MakeEvenLayout(Globals(), 2, SplitKind::kRows), root_ + "/two");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  CheckAgainstReference(RankDirs(root_ + "/two", 2), SourceManifest());
  auto m = ParseManifest(ReadFile(root_ + "/two/rank-00000/manifest.json"), "two");
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(std::any_of(m->tensors.begin(), m->tensors.end(), [](const ManifestTensor& t) {
    return t.name == "empty" && t.shape == std::vector<uint64_t>{0, 8} && t.numel == 0;
  }));
  auto store = CreateStoreFromCheckpoint(root_ + "/two/rank-00000", root_ + "/restored", StoreOptions{});
  EXPECT_TRUE(store.ok()) << store.status().ToString();

  fs::remove(s4[2] + "/tensors/empty/exp_avg");
  const std::string dest = root_ + "/out";
  ExpectError(Reshard(s4, MakeEvenLayout(Globals(), 2, SplitKind::kRows), dest),
              {s4[2] + "/tensors/empty/exp_avg", "tensor 'empty'", "field 'exp_avg'", "missing"});
  ExpectNothingWritten(dest);
}

TEST(ReshardLayoutJson, RoundTripAndStrictParse) {
  TargetLayout t = MakeEvenLayout({{"a", {10, 3}}, {"b/c", {2}}}, 3, SplitKind::kRows);
  ASSERT_EQ(t.ranks.size(), 3u);
  EXPECT_EQ(t.ranks[0].count("b/c"), 0u);  // 2 rows over 3 ranks: rank 0 holds none
  EXPECT_EQ(t.ranks[1].at("a").offset, (std::vector<uint64_t>{3, 0}));
  EXPECT_EQ(t.ranks[1].at("a").shape, (std::vector<uint64_t>{3, 3}));
  EXPECT_EQ(t.ranks[2].at("a").shape, (std::vector<uint64_t>{4, 3}));
  const std::string json = SerializeTargetLayout(t);
  auto back = ParseTargetLayout(json, "l.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(SerializeTargetLayout(*back), json);
  // A flat range within a box, and a replica, round-trip too.
  ShardBox within = FlatRange(2, 9);
  within.within_offset = {4, 0};
  within.within_shape = {5, 3};
  t.ranks[0]["a"] = within;
  t.ranks[0]["b/c"].replica = true;
  t.ranks[0]["b/c"].offset = {0};
  t.ranks[0]["b/c"].shape = {2};
  auto again = ParseTargetLayout(SerializeTargetLayout(t), "l.json");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ranks[0].at("a").within_offset, within.within_offset);
  EXPECT_EQ(again->ranks[0].at("a").within_shape, within.within_shape);
  EXPECT_TRUE(again->ranks[0].at("b/c").replica);
  EXPECT_FALSE(again->ranks[0].at("a").replica);
  EXPECT_EQ(SerializeTargetLayout(*again), SerializeTargetLayout(t));
  // global-boxes.json: round trip and strict parse.
  std::map<std::string, GlobalBox> boxes{{"w", GlobalBox{{0, 8}, {4, 16}, false}}, {"n", GlobalBox{{}, {}, true}}};
  auto parsed = ParseGlobalBoxes(SerializeGlobalBoxes(boxes), "g.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->at("w").offset, (std::vector<uint64_t>{0, 8}));
  EXPECT_EQ(parsed->at("w").global_shape, (std::vector<uint64_t>{4, 16}));
  EXPECT_TRUE(parsed->at("n").replica);
  auto bad_boxes = ParseGlobalBoxes(R"({"format":"optstate-global-boxes","format_version":1,"tensors":{"w":{"offset":[0]}}})",
                                    "g.json");
  ASSERT_FALSE(bad_boxes.ok());
  EXPECT_NE(bad_boxes.status().message().find("g.json: key 'tensors[\"w\"].global_shape'"), std::string::npos)
      << bad_boxes.status().ToString();

  auto bad = [](const std::string& text, const std::string& want) {
    auto r = ParseTargetLayout(text, "l.json");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find("l.json"), std::string::npos) << r.status().ToString();
  };
  bad("{", "not valid JSON");
  bad(R"({"format":"x","format_version":1,"ranks":[]})", "format");
  bad(R"({"format":"optstate-reshard-layout","format_version":2,"ranks":[{"rank":0,"tensors":{}}]})",
      "format_version");
  bad(R"({"format":"optstate-reshard-layout","format_version":1,"ranks":[{"rank":1,"tensors":{}}]})",
      "ranks[0].rank");
  bad(R"({"format":"optstate-reshard-layout","format_version":1,"ranks":[{"rank":0,"tensors":{"a":{"offset":[0],"shape":[0]}}}]})",
      "empty box");
  bad(R"({"format":"optstate-reshard-layout","format_version":1,"ranks":[{"rank":0,"tensors":{"a":{"offset":[0,0],"shape":[1]}}}]})",
      "different ranks");
  bad(R"({"format":"optstate-reshard-layout","format_version":1,"ranks":[{"rank":0,"tensors":{"a":{"offset":[-1],"shape":[1]}}}]})",
      "non-negative");
  bad(R"({"format":"optstate-reshard-layout","format_version":1,"ranks":[{"rank":0,"tensors":{"a":{"flat":[3,3]}}}]})",
      "begin < end");
  bad(R"({"format":"optstate-reshard-layout","format_version":1,"ranks":[{"rank":0,"tensors":{"a":{"flat":[0,1,2]}}}]})",
      "[begin, end)");
  bad(R"({"format":"optstate-reshard-layout","format_version":1,"ranks":[{"rank":0,"tensors":{"a":{"flat":[0,4],"offset":[0]}}}]})",
      "not both");

  // Flat ranges: {"flat": [begin, end]}, kept through a round trip.
  auto flat = MakeBucketLayout({{"w", {4, 3}}, {"b", {3}}}, 10, 2);
  ASSERT_TRUE(flat.ok());
  const std::string fjson = SerializeTargetLayout(*flat);
  EXPECT_NE(fjson.find(R"("flat": [)"), std::string::npos) << fjson;
  auto fback = ParseTargetLayout(fjson, "f.json");
  ASSERT_TRUE(fback.ok()) << fback.status().ToString();
  EXPECT_TRUE(fback->ranks[1].at("w").flat);
  EXPECT_EQ(fback->ranks[1].at("w").offset, std::vector<uint64_t>{6});
  EXPECT_EQ(fback->ranks[1].at("w").shape, std::vector<uint64_t>{6});
  EXPECT_EQ(SerializeTargetLayout(*fback), fjson);
}

// Run by CrashLeavesNoAcceptedCheckpoint in a child process: reshards, and is
// killed by OPTSTATE_CRASH_AT.
TEST(ReshardChild, DISABLED_Run) {
  const char* env = std::getenv(kChildEnv);
  ASSERT_NE(env, nullptr);
  std::vector<std::string> parts;
  std::string arg(env);
  for (size_t pos = 0;;) {
    const size_t bar = arg.find('|', pos);
    parts.push_back(arg.substr(pos, bar - pos));
    if (bar == std::string::npos) break;
    pos = bar + 1;
  }
  auto layout = ParseTargetLayout(ReadFile(parts[0]), parts[0]);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  auto r = Reshard(std::vector<std::string>(parts.begin() + 2, parts.end()), *layout, parts[1]);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::printf("RESHARDED\n");
}

TEST_F(ReshardTest, CrashLeavesNoAcceptedCheckpointAndARerunSucceeds) {
  const std::string layout = root_ + "/layout.json";
  std::ofstream(layout) << SerializeTargetLayout(MakeEvenLayout(Globals(), 3, SplitKind::kColumns));
  const std::string dest = root_ + "/out";
  std::string env = layout + "|" + dest;
  for (const std::string& s : RankDirs(src_, 4)) env += "|" + s;
  auto run = [&](const std::string& crash_at) {
    ::setenv(kChildEnv, env.c_str(), 1);
    test_util::ChildOptions co;
    co.exe = "/proc/self/exe";
    co.args = {"--gtest_filter=ReshardChild.DISABLED_Run", "--gtest_also_run_disabled_tests"};
    co.crash_at = crash_at;
    test_util::ChildResult res = test_util::RunChild(co);
    ::unsetenv(kChildEnv);
    return res;
  };
  for (const char* point : {"reshard.after_chunk:5", "reshard.before_rename"}) {
    test_util::ChildResult res = run(point);
    ASSERT_TRUE(WIFSIGNALED(res.wait_status) && WTERMSIG(res.wait_status) == SIGKILL)
        << point << ": the child was not killed there:\n" << res.output;
    EXPECT_FALSE(fs::exists(dest)) << point;
    // Restore accepts nothing the crash left: no rank directory under dest.
    auto restored = CreateStoreFromCheckpoint(dest + "/" + ReshardRankDirName(0), root_ + "/r", StoreOptions{});
    EXPECT_FALSE(restored.ok()) << point;
    bool partial = false;
    for (const auto& e : fs::directory_iterator(root_)) {
      partial = partial || e.path().filename().string().rfind("out.partial-", 0) == 0;
    }
    EXPECT_TRUE(partial) << point;  // left behind, beside dest, never at it
  }
  // A rerun (partial directories of the crashed runs still there) succeeds.
  test_util::ChildResult res = run("");
  ASSERT_TRUE(WIFEXITED(res.wait_status) && WEXITSTATUS(res.wait_status) == 0) << res.output;
  CheckAgainstReference(RankDirs(dest, 3), SourceManifest());
  for (uint32_t r = 0; r < 3; ++r) {
    auto store = CreateStoreFromCheckpoint(dest + "/" + ReshardRankDirName(r), root_ + "/r" + std::to_string(r),
                                           StoreOptions{});
    EXPECT_TRUE(store.ok()) << store.status().ToString();
  }
}

}  // namespace
}  // namespace optstate::vfs
