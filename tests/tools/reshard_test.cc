// optstate-reshard as a user runs it: two ranks' exported checkpoints, a
// layout for three ranks from `layout`, `run`, then optstate-restore of each
// new rank; the restored values are the global indices the sources held.
#include <filesystem>
#include <fstream>

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
void WriteRank(const std::string& store_path, const std::string& ckpt, uint32_t r) {
  vfs::StoreOptions o;
  o.chunk_size_bytes = 2 * vfs::kMiB;
  o.preallocate_step_bytes = 8 * vfs::kMiB;
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
  auto run = Tool("optstate-reshard",
                  {"run", "--layout", dir / "l.json", "--dest", dir / "out", dir / "c0", dir / "c1"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("into 3 ranks"), std::string::npos) << run.out;
  for (uint32_t r = 0; r < 3; ++r) {
    const std::string store = dir / ("r" + std::to_string(r));
    auto restore = Tool("optstate-restore",
                        {dir / ("out/" + vfs::ReshardRankDirName(r)), store, "--create", "r", "-q"});
    ASSERT_EQ(restore.exit_code, 0) << restore.err;
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

}  // namespace
}  // namespace optstate::tools
