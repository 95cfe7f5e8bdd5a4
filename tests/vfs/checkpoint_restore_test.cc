// Restore: a checkpoint written from one store's generation restores bit for
// bit (into a fresh store and into the source store), and every bad input is
// refused with a clear message while the target store stays unchanged.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/vfs/checkpoint_test_util.h"
#include "vfs/checkpoint.h"

namespace optstate::vfs {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

class RestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir("restore");
    src_ = CreateStore(root_ + "/src");
    ASSERT_NE(src_, nullptr);
    CreateTensors(src_.get(), DefaultTensors());
    gen1_ = WriteStep(src_.get(), 11, /*sparse=*/true);  // some chunks stay zero
    auto v = src_->OpenGeneration(kLatest);
    ASSERT_TRUE(v.ok());
    want_ = DumpView(**v);
    ckpt_ = root_ + "/ckpt";
    WriteCheckpointDir(**v, ckpt_);
  }
  void TearDown() override {
    src_.reset();
    fs::remove_all(root_);
  }
  // A copy of the checkpoint to damage.
  std::string CopyCkpt(const std::string& name) {
    std::string d = root_ + "/" + name;
    fs::copy(ckpt_, d, fs::copy_options::recursive);
    return d;
  }
  void ExpectRefused(Store* s, const std::string& dir, const std::vector<std::string>& parts) {
    GenerationInfo before = s->LatestGeneration();
    auto dump_before = DumpLatest(s);
    auto r = RestoreCheckpoint(s, dir);
    ASSERT_FALSE(r.ok()) << "restore of " << dir << " succeeded";
    for (const std::string& p : parts) {
      EXPECT_NE(r.status().message().find(p), std::string::npos)
          << "'" << p << "' not in: " << r.status().message();
    }
    EXPECT_EQ(s->LatestGeneration().generation, before.generation);
    EXPECT_EQ(s->LatestGeneration().step, before.step);
    EXPECT_TRUE(DumpLatest(s) == dump_before) << "store changed by a refused restore";
    auto st = s->Stats();
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->pending_bytes, 0u);
  }

  std::string root_, ckpt_;
  std::unique_ptr<Store> src_;
  uint64_t gen1_ = 0;
  std::map<std::string, std::string> want_;
};

TEST_F(RestoreTest, FreshStoreBitExact) {
  auto b = CreateStoreFromCheckpoint(ckpt_, root_ + "/fresh", StoreOptions{});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE(DumpLatest(b->get()) == want_);
  GenerationInfo g = (*b)->LatestGeneration();
  EXPECT_EQ(g.step, 11u);
  ASSERT_EQ(g.groups.size(), 2u);
  EXPECT_EQ(g.groups[1].step_count, 5u);
  EXPECT_DOUBLE_EQ(g.groups[1].hyper.at("lr"), 2.5e-4);
  auto t = (*b)->FindTensor("layers.0/w");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->shape, (std::vector<uint64_t>{700, 1000}));
  // The restored store's own checkpoint view is byte-identical (manifest aside).
  auto v = (*b)->OpenGeneration(kLatest);
  ASSERT_TRUE(v.ok());
  auto l = CheckpointLayout::Build(v->get());
  ASSERT_TRUE(l.ok());
  for (const CheckpointFile& f : (*l)->files()) {
    if (f.kind == CheckpointFileKind::kManifest) continue;
    std::string bytes(f.size_bytes, '\0');
    ASSERT_TRUE((*l)->Read(f, 0, bytes.data(), bytes.size()).ok());
    if (f.kind == CheckpointFileKind::kField) {
      EXPECT_EQ(bytes, ReadFile(ckpt_ + "/" + f.path)) << f.path;
    }
  }
}

TEST_F(RestoreTest, IntoSourceStoreRollsBack) {
  WriteStep(src_.get(), 12);
  ASSERT_FALSE(DumpLatest(src_.get()) == want_);
  auto g = src_->Restore(ckpt_);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(*g, gen1_ + 2);
  EXPECT_TRUE(DumpLatest(src_.get()) == want_);
  EXPECT_EQ(src_->LatestGeneration().step, 11u);
}

TEST_F(RestoreTest, RefusesWrongLayout) {
  auto other = CreateStore(root_ + "/other");
  auto defs = DefaultTensors();
  defs[0].numel = 699999;
  defs[0].shape = {};
  defs[2].name = "embedding";
  CreateTensors(other.get(), defs);
  WriteStep(other.get(), 3);
  ExpectRefused(other.get(), ckpt_,
                {"does not match", "layers.0/w", "numel", "'emb': in the checkpoint, not in the store",
                 "'embedding': in the store, not in the checkpoint"});
}

TEST_F(RestoreTest, RefusesTruncatedFile) {
  WriteStep(src_.get(), 12);
  std::string d = CopyCkpt("trunc");
  fs::resize_file(d + "/tensors/layers.0%2Fw/exp_avg", 2800000 - 4);
  ExpectRefused(src_.get(), d, {"tensors/layers.0%2Fw/exp_avg", "truncated"});
}

TEST_F(RestoreTest, RefusesAlteredChunk) {
  WriteStep(src_.get(), 12);
  std::string d = CopyCkpt("flip");
  {
    std::fstream f(d + "/tensors/layers.0%2Fw/main", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2 * kMiB + 100);
    f.put('\x7f');
  }
  ExpectRefused(src_.get(), d, {"tensors/layers.0%2Fw/main", "chunk 1", "XXH3"});
}

TEST_F(RestoreTest, RefusesEditedManifest) {
  WriteStep(src_.get(), 12);
  std::string d = CopyCkpt("edit");
  auto j = nlohmann::json::parse(ReadFile(d + "/manifest.json"));
  j["tensors"][0]["fields"][0]["chunks"][0]["length"] = 12345;
  std::ofstream(d + "/manifest.json") << j.dump();
  ExpectRefused(src_.get(), d, {d + "/manifest.json", "chunks[0]"});
  // A changed hash is caught by the data check.
  j = nlohmann::json::parse(ReadFile(ckpt_ + "/manifest.json"));
  j["tensors"][1]["fields"][2]["chunks"][0]["xxh3"] = "0123456789abcdef";
  std::ofstream(d + "/manifest.json", std::ios::trunc) << j.dump();
  ExpectRefused(src_.get(), d, {"chunk 0", "XXH3"});
  // A missing file.
  std::string d2 = CopyCkpt("missing");
  fs::remove(d2 + "/tensors/emb/exp_avg_sq");
  ExpectRefused(src_.get(), d2, {"emb", "exp_avg_sq"});
}

TEST_F(RestoreTest, CreateRefusesBadCheckpointAndLeavesNothing) {
  std::string d = CopyCkpt("trunc2");
  fs::resize_file(d + "/tensors/emb/main", 100);
  auto b = CreateStoreFromCheckpoint(d, root_ + "/never", StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("truncated"), std::string::npos) << b.status().message();
  EXPECT_FALSE(fs::exists(root_ + "/never"));
}

}  // namespace
}  // namespace optstate::vfs
