// Many small tensors: a commit publishes its chunk versions in a few
// chunk-map pack records (format version 2), GC rewrites a pack that is
// partly dead and deletes one that is all dead, small chunk writes reach the
// disk as a few large writes, and a store of format version 1 keeps its
// encoding. The reference for every byte is the deterministic pattern each
// chunk was written with (FillPattern of its seed).
#include <gtest/gtest.h>

#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/common/sync_point_flag.h"
#include "tests/vfs/store_test_util.h"
#include "vfs/fault_injection.h"
#include "vfs/store.h"

namespace optstate::vfs {
namespace {

using store_testing::Buf;
using store_testing::FillPattern;
using store_testing::kTestChunk;
using store_testing::NewTensor;
using store_testing::TempDir;
using store_testing::TestOptions;
using store_testing::Unwrap;

constexpr uint64_t kSmallNumel = 10;  // 40-byte chunks: each in a 4 KiB piece

uint64_t Seed(uint64_t gen, const ChunkRef& r) { return store_testing::ChunkSeed(gen, r.tensor_id, r.field, r.index); }

std::vector<ChunkRef> ChunksOf(const std::vector<TensorInfo>& ts) {
  std::vector<ChunkRef> refs;
  for (const auto& t : ts) {
    for (uint32_t f = 0; f < t.fields.size(); ++f) refs.push_back(ChunkRef{t.id, f, 0});
  }
  return refs;
}

// Writes every chunk of `refs` with the pattern of `seed` through one ChunkIo,
// all submitted before any is reaped (as a step does).
void WriteMany(Store* s, const std::vector<ChunkRef>& refs, uint64_t seed) {
  auto io = Unwrap(s->NewChunkIo(ChunkIoOptions{}));
  std::vector<std::unique_ptr<Buf>> bufs;  // each lives until its write completes
  std::vector<ChunkCompletion> done;
  for (size_t i = 0; i < refs.size(); ++i) {
    bufs.push_back(std::make_unique<Buf>(4096));
    FillPattern(bufs.back()->data(), 4096, Seed(seed, refs[i]));
    ASSERT_OK(io->SubmitWrite(refs[i], bufs.back()->data(), i));
  }
  while (io->in_flight() > 0) ASSERT_OK(io->Reap(&done, 1));
  ASSERT_EQ(done.size(), refs.size());
  for (const auto& c : done) ASSERT_OK(c.status);
}

// Each chunk of refs reads back as the pattern of seeds[i] (its first
// kSmallNumel x 4 bytes, zeros after).
void ExpectChunks(Store* s, const std::vector<ChunkRef>& refs, const std::vector<uint64_t>& seeds) {
  Buf buf(kTestChunk);
  std::vector<uint8_t> want(4096);
  for (size_t i = 0; i < refs.size(); ++i) {
    ASSERT_OK(s->ReadChunk(refs[i], buf.data()));
    FillPattern(want.data(), 4096, Seed(seeds[i], refs[i]));
    ASSERT_EQ(0, std::memcmp(buf.data(), want.data(), kSmallNumel * 4)) << "chunk " << i;
    for (uint64_t b = kSmallNumel * 4; b < 4096; ++b) ASSERT_EQ(buf.data()[b], 0) << "chunk " << i;
  }
}

struct KeyCounts {
  uint64_t chunk = 0;  // "C/" records
  uint64_t pack = 0;   // "P/" records
};
// Counts the index records of a closed store.
KeyCounts CountIndexKeys(const std::string& store) {
  rocksdb::DB* raw = nullptr;
  rocksdb::Status st = rocksdb::DB::OpenForReadOnly(rocksdb::Options(), store + "/index", &raw);
  EXPECT_TRUE(st.ok()) << st.ToString();
  std::unique_ptr<rocksdb::DB> db(raw);
  KeyCounts n;
  if (!db) return n;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (it->key().starts_with("C/")) ++n.chunk;
    if (it->key().starts_with("P/")) ++n.pack;
  }
  return n;
}

std::vector<TensorInfo> MakeSmall(Store* s, int n) {
  std::vector<TensorInfo> ts;
  for (int i = 0; i < n; ++i) ts.push_back(NewTensor(s, "layer." + std::to_string(i) + ".bias", kSmallNumel));
  return ts;
}

void ExpectVerified(Store* s) {
  VerifyReport r = Unwrap(s->Verify());
  EXPECT_TRUE(r.ok()) << (r.problems.empty() ? "leaked slots " + std::to_string(r.leaked_slots) : r.problems[0]);
}

TEST(StorePackTest, CommitIndexesThousandsOfChunksInAFewRecords) {
  TempDir dir;
  const std::string path = dir / "s";
  std::vector<ChunkRef> refs;
  {
    auto s = Unwrap(Store::Create(path, TestOptions()));
    EXPECT_EQ(s->identity().format_version, kFormatVersion);
    refs = ChunksOf(MakeSmall(s.get(), 1500));  // 4500 chunk versions
    WriteMany(s.get(), refs, 1);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
    ExpectChunks(s.get(), refs, std::vector<uint64_t>(refs.size(), 1));
  }
  const KeyCounts n = CountIndexKeys(path);
  EXPECT_EQ(n.chunk, 0u);
  EXPECT_EQ(n.pack, 3u) << "4500 versions in records of 2048";
  auto s = Unwrap(Store::Open(path, TestOptions()));
  ExpectChunks(s.get(), refs, std::vector<uint64_t>(refs.size(), 1));
  ExpectVerified(s.get());
}

TEST(StorePackTest, GcRewritesAPartlyDeadPackAndDeletesADeadOne) {
  TempDir dir;
  const std::string path = dir / "s";
  std::vector<ChunkRef> refs, even, odd;
  std::vector<uint64_t> seeds;
  {
    auto s = Unwrap(Store::Create(path, TestOptions()));  // retains 1 generation
    refs = ChunksOf(MakeSmall(s.get(), 300));
    for (const auto& r : refs) (r.tensor_id % 2 ? odd : even).push_back(r);
    WriteMany(s.get(), refs, 1);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
    WriteMany(s.get(), even, 2);  // generation 1's pack: half of it dies
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 2u);
    for (const auto& r : refs) seeds.push_back(r.tensor_id % 2 ? 1 : 2);
    ExpectChunks(s.get(), refs, seeds);
  }
  KeyCounts n = CountIndexKeys(path);
  EXPECT_EQ(n.pack, 2u) << "generation 1's pack rewritten with the odd tensors, generation 2's";
  {
    // Reloaded from the index: the rewritten pack holds exactly the odd tensors' versions.
    auto s = Unwrap(Store::Open(path, TestOptions()));
    ExpectChunks(s.get(), refs, seeds);
    ExpectVerified(s.get());
    auto ro = Unwrap(Store::OpenReadOnly(path, TestOptions()));
    auto view = Unwrap(ro->OpenGeneration(kLatest));
    Buf buf(kTestChunk);
    std::vector<uint8_t> want(4096);
    for (size_t i = 0; i < refs.size(); ++i) {
      ASSERT_OK(view->ReadChunk(refs[i], buf.data()));
      FillPattern(want.data(), 4096, Seed(seeds[i], refs[i]));
      ASSERT_EQ(0, std::memcmp(buf.data(), want.data(), kSmallNumel * 4)) << "reader, chunk " << i;
    }
    view.reset();
    ro.reset();
    WriteMany(s.get(), odd, 3);  // the rest of generation 1's pack dies
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 3u);
    for (size_t i = 0; i < refs.size(); ++i) seeds[i] = refs[i].tensor_id % 2 ? 3 : 2;
    ExpectChunks(s.get(), refs, seeds);
    ExpectVerified(s.get());
  }
  n = CountIndexKeys(path);
  EXPECT_EQ(n.pack, 2u) << "generation 1's pack deleted; generations 2 and 3 hold one each";
  auto s = Unwrap(Store::Open(path, TestOptions()));
  ExpectChunks(s.get(), refs, seeds);
  ExpectVerified(s.get());
}

TEST(StorePackTest, FormatVersion1StoreKeepsItsEncoding) {
  TempDir dir;
  const std::string path = dir / "s";
  std::vector<ChunkRef> refs;
  {
    test_util::SyncPointFlag v1("store.create.format_v1");
    ASSERT_TRUE(SyncPoint::CompiledIn());
    auto s = Unwrap(Store::Create(path, TestOptions()));
    EXPECT_EQ(s->identity().format_version, 1u);
    refs = ChunksOf(MakeSmall(s.get(), 20));
    WriteMany(s.get(), refs, 1);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
  }
  KeyCounts n = CountIndexKeys(path);
  EXPECT_EQ(n.chunk, refs.size());
  EXPECT_EQ(n.pack, 0u);
  {
    auto s = Unwrap(Store::Open(path, TestOptions()));  // this build, without the flag
    EXPECT_EQ(s->identity().format_version, 1u);
    ExpectChunks(s.get(), refs, std::vector<uint64_t>(refs.size(), 1));
    WriteMany(s.get(), refs, 2);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 2u);
    ExpectVerified(s.get());
  }
  n = CountIndexKeys(path);
  EXPECT_EQ(n.chunk, refs.size()) << "generation 1's records collected, generation 2's one per chunk";
  EXPECT_EQ(n.pack, 0u) << "a version 1 store must stay readable by the builds that wrote it";
  auto ro = Unwrap(Store::OpenReadOnly(path, TestOptions()));
  auto view = Unwrap(ro->OpenGeneration(kLatest));
  Buf buf(kTestChunk);
  std::vector<uint8_t> want(4096);
  for (const auto& r : refs) {
    ASSERT_OK(view->ReadChunk(r, buf.data()));
    FillPattern(want.data(), 4096, Seed(2, r));
    ASSERT_EQ(0, std::memcmp(buf.data(), want.data(), kSmallNumel * 4));
  }
}

TEST(StorePackTest, SmallWritesReachTheDiskAsFewLargeWrites) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  StoreOptions o = TestOptions();
  o.fs = &fs;
  auto s = Unwrap(Store::Create(dir / "s", o));
  const auto refs = ChunksOf(MakeSmall(s.get(), 200));  // 600 chunks of 40 bytes
  fs.ResetCounters();
  WriteMany(s.get(), refs, 1);
  const uint64_t writes = fs.OpCount(OpClass::kWrite);
  EXPECT_GT(writes, 0u);
  EXPECT_LE(writes, refs.size() / 16) << "one write per small chunk";
  ASSERT_OK(s->Commit(CommitInfo{}).status());
  ExpectChunks(s.get(), refs, std::vector<uint64_t>(refs.size(), 1));
  ExpectVerified(s.get());
}

TEST(StorePackTest, AFailedPackWriteFailsEachOfItsWritesAndKeepsTheCommittedState) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  StoreOptions o = TestOptions();
  o.fs = &fs;
  auto s = Unwrap(Store::Create(dir / "s", o));
  const auto refs = ChunksOf(MakeSmall(s.get(), 20));
  WriteMany(s.get(), refs, 1);
  ASSERT_OK(s->Commit(CommitInfo{}).status());

  FaultRule rule = FaultRule::FailNth(OpClass::kWrite, 1);
  rule.path_contains = ".chunks";
  fs.AddRule(rule);
  {
    auto io = Unwrap(s->NewChunkIo(ChunkIoOptions{}));
    std::vector<std::unique_ptr<Buf>> bufs;
    for (size_t i = 0; i < refs.size(); ++i) {
      bufs.push_back(std::make_unique<Buf>(4096));
      FillPattern(bufs.back()->data(), 4096, Seed(2, refs[i]));
      ASSERT_OK(io->SubmitWrite(refs[i], bufs.back()->data(), i));
    }
    std::vector<ChunkCompletion> done;
    while (io->in_flight() > 0) ASSERT_OK(io->Reap(&done, 1));
    ASSERT_EQ(done.size(), refs.size());
    size_t failed = 0;
    for (const auto& c : done) {
      if (c.status.ok()) continue;
      ++failed;
      EXPECT_NE(c.status.message().find("store " + (dir / "s")), std::string::npos) << c.status.ToString();
      EXPECT_NE(c.status.message().find("layer."), std::string::npos) << c.status.ToString();
    }
    EXPECT_GT(failed, 1u) << "the first pack of adjacent writes failed as a whole";
  }
  fs.ClearRules();
  ASSERT_OK(s->AbortPending());
  ExpectChunks(s.get(), refs, std::vector<uint64_t>(refs.size(), 1));
  WriteMany(s.get(), refs, 3);
  ASSERT_OK(s->Commit(CommitInfo{}).status());
  ExpectChunks(s.get(), refs, std::vector<uint64_t>(refs.size(), 3));
  ExpectVerified(s.get());
}

}  // namespace
}  // namespace optstate::vfs
