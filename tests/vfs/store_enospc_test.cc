// ENOSPC on a real small filesystem: a 64 MiB ext4 image loop-mounted in the
// test (root only; skipped with the reason otherwise) holds the data dir. The
// store fills it, a write fails with kNoSpace naming the data dir, the last
// committed generation stays intact, and once a snapshot is released the same
// generation commits without growing the file.
#include <sys/mount.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>

#include "tests/vfs/store_test_util.h"
#include "vfs/store.h"

namespace optstate::vfs {
namespace {

using namespace store_testing;  // NOLINT

constexpr uint64_t kChunks = 10;  // per generation: 20 MiB; the fs has ~50 MiB

class StoreEnospcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to loop-mount an ext4 image";
    mnt_ = dir_ / "mnt";
    std::filesystem::create_directories(mnt_);
    const std::string img = dir_ / "fs.img";
    const std::string cmd = "truncate -s 64M " + img + " && mkfs.ext4 -q -F " + img + " >/dev/null 2>&1 && mount -o loop " +
                            img + " " + mnt_ + " 2>/dev/null";
    if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "cannot loop-mount an ext4 image here (" << cmd << ")";
    mounted_ = true;
  }
  void TearDown() override {
    if (mounted_ && ::umount(mnt_.c_str()) != 0) ::umount2(mnt_.c_str(), MNT_DETACH);
  }

  TempDir dir_;
  std::string mnt_;
  bool mounted_ = false;
};

Status WriteGeneration(Store* s, const TensorInfo& t, uint64_t g) {
  Buf buf(kTestChunk);
  for (uint64_t c = 0; c < kChunks; ++c) {
    FillPattern(buf.data(), kTestChunk, ChunkSeed(g, t.id, 0, c));
    OPTSTATE_RETURN_IF_ERROR(s->WriteChunk(ChunkRef{t.id, 0, c}, buf.data()));
  }
  return Status();
}

void ExpectGeneration(const GenerationView& v, const TensorInfo& t, uint64_t g) {
  Buf got(kTestChunk), want(kTestChunk);
  for (uint64_t c = 0; c < kChunks; ++c) {
    Status s = v.ReadChunk(ChunkRef{t.id, 0, c}, got.data());
    ASSERT_TRUE(s.ok()) << s.ToString();
    FillPattern(want.data(), kTestChunk, ChunkSeed(g, t.id, 0, c));
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), kTestChunk)) << "generation " << g << " chunk " << c;
  }
}

TEST_F(StoreEnospcTest, FullDataDirIsAClearErrorAndNothingIsLost) {
  StoreOptions opts = TestOptions();
  const std::string data = mnt_ + "/data";
  opts.data_dirs = {data};
  auto s = Store::Create(dir_ / "s", opts);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  TensorSpec spec;
  spec.name = "w";
  spec.numel = kChunks * kTestChunk / 4;
  spec.fields = {{"main", DType::kF32}};
  auto t = (*s)->CreateTensor(spec);
  ASSERT_TRUE(t.ok());
  for (uint64_t g = 1; g <= 2; ++g) {
    Status w = WriteGeneration(s->get(), *t, g);
    ASSERT_TRUE(w.ok()) << w.ToString();
    ASSERT_TRUE((*s)->Commit(CommitInfo{g, {}}).ok());
    if (g == 1) {
      ASSERT_TRUE((*s)->CreateSnapshot("keep").ok());
    }
  }
  // Generation 1 (snapshot) + 2 (latest) hold 40 MiB: 20 more do not fit.
  Status full = WriteGeneration(s->get(), *t, 3);
  ASSERT_FALSE(full.ok()) << "64 MiB filesystem did not fill up";
  EXPECT_EQ(full.code(), StatusCode::kNoSpace) << full.ToString();
  EXPECT_NE(full.message().find(data), std::string::npos) << full.ToString();
  EXPECT_NE(full.message().find("tensor 'w'"), std::string::npos) << full.ToString();
  {
    auto v = (*s)->OpenGeneration(kLatest);
    ASSERT_TRUE(v.ok());
    EXPECT_EQ((*v)->info().generation, 2u);
    ExpectGeneration(**v, *t, 2);
    auto snap = (*s)->OpenSnapshot("keep");
    ASSERT_TRUE(snap.ok());
    ExpectGeneration(**snap, *t, 1);
  }
  ASSERT_TRUE((*s)->AbortPending().ok());
  auto before = (*s)->Stats();
  ASSERT_TRUE(before.ok());
  // Free space: releasing the snapshot frees generation 1's extents.
  ASSERT_TRUE((*s)->ReleaseSnapshot("keep").ok());
  Status w = WriteGeneration(s->get(), *t, 3);
  ASSERT_TRUE(w.ok()) << w.ToString();
  auto g3 = (*s)->Commit(CommitInfo{3, {}});
  ASSERT_TRUE(g3.ok()) << g3.status().ToString();
  EXPECT_EQ(*g3, 3u);
  auto after = (*s)->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->data_file_bytes[0], before->data_file_bytes[0]) << "reused extents must not grow the file";
  s->reset();
  auto r = Store::Open(dir_ / "s", opts);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto v = (*r)->OpenGeneration(kLatest);
  ASSERT_TRUE(v.ok());
  ExpectGeneration(**v, *t, 3);
  auto rep = (*r)->Verify();
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep->ok());
}

}  // namespace
}  // namespace optstate::vfs
