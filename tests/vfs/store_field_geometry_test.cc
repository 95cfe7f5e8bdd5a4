// Fields with their own element count and chunk stride (FieldSpec::numel,
// FieldSpec::chunk_bytes): the layout of a q8 tensor (codes + scales), its
// chunk geometry, round trips across reopen, Verify, and the validation of
// the scales field.
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "tests/vfs/store_test_util.h"
#include "vfs/store.h"

namespace optstate::vfs {
namespace {

using store_testing::Buf;
using store_testing::FillPattern;
using store_testing::kTestChunk;
using store_testing::TempDir;
using store_testing::TestOptions;
using store_testing::Unwrap;

// Two full codes chunks and a partial one whose elements are not a multiple
// of 256: every field has 3 chunks except main (f32: 4 bytes an element).
constexpr uint64_t kNumel = 2 * kTestChunk + 1000;

TensorSpec Q8Spec(const std::string& name) {
  TensorSpec spec;
  spec.name = name;
  spec.numel = kNumel;
  spec.fields = AdamQ8Fields(kNumel, kTestChunk);
  return spec;
}

TEST(FieldGeometryTest, Q8FieldsCutTheSameElementsIntoChunkC) {
  const TensorSpec spec = Q8Spec("w");
  ASSERT_EQ(spec.fields.size(), 5u);
  const uint64_t blocks = (kNumel + 255) / 256;
  for (const char* codes : {"exp_avg", "exp_avg_sq"}) {
    const int c = spec.FieldIndexOf(codes);
    const int s = spec.FieldIndexOf(std::string(codes) + ".absmax");
    ASSERT_GE(c, 0);
    ASSERT_GE(s, 0);
    const auto cf = static_cast<uint32_t>(c), sf = static_cast<uint32_t>(s);
    EXPECT_EQ(spec.field_numel(cf), kNumel);
    EXPECT_EQ(spec.field_bytes(cf), kNumel);
    EXPECT_EQ(spec.field_numel(sf), blocks);
    EXPECT_EQ(spec.field_bytes(sf), blocks * 4);
    EXPECT_EQ(spec.field_chunk_bytes(cf, kTestChunk), kTestChunk);
    EXPECT_EQ(spec.field_chunk_bytes(sf, kTestChunk), kTestChunk / 64);
    ASSERT_EQ(spec.field_chunk_count(cf, kTestChunk), 3u);
    ASSERT_EQ(spec.field_chunk_count(sf, kTestChunk), 3u);
    // Chunk k of the scales holds exactly the blocks of chunk k of the codes.
    for (uint64_t k = 0; k < 3; ++k) {
      const uint64_t first_elem = k * kTestChunk;
      const uint64_t first_block = k * spec.field_chunk_bytes(sf, kTestChunk) / 4;
      EXPECT_EQ(first_block * 256, first_elem);
    }
  }
  EXPECT_EQ(spec.field_chunk_count(0, kTestChunk), (kNumel * 4 + kTestChunk - 1) / kTestChunk);
  ASSERT_TRUE(ValidateFields(spec, kTestChunk, "test").ok());
}

TEST(FieldGeometryTest, Q8TensorRoundTripsAcrossReopenAndVerifies) {
  TempDir dir;
  const TensorSpec spec = Q8Spec("w");
  std::vector<std::vector<uint64_t>> lens(spec.fields.size());
  {
    auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
    TensorInfo t = Unwrap(s->CreateTensor(spec));
    Buf buf(kTestChunk);
    auto view_before = s->ChunkCount(t, 3);
    EXPECT_EQ(view_before, 3u);
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      for (uint64_t c = 0; c < s->ChunkCount(t, f); ++c) {
        FillPattern(buf.data(), kTestChunk, store_testing::ChunkSeed(1, t.id, f, c));
        ASSERT_OK(s->WriteChunk(ChunkRef{t.id, f, c}, buf.data()));
      }
    }
    ASSERT_OK(s->Commit(CommitInfo{}).status());
  }
  auto s = Unwrap(Store::Open(dir / "s", TestOptions()));
  TensorInfo t = Unwrap(s->FindTensor("w"));
  ASSERT_EQ(t.fields.size(), 5u);
  EXPECT_EQ(t.fields[3].numel, (kNumel + 255) / 256);
  EXPECT_EQ(t.fields[3].chunk_bytes, kTestChunk / 64);
  EXPECT_EQ(t.fields[1].dtype, DType::kQ8S);
  EXPECT_EQ(t.fields[2].dtype, DType::kQ8U);
  auto view = Unwrap(s->OpenGeneration(kLatest));
  Buf buf(kTestChunk);
  for (uint32_t f = 0; f < t.fields.size(); ++f) {
    const uint64_t stride = t.field_chunk_bytes(f, kTestChunk);
    const uint64_t bytes = t.field_bytes(f);
    ASSERT_EQ(view->ChunkCount(t, f), t.field_chunk_count(f, kTestChunk));
    for (uint64_t c = 0; c < view->ChunkCount(t, f); ++c) {
      ChunkInfo ci = Unwrap(view->Chunk(ChunkRef{t.id, f, c}));
      EXPECT_EQ(ci.offset_bytes, c * stride) << t.fields[f].name << " chunk " << c;
      EXPECT_EQ(ci.length_bytes, std::min(stride, bytes - c * stride)) << t.fields[f].name << " chunk " << c;
      ASSERT_OK(view->ReadChunk(ChunkRef{t.id, f, c}, buf.data()));
      std::vector<uint8_t> want(kTestChunk);
      FillPattern(want.data(), kTestChunk, store_testing::ChunkSeed(1, t.id, f, c));
      ASSERT_EQ(0, std::memcmp(buf.data(), want.data(), ci.length_bytes)) << t.fields[f].name << " chunk " << c;
    }
  }
  // The scales' short chunks are stored in pieces of a slot, not a slot each.
  StoreStats st = Unwrap(s->Stats());
  uint64_t logical = 0;
  for (uint32_t f = 0; f < t.fields.size(); ++f) logical += t.field_bytes(f);
  EXPECT_EQ(st.live_bytes, logical);
  VerifyReport r = Unwrap(s->Verify());
  EXPECT_TRUE(r.ok()) << (r.problems.empty() ? "leaked slots" : r.problems[0]);
}

// Each way a q8 layout can be wrong is refused, naming the tensor and field.
TEST(FieldGeometryTest, InconsistentScalesAreRefusedNamingTensorAndField) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  struct Case {
    const char* what;
    void (*edit)(std::vector<FieldSpec>*);
    const char* needle;
  };
  const Case cases[] = {
      {"missing scales", [](std::vector<FieldSpec>* f) { f->pop_back(); }, "exp_avg_sq.absmax' is missing"},
      {"scales count", [](std::vector<FieldSpec>* f) { (*f)[3].numel += 1; }, "exp_avg.absmax"},
      {"scales dtype", [](std::vector<FieldSpec>* f) { (*f)[4].dtype = DType::kBF16; }, "must be f32"},
      {"scales stride", [](std::vector<FieldSpec>* f) { (*f)[3].chunk_bytes = kTestChunk / 32; }, "1/64"},
      {"stride unaligned", [](std::vector<FieldSpec>* f) { (*f)[0].chunk_bytes = 1000; }, "multiple of 4096"},
      {"stride too big", [](std::vector<FieldSpec>* f) { (*f)[0].chunk_bytes = 2 * kTestChunk; },
       "multiple of 4096"},
  };
  for (const Case& c : cases) {
    TensorSpec spec = Q8Spec("bad");
    c.edit(&spec.fields);
    auto r = s->CreateTensor(spec);
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(r.status().message().find("tensor 'bad'"), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << c.what << ": " << r.status().ToString();
  }
  EXPECT_TRUE(s->ListTensors().empty());
}

}  // namespace
}  // namespace optstate::vfs
