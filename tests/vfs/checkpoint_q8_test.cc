// Checkpoints of tensors with q8 moments (codes fields q8s/q8u + f32 absmax
// fields with their own element count and chunk bytes): export and restore
// are byte-identical, the manifest says how to decode, a manifest that lies
// about the layout is refused naming tensor and field with nothing written,
// and reshard refuses q8 sources saying how to convert first.
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/vfs/checkpoint_test_util.h"
#include "tests/vfs/store_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/reshard.h"
#include "vfs/store.h"

namespace optstate::vfs {
namespace {

namespace fs = std::filesystem;
using store_testing::Buf;
using store_testing::FillPattern;
using store_testing::kTestChunk;
using store_testing::TempDir;
using store_testing::TestOptions;
using store_testing::Unwrap;

constexpr uint64_t kNumel = kTestChunk + 3000;  // two slices, not a multiple of 256

std::string ReadFile(const std::string& p) {
  std::stringstream s;
  s << std::ifstream(p, std::ios::binary).rdbuf();
  return s.str();
}

class CheckpointQ8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = Unwrap(Store::Create(dir_ / "src", TestOptions()));
    TensorSpec spec;
    spec.name = "w";
    spec.numel = kNumel;
    spec.fields = AdamQ8Fields(kNumel, kTestChunk);
    TensorInfo t = Unwrap(s->CreateTensor(spec));
    Buf buf(kTestChunk);
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      for (uint64_t c = 0; c < s->ChunkCount(t, f); ++c) {
        FillPattern(buf.data(), kTestChunk, store_testing::ChunkSeed(1, t.id, f, c));
        ASSERT_TRUE(s->WriteChunk(ChunkRef{t.id, f, c}, buf.data()).ok());
      }
    }
    ASSERT_TRUE(s->Commit(CommitInfo{.step = 1, .groups = {}}).ok());
    ckpt_ = dir_ / "ckpt";
    ASSERT_TRUE(ExportCheckpoint(s.get(), ckpt_).ok());
    src_ = std::move(s);
  }

  // A copy of the checkpoint with its manifest edited.
  std::string Edited(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const std::string d = dir_ / name;
    fs::copy(ckpt_, d, fs::copy_options::recursive);
    nlohmann::json j = nlohmann::json::parse(ReadFile(d + "/manifest.json"));
    edit(j);
    std::ofstream(d + "/manifest.json", std::ios::trunc) << testing::SealManifest(j.dump());
    return d;
  }

  void ExpectRefused(const std::string& d, const std::vector<std::string>& words) {
    const std::string dest = dir_ / ("never-" + fs::path(d).filename().string());
    auto r = CreateStoreFromCheckpoint(d, dest, StoreOptions{});
    ASSERT_FALSE(r.ok()) << d;
    for (const std::string& w : words) {
      EXPECT_NE(r.status().message().find(w), std::string::npos) << "lacks '" << w << "': " << r.status().ToString();
    }
    EXPECT_FALSE(fs::exists(dest)) << "a refused restore left " << dest;
  }

  TempDir dir_;
  std::string ckpt_;
  std::unique_ptr<Store> src_;
};

TEST_F(CheckpointQ8Test, ExportRestoreIsByteIdenticalAndTheManifestSaysHowToDecode) {
  Manifest m = Unwrap(ParseManifest(ReadFile(ckpt_ + "/manifest.json"), "manifest.json"));
  ASSERT_EQ(m.tensors.size(), 1u);
  const ManifestTensor& t = m.tensors[0];
  ASSERT_EQ(t.fields.size(), 5u);
  EXPECT_EQ(t.fields[1].dtype, DType::kQ8S);
  EXPECT_EQ(t.fields[1].scales, "exp_avg.absmax");
  EXPECT_EQ(t.fields[1].block_size, 256u);
  EXPECT_EQ(t.fields[2].dtype, DType::kQ8U);
  EXPECT_EQ(t.fields[2].scales, "exp_avg_sq.absmax");
  EXPECT_EQ(t.fields[3].numel, (kNumel + 255) / 256);
  EXPECT_EQ(t.fields[3].chunk_bytes, kTestChunk / 64);
  EXPECT_EQ(t.fields[3].chunks.size(), 2u);
  EXPECT_EQ(t.fields[3].chunks[1].offset_bytes, kTestChunk / 64);
  const std::string st = ReadFile(ckpt_ + "/state.safetensors");
  EXPECT_NE(st.find("\"w/exp_avg\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(kNumel) + "]"), std::string::npos);
  EXPECT_NE(st.find("\"w/exp_avg.absmax\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string((kNumel + 255) / 256) + "]"),
            std::string::npos);

  auto dst = Unwrap(CreateStoreFromCheckpoint(ckpt_, dir_ / "dst", StoreOptions{}));
  auto a = Unwrap(src_->OpenGeneration(kLatest));
  auto b = Unwrap(dst->OpenGeneration(kLatest));
  const TensorInfo ta = Unwrap(a->FindTensor("w"));
  const TensorInfo tb = Unwrap(b->FindTensor("w"));
  ASSERT_EQ(tb.fields.size(), 5u);
  Buf ba(kTestChunk), bb(kTestChunk);
  for (uint32_t f = 0; f < ta.fields.size(); ++f) {
    EXPECT_EQ(tb.fields[f].numel, ta.fields[f].numel);
    EXPECT_EQ(tb.fields[f].chunk_bytes, ta.fields[f].chunk_bytes);
    ASSERT_EQ(b->ChunkCount(tb, f), a->ChunkCount(ta, f));
    for (uint64_t c = 0; c < a->ChunkCount(ta, f); ++c) {
      const ChunkInfo ia = Unwrap(a->Chunk(ChunkRef{ta.id, f, c}));
      const ChunkInfo ib = Unwrap(b->Chunk(ChunkRef{tb.id, f, c}));
      EXPECT_EQ(ia.checksum, ib.checksum) << ta.fields[f].name << " chunk " << c;
      ASSERT_TRUE(a->ReadChunk(ChunkRef{ta.id, f, c}, ba.data()).ok());
      ASSERT_TRUE(b->ReadChunk(ChunkRef{tb.id, f, c}, bb.data()).ok());
      EXPECT_EQ(std::memcmp(ba.data(), bb.data(), ia.length_bytes), 0) << ta.fields[f].name << " chunk " << c;
    }
  }
  EXPECT_TRUE(Unwrap(dst->Verify()).ok());
}

TEST_F(CheckpointQ8Test, AManifestThatLiesAboutTheQ8LayoutIsRefusedAndNothingIsWritten) {
  // The absmax field's element count (the key names the tensor and the field).
  ExpectRefused(Edited("count", [](nlohmann::json& j) { j["tensors"][0]["fields"][3]["numel"] = 1; }),
                {"('w')", "fields[3]"});
  // The absmax field missing.
  ExpectRefused(Edited("missing",
                       [](nlohmann::json& j) { j["tensors"][0]["fields"].erase(4); }),
                {"tensor 'w'", "exp_avg_sq.absmax", "missing"});
  // The scales named in the codes field.
  ExpectRefused(Edited("scales", [](nlohmann::json& j) { j["tensors"][0]["fields"][1]["scales"] = "other"; }),
                {"fields[1].scales"});
  // dtype q8s in the manifest, F32 in state.safetensors.
  {
    const std::string d = dir_ / "stdtype";
    fs::copy(ckpt_, d, fs::copy_options::recursive);
    std::string st = ReadFile(d + "/state.safetensors");
    const std::string from = "\"w/exp_avg\":{\"dtype\":\"U8\"";
    const size_t at = st.find(from);
    ASSERT_NE(at, std::string::npos);
    st.replace(at, from.size(), "\"w/exp_avg\":{\"dtype\":\"F32\"");  // same length
    std::ofstream(d + "/state.safetensors", std::ios::binary | std::ios::trunc) << st;
    ExpectRefused(d, {"w/exp_avg", "U8"});
  }
}

TEST_F(CheckpointQ8Test, ReshardRefusesQ8SourcesAndSaysHowToConvert) {
  TargetLayout target;
  target.ranks.resize(1);
  auto r = Reshard({ckpt_}, target, dir_ / "out");
  ASSERT_FALSE(r.ok());
  const std::string msg = r.status().ToString();
  for (const std::string& w : {std::string("tensor 'w'"), std::string("exp_avg"), std::string("--moments f32"),
                               ckpt_}) {
    EXPECT_NE(msg.find(w), std::string::npos) << "lacks '" << w << "': " << msg;
  }
  EXPECT_FALSE(fs::exists(dir_ / "out"));
}

}  // namespace
}  // namespace optstate::vfs
