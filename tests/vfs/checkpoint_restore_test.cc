// Restore: a checkpoint written from one store's generation restores bit for
// bit (into a fresh store and into the source store), and every bad input is
// refused with a clear message while the target store stays unchanged.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
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

// state.safetensors holds the same bytes as the field files; a restore reads
// and checks it too, so damage there is refused like damage anywhere else.
TEST_F(RestoreTest, RefusesCorruptSafetensors) {
  WriteStep(src_.get(), 12);
  const std::string st_name = std::string("/") + kSafetensorsFileName;
  uint64_t hlen = 0;
  {
    std::string st = ReadFile(ckpt_ + st_name);
    for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<unsigned char>(st[i]);
  }
  // One byte of the data section: "emb" is the first tensor by name, its
  // main field the first 2 MiB of data; flip a byte in its only chunk.
  std::string d = CopyCkpt("stflip");
  {
    std::fstream f(d + st_name, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(8 + hlen + 1000));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(8 + hlen + 1000));
    f.put(static_cast<char>(c ^ 0x10));
  }
  ExpectRefused(src_.get(), d, {d + st_name, "tensor 'emb' field 'main' chunk 0", "XXH3"});
  auto b = CreateStoreFromCheckpoint(d, root_ + "/never", StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find(st_name), std::string::npos) << b.status().message();
  EXPECT_FALSE(fs::exists(root_ + "/never"));
  // Truncated.
  std::string t = CopyCkpt("sttrunc");
  fs::resize_file(t + st_name, fs::file_size(t + st_name) - 1);
  ExpectRefused(src_.get(), t, {t + st_name, "truncated"});
  // A header entry that does not match the manifest (same length: F32 -> F16).
  std::string e = CopyCkpt("stentry");
  {
    std::string st = ReadFile(e + st_name);
    size_t at = st.find("\"F32\"");
    ASSERT_NE(at, std::string::npos);
    st[at + 2] = '1';
    st[at + 3] = '6';
    std::ofstream(e + st_name, std::ios::binary | std::ios::trunc) << st;
  }
  ExpectRefused(src_.get(), e, {e + st_name, "entry", "F16", "dtype F32"});
  // Garbage instead of a header.
  std::string g = CopyCkpt("stgarbage");
  std::ofstream(g + st_name, std::ios::binary | std::ios::trunc) << "not a safetensors file";
  ExpectRefused(src_.get(), g, {g + st_name});
}

// A copy of a mount's latest/ taken while the trainer committed: the
// manifest of one generation, other files of another. The restore says so
// and names both generations (not "damaged").
TEST_F(RestoreTest, TornCopyIsNamedAsMixedGenerations) {
  const uint64_t gen2 = WriteStep(src_.get(), 12);
  ASSERT_GT(gen2, gen1_);
  auto v2 = src_->OpenGeneration(kLatest);
  ASSERT_TRUE(v2.ok());
  const std::string ckpt2 = root_ + "/ckpt2";
  WriteCheckpointDir(**v2, ckpt2);
  v2->reset();
  const std::string st_name = std::string("/") + kSafetensorsFileName;

  // manifest.json of generation 1, state.safetensors of generation 2.
  std::string d = CopyCkpt("torn_st");
  fs::copy_file(ckpt2 + st_name, d + st_name, fs::copy_options::overwrite_existing);
  ExpectRefused(src_.get(), d,
                {d, "different generations", "manifest.json is of generation " + std::to_string(gen1_),
                 "state.safetensors of generation " + std::to_string(gen2), "snapshots/"});
  {
    auto r = RestoreCheckpoint(src_.get(), d);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().message().find("damaged"), std::string::npos) << r.status().message();
  }
  auto b = CreateStoreFromCheckpoint(d, root_ + "/never", StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("different generations"), std::string::npos)
      << b.status().message();
  EXPECT_FALSE(fs::exists(root_ + "/never"));

  // The manifest of generation 2 with everything else of generation 1.
  std::string m = CopyCkpt("torn_manifest");
  fs::copy_file(ckpt2 + "/manifest.json", m + "/manifest.json", fs::copy_options::overwrite_existing);
  ExpectRefused(src_.get(), m,
                {"different generations", "manifest.json is of generation " + std::to_string(gen2),
                 "state.safetensors of generation " + std::to_string(gen1_)});

  // One field file of generation 2: no header to tell, but the message says
  // which generation the manifest is of and that a copy can be the cause.
  std::string f = CopyCkpt("torn_field");
  fs::copy_file(ckpt2 + "/tensors/layers.0%2Fw/exp_avg", f + "/tensors/layers.0%2Fw/exp_avg",
                fs::copy_options::overwrite_existing);
  ExpectRefused(src_.get(), f,
                {"tensors/layers.0%2Fw/exp_avg", "generation " + std::to_string(gen1_) + " of the manifest",
                 "copied from another generation", "snapshots/"});

  // The same generation number of another store.
  auto other = CreateStore(root_ + "/other");
  CreateTensors(other.get(), DefaultTensors());
  ASSERT_EQ(WriteStep(other.get(), 11, /*sparse=*/true), gen1_);
  auto vo = other->OpenGeneration(kLatest);
  ASSERT_TRUE(vo.ok());
  const std::string ckpt_other = root_ + "/ckpt_other";
  WriteCheckpointDir(**vo, ckpt_other);
  std::string o = CopyCkpt("torn_store");
  fs::copy_file(ckpt_other + st_name, o + st_name, fs::copy_options::overwrite_existing);
  ExpectRefused(src_.get(), o, {"different stores", src_->identity().uuid, other->identity().uuid});
}

// Checkpoints written before the store uuid was in state.safetensors'
// metadata, with its header padded to 8 bytes (the layout before the data
// section was page aligned) and "adamw": 1.0 in the manifest, still restore;
// so does one without state.safetensors (the field files hold all data).
TEST_F(RestoreTest, OlderCheckpointsStillRestore) {
  const std::string st_name = std::string("/") + kSafetensorsFileName;
  std::string d = CopyCkpt("old");
  {
    std::string st = ReadFile(d + st_name);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<unsigned char>(st[i]);
    auto h = nlohmann::json::parse(st.substr(8, hlen));
    h["__metadata__"].erase("optstate.store_uuid");
    std::string hj = h.dump();
    while ((8 + hj.size()) % 8 != 0) hj.push_back(' ');
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((hj.size() >> (8 * i)) & 0xff);
    out += hj;
    out += st.substr(8 + hlen);
    std::ofstream(d + st_name, std::ios::binary | std::ios::trunc) << out;
    auto j = nlohmann::json::parse(ReadFile(d + "/manifest.json"));
    j["groups"][0]["hyper"]["adamw"] = 1.0;
    std::ofstream(d + "/manifest.json", std::ios::trunc) << j.dump(1);
  }
  auto b = CreateStoreFromCheckpoint(d, root_ + "/from_old", StoreOptions{});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE(DumpLatest(b->get()) == want_);
  EXPECT_EQ((*b)->LatestGeneration().groups[0].hyper.at("adamw"), 1.0);

  std::string n = CopyCkpt("no_st");
  fs::remove(n + st_name);
  WriteStep(src_.get(), 12);
  auto g = RestoreCheckpoint(src_.get(), n);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE(DumpLatest(src_.get()) == want_);
}

// beta1 = 7, eps = 0, lr = -5, a tensor in a group that does not exist:
// refused before anything is written, naming the manifest, group and key.
TEST_F(RestoreTest, RefusesOutOfRangeHyperparametersAndUnknownGroups) {
  WriteStep(src_.get(), 12);
  auto edit = [&](const std::string& name, const std::function<void(nlohmann::json&)>& f) {
    std::string d = CopyCkpt(name);
    auto j = nlohmann::json::parse(ReadFile(d + "/manifest.json"));
    f(j);
    std::ofstream(d + "/manifest.json", std::ios::trunc) << j.dump(1);
    return d;
  };
  std::string d = edit("beta1", [](auto& j) { j["groups"][0]["hyper"]["beta1"] = 7; });
  ExpectRefused(src_.get(), d, {d + "/manifest.json", "group 0", "beta1 = 7", "[0, 1)"});
  d = edit("eps", [](auto& j) { j["groups"][1]["hyper"]["eps"] = 0; });
  ExpectRefused(src_.get(), d, {d + "/manifest.json", "group 1", "eps = 0", "> 0"});
  d = edit("lr", [](auto& j) { j["groups"][1]["hyper"]["lr"] = -5; });
  ExpectRefused(src_.get(), d, {d + "/manifest.json", "group 1", "lr = -5", ">= 0"});
  d = edit("group", [](auto& j) {
    for (auto& t : j["tensors"]) {
      if (t["name"] == "emb") t["group"] = 9;
    }
  });
  ExpectRefused(src_.get(), d, {d + "/manifest.json", "'emb'", "group 9 is not among"});
  d = edit("steps", [](auto& j) { j["groups"][0]["step_count"] = 12; });
  ExpectRefused(src_.get(), d, {d + "/manifest.json", "step_count", "step 11"});
  auto b = CreateStoreFromCheckpoint(d, root_ + "/never", StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_FALSE(fs::exists(root_ + "/never"));
}

// --create makes the store directory itself; what is in the way is named.
TEST_F(RestoreTest, CreateSaysWhatIsInTheWay) {
  const std::string empty = root_ + "/empty";
  fs::create_directory(empty);
  auto b = CreateStoreFromCheckpoint(ckpt_, empty, StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("is an existing empty directory"), std::string::npos)
      << b.status().message();
  EXPECT_NE(b.status().message().find("does not exist yet"), std::string::npos) << b.status().message();
  EXPECT_TRUE(fs::is_directory(empty));
  EXPECT_TRUE(fs::is_empty(empty));

  const std::string file = root_ + "/file";
  std::ofstream(file) << "keep me";
  b = CreateStoreFromCheckpoint(ckpt_, file, StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("is a regular file"), std::string::npos) << b.status().message();
  EXPECT_EQ(ReadFile(file), "keep me");

  b = CreateStoreFromCheckpoint(ckpt_, root_ + "/src", StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("is already a store"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("without --create"), std::string::npos) << b.status().message();
}

TEST_F(RestoreTest, CreateRefusesBadCheckpointAndLeavesNothing) {
  std::string d = CopyCkpt("trunc2");
  fs::resize_file(d + "/tensors/emb/main", 100);
  auto b = CreateStoreFromCheckpoint(d, root_ + "/never", StoreOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("truncated"), std::string::npos) << b.status().message();
  EXPECT_FALSE(fs::exists(root_ + "/never"));
}

// A refused --create into an external data dir leaves that dir as it found it:
// neither the data file nor its owner record stays behind.
TEST_F(RestoreTest, CreateRefusedAfterImportStartedLeavesNoDataFiles) {
  std::string d = CopyCkpt("flip-ext");
  {
    std::fstream f(d + "/tensors/layers.0%2Fw/main", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2 * kMiB + 100);
    f.put('\x7f');
  }
  const std::string ext = root_ + "/ext";
  fs::create_directory(ext);
  StoreOptions opts;
  opts.data_dirs = {ext};
  auto b = CreateStoreFromCheckpoint(d, root_ + "/never", opts);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("XXH3"), std::string::npos) << b.status().message();
  EXPECT_FALSE(fs::exists(root_ + "/never"));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(ext)) left.push_back(e.path().filename().string());
  EXPECT_TRUE(left.empty()) << "left in the data dir: " << ::testing::PrintToString(left);
}

}  // namespace
}  // namespace optstate::vfs
