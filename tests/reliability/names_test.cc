// Bad input through the whole path store -> checkpoint layout -> restore:
// tensor names with '/', "..", ".", '%', spaces, UTF-8, a 4096-byte name and
// one a byte too long, NUL (rejected), the empty name (rejected); the layout
// must give every tensor a distinct single path component, and a checkpoint
// exported through the layout must restore (CreateStoreFromCheckpoint) to the
// same names and bytes. A checkpoint whose layout differs from the target
// store (numel, missing tensor) is refused with the differences named and the
// store unchanged.
#include <filesystem>
#include <fstream>
#include <set>

#include <gtest/gtest.h>

#include "tests/reliability/reliability_util.h"
#include "vfs/checkpoint.h"

namespace optstate::reliability {
namespace {

using vfs::ChunkRef;
using vfs::Store;
using wl::FillPattern;
using wl::TempDir;
using wl::TestOptions;
namespace fs = std::filesystem;

std::vector<std::string> OddNames() {
  return {"a/b",      "../../etc/passwd", "..",        ".",         "/abs",         "a//b/",
          "100%",     "%2E%2E",           "sp ace\t",  "ünï/ç😀",   std::string(4096, 'x'),
          std::string(4095, '/') + "z", "tensors",   "manifest.json"};
}

void ExportCheckpoint(const vfs::GenerationView* v, const std::string& dir) {
  auto layout = vfs::CheckpointLayout::Build(v);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  std::set<std::string> paths;
  for (const auto& f : (*layout)->files()) {
    ASSERT_TRUE(paths.insert(f.path).second) << "duplicate path " << f.path;
    // Every file stays inside the checkpoint dir: no "..", no absolute path,
    // no component longer than 255 bytes.
    const fs::path p(f.path);
    ASSERT_FALSE(p.is_absolute()) << f.path;
    for (const auto& comp : p) {
      ASSERT_NE(comp.string(), "..") << f.path;
      ASSERT_NE(comp.string(), ".") << f.path;
      ASSERT_LE(comp.string().size(), 255u) << f.path;
    }
    const fs::path out = fs::path(dir) / p;
    fs::create_directories(out.parent_path());
    std::vector<char> buf(f.size_bytes);
    auto n = (*layout)->Read(f, 0, buf.data(), buf.size());
    ASSERT_TRUE(n.ok() && *n == f.size_bytes) << f.path;
    std::ofstream(out, std::ios::binary).write(buf.data(), static_cast<std::streamsize>(buf.size()));
  }
}

TEST(NamesTest, OddNamesRoundTripThroughLayoutAndRestore) {
  TempDir dir;
  const std::string path = dir / "store";
  auto s = Store::Create(path, TestOptions());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  // Rejected names.
  for (const std::string& bad : {std::string("a\0b", 3), std::string(), std::string(4097, 'y')}) {
    vfs::TensorSpec spec;
    spec.name = bad;
    spec.numel = 4;
    auto t = (*s)->CreateTensor(spec);
    EXPECT_FALSE(t.ok()) << "name of " << bad.size() << " bytes accepted";
    if (!t.ok()) {
      EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().ToString();
    }
  }
  const auto names = OddNames();
  Buf buf(kTestChunk);
  for (size_t i = 0; i < names.size(); ++i) {
    vfs::TensorSpec spec;
    spec.name = names[i];
    spec.numel = 1000 + i;
    auto t = (*s)->CreateTensor(spec);
    ASSERT_TRUE(t.ok()) << "name #" << i << ": " << t.status().ToString();
    for (uint32_t f = 0; f < 3; ++f) {
      FillPattern(buf.data(), kTestChunk, 77 + i * 3 + f);
      ASSERT_OK((*s)->WriteChunk(ChunkRef{t->id, f, 0}, buf.data()));
    }
  }
  ASSERT_TRUE((*s)->Commit(vfs::CommitInfo{5, {vfs::GroupInfo{0, 5, {{"lr", 0.5}}}}}).ok());
  auto v = (*s)->OpenGeneration(vfs::kLatest);
  ASSERT_TRUE(v.ok());
  const std::string ckpt = dir / "ckpt";
  ExportCheckpoint(v->get(), ckpt);
  if (HasFailure()) return;
  auto r = vfs::CreateStoreFromCheckpoint(ckpt, dir / "restored", TestOptions());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto rv = (*r)->OpenGeneration(vfs::kLatest);
  ASSERT_TRUE(rv.ok());
  EXPECT_EQ((*rv)->info().step, 5u);
  ASSERT_EQ((*rv)->tensors().size(), names.size());
  Buf got(kTestChunk);
  uint64_t bytes = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    auto t = (*rv)->FindTensor(names[i]);
    ASSERT_TRUE(t.ok()) << "name #" << i << " lost in the round trip: " << t.status().ToString();
    EXPECT_EQ(t->numel, 1000 + i);
    for (uint32_t f = 0; f < 3; ++f) {
      ASSERT_OK((*rv)->ReadChunk(ChunkRef{t->id, f, 0}, got.data()));
      FillPattern(buf.data(), kTestChunk, 77 + i * 3 + f);
      EXPECT_EQ(0, std::memcmp(got.data(), buf.data(), t->field_bytes(f))) << "name #" << i << " field " << f;
      bytes += t->field_bytes(f);
    }
  }
  std::printf("odd names: %zu tensors round-tripped, %llu bytes compared\n", names.size(),
              static_cast<unsigned long long>(bytes));
}

TEST(NamesTest, RestoreOfADifferentLayoutIsRefusedAndNamesTheDifference) {
  TempDir dir;
  auto make = [&](const std::string& p, uint64_t numel, bool extra) {
    auto s = Store::Create(p, TestOptions());
    EXPECT_TRUE(s.ok());
    vfs::TensorSpec spec;
    spec.name = "w";
    spec.numel = numel;
    EXPECT_TRUE((*s)->CreateTensor(spec).ok());
    if (extra) {
      spec.name = "extra";
      EXPECT_TRUE((*s)->CreateTensor(spec).ok());
    }
    Buf buf(kTestChunk);
    FillPattern(buf.data(), kTestChunk, numel);
    auto t = (*s)->FindTensor("w");
    EXPECT_TRUE((*s)->WriteChunk(ChunkRef{t->id, 0, 0}, buf.data()).ok());
    EXPECT_TRUE((*s)->Commit(vfs::CommitInfo{1, {vfs::GroupInfo{0, 1, {}}}}).ok());
    return std::move(*s);
  };
  auto src = make(dir / "src", 1000, false);
  auto v = src->OpenGeneration(vfs::kLatest);
  ASSERT_TRUE(v.ok());
  ExportCheckpoint(v->get(), dir / "ckpt");
  for (auto [numel, extra] : {std::pair<uint64_t, bool>{1001, false}, {1000, true}}) {
    auto dst = make(dir / ("dst" + std::to_string(numel) + (extra ? "x" : "")), numel, extra);
    auto r = vfs::RestoreCheckpoint(dst.get(), dir / "ckpt");
    ASSERT_FALSE(r.ok()) << "restore into a store with a different layout succeeded";
    EXPECT_NE(r.status().message().find(extra ? "extra" : "numel"), std::string::npos) << r.status().ToString();
    EXPECT_EQ(dst->LatestGeneration().generation, 1u);
    Buf got(kTestChunk), want(kTestChunk);
    auto t = dst->FindTensor("w");
    ASSERT_OK(dst->ReadChunk(ChunkRef{t->id, 0, 0}, got.data()));
    FillPattern(want.data(), kTestChunk, numel);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), numel * 4)) << "target store changed by a refused restore";
  }
}

}  // namespace
}  // namespace optstate::reliability
