// SliceLayout: the chunk geometry the engine derives from an update rule's
// fields, checked against the store's own q8 field layout (vfs::AdamQ8Fields)
// and the slices the pipeline moved before rules existed.
#include "memmgr/internal/slice_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "memmgr/internal/adamw_rule.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {
namespace {

constexpr uint64_t kChunk = 2ull << 20;

SliceLayout LayoutOf(const UpdateRule& rule) {
  auto l = SliceLayout::Make(rule, kChunk);
  EXPECT_TRUE(l.ok()) << l.status().ToString();
  return l.ok() ? *l : SliceLayout();
}

TEST(SliceLayout, AdamWSlicesHoldThreeFourOrEightChunks) {
  struct Case {
    MomentDType m;
    uint32_t chunks, bytes_in_chunks;
    uint64_t slice_elems;
  };
  for (const Case& c : {Case{MomentDType::kF32, 3, 3, kChunk / 4}, Case{MomentDType::kBF16, 4, 4, kChunk / 2},
                        Case{MomentDType::kQ8, 8, 6, kChunk}}) {
    std::unique_ptr<UpdateRule> rule = NewAdamWRule(c.m);
    SliceLayout l = LayoutOf(*rule);
    EXPECT_EQ(l.slice_chunks(), c.chunks) << MomentDTypeName(c.m);
    EXPECT_EQ(l.slice_bytes_in_chunks(), c.bytes_in_chunks) << MomentDTypeName(c.m);
    EXPECT_EQ(l.slice_elems(), c.slice_elems) << MomentDTypeName(c.m);
  }
}

TEST(SliceLayout, FieldSpecsAreTheStoresAdamFields) {
  const uint64_t numel = 3 * kChunk + 1000;
  std::unique_ptr<UpdateRule> q8 = NewAdamWRule(MomentDType::kQ8);
  const std::vector<vfs::FieldSpec> got = LayoutOf(*q8).FieldSpecs(*q8, numel);
  const std::vector<vfs::FieldSpec> want = vfs::AdamQ8Fields(numel, kChunk);
  ASSERT_EQ(got.size(), want.size());
  for (size_t f = 0; f < want.size(); ++f) {
    EXPECT_EQ(got[f].name, want[f].name);
    EXPECT_EQ(got[f].dtype, want[f].dtype) << want[f].name;
    EXPECT_EQ(got[f].numel, want[f].numel) << want[f].name;
    EXPECT_EQ(got[f].chunk_bytes, want[f].chunk_bytes) << want[f].name;
  }
  std::unique_ptr<UpdateRule> f32 = NewAdamWRule(MomentDType::kF32);
  const std::vector<vfs::FieldSpec> plain = LayoutOf(*f32).FieldSpecs(*f32, numel);
  const std::vector<vfs::FieldSpec> adam = vfs::AdamFields();
  ASSERT_EQ(plain.size(), adam.size());
  for (size_t f = 0; f < adam.size(); ++f) {
    EXPECT_EQ(plain[f].name, adam[f].name);
    EXPECT_EQ(plain[f].dtype, adam[f].dtype);
    EXPECT_EQ(plain[f].numel, 0u);
    EXPECT_EQ(plain[f].chunk_bytes, 0u);
  }
}

// The last, partial slice of a q8 tensor: main chunks of its elements, one
// codes chunk per moment, one scales chunk per moment (ceil(elems / 256)).
TEST(SliceLayout, PartialQ8SliceAndItsKernelPieces) {
  std::unique_ptr<UpdateRule> q8 = NewAdamWRule(MomentDType::kQ8);
  SliceLayout l = LayoutOf(*q8);
  const uint64_t elems = kChunk / 4 + 1000;  // a bit more than one main chunk
  const uint64_t numel = 2 * kChunk + elems;
  ASSERT_EQ(l.Slices(numel), 3u);
  SliceLayout::Slice s;
  l.SliceOf(numel, 2, &s);
  EXPECT_EQ(s.first_elem, 2 * kChunk);
  EXPECT_EQ(s.elems, elems);
  ASSERT_EQ(s.n, 6u);  // two main chunks, two codes, two scales
  EXPECT_EQ(s.chunks[0].rule_field, 0u);
  EXPECT_EQ(s.chunks[0].index, 8u);  // slice 2 x four main chunks a slice
  EXPECT_EQ(s.chunks[0].len, kChunk);
  EXPECT_EQ(s.chunks[1].index, 9u);
  EXPECT_EQ(s.chunks[1].len, 1000u * 4);
  for (uint32_t k : {2u, 3u}) {
    EXPECT_EQ(s.chunks[k].index, 2u);
    EXPECT_EQ(s.chunks[k].len, elems);
  }
  for (uint32_t k : {4u, 5u}) {
    EXPECT_EQ(s.chunks[k].index, 2u);
    EXPECT_EQ(s.chunks[k].len, (elems + 255) / 256 * 4);
  }
  // Kernel pieces: one main chunk's elements each, every field contiguous.
  std::vector<std::vector<char>> mem(6, std::vector<char>(kChunk));
  void* bufs[6];
  for (int i = 0; i < 6; ++i) bufs[i] = mem[i].data();
  void* f[kMaxRuleFields];
  EXPECT_EQ(l.Piece(s, bufs, 0, f), kChunk / 4);
  EXPECT_EQ(f[0], bufs[0]);
  EXPECT_EQ(f[1], bufs[2]);
  EXPECT_EQ(f[4], bufs[5]);
  const uint64_t off = kChunk / 4;
  EXPECT_EQ(l.Piece(s, bufs, off, f), 1000u);
  EXPECT_EQ(f[0], bufs[1]);
  EXPECT_EQ(f[1], static_cast<char*>(bufs[2]) + off);
  EXPECT_EQ(f[2], static_cast<char*>(bufs[3]) + off);
  EXPECT_EQ(f[3], static_cast<char*>(bufs[4]) + off / 256 * 4);
  EXPECT_EQ(f[4], static_cast<char*>(bufs[5]) + off / 256 * 4);
}

}  // namespace
}  // namespace optstate::memmgr::internal
