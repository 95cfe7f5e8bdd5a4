// Per-tensor step counts (CommitInfo / GenerationInfo::tensor_steps,
// TensorStepCount, the manifest's per-tensor "step_count"): a generation
// records the count of every tensor whose count differs from its group's;
// they persist across reopen (read-write and read-only), each commit replaces
// them, generation records written before they existed read as the group's
// count, an export restores them (into a fresh store and over the source),
// a manifest without them restores the group's count, and a count above the
// manifest's step is refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <nlohmann/json.hpp>

#include "tests/vfs/checkpoint_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/internal/store_format.h"
#include "vfs/store.h"

namespace optstate::vfs {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

class TensorStepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir("tensor-steps");
    store_ = CreateStore(root_ + "/s");
    ASSERT_NE(store_, nullptr);
    CreateTensors(store_.get(), DefaultTensors());  // groups 0, 1, 0, 1
    for (const TensorDef& d : DefaultTensors()) ids_[d.name] = store_->FindTensor(d.name)->id;
  }
  void TearDown() override {
    store_.reset();
    fs::remove_all(root_);
  }
  // Step 11: group 0 took 11 steps, group 1 took 5 (WriteStep). "layers.0/b"
  // (group 1) took 2, "emb" (group 0) 9; "odd name %.." (group 1) is given
  // its group's count, which the record need not hold.
  uint64_t CommitWithOwnCounts(Store* s) {
    const uint64_t cs = s->chunk_size_bytes();
    AlignedChunk buf(cs);
    for (const TensorInfo& t : s->ListTensors()) {
      FillPattern(buf.p, std::min<uint64_t>(cs, t.numel * 4), t.id, 0);
      EXPECT_TRUE(s->WriteChunk(ChunkRef{t.id, 0, 0}, buf.p).ok());
    }
    CommitInfo ci;
    ci.step = 11;
    ci.groups = {{0, 11, {{"lr", 1e-3}}}, {1, 5, {{"lr", 2.5e-4}}}};
    ci.tensor_steps = {{ids_.at("layers.0/b"), 2}, {ids_.at("emb"), 9}, {ids_.at("odd name %.."), 5}};
    auto g = s->Commit(ci);
    EXPECT_TRUE(g.ok()) << g.status().ToString();
    return g.ok() ? *g : 0;
  }
  // name -> TensorStepCount in s's latest generation.
  static std::map<std::string, uint64_t> Counts(Store* s) {
    std::map<std::string, uint64_t> out;
    const GenerationInfo g = s->LatestGeneration();
    for (const TensorInfo& t : s->ListTensors()) out[t.name] = TensorStepCount(g, t);
    return out;
  }
  const std::map<std::string, uint64_t> want_ = {
      {"layers.0/w", 11}, {"layers.0/b", 2}, {"emb", 9}, {"odd name %..", 5}};

  std::string root_;
  std::unique_ptr<Store> store_;
  std::map<std::string, uint32_t> ids_;
};

TEST_F(TensorStepsTest, PersistAcrossReopenAndEachCommitReplacesThem) {
  const uint64_t gen = CommitWithOwnCounts(store_.get());
  EXPECT_EQ(Counts(store_.get()), want_);
  // Only the counts that differ from their group's are recorded.
  const GenerationInfo g = store_->LatestGeneration();
  EXPECT_EQ(g.tensor_steps, (std::map<uint32_t, uint64_t>{{ids_.at("layers.0/b"), 2}, {ids_.at("emb"), 9}}));
  {
    auto v = store_->OpenGeneration(gen);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    EXPECT_EQ((*v)->info().tensor_steps, g.tensor_steps);
  }
  store_.reset();
  StoreOptions o;
  {
    auto ro = Store::OpenReadOnly(root_ + "/s", o);
    ASSERT_TRUE(ro.ok()) << ro.status().ToString();
    EXPECT_EQ(Counts(ro->get()), want_);
  }
  auto s = Store::Open(root_ + "/s", o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  store_ = std::move(*s);
  EXPECT_EQ(Counts(store_.get()), want_);
  // A commit without tensor_steps: every tensor takes its group's count.
  WriteStep(store_.get(), 12);  // groups 12 and 6
  EXPECT_EQ(Counts(store_.get()), (std::map<std::string, uint64_t>{
                                      {"layers.0/w", 12}, {"layers.0/b", 6}, {"emb", 12}, {"odd name %..", 6}}));
  EXPECT_TRUE(store_->LatestGeneration().tensor_steps.empty());
}

TEST_F(TensorStepsTest, RecordsWrittenBeforeTensorStepsReadAsTheGroupsCount) {
  // A generation record as stores wrote it before per-tensor counts existed.
  const std::string old =
      R"({"commit_time_unix_ms":1700000000000,"generation":3,"groups":[{"hyper":{"lr":0.001},"id":0,)"
      R"("step_count":7},{"hyper":{"lr":0.00025},"id":1,"step_count":3}],"index_digest":12345,"step":7})";
  auto g = internal::DecodeGeneration(old);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE(g->tensor_steps.empty());
  TensorInfo t;
  t.group = 1;
  EXPECT_EQ(TensorStepCount(*g, t), 3u);
  t.group = 0;
  EXPECT_EQ(TensorStepCount(*g, t), 7u);
  t.group = 9;  // a group the generation does not list
  EXPECT_EQ(TensorStepCount(*g, t), 0u);
  // And a generation whose tensors all have their group's count is written
  // as before (no key), so older readers read it too.
  GenerationInfo same = *g;
  EXPECT_EQ(nlohmann::json::parse(internal::EncodeGeneration(same)).count("tensor_steps"), 0u);
  same.tensor_steps[4] = 1;
  auto back = internal::DecodeGeneration(internal::EncodeGeneration(same));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->tensor_steps, same.tensor_steps);
}

TEST_F(TensorStepsTest, CommitRefusesACountForATensorTheStoreDoesNotHold) {
  CommitInfo ci;
  ci.step = 1;
  ci.groups = {{0, 1, {}}, {1, 1, {}}};
  ci.tensor_steps = {{ids_.at("emb"), 1}, {4242, 1}};
  auto g = store_->Commit(ci);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("tensor id 4242"), std::string::npos) << g.status().ToString();
  EXPECT_NE(g.status().message().find(root_ + "/s"), std::string::npos) << g.status().ToString();
  EXPECT_EQ(store_->LatestGeneration().generation, 0u);
}

TEST_F(TensorStepsTest, ExportAndRestoreKeepEveryTensorsCount) {
  CommitWithOwnCounts(store_.get());
  const std::string ckpt = root_ + "/ckpt";
  auto e = ExportCheckpoint(store_.get(), ckpt);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  // The manifest gives every tensor its count (absent ones would read as the group's).
  auto j = nlohmann::json::parse(ReadFile(ckpt + "/manifest.json"));
  std::map<std::string, uint64_t> in_manifest;
  for (const auto& t : j["tensors"]) in_manifest[t["name"].get<std::string>()] = t["step_count"].get<uint64_t>();
  EXPECT_EQ(in_manifest, want_);
  // Into a fresh store.
  auto fresh = CreateStoreFromCheckpoint(ckpt, root_ + "/fresh", StoreOptions{});
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(Counts(fresh->get()), want_);
  // Over the source store after it moved on (every tensor at its group's count).
  WriteStep(store_.get(), 12);
  ASSERT_NE(Counts(store_.get()), want_);
  auto r = store_->Restore(ckpt);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Counts(store_.get()), want_);
}

TEST_F(TensorStepsTest, ManifestWithoutCountsRestoresTheGroupsAndACountAboveTheStepIsRefused) {
  CommitWithOwnCounts(store_.get());
  const std::string ckpt = root_ + "/ckpt";
  auto v = store_->OpenGeneration(kLatest);
  ASSERT_TRUE(v.ok());
  WriteCheckpointDir(**v, ckpt);
  v->reset();
  auto rewrite = [&](const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
    fs::copy(ckpt, dir, fs::copy_options::recursive);
    auto j = nlohmann::json::parse(ReadFile(dir + "/manifest.json"));
    edit(j);
    std::ofstream(dir + "/manifest.json", std::ios::trunc) << SealManifest(j.dump(1) + "\n");
  };
  // A manifest written before per-tensor counts: each tensor takes its group's.
  const std::string old = root_ + "/old";
  rewrite(old, [](nlohmann::json& j) {
    for (auto& t : j["tensors"]) t.erase("step_count");
  });
  auto m = ParseManifest(ReadFile(old + "/manifest.json"), old);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (const ManifestTensor& t : m->tensors) EXPECT_EQ(t.step_count, t.group == 0 ? 11u : 5u) << t.name;
  auto fresh = CreateStoreFromCheckpoint(old, root_ + "/fresh", StoreOptions{});
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(Counts(fresh->get()), (std::map<std::string, uint64_t>{
                                      {"layers.0/w", 11}, {"layers.0/b", 5}, {"emb", 11}, {"odd name %..", 5}}));
  // A tensor that took more steps than the checkpoint's step.
  const std::string bad = root_ + "/bad";
  rewrite(bad, [](nlohmann::json& j) { j["tensors"][1]["step_count"] = 12; });
  auto before = Counts(store_.get());
  auto r = store_->Restore(bad);
  ASSERT_FALSE(r.ok());
  for (const char* part : {"manifest.json", "step_count", "took 12 steps", "step 11"}) {
    EXPECT_NE(r.status().message().find(part), std::string::npos) << part << " not in " << r.status().ToString();
  }
  EXPECT_EQ(Counts(store_.get()), before);
}

}  // namespace
}  // namespace optstate::vfs
