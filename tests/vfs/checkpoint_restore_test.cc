// Restore: a checkpoint written from one store's generation restores bit for
// bit (into a fresh store and into the source store), and every bad input is
// refused with a clear message while the target store stays unchanged.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <set>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "base/sync_point.h"
#include "tests/common/test_util.h"
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
  std::ofstream(d + "/manifest.json") << SealManifest(j.dump());
  ExpectRefused(src_.get(), d, {d + "/manifest.json", "chunks[0]"});
  // A changed hash is caught by the data check.
  j = nlohmann::json::parse(ReadFile(ckpt_ + "/manifest.json"));
  j["tensors"][1]["fields"][2]["chunks"][0]["xxh3"] = "0123456789abcdef";
  std::ofstream(d + "/manifest.json", std::ios::trunc) << SealManifest(j.dump());
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
    j.erase(kManifestChecksumKey);  // manifests written before carried no checksum of their own
    j.erase("job");                 // nor a job
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
    std::ofstream(d + "/manifest.json", std::ios::trunc) << SealManifest(j.dump(1));
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

// A tensor of the same element count in another shape ([700, 1000] vs
// [1000, 700]) is refused naming "shape", and nothing is written.
TEST_F(RestoreTest, RefusesSameNumelOtherShape) {
  auto other = CreateStore(root_ + "/transposed");
  auto defs = DefaultTensors();
  defs[0].shape = {1000, 700};
  CreateTensors(other.get(), defs);
  WriteStep(other.get(), 3);
  ExpectRefused(other.get(), ckpt_,
                {"does not match", "tensor 'layers.0/w': shape checkpoint [700, 1000] vs store [1000, 700]"});
}

// A shard of a tensor: restore compares its place in the global tensor too.
class ShardRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override { root_ = MakeTempDir("shard-restore"); }
  void TearDown() override { fs::remove_all(root_); }
  // A store at `name` with one tensor "w" of shape [2, 3] at `offset` of
  // `global`, written and committed at step 5.
  std::unique_ptr<Store> ShardStore(const std::string& name, std::vector<uint64_t> global,
                                    std::vector<uint64_t> offset) {
    auto s = CreateStore(root_ + "/" + name);
    TensorSpec spec;
    spec.name = "w";
    spec.numel = 6;
    spec.shape = {2, 3};
    spec.global_shape = std::move(global);
    spec.shard_offset = std::move(offset);
    EXPECT_TRUE(s->CreateTensor(spec).ok());
    WriteStep(s.get(), 5);
    return s;
  }
  void ExpectRefused(Store* s, const std::string& dir, const std::string& part) {
    const GenerationInfo before = s->LatestGeneration();
    auto dump = DumpLatest(s);
    auto r = RestoreCheckpoint(s, dir);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(part), std::string::npos) << r.status().message();
    EXPECT_EQ(s->LatestGeneration().generation, before.generation);
    EXPECT_TRUE(DumpLatest(s) == dump);
  }
  std::string root_;
};

TEST_F(ShardRestoreTest, RefusesOtherGlobalShape) {
  auto src = ShardStore("src", {4, 3}, {0, 0});
  auto v = src->OpenGeneration(kLatest);
  ASSERT_TRUE(v.ok());
  WriteCheckpointDir(**v, root_ + "/ckpt");
  auto other = ShardStore("other", {6, 3}, {0, 0});
  ExpectRefused(other.get(), root_ + "/ckpt", "tensor 'w': global_shape (shard) checkpoint [4, 3] vs store [6, 3]");
}

TEST_F(ShardRestoreTest, RefusesOtherShardOffset) {
  auto src = ShardStore("src", {4, 3}, {0, 0});
  auto v = src->OpenGeneration(kLatest);
  ASSERT_TRUE(v.ok());
  WriteCheckpointDir(**v, root_ + "/ckpt");
  auto other = ShardStore("other", {4, 3}, {2, 0});
  ExpectRefused(other.get(), root_ + "/ckpt", "tensor 'w': shard_offset (shard) checkpoint [0, 0] vs store [2, 0]");
}

// Bit flips in manifest.json (lr 0.001 -> 0.003, beta1 0.9 -> 0.8: one bit
// each) are caught by the manifest's own checksum, by restore, --create and
// reshard alike; both checksums and the path are named.
TEST_F(RestoreTest, RefusesManifestWithFlippedBits) {
  WriteStep(src_.get(), 12);
  const std::string good = ReadFile(ckpt_ + "/manifest.json");
  ASSERT_TRUE(VerifyManifestChecksum(good, "good").ok());
  ASSERT_NE(good.find(std::string("\"") + kManifestChecksumKey + "\""), std::string::npos);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"lr\": 0.001", "\"lr\": 0.003"}, {"\"beta1\": 0.9", "\"beta1\": 0.8"}}) {
    std::string d = CopyCkpt("flip" + std::to_string(from.size()) + to.back());
    std::string text = good;
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    std::ofstream(d + "/manifest.json", std::ios::trunc | std::ios::binary) << text;
    ExpectRefused(src_.get(), d, {d + "/manifest.json", "XXH3", kManifestChecksumKey});
    auto r = RestoreCheckpoint(src_.get(), d);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
    auto b = CreateStoreFromCheckpoint(d, root_ + "/never", StoreOptions{});
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kCorruption) << b.status().ToString();
    EXPECT_FALSE(fs::exists(root_ + "/never"));
  }
}

// A checkpoint of another store does not replace the training state of a
// store that has taken steps unless forced; when it does, the replaced head is
// kept as a snapshot holding exactly the bytes it had.
TEST_F(RestoreTest, RefusesAnotherStoresCheckpointUnlessForced) {
  auto other = CreateStore(root_ + "/jobA");
  CreateTensors(other.get(), DefaultTensors());
  WriteStep(other.get(), 20);
  WriteStep(other.get(), 21);
  const GenerationInfo head = other->LatestGeneration();
  const auto head_bytes = DumpLatest(other.get());
  ExpectRefused(other.get(), ckpt_,
                {"another store", src_->identity().uuid, other->identity().uuid, "--force", "step 21"});
  auto r = RestoreCheckpointInto(other.get(), ckpt_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(other->ListSnapshots().empty());

  RestoreOptions force;
  force.force = true;
  auto f = RestoreCheckpointInto(other.get(), ckpt_, force);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE(DumpLatest(other.get()) == want_);
  EXPECT_EQ(other->LatestGeneration().step, 11u);
  EXPECT_EQ(f->kept_snapshot.rfind("pre-restore-" + std::to_string(head.generation) + "-", 0), 0u)
      << f->kept_snapshot;
  auto snaps = other->ListSnapshots();
  ASSERT_EQ(snaps.size(), 1u);
  EXPECT_EQ(snaps[0].name, f->kept_snapshot);
  EXPECT_EQ(snaps[0].generation, head.generation);
  auto kept = other->OpenSnapshot(f->kept_snapshot);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_EQ((*kept)->info().step, 21u);
  EXPECT_TRUE(DumpView(**kept) == head_bytes);

  // A store that has taken no step has no training state to lose: taken
  // without force, and no snapshot is made.
  auto fresh = CreateStore(root_ + "/fresh");
  CreateTensors(fresh.get(), DefaultTensors());
  auto g = RestoreCheckpointInto(fresh.get(), ckpt_);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE(g->kept_snapshot.empty());
  EXPECT_TRUE(fresh->ListSnapshots().empty());
}

// Every restore over a trained head keeps it, under a name no other snapshot
// has (two restores within one millisecond too); a failed restore releases
// the snapshot it made.
TEST_F(RestoreTest, KeepsEachReplacedHeadUnderItsOwnName) {
  WriteStep(src_.get(), 12);
  const auto at12 = DumpLatest(src_.get());
  auto a = RestoreCheckpointInto(src_.get(), ckpt_);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = RestoreCheckpointInto(src_.get(), ckpt_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE(a->kept_snapshot, b->kept_snapshot);
  EXPECT_EQ(src_->ListSnapshots().size(), 2u);
  auto kept = src_->OpenSnapshot(a->kept_snapshot);
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(DumpView(**kept) == at12);

  std::string d = CopyCkpt("trunc-snap");
  fs::resize_file(d + "/tensors/emb/main", 100);
  ExpectRefused(src_.get(), d, {"truncated"});
  EXPECT_EQ(src_->ListSnapshots().size(), 2u) << "a failed restore left its snapshot behind";
}

// The job (lineage) is the store's: kept across reopen, written to every
// manifest, inherited by a store created from a checkpoint.
TEST_F(RestoreTest, JobIsRecordedAndInherited) {
  const std::string job = src_->identity().job;
  EXPECT_EQ(job.size(), 36u) << "a new store is a job of its own (a uuid): '" << job << "'";
  auto m = ReadManifestFile(ckpt_ + "/manifest.json");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->job, job);
  auto b = CreateStoreFromCheckpoint(ckpt_, root_ + "/child", StoreOptions{});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*b)->identity().job, job);
  EXPECT_NE((*b)->identity().uuid, src_->identity().uuid);
  b->reset();
  auto reopened = Store::Open(root_ + "/child", StoreOptions{});
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->identity().job, job);
  auto other = CreateStore(root_ + "/named", 2 * kMiB, "my-job");
  EXPECT_EQ(other->identity().job, "my-job");
  EXPECT_NE(CreateStore(root_ + "/x")->identity().job, job);
}

// optstate-restore --create is all or nothing: SIGKILLed at each sync point
// of the creation, the import and the commit, it leaves either no store at
// the path or the complete one (bit for bit the checkpoint, verified clean),
// and a rerun makes it (or, where it is complete, says so), leaving no
// half-built directory next to it and no stray data file in an external data
// dir.
TEST_F(RestoreTest, CreateIsAllOrNothingWhenKilled) {
  if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "built without test sync points (OPTSTATE_TEST_HOOKS)";
  const std::vector<std::string> points = {
      "store.create.begin",     "store.create.identity", "store.create.index",  "store.create.renamed",
      "restore.create.created", "extent.after_write",    "commit.before_sync",  "commit.before_batch",
      "commit.after_batch",     "restore.create.committed", "restore.create.renamed"};
  auto expect_complete = [&](const std::string& path) {
    auto s = Store::Open(path, StoreOptions{});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_TRUE(DumpLatest(s->get()) == want_) << path << " is not the checkpoint";
    const GenerationInfo g = (*s)->LatestGeneration();
    EXPECT_EQ(g.step, 11u);
    ASSERT_EQ(g.groups.size(), 2u);
    EXPECT_EQ(g.groups[1].step_count, 5u);
    EXPECT_EQ((*s)->ListTensors().size(), DefaultTensors().size());
    auto rep = (*s)->Verify();
    ASSERT_TRUE(rep.ok());
    EXPECT_TRUE(rep->ok()) << ::testing::PrintToString(rep->problems);
  };
  for (size_t i = 0; i < points.size(); ++i) {
    SCOPED_TRACE("killed at " + points[i]);
    const std::string dir = root_ + "/kill" + std::to_string(i);
    const std::string ext = dir + "/ext", path = dir + "/store";
    fs::create_directories(ext);
    test_util::ChildOptions o;
    o.exe = test_util::SiblingBinary("store_crash_child");
    o.args = {"restore", path, ckpt_, ext};
    o.crash_at = points[i];
    test_util::ChildResult r = test_util::RunChild(o);
    ASSERT_EQ(r.error, "");
    ASSERT_TRUE(WIFSIGNALED(r.wait_status) && WTERMSIG(r.wait_status) == SIGKILL)
        << "the child was not killed at " << points[i] << ": " << r.output;
    const bool complete = fs::exists(path);
    if (complete) expect_complete(path);
    StoreOptions so;
    so.data_dirs = {ext};
    auto b = CreateStoreFromCheckpoint(ckpt_, path, so);
    if (complete) {
      ASSERT_FALSE(b.ok());
      EXPECT_EQ(b.status().code(), StatusCode::kAlreadyExists) << b.status().ToString();
    } else {
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      b->reset();
    }
    std::string uuid;
    expect_complete(path);
    {
      auto s = Store::Open(path, StoreOptions{});
      ASSERT_TRUE(s.ok());
      uuid = (*s)->identity().uuid;
    }
    std::set<std::string> names, ext_names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    for (const auto& e : fs::directory_iterator(ext)) ext_names.insert(e.path().filename().string());
    EXPECT_EQ(names, (std::set<std::string>{"ext", "store"}));
    EXPECT_EQ(ext_names, (std::set<std::string>{uuid + ".chunks", uuid + ".owner"}));
  }
}

}  // namespace
}  // namespace optstate::vfs
