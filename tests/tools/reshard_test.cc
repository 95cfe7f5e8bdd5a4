// optstate-reshard as a user runs it: two ranks' exported checkpoints, a
// layout for three ranks from `layout`, `run` (--no-safetensors), then
// optstate-restore of each new rank; the restored values are the global
// indices the sources held.
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tests/tools/tools_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/io_buffer.h"
#include "vfs/reshard.h"

namespace optstate::tools {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::Tool;

constexpr uint64_t kGlobal = 1'000'003;  // elements of "w": ~4 MB per field, 2 chunks

// Rank r of 2 holds w[r*half, ...) with main[i] = global index i (as float).
void WriteRank(const std::string& store_path, const std::string& ckpt, uint32_t r,
               const std::string& job = "tools-reshard-test") {
  vfs::StoreOptions o;
  o.chunk_size_bytes = 2 * vfs::kMiB;
  o.preallocate_step_bytes = 8 * vfs::kMiB;
  o.job = job;
  auto s = vfs::Store::Create(store_path, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const uint64_t lo = r == 0 ? 0 : kGlobal / 2, hi = r == 0 ? kGlobal / 2 : kGlobal;
  vfs::TensorSpec spec;
  spec.name = "w";
  spec.numel = hi - lo;
  spec.global_shape = {kGlobal};
  spec.shard_offset = {lo};
  auto t = (*s)->CreateTensor(spec);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const uint64_t per_chunk = o.chunk_size_bytes / 4;
  vfs::IoBuffer buf(o.chunk_size_bytes);
  for (uint64_t c = 0; c * per_chunk < spec.numel; ++c) {
    for (uint64_t i = 0; i < per_chunk; ++i) buf.as<float>()[i] = static_cast<float>(lo + c * per_chunk + i);
    ASSERT_TRUE((*s)->WriteChunk({t->id, 0, c}, buf.data()).ok());
  }
  vfs::CommitInfo ci;
  ci.step = 5;
  ci.groups.push_back(vfs::GroupInfo{0, 5, {{"lr", 1e-3}}});
  ASSERT_TRUE((*s)->Commit(ci).ok());
  auto e = vfs::ExportCheckpoint(s->get(), ckpt);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
}

TEST(ReshardTool, LayoutRunRestore) {
  TempDir dir;
  WriteRank(dir / "s0", dir / "c0", 0);
  WriteRank(dir / "s1", dir / "c1", 1);
  auto layout = Tool("optstate-reshard", {"layout", "--ranks", "3", "-o", dir / "l.json", dir / "c1", dir / "c0"});
  ASSERT_EQ(layout.exit_code, 0) << layout.err;
  auto run = Tool("optstate-reshard", {"run", "--layout", dir / "l.json", "--dest", dir / "out", "--no-safetensors",
                                       dir / "c0", dir / "c1"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("into 3 ranks"), std::string::npos) << run.out;
  for (uint32_t r = 0; r < 3; ++r) {
    // --no-safetensors: the field files alone, and the manifest says so.
    const std::string out = dir / ("out/" + vfs::ReshardRankDirName(r));
    EXPECT_FALSE(fs::exists(out + "/" + vfs::kSafetensorsFileName)) << out;
    auto m = vfs::ReadManifestFile(out + "/" + vfs::kManifestFileName);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_FALSE(m->has_safetensors) << out;
    const std::string store = dir / ("r" + std::to_string(r));
    auto restore = Tool("optstate-restore",
                        {dir / ("out/" + vfs::ReshardRankDirName(r)), store, "--create", "r", "-q"});
    ASSERT_EQ(restore.exit_code, 0) << restore.err;
    // -q: nothing on either stream (no progress, no [info] log line).
    EXPECT_EQ(restore.out + restore.err, "");
    auto s = vfs::Store::OpenReadOnly(store, vfs::StoreOptions{});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto t = (*s)->FindTensor("w");
    ASSERT_TRUE(t.ok());
    const uint64_t lo = kGlobal * r / 3, hi = kGlobal * (r + 1) / 3;
    EXPECT_EQ(t->shard_offset, std::vector<uint64_t>{lo});
    ASSERT_EQ(t->numel, hi - lo);
    EXPECT_EQ((*s)->LatestGeneration().step, 5u);
    auto v = (*s)->OpenGeneration(vfs::kLatest);
    ASSERT_TRUE(v.ok());
    const uint64_t per_chunk = (*s)->chunk_size_bytes() / 4;
    vfs::IoBuffer buf((*s)->chunk_size_bytes());
    uint64_t wrong = 0;
    for (uint64_t c = 0; c * per_chunk < t->numel; ++c) {
      ASSERT_TRUE((*v)->ReadChunk({t->id, 0, c}, buf.data()).ok());
      for (uint64_t i = 0; i < per_chunk && c * per_chunk + i < t->numel; ++i) {
        wrong += buf.as<float>()[i] != static_cast<float>(lo + c * per_chunk + i);
      }
    }
    EXPECT_EQ(wrong, 0u) << "rank " << r;
  }

  // A missing rank: refused (exit 1), the tensor and the uncovered range named, nothing written.
  auto missing = Tool("optstate-reshard", {"run", "--layout", dir / "l.json", "--dest", dir / "out2", dir / "c0"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("tensor 'w'"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find(fmt::format("[{}, {})", kGlobal / 2, kGlobal)), std::string::npos) << missing.err;
  EXPECT_FALSE(fs::exists(dir / "out2"));
  // A malformed command line: exit 2.
  EXPECT_EQ(Tool("optstate-reshard", {"run", "--dest", dir / "out3"}).exit_code, 2);
}

// Rank r of 2 holds rows [300 r, 300 r + 300) of the 600 x 700 matrix "m"
// (main[i] = global index i) and half of the 1-D "v".
void WriteMatrixRank(const std::string& store_path, const std::string& ckpt, uint32_t r,
                     const std::string& job = "tools-reshard-test") {
  vfs::StoreOptions o;
  o.chunk_size_bytes = 2 * vfs::kMiB;
  o.preallocate_step_bytes = 8 * vfs::kMiB;
  o.job = job;
  auto s = vfs::Store::Create(store_path, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  struct Part {
    std::string name;
    std::vector<uint64_t> global, offset, shape;
    uint64_t first;  // global index of the first element
  };
  for (const Part& p : {Part{"layers.0.m", {600, 700}, {300 * r, 0}, {300, 700}, 300 * 700 * r},
                        Part{"layers.0.v", {1000}, {500 * r}, {500}, 500 * r}}) {
    vfs::TensorSpec spec;
    spec.name = p.name;
    spec.numel = 1;
    for (uint64_t d : p.shape) spec.numel *= d;
    spec.shape = p.shape;
    spec.global_shape = p.global;
    spec.shard_offset = p.offset;
    auto t = (*s)->CreateTensor(spec);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const uint64_t per_chunk = o.chunk_size_bytes / 4;
    vfs::IoBuffer buf(o.chunk_size_bytes);
    for (uint64_t c = 0; c * per_chunk < spec.numel; ++c) {
      for (uint64_t i = 0; i < per_chunk; ++i) buf.as<float>()[i] = static_cast<float>(p.first + c * per_chunk + i);
      for (uint32_t f = 0; f < 3; ++f) ASSERT_TRUE((*s)->WriteChunk({t->id, f, c}, buf.data()).ok());
    }
  }
  vfs::CommitInfo ci;
  ci.step = 5;
  ci.groups.push_back(vfs::GroupInfo{0, 5, {{"lr", 1e-3}}});
  ASSERT_TRUE((*s)->Commit(ci).ok());
  auto e = vfs::ExportCheckpoint(s->get(), ckpt);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
}

std::string Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(ReshardTool, SplitRulesAndFlatBucketsOfMatrices) {
  TempDir dir;
  WriteMatrixRank(dir / "s0", dir / "c0", 0);
  WriteMatrixRank(dir / "s1", dir / "c1", 1);
  const std::string c0 = dir / "c0", c1 = dir / "c1";
  // Rules by name, first match wins: the matrix along columns, the rest in flat ranges.
  auto rules = Tool("optstate-reshard", {"layout", "--ranks", "3", "--split", "*.m=columns", "--split", "*=flat",
                                         c0, c1});
  ASSERT_EQ(rules.exit_code, 0) << rules.err;
  auto l = vfs::ParseTargetLayout(rules.out, "stdout");
  ASSERT_TRUE(l.ok()) << l.status().ToString() << rules.out;
  EXPECT_EQ(l->ranks[1].at("layers.0.m").offset, (std::vector<uint64_t>{0, 233}));
  EXPECT_TRUE(l->ranks[2].at("layers.0.v").flat);
  // The same as one comma-separated --split.
  auto comma = Tool("optstate-reshard", {"layout", "--ranks", "3", "--split", "*.m=dim1,*=flat", c0, c1});
  ASSERT_EQ(comma.exit_code, 0) << comma.err;
  EXPECT_EQ(comma.out, rules.out);
  // Flat buckets of the 2-D matrix (a data-parallel optimizer's layout), and back to rows: the field
  // files come back byte for byte.
  auto buckets = Tool("optstate-reshard", {"layout", "--ranks", "3", "--bucket-elements", "100000", "-o",
                                           dir / "b.json", c0, c1});
  ASSERT_EQ(buckets.exit_code, 0) << buckets.err;
  EXPECT_NE(Slurp(dir / "b.json").find("\"flat\""), std::string::npos);
  auto run = Tool("optstate-reshard", {"run", "-q", "--layout", dir / "b.json", "--dest", dir / "flat", c0, c1});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  // -q: nothing on either stream (no summary line, no [info] log line).
  EXPECT_EQ(run.out + run.err, "");
  std::vector<std::string> flat;
  for (uint32_t r = 0; r < 3; ++r) flat.push_back(dir / ("flat/" + vfs::ReshardRankDirName(r)));
  for (const std::string& d : flat) EXPECT_TRUE(fs::exists(d + "/" + vfs::kSafetensorsFileName)) << d;  // the default
  auto rows = Tool("optstate-reshard", {"layout", "--ranks", "2", "-o", dir / "r.json", flat[0], flat[1], flat[2]});
  ASSERT_EQ(rows.exit_code, 0) << rows.err;
  auto back = Tool("optstate-reshard",
                   {"run", "-q", "--layout", dir / "r.json", "--dest", dir / "back", flat[2], flat[0], flat[1]});
  ASSERT_EQ(back.exit_code, 0) << back.err;
  for (uint32_t r = 0; r < 2; ++r) {
    for (const char* f : {"tensors/layers.0.m/main", "tensors/layers.0.m/exp_avg_sq", "tensors/layers.0.v/exp_avg"}) {
      const std::string want = Slurp((r == 0 ? c0 : c1) + "/" + f);
      EXPECT_FALSE(want.empty());
      EXPECT_TRUE(want == Slurp(dir / ("back/" + vfs::ReshardRankDirName(r) + "/" + f))) << r << " " << f;
    }
  }
  // Bad rules: named, exit 2 for a malformed rule, 1 for one that does not fit the checkpoints.
  auto replicate = Tool("optstate-reshard", {"layout", "--ranks", "2", "--split", "*.v=replicate", c0, c1});
  EXPECT_EQ(replicate.exit_code, 2);
  EXPECT_NE(replicate.err.find("exactly one rank"), std::string::npos) << replicate.err;
  auto unmatched = Tool("optstate-reshard", {"layout", "--ranks", "2", "--split", "*.m=rows", c0, c1});
  EXPECT_EQ(unmatched.exit_code, 1);
  EXPECT_NE(unmatched.err.find("no split rule matches tensor 'layers.0.v'"), std::string::npos) << unmatched.err;
  auto typo = Tool("optstate-reshard", {"layout", "--ranks", "2", "--split", "*.mm=rows,*=rows", c0, c1});
  EXPECT_EQ(typo.exit_code, 1);
  EXPECT_NE(typo.err.find("'*.mm' matches no tensor"), std::string::npos) << typo.err;
}

}  // namespace
}  // namespace optstate::tools
