// Store behaviour on real files and a real RocksDB: round trips, reopen,
// striping, copy-on-write, views, snapshots, GC, disk use, errors, corruption.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <set>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "tests/common/sync_point_flag.h"
#include "tests/vfs/store_test_util.h"
#include "vfs/store.h"
#include "base/sync_point.h"

namespace optstate::vfs {
namespace {

using store_testing::Buf;
using store_testing::FillPattern;
using store_testing::kTestChunk;
using store_testing::NewTensor;
using store_testing::TempDir;
using store_testing::TestOptions;
using store_testing::Unwrap;

// A ChunkIo of `src` (a Store or a GenerationView), with `sync_engine` on the
// synchronous engine (which ChunkIo falls back to where io_uring is
// unavailable) through the test sync point "chunk_io.use_sync_engine"
// (vfs/chunk_io.cc), armed only while NewChunkIo runs.
// REQUIRES: !sync_engine || SyncPoint::CompiledIn().
template <typename Source>
Result<std::unique_ptr<ChunkIo>> NewChunkIoOn(Source* src, const ChunkIoOptions& o, bool sync_engine) {
  if (!sync_engine) return src->NewChunkIo(o);
  test_util::SyncPointFlag sync_engine_flag("chunk_io.use_sync_engine");
  auto io = src->NewChunkIo(o);
  EXPECT_EQ(sync_engine_flag.passes(), 1u) << "NewChunkIo did not choose its engine at chunk_io.use_sync_engine";
  return io;
}

uint64_t Sum(const std::vector<uint64_t>& v) { return std::accumulate(v.begin(), v.end(), uint64_t{0}); }

// The expected logical bytes of one chunk written with seed.
std::vector<uint8_t> Expected(uint64_t len, uint64_t seed) {
  std::vector<uint8_t> v(kTestChunk);  // written as a whole chunk, then cut
  FillPattern(v.data(), kTestChunk, seed);
  v.resize(len);
  return v;
}

void WriteAll(Store* s, const TensorInfo& t, uint64_t gen, Buf* buf) {
  for (uint32_t f = 0; f < t.fields.size(); ++f) {
    for (uint64_t c = 0; c < s->ChunkCount(t, f); ++c) {
      FillPattern(buf->data(), kTestChunk, store_testing::ChunkSeed(gen, t.id, f, c));
      ASSERT_OK(s->WriteChunk(ChunkRef{t.id, f, c}, buf->data()));
    }
  }
}

// Reads every chunk through `read` and compares with gen's pattern (or zeros).
template <typename ReadFn>
void CheckAll(ReadFn read, const TensorInfo& t, uint64_t chunks_per_field_bytes, std::optional<uint64_t> gen) {
  Buf buf(kTestChunk);
  for (uint32_t f = 0; f < t.fields.size(); ++f) {
    const uint64_t bytes = t.field_bytes(f);
    const uint64_t n = (bytes + kTestChunk - 1) / kTestChunk;
    for (uint64_t c = 0; c < n; ++c) {
      const uint64_t len = std::min(kTestChunk, bytes - c * kTestChunk);
      ASSERT_OK(read(ChunkRef{t.id, f, c}, buf.data()));
      std::vector<uint8_t> want = gen ? Expected(len, store_testing::ChunkSeed(*gen, t.id, f, c))
                                      : std::vector<uint8_t>(len, 0);
      ASSERT_EQ(0, std::memcmp(buf.data(), want.data(), len)) << t.name << " field " << f << " chunk " << c;
      for (uint64_t i = len; i < kTestChunk; i += 4093) ASSERT_EQ(buf.data()[i], 0) << "tail not zeroed";
    }
  }
  (void)chunks_per_field_bytes;
}

TEST(StoreTest, RoundTripSizesAcrossReopenStripedOverTwoDirs) {
  TempDir dir;
  StoreOptions opts = TestOptions();
  std::filesystem::create_directories(dir / "nvme0");
  std::filesystem::create_directories(dir / "nvme1");
  opts.data_dirs = {dir / "nvme0", dir / "nvme1"};
  const uint64_t q = kTestChunk / 4;  // f32 elements per chunk
  const std::map<std::string, uint64_t> sizes = {
      {"zero", 0}, {"one", 1}, {"odd", 12345}, {"exact", q}, {"chunk_plus_1", q + 1}, {"many", 5 * q + 777}};
  std::vector<TensorInfo> tensors;
  {
    auto s = Unwrap(Store::Create(dir / "rank0.dense", opts));
    EXPECT_EQ(s->identity().name, "rank0.dense");
    EXPECT_EQ(s->identity().data_dirs.size(), 2u);
    Buf buf(kTestChunk);
    for (const auto& [name, numel] : sizes) {
      TensorSpec spec;
      spec.name = name;
      spec.numel = numel;
      spec.group = numel % 3;
      tensors.push_back(Unwrap(s->CreateTensor(spec)));
      EXPECT_EQ(s->ChunkCount(tensors.back(), 0), (numel * 4 + kTestChunk - 1) / kTestChunk);
      WriteAll(s.get(), tensors.back(), 1, &buf);
    }
    // Pending writes are visible to the store's own reads before commit.
    for (const auto& t : tensors) {
      CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, 1);
    }
    CommitInfo ci;
    ci.step = 7;
    ci.groups = {GroupInfo{0, 7, {{"lr", 1e-3}, {"beta1", 0.9}}}, GroupInfo{1, 3, {{"lr", 2.5e-4}}}};
    EXPECT_EQ(Unwrap(s->Commit(ci)), 1u);
    auto st = Unwrap(s->Stats());
    ASSERT_EQ(st.data_file_bytes.size(), 2u);
    EXPECT_GT(st.data_file_bytes[0], 0u) << "chunks not striped to dir 0";
    EXPECT_GT(st.data_file_bytes[1], 0u) << "chunks not striped to dir 1";
    uint64_t live = 0;
    for (const auto& t : tensors) live += 3 * t.numel * 4;
    EXPECT_EQ(st.live_bytes, live);
  }
  auto s = Unwrap(Store::Open(dir / "rank0.dense", opts));
  auto latest = s->LatestGeneration();
  EXPECT_EQ(latest.generation, 1u);
  EXPECT_EQ(latest.step, 7u);
  ASSERT_EQ(latest.groups.size(), 2u);
  EXPECT_EQ(latest.groups[1].step_count, 3u);
  EXPECT_EQ(latest.groups[0].hyper.at("beta1"), 0.9);
  EXPECT_EQ(latest.groups[1].hyper.at("lr"), 2.5e-4);
  auto listed = s->ListTensors();
  ASSERT_EQ(listed.size(), sizes.size());
  for (size_t i = 1; i < listed.size(); ++i) EXPECT_LT(listed[i - 1].name, listed[i].name);
  for (const auto& t : tensors) {
    auto found = Unwrap(s->FindTensor(t.name));
    EXPECT_EQ(found.id, t.id);
    EXPECT_EQ(found.numel, t.numel);
    EXPECT_EQ(found.fields.size(), 3u);
    EXPECT_EQ(found.created_generation, 1u);
    CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, found, 0, 1);
  }
  // The same bytes through a view and through the asynchronous ChunkIo.
  auto view = Unwrap(s->OpenGeneration(kLatest));
  EXPECT_EQ(view->info().generation, 1u);
  for (const auto& t : tensors) {
    CheckAll([&](const ChunkRef& r, void* b) { return view->ReadChunk(r, b); }, t, 0, 1);
  }
  auto io = Unwrap(s->NewChunkIo(ChunkIoOptions{}));
  const TensorInfo& many =
      *std::find_if(tensors.begin(), tensors.end(), [](const TensorInfo& t) { return t.name == "many"; });
  std::vector<std::unique_ptr<Buf>> bufs;
  uint64_t tag = 0;
  for (uint32_t f = 0; f < 3; ++f) {
    for (uint64_t c = 0; c < s->ChunkCount(many, f); ++c) {
      bufs.push_back(std::make_unique<Buf>(kTestChunk));
      ASSERT_OK(io->SubmitRead(ChunkRef{many.id, f, c}, bufs.back()->data(), tag++));
    }
  }
  std::vector<ChunkCompletion> done;
  while (done.size() < tag) ASSERT_OK(io->Reap(&done, 1));
  EXPECT_EQ(io->in_flight(), 0u);
  for (const auto& d : done) {
    ASSERT_OK(d.status);
    const uint32_t f = static_cast<uint32_t>(d.tag / s->ChunkCount(many, 0));
    const uint64_t c = d.tag % s->ChunkCount(many, 0);
    const uint64_t len = std::min(kTestChunk, many.field_bytes(f) - c * kTestChunk);
    auto want = Expected(len, store_testing::ChunkSeed(1, many.id, f, c));
    EXPECT_EQ(0, std::memcmp(bufs[d.tag]->data(), want.data(), len)) << "tag " << d.tag;
  }
  auto rep = Unwrap(s->Verify());
  EXPECT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaked " + std::to_string(rep.leaked_slots) : rep.problems[0]);
  EXPECT_GT(rep.chunks_checked, 10u);
}

TEST(StoreTest, NeverWrittenChunksReadZerosWithoutIo) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(s.get(), "w", 3 * kTestChunk / 4 + 5);
  CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, std::nullopt);
  EXPECT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
  CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, std::nullopt);
  auto view = Unwrap(s->OpenGeneration(1));
  auto info = Unwrap(view->Chunk(ChunkRef{t.id, 2, 3}));
  EXPECT_TRUE(info.zero);
  EXPECT_EQ(info.length_bytes, 20u);
  std::vector<uint8_t> z(20, 0);
  EXPECT_EQ(info.checksum, ChunkChecksum(z.data(), 20));
  auto st = Unwrap(s->Stats());
  EXPECT_EQ(Sum(st.data_file_bytes), 0u) << "zero chunks must not allocate data";
  EXPECT_EQ(st.lifetime_bytes_written, 0u);
  Buf b(kTestChunk);
  EXPECT_EQ(s->ReadChunk(ChunkRef{t.id, 0, 4}, b.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->ReadChunk(ChunkRef{t.id, 3, 0}, b.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->ReadChunk(ChunkRef{t.id + 9, 0, 0}, b.data()).code(), StatusCode::kNotFound);
}

// ChunkIo::SubmitRead and GenerationView::ReadChunk with a buffer smaller
// than a chunk (StreamedAdam's small staging sets, the mount's readers of
// small fields): a short chunk reads into it, written or never written,
// with the tail zeroed only up to buf_bytes (the bytes after it stay as they
// were); a chunk that does not fit is refused, naming tensor, field and chunk.
TEST(StoreTest, ChunkReadsIntoABufferSmallerThanAChunk) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  TensorSpec spec;
  spec.name = "norm";
  spec.numel = 1000;  // 4000 bytes a field: one short chunk
  auto t = Unwrap(s->CreateTensor(spec));
  spec.name = "big";
  spec.numel = kTestChunk / 4;  // one whole chunk a field
  auto big = Unwrap(s->CreateTensor(spec));
  Buf w(kTestChunk);
  FillPattern(w.data(), kTestChunk, 7);
  ASSERT_OK(s->WriteChunk(ChunkRef{t.id, 0, 0}, w.data()));
  ASSERT_OK(s->WriteChunk(ChunkRef{big.id, 0, 0}, w.data()));
  ASSERT_OK(s->Commit(CommitInfo{}).status());
  constexpr uint64_t kSmall = 8192;
  auto io = Unwrap(s->NewChunkIo(ChunkIoOptions{}));
  for (uint32_t field : {0u, 1u}) {  // main was written, exp_avg never
    Buf b(2 * kSmall);
    std::memset(b.data(), 0xAB, 2 * kSmall);
    ASSERT_OK(io->SubmitRead(ChunkRef{t.id, field, 0}, b.data(), field, kSmall));
    std::vector<ChunkCompletion> done;
    ASSERT_OK(io->Reap(&done, 1));
    ASSERT_EQ(done.size(), 1u);
    ASSERT_OK(done[0].status);
    std::vector<uint8_t> want = field == 0 ? Expected(4000, 7) : std::vector<uint8_t>(4000, 0);
    EXPECT_EQ(0, std::memcmp(b.data(), want.data(), 4000)) << "field " << field;
    for (uint64_t i = 4000; i < kSmall; ++i) ASSERT_EQ(b.data()[i], 0) << "tail byte " << i << ", field " << field;
    for (uint64_t i = kSmall; i < 2 * kSmall; ++i) {
      ASSERT_EQ(b.data()[i], 0xAB) << "byte " << i << " past buf_bytes written, field " << field;
    }
  }
  // The synchronous read of a generation does the same.
  auto view = Unwrap(s->OpenGeneration(kLatest));
  {
    Buf b(2 * kSmall);
    std::memset(b.data(), 0xAB, 2 * kSmall);
    ASSERT_OK(view->ReadChunk(ChunkRef{t.id, 0, 0}, b.data(), kSmall));
    std::vector<uint8_t> want = Expected(4000, 7);
    EXPECT_EQ(0, std::memcmp(b.data(), want.data(), 4000));
    for (uint64_t i = 4000; i < kSmall; ++i) ASSERT_EQ(b.data()[i], 0) << "view: tail byte " << i;
    for (uint64_t i = kSmall; i < 2 * kSmall; ++i) ASSERT_EQ(b.data()[i], 0xAB) << "view: byte " << i;
    EXPECT_EQ(view->ReadChunk(ChunkRef{big.id, 0, 0}, b.data(), kSmall).code(), StatusCode::kInvalidArgument);
  }
  Buf b(kSmall);
  Status st = io->SubmitRead(ChunkRef{big.id, 0, 0}, b.data(), 9, kSmall);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("big"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("does not fit"), std::string::npos) << st.ToString();
  EXPECT_EQ(io->in_flight(), 0u);
}

TEST(StoreTest, ViewOfOldGenerationSurvivesCommitsThenExtentsAreReused) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(s.get(), "w", 2 * kTestChunk / 4);
  Buf buf(kTestChunk);
  WriteAll(s.get(), t, 1, &buf);
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
  auto old = Unwrap(s->OpenGeneration(1));
  for (uint64_t g = 2; g <= 4; ++g) {
    WriteAll(s.get(), t, g, &buf);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{g, {}})), g);
    CheckAll([&](const ChunkRef& r, void* b) { return old->ReadChunk(r, b); }, t, 0, 1);
    CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, g);
  }
  // Generations 2 and 3 are gone (retained_generations = 1), 1 is held.
  EXPECT_TRUE(s->OpenGeneration(2).status().IsNotFound());
  auto gens = s->ListGenerations();
  ASSERT_EQ(gens.size(), 2u);
  EXPECT_EQ(gens[0].generation, 1u);
  EXPECT_EQ(gens[1].generation, 4u);
  auto held = Unwrap(s->Stats());
  EXPECT_EQ(held.leases, 1u);
  EXPECT_EQ(held.referenced_extent_bytes, 12 * kTestChunk);  // gen 1 + gen 4, 6 chunks each
  old.reset();
  ASSERT_OK(s->CollectGarbage());
  auto freed = Unwrap(s->Stats());
  EXPECT_EQ(freed.referenced_extent_bytes, 6 * kTestChunk);
  EXPECT_EQ(freed.generations_retained, 1u);
  // Next generation reuses the freed slots: the files do not grow.
  WriteAll(s.get(), t, 5, &buf);
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 5u);
  auto after = Unwrap(s->Stats());
  EXPECT_EQ(Sum(after.data_file_bytes), Sum(freed.data_file_bytes));
  CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, 5);
  auto rep = Unwrap(s->Verify());
  EXPECT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaked " + std::to_string(rep.leaked_slots) : rep.problems[0]);
}

TEST(StoreTest, SnapshotsPinGenerations) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(s.get(), "w", kTestChunk / 4 + 100);
  Buf buf(kTestChunk);
  WriteAll(s.get(), t, 1, &buf);
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{10, {GroupInfo{0, 10, {}}}})), 1u);
  auto snap = Unwrap(s->CreateSnapshot("step-10"));
  EXPECT_EQ(snap.generation, 1u);
  EXPECT_EQ(s->CreateSnapshot("step-10").status().code(), StatusCode::kAlreadyExists);
  for (const char* bad : {"", ".", "..", "a/b", "x y", "\xc3\xa9"}) {
    EXPECT_EQ(s->CreateSnapshot(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(s->CreateSnapshot(std::string(256, 'a')).status().code(), StatusCode::kInvalidArgument);
  for (uint64_t g = 2; g <= 3; ++g) {
    WriteAll(s.get(), t, g, &buf);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{g * 10, {}})), g);
  }
  {
    auto v = Unwrap(s->OpenSnapshot("step-10"));
    EXPECT_EQ(v->info().generation, 1u);
    EXPECT_EQ(v->info().step, 10u);
    CheckAll([&](const ChunkRef& r, void* b) { return v->ReadChunk(r, b); }, t, 0, 1);
  }
  s.reset();
  s = Unwrap(Store::Open(dir / "s", TestOptions()));
  ASSERT_EQ(s->ListSnapshots().size(), 1u);
  {
    auto v = Unwrap(s->OpenSnapshot("step-10"));
    CheckAll([&](const ChunkRef& r, void* b) { return v->ReadChunk(r, b); }, t, 0, 1);
  }
  auto before = Unwrap(s->Stats());
  EXPECT_EQ(before.snapshots, 1u);
  // 2 generations x 3 fields of a whole chunk and a 400-byte tail in a 4 KiB piece.
  EXPECT_EQ(before.referenced_extent_bytes, 2 * 3 * (kTestChunk + 4096));
  ASSERT_OK(s->ReleaseSnapshot("step-10"));
  EXPECT_TRUE(s->ReleaseSnapshot("step-10").IsNotFound());
  auto v = s->OpenSnapshot("step-10");
  EXPECT_TRUE(v.status().IsNotFound());
  auto after = Unwrap(s->Stats());
  EXPECT_EQ(after.referenced_extent_bytes, 3 * (kTestChunk + 4096));
  EXPECT_EQ(after.snapshots, 0u);
  auto rep = Unwrap(s->Verify());
  EXPECT_TRUE(rep.ok());
}

TEST(StoreTest, DiskUseStaysWithinTwiceLivePlusPreallocation) {
  TempDir dir;
  StoreOptions opts = TestOptions();
  auto s = Unwrap(Store::Create(dir / "s", opts));
  std::vector<TensorInfo> ts;
  for (int i = 0; i < 3; ++i) {
    TensorSpec spec;
    spec.name = "t" + std::to_string(i);
    spec.numel = (2 * i + 1) * kTestChunk / 4;  // 1, 3, 5 chunks per field
    ts.push_back(Unwrap(s->CreateTensor(spec)));
  }
  Buf buf(kTestChunk);
  const uint64_t live = 3 * 9 * kTestChunk;
  for (uint64_t g = 1; g <= 10; ++g) {
    for (const auto& t : ts) WriteAll(s.get(), t, g, &buf);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{g, {}})), g);
    auto st = Unwrap(s->Stats());
    EXPECT_EQ(st.live_bytes, live);
    const uint64_t disk = Sum(st.data_file_bytes);
    EXPECT_LE(disk, 2 * live + opts.preallocate_step_bytes) << "generation " << g << ": " << disk << " bytes";
    EXPECT_EQ(st.referenced_extent_bytes, live);
    EXPECT_EQ(Sum(st.data_free_bytes), disk - live);
    EXPECT_EQ(st.lifetime_bytes_written, g * live);
  }
  for (const auto& t : ts) CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, 10);
  auto rep = Unwrap(s->Verify());
  EXPECT_TRUE(rep.ok());
}

TEST(StoreTest, AbortPendingFreesExtentsAndKeepsCommittedData) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(s.get(), "w", 2 * kTestChunk / 4);
  Buf buf(kTestChunk);
  WriteAll(s.get(), t, 1, &buf);
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
  WriteAll(s.get(), t, 2, &buf);
  WriteAll(s.get(), t, 3, &buf);  // rewrite within one pending generation
  EXPECT_EQ(Unwrap(s->Stats()).pending_bytes, 6 * kTestChunk);
  CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, 3);
  ASSERT_OK(s->AbortPending());
  CheckAll([&](const ChunkRef& r, void* b) { return s->ReadChunk(r, b); }, t, 0, 1);
  auto rep = Unwrap(s->Verify());
  EXPECT_TRUE(rep.ok()) << rep.leaked_slots;
  EXPECT_EQ(Unwrap(s->Stats()).pending_bytes, 0u);
}

// A tensor that only the pending generation holds is gone after an abort, and
// after a writer closed without committing: the next commit never publishes it
// as a tensor of zeros.
TEST(StoreTest, TensorsOfAnUncommittedGenerationAreNeverPublished) {
  TempDir dir;
  TensorSpec kept, aborted, unclosed;
  kept.name = "kept";
  aborted.name = "aborted";
  unclosed.name = "unclosed";
  kept.numel = aborted.numel = unclosed.numel = kTestChunk / 4 + 3;
  Buf buf(kTestChunk);
  {
    auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
    auto t = Unwrap(s->CreateTensor(kept));
    WriteAll(s.get(), t, 1, &buf);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
    auto a = Unwrap(s->CreateTensor(aborted));
    WriteAll(s.get(), a, 2, &buf);
    ASSERT_OK(s->AbortPending());
    EXPECT_EQ(s->FindTensor("aborted").status().code(), StatusCode::kNotFound);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 2u);
    (void)Unwrap(s->CreateTensor(unclosed));  // the writer goes away before a commit
  }
  auto s = Unwrap(Store::Open(dir / "s", TestOptions()));
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 3u);
  std::vector<std::string> names;
  for (const auto& t : s->ListTensors()) names.push_back(t.name);
  EXPECT_EQ(names, std::vector<std::string>{"kept"});
  auto v = Unwrap(s->OpenGeneration(kLatest));
  names.clear();
  for (const auto& t : v->tensors()) names.push_back(t.name);
  EXPECT_EQ(names, std::vector<std::string>{"kept"});
  // The names are free again.
  EXPECT_TRUE(s->CreateTensor(aborted).ok());
  EXPECT_TRUE(s->CreateTensor(unclosed).ok());
  CheckAll([&](const ChunkRef& r, void* b) { return v->ReadChunk(r, b); }, Unwrap(v->FindTensor("kept")), 0, 1);
  EXPECT_TRUE(Unwrap(s->Verify()).ok());
}

TEST(StoreTest, CommitRefusesWhileWritesInFlight) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(s.get(), "w", 4 * kTestChunk / 4);
  auto io = Unwrap(s->NewChunkIo(ChunkIoOptions{}));
  std::vector<std::unique_ptr<Buf>> bufs;
  for (uint64_t c = 0; c < 4; ++c) {
    bufs.push_back(std::make_unique<Buf>(kTestChunk));
    FillPattern(bufs.back()->data(), kTestChunk, store_testing::ChunkSeed(1, t.id, 0, c));
    ASSERT_OK(io->SubmitWrite(ChunkRef{t.id, 0, c}, bufs.back()->data(), c));
  }
  if (io->in_flight() > 0) {
    EXPECT_EQ(s->Commit(CommitInfo{}).status().code(), StatusCode::kFailedPrecondition);
  }
  std::vector<ChunkCompletion> done;
  while (io->in_flight() > 0) ASSERT_OK(io->Reap(&done, 1));
  ASSERT_EQ(done.size(), 4u);
  for (const auto& d : done) ASSERT_OK(d.status);
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
  Buf b(kTestChunk);
  for (uint64_t c = 0; c < 4; ++c) {
    ASSERT_OK(s->ReadChunk(ChunkRef{t.id, 0, c}, b.data()));
    auto want = Expected(kTestChunk, store_testing::ChunkSeed(1, t.id, 0, c));
    EXPECT_EQ(0, std::memcmp(b.data(), want.data(), kTestChunk));
  }
  // The synchronous engine gives the same bytes.
  if (!SyncPoint::CompiledIn()) GTEST_SKIP() << "the synchronous engine part needs OPTSTATE_TEST_HOOKS";
  auto sio = Unwrap(NewChunkIoOn(s.get(), ChunkIoOptions{}, /*sync_engine=*/true));
  ASSERT_OK(sio->SubmitRead(ChunkRef{t.id, 0, 2}, b.data(), 99));
  done.clear();
  ASSERT_OK(sio->Reap(&done, 1));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].tag, 99u);
  ASSERT_OK(done[0].status);
  auto want = Expected(kTestChunk, store_testing::ChunkSeed(1, t.id, 0, 2));
  EXPECT_EQ(0, std::memcmp(b.data(), want.data(), kTestChunk));
}

TEST(StoreTest, CreateIntoAnEmptyDirectoryMakesItTheStore) {
  TempDir dir;
  std::filesystem::create_directories(dir / "e");
  std::string uuid;
  {
    auto s = Unwrap(Store::Create(dir / "e", TestOptions()));
    uuid = s->identity().uuid;
  }
  {
    auto s = Unwrap(Store::Open(dir / "e", TestOptions()));
    EXPECT_EQ(s->identity().uuid, uuid);
  }
  // Not empty (a store, or anything else): refused, and nothing in it is touched.
  EXPECT_EQ(Store::Create(dir / "e", TestOptions()).status().code(), StatusCode::kAlreadyExists);
  std::filesystem::create_directories(dir / "full");
  { std::ofstream(dir / "full/keep") << "x"; }
  EXPECT_EQ(Store::Create(dir / "full", TestOptions()).status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(std::filesystem::exists(dir / "full/keep"));
  // A creation that fails leaves the empty directory as it was.
  std::filesystem::create_directories(dir / "e2");
  { std::ofstream(dir / "afile") << "x"; }
  StoreOptions bad = TestOptions();
  bad.data_dirs = {dir / "afile/data"};
  EXPECT_FALSE(Store::Create(dir / "e2", bad).ok());
  EXPECT_TRUE(std::filesystem::is_directory(dir / "e2"));
  EXPECT_TRUE(std::filesystem::is_empty(dir / "e2"));
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename().string().find(".creating-"), std::string::npos) << entry.path();
  }
}

TEST(StoreTest, OpenOfMissingOrDamagedStoreFailsWithPathAndReason) {
  TempDir dir;
  auto missing = Store::Open(dir / "nope", TestOptions());
  EXPECT_TRUE(missing.status().IsNotFound());
  EXPECT_NE(missing.status().message().find(dir / "nope"), std::string::npos) << missing.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(dir / "nope")) << "Open must never create";

  std::filesystem::create_directories(dir / "empty");
  auto empty = Store::Open(dir / "empty", TestOptions());
  EXPECT_TRUE(empty.status().IsCorruption()) << empty.status().ToString();
  EXPECT_NE(empty.status().message().find("IDENTITY"), std::string::npos);

  { auto s = Unwrap(Store::Create(dir / "s", TestOptions())); }
  EXPECT_EQ(Store::Create(dir / "s", TestOptions()).status().code(), StatusCode::kAlreadyExists);
  const std::string ident = dir / "s/IDENTITY";
  std::string good;
  {
    std::ifstream in(ident);
    good.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto write_identity = [&](const std::string& text) {
    std::ofstream out(ident, std::ios::trunc);
    out << text;
  };
  write_identity("{not json");
  auto bad = Store::Open(dir / "s", TestOptions());
  EXPECT_TRUE(bad.status().IsCorruption()) << bad.status().ToString();
  std::string v2 = good;
  v2.replace(v2.find("\"format_version\": 2"), 19, "\"format_version\": 3");
  write_identity(v2);
  bad = Store::Open(dir / "s", TestOptions());
  EXPECT_TRUE(bad.status().IsCorruption());
  EXPECT_NE(bad.status().message().find("format version 3"), std::string::npos) << bad.status().ToString();
  write_identity(good);
  { auto s = Unwrap(Store::Open(dir / "s", TestOptions())); }
  // A damaged index: CURRENT names a manifest that does not exist.
  {
    std::ofstream out(dir / "s/index/CURRENT", std::ios::trunc);
    out << "MANIFEST-999999\n";
  }
  bad = Store::Open(dir / "s", TestOptions());
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(dir / "s"), std::string::npos) << bad.status().ToString();
  std::filesystem::remove_all(dir / "s/index");
  bad = Store::Open(dir / "s", TestOptions());
  EXPECT_TRUE(bad.status().IsCorruption());
  EXPECT_NE(bad.status().message().find("index"), std::string::npos) << bad.status().ToString();
}

TEST(StoreTest, SecondOpenInProcessIsBusyNamingPid) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto again = Store::Open(dir / "s", TestOptions());
  EXPECT_EQ(again.status().code(), StatusCode::kBusy);
  EXPECT_NE(again.status().message().find("in use by pid " + std::to_string(getpid())), std::string::npos)
      << again.status().ToString();
  // Readers never take LOCK.
  auto ro = Unwrap(Store::OpenReadOnly(dir / "s", TestOptions()));
  EXPECT_TRUE(ro->read_only());
  EXPECT_EQ(ro->Commit(CommitInfo{}).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ro->CreateSnapshot("x").status().code(), StatusCode::kFailedPrecondition);
  s.reset();
  auto reopened = Store::Open(dir / "s", TestOptions());
  EXPECT_TRUE(reopened.ok()) << reopened.status().ToString();
}

TEST(StoreTest, ReadOnlyReaderLeaseSurvivesWriterCommits) {
  TempDir dir;
  auto w = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(w.get(), "w", 2 * kTestChunk / 4 + 3);
  Buf buf(kTestChunk);
  WriteAll(w.get(), t, 1, &buf);
  ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), 1u);
  auto ro = Unwrap(Store::OpenReadOnly(dir / "s", TestOptions()));
  EXPECT_EQ(ro->LatestGeneration().generation, 1u);
  auto view = Unwrap(ro->OpenGeneration(kLatest));
  EXPECT_EQ(view->info().generation, 1u);
  EXPECT_EQ(Unwrap(w->Stats()).leases, 1u);
  for (uint64_t g = 2; g <= 4; ++g) {
    WriteAll(w.get(), t, g, &buf);
    ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), g);
    CheckAll([&](const ChunkRef& r, void* b) { return view->ReadChunk(r, b); }, t, 0, 1);
  }
  ASSERT_OK(ro->CatchUp());
  EXPECT_EQ(ro->LatestGeneration().generation, 4u);
  CheckAll([&](const ChunkRef& r, void* b) { return ro->ReadChunk(r, b); }, t, 0, 4);
  auto view4 = Unwrap(ro->OpenGeneration(kLatest));
  EXPECT_EQ(view4->info().generation, 4u);
  CheckAll([&](const ChunkRef& r, void* b) { return view4->ReadChunk(r, b); }, t, 0, 4);
  view.reset();
  ASSERT_OK(w->CollectGarbage());
  // Per field: 2 whole chunks and a 12-byte tail in a 4 KiB piece.
  EXPECT_EQ(Unwrap(w->Stats()).referenced_extent_bytes, 3 * (2 * kTestChunk + 4096));
  auto rep = Unwrap(ro->Verify());
  EXPECT_TRUE(rep.problems.empty()) << rep.problems[0];
}

// RETAINED as the file format in vfs/internal/store_core.h documents it, decoded here on
// its own: "OSRETAIN", count, generations (little-endian u64), XXH3.
std::vector<uint64_t> ReadRetainedFile(const std::filesystem::path& store) {
  std::ifstream in(store / "RETAINED", std::ios::binary);
  std::string rec((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_GE(rec.size(), 24u);
  EXPECT_EQ(rec.substr(0, 8), "OSRETAIN");
  uint64_t n = 0, sum = 0;
  std::memcpy(&n, rec.data() + 8, 8);
  EXPECT_LE(24 + 8 * n, rec.size());
  std::memcpy(&sum, rec.data() + 16 + 8 * n, 8);
  EXPECT_EQ(sum, XXH3_64bits(rec.data(), 16 + 8 * n));
  std::vector<uint64_t> gens(n);
  std::memcpy(gens.data(), rec.data() + 16, 8 * n);
  return gens;
}

// A reader's catch-up that brings nothing keeps its maps (vfs/internal/store_core.h
// CatchUpChecked: the secondary's sequence number did not move); one that
// follows a write that is not a commit (a snapshot made or released) must
// still show it, and a writer's reopen (a flush of its WAL, no new write)
// must leave the same state readable.
TEST(StoreTest, ReaderCatchUpFollowsWritesThatAreNotCommits) {
  TempDir dir;
  auto w = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(w.get(), "w", kTestChunk / 4 + 5);
  Buf buf(kTestChunk);
  WriteAll(w.get(), t, 1, &buf);
  ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), 1u);
  auto ro = Unwrap(Store::OpenReadOnly(dir / "s", TestOptions()));
  auto names = [&] {
    std::vector<std::string> n;
    for (const SnapshotInfo& i : ro->ListSnapshots()) n.push_back(i.name);
    return n;
  };
  for (int i = 0; i < 3; ++i) {  // nothing new: the same state each time
    ASSERT_OK(ro->CatchUp());
    EXPECT_EQ(ro->LatestGeneration().generation, 1u);
    EXPECT_TRUE(names().empty());
  }
  ASSERT_OK(w->CreateSnapshot("a").status());
  ASSERT_OK(ro->CatchUp());
  EXPECT_EQ(names(), std::vector<std::string>{"a"}) << "a snapshot made without a commit was missed";
  ASSERT_OK(w->CreateSnapshot("b").status());
  ASSERT_OK(w->ReleaseSnapshot("a"));
  ASSERT_OK(ro->CatchUp());
  EXPECT_EQ(names(), std::vector<std::string>{"b"});
  w.reset();
  { auto w2 = Unwrap(Store::Open(dir / "s", TestOptions())); }  // recovery flush, no write
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK(ro->CatchUp());
    EXPECT_EQ(ro->LatestGeneration().generation, 1u);
    EXPECT_EQ(names(), std::vector<std::string>{"b"});
    auto v = Unwrap(ro->OpenSnapshot("b"));
    CheckAll([&](const ChunkRef& r, void* b) { return v->ReadChunk(r, b); }, t, 0, 1);
  }
  w = Unwrap(Store::Open(dir / "s", TestOptions()));
  WriteAll(w.get(), t, 2, &buf);
  ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), 2u);
  ASSERT_OK(ro->CatchUp());
  EXPECT_EQ(ro->LatestGeneration().generation, 2u);
  CheckAll([&](const ChunkRef& r, void* b) { return ro->ReadChunk(r, b); }, t, 0, 2);
}

// A RocksDB secondary instance can show an older state after the writer
// reopens (its recovery flush + a compaction leave entries replayed from the
// old WAL shadowing newer ones). The reader must notice (COMMITTED, the
// generation's index digest) and never serve the older state.
TEST(StoreTest, ReaderNeverSeesAnOlderStateAfterTheWriterReopens) {
  TempDir dir;
  TensorSpec spec;
  spec.name = "w";
  spec.numel = kTestChunk / 4 + 5;
  TensorInfo t;
  Buf buf(kTestChunk);
  {
    auto w = Unwrap(Store::Create(dir / "s", TestOptions()));
    t = Unwrap(w->CreateTensor(spec));
    WriteAll(w.get(), t, 1, &buf);
    ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), 1u);
  }
  auto ro = Unwrap(Store::OpenReadOnly(dir / "s", TestOptions()));
  uint64_t latest = 1;
  for (int round = 0; round < 24; ++round) {
    {
      auto w = Unwrap(Store::Open(dir / "s", TestOptions()));
      // The reader replays generation `latest` from this writer's WAL, then
      // the writer commits one more into the same WAL and closes.
      WriteAll(w.get(), t, latest + 1, &buf);
      ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), ++latest);
      ASSERT_OK(ro->CatchUp());
      ASSERT_EQ(ro->LatestGeneration().generation, latest);
      WriteAll(w.get(), t, latest + 1, &buf);
      ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), ++latest);
    }
    // Reopen: the writer's recovery flushes that WAL into a table file.
    { auto w = Unwrap(Store::Open(dir / "s", TestOptions())); }
    ASSERT_OK(ro->CatchUp());
    ASSERT_EQ(ro->LatestGeneration().generation, latest) << "round " << round;
    auto v = Unwrap(ro->OpenGeneration(kLatest));
    ASSERT_EQ(v->info().generation, latest) << "round " << round;
    CheckAll([&](const ChunkRef& r, void* b) { return v->ReadChunk(r, b); }, t, 0, latest);
  }
  // RETAINED lists exactly the generations the writer can still open.
  auto w = Unwrap(Store::Open(dir / "s", TestOptions()));
  ASSERT_OK(w->CreateSnapshot("keep").status());
  WriteAll(w.get(), t, latest + 1, &buf);
  ASSERT_EQ(Unwrap(w->Commit(CommitInfo{})), ++latest);
  std::vector<uint64_t> openable;
  for (uint64_t g = 1; g <= latest; ++g) {
    if (w->OpenGeneration(g).ok()) openable.push_back(g);
  }
  EXPECT_EQ(openable, (std::vector<uint64_t>{latest - 1, latest}));
  EXPECT_EQ(ReadRetainedFile(dir / "s"), openable);
  ASSERT_OK(w->ReleaseSnapshot("keep"));
  ASSERT_OK(w->CollectGarbage());
  EXPECT_EQ(ReadRetainedFile(dir / "s"), std::vector<uint64_t>{latest});
}

// Flips bits `mask` of byte `at` of a chunk's extent in its data file (a
// disk's silent corruption, under the store).
void FlipByteOnDisk(const Store& s, const ChunkInfo& info, uint64_t at, uint8_t mask) {
  const std::string file = s.identity().data_dirs[info.data_dir] + "/" + s.identity().uuid + ".chunks";
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << file;
  uint8_t b;
  ASSERT_EQ(::pread(fd, &b, 1, info.file_offset + at), 1);
  b ^= mask;
  ASSERT_EQ(::pwrite(fd, &b, 1, info.file_offset + at), 1);
  ::fsync(fd);
  ::close(fd);
}

TEST(StoreTest, FlippedByteIsCorruptionNamingTheChunk) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  auto t = NewTensor(s.get(), "layers.3.mlp", 3 * kTestChunk / 4);
  Buf buf(kTestChunk);
  WriteAll(s.get(), t, 1, &buf);
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
  ChunkInfo info;
  {
    auto v = Unwrap(s->OpenGeneration(1));
    info = Unwrap(v->Chunk(ChunkRef{t.id, 1, 2}));
  }
  ASSERT_FALSE(info.zero);
  EXPECT_EQ(info.written_generation, 1u);
  ASSERT_NO_FATAL_FAILURE(FlipByteOnDisk(*s, info, 12345, 0x10));
  Status r = s->ReadChunk(ChunkRef{t.id, 1, 2}, buf.data());
  EXPECT_TRUE(r.IsCorruption()) << r.ToString();
  for (const char* part : {"layers.3.mlp", "exp_avg", "chunk 2", "generation 1"}) {
    EXPECT_NE(r.message().find(part), std::string::npos) << part << " missing from: " << r.message();
  }
  EXPECT_NE(r.message().find(s->path()), std::string::npos);
  ASSERT_OK(s->ReadChunk(ChunkRef{t.id, 1, 1}, buf.data()));  // neighbours fine
  auto rep = Unwrap(s->Verify());
  ASSERT_EQ(rep.problems.size(), 1u);
  EXPECT_NE(rep.problems[0].find("chunk 2"), std::string::npos) << rep.problems[0];
  EXPECT_NE(rep.problems[0].find("exp_avg"), std::string::npos) << rep.problems[0];
  // The async path reports it too.
  auto io = Unwrap(s->NewChunkIo(ChunkIoOptions{}));
  ASSERT_OK(io->SubmitRead(ChunkRef{t.id, 1, 2}, buf.data(), 5));
  std::vector<ChunkCompletion> done;
  ASSERT_OK(io->Reap(&done, 1));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].status.IsCorruption()) << done[0].status.ToString();
  // With verify_reads = false Reap leaves the check to VerifyChunkRead, which
  // must report the same chunk the same way; the good neighbour passes it.
  ChunkIoOptions deferred;
  deferred.verify_reads = false;
  auto dio = Unwrap(s->NewChunkIo(deferred));
  Buf good(kTestChunk);
  ASSERT_OK(dio->SubmitRead(ChunkRef{t.id, 1, 2}, buf.data(), 6));
  ASSERT_OK(dio->SubmitRead(ChunkRef{t.id, 1, 1}, good.data(), 7));
  done.clear();
  ASSERT_OK(dio->Reap(&done, 2));
  ASSERT_EQ(done.size(), 2u);
  for (const ChunkCompletion& c : done) {
    ASSERT_OK(c.status);  // the bytes arrived; nothing checked them yet
    EXPECT_TRUE(c.needs_verify);
    Status v = VerifyChunkRead(c, c.tag == 6 ? buf.data() : good.data());
    if (c.tag == 7) {
      EXPECT_TRUE(v.ok()) << v.ToString();
      continue;
    }
    EXPECT_TRUE(v.IsCorruption()) << v.ToString();
    for (const char* part : {"layers.3.mlp", "exp_avg", "chunk 2", "generation 1", "checksum mismatch"}) {
      EXPECT_NE(v.message().find(part), std::string::npos) << part << " missing from: " << v.message();
    }
  }
}

// ChunkIoOptions::hash_threads: big chunks are hashed off the caller's thread
// (a write while it is in flight, a read once it landed), small ones on it.
// What a bug breaks: a checksum of the wrong bytes fails Verify; a read handed
// out before its check lets a flipped byte through; a lost wake hangs Reap.
TEST(StoreTest, HashThreadsChecksumWritesAndVerifyReadsOffTheCallersThread) {
  for (const bool sync_engine : {false, true}) {
    SCOPED_TRACE(sync_engine ? "sync engine" : "io_uring");
    if (sync_engine && !SyncPoint::CompiledIn()) GTEST_SKIP() << "the sync engine part needs OPTSTATE_TEST_HOOKS";
    TempDir dir;
    auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
    const uint64_t q = kTestChunk / 4;
    std::vector<TensorInfo> tensors;
    for (const auto& [name, numel] : std::vector<std::pair<std::string, uint64_t>>{
             {"big", 5 * q + 777}, {"norm", 1000}, {"quarter", q / 4 + 1}}) {
      TensorSpec spec;
      spec.name = name;
      spec.numel = numel;
      tensors.push_back(Unwrap(s->CreateTensor(spec)));
    }
    ChunkIoOptions o;
    o.hash_threads = 3;
    std::vector<ChunkRef> refs;
    for (const TensorInfo& t : tensors) {
      for (uint32_t f = 0; f < 3; ++f) {
        for (uint64_t c = 0; c < s->ChunkCount(t, f); ++c) refs.push_back(ChunkRef{t.id, f, c});
      }
    }
    std::vector<std::unique_ptr<Buf>> bufs;
    {
      auto io = Unwrap(NewChunkIoOn(s.get(), o, sync_engine));
      for (size_t i = 0; i < refs.size(); ++i) {
        bufs.push_back(std::make_unique<Buf>(kTestChunk));
        FillPattern(bufs.back()->data(), kTestChunk,
                    store_testing::ChunkSeed(1, refs[i].tensor_id, refs[i].field, refs[i].index));
        ASSERT_OK(io->SubmitWrite(refs[i], bufs.back()->data(), i));
      }
      std::vector<ChunkCompletion> done;
      ASSERT_OK(io->Reap(&done, refs.size()));  // all of them in one call
      ASSERT_EQ(done.size(), refs.size());
      std::set<uint64_t> tags;
      for (const ChunkCompletion& c : done) {
        ASSERT_OK(c.status);
        tags.insert(c.tag);
      }
      EXPECT_EQ(tags.size(), refs.size());
      EXPECT_EQ(io->in_flight(), 0u);
    }
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
    auto rep = Unwrap(s->Verify());
    ASSERT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaked slots" : rep.problems[0]);
    EXPECT_EQ(rep.chunks_checked, refs.size());
    // Read back with verification on the hashers.
    {
      auto io = Unwrap(NewChunkIoOn(s.get(), o, sync_engine));
      for (size_t i = 0; i < refs.size(); ++i) {
        std::memset(bufs[i]->data(), 0xAB, kTestChunk);
        ASSERT_OK(io->SubmitRead(refs[i], bufs[i]->data(), i));
      }
      std::vector<ChunkCompletion> done;
      while (done.size() < refs.size()) ASSERT_OK(io->Reap(&done, 1));
      EXPECT_EQ(io->in_flight(), 0u);
      for (const ChunkCompletion& c : done) {
        ASSERT_OK(c.status);
        const ChunkRef& r = refs[c.tag];
        const TensorInfo& t = *std::find_if(tensors.begin(), tensors.end(),
                                            [&](const TensorInfo& x) { return x.id == r.tensor_id; });
        const uint64_t len = std::min(kTestChunk, t.field_bytes(r.field) - r.index * kTestChunk);
        auto want = Expected(len, store_testing::ChunkSeed(1, r.tensor_id, r.field, r.index));
        EXPECT_EQ(0, std::memcmp(bufs[c.tag]->data(), want.data(), len)) << t.name << " chunk " << r.index;
      }
    }
    // A flipped byte in big's exp_avg_sq chunk 3 fails that read alone, named.
    auto v = Unwrap(s->OpenGeneration(1));
    const ChunkInfo info = Unwrap(v->Chunk(ChunkRef{tensors[0].id, 2, 3}));
    ASSERT_NO_FATAL_FAILURE(FlipByteOnDisk(*s, info, 777, 0x01));
    auto io = Unwrap(NewChunkIoOn(v.get(), o, sync_engine));
    ASSERT_OK(io->SubmitRead(ChunkRef{tensors[0].id, 2, 3}, bufs[0]->data(), 1));
    ASSERT_OK(io->SubmitRead(ChunkRef{tensors[0].id, 2, 2}, bufs[1]->data(), 2));
    std::vector<ChunkCompletion> done;
    ASSERT_OK(io->Reap(&done, 2));
    ASSERT_EQ(done.size(), 2u);
    for (const ChunkCompletion& c : done) {
      if (c.tag == 2) {
        EXPECT_TRUE(c.status.ok()) << c.status.ToString();
        continue;
      }
      EXPECT_TRUE(c.status.IsCorruption()) << c.status.ToString();
      for (const char* part : {"big", "exp_avg_sq", "chunk 3", "generation 1", "checksum mismatch"}) {
        EXPECT_NE(c.status.message().find(part), std::string::npos) << part << " missing from: " << c.status.message();
      }
    }
  }
}

TEST(StoreTest, TensorLookupAndValidation) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  for (const char* n : {"layer.0.weight", "layer.1.weight", "layer.10.bias", "embed"}) {
    TensorSpec spec;
    spec.name = n;
    spec.numel = 10;
    ASSERT_TRUE(s->CreateTensor(spec).ok());
  }
  auto miss = s->FindTensor("layer.0.weigth");
  ASSERT_TRUE(miss.status().IsNotFound());
  EXPECT_NE(miss.status().message().find("'layer.0.weight'"), std::string::npos) << miss.status().ToString();
  TensorSpec dup;
  dup.name = "embed";
  EXPECT_EQ(s->CreateTensor(dup).status().code(), StatusCode::kAlreadyExists);
  TensorSpec bad;
  bad.name = std::string("a\0b", 3);
  EXPECT_EQ(s->CreateTensor(bad).status().code(), StatusCode::kInvalidArgument);
  bad.name = std::string(4097, 'x');
  EXPECT_EQ(s->CreateTensor(bad).status().code(), StatusCode::kInvalidArgument);
  bad.name = "\xff\xfe";
  EXPECT_EQ(s->CreateTensor(bad).status().code(), StatusCode::kInvalidArgument);
  bad.name = "shape";
  bad.numel = 10;
  bad.shape = {3, 3};
  EXPECT_EQ(s->CreateTensor(bad).status().code(), StatusCode::kInvalidArgument);
  TensorSpec ok;
  ok.name = std::string(4096, 'y');
  ok.numel = 12;
  ok.shape = {3, 4};
  ok.global_shape = {6, 4};
  ok.shard_offset = {3, 0};
  ok.fields = {{"main", DType::kF32}, {"m", DType::kBF16}};
  auto t = Unwrap(s->CreateTensor(ok));
  EXPECT_EQ(t.field_bytes(1), 24u);
  EXPECT_EQ(Unwrap(s->FieldIndex(t, "m")), 1u);
  EXPECT_TRUE(s->FieldIndex(t, "exp_avg").status().IsNotFound());
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{})), 1u);
  s.reset();
  s = Unwrap(Store::Open(dir / "s", TestOptions()));
  auto back = Unwrap(s->FindTensor(ok.name));
  EXPECT_EQ(back.global_shape, ok.global_shape);
  EXPECT_EQ(back.shard_offset, ok.shard_offset);
  EXPECT_EQ(back.fields[1].dtype, DType::kBF16);
  EXPECT_EQ(s->ListTensors().size(), 5u);
}

// A shard's geometry is checked when the tensor is created, whoever creates
// it: a box outside its global shape, or a flat range past its elements, is
// refused naming the tensor and the dimension, and nothing is created.
TEST(StoreTest, ShardOutsideItsGlobalShapeIsRefused) {
  TempDir dir;
  auto s = Unwrap(Store::Create(dir / "s", TestOptions()));
  TensorSpec box;
  box.name = "w";
  box.numel = 6;
  box.shape = {2, 3};
  box.global_shape = {4, 3};
  box.shard_offset = {3, 0};  // rows [3, 5) of 4
  Status st = s->CreateTensor(box).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("tensor 'w'"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("outside the tensor in dimension 0"), std::string::npos) << st.ToString();
  TensorSpec flat = box;
  flat.shape = {6};
  flat.shard_offset = {7};  // [7, 13) of 12 elements
  st = s->CreateTensor(flat).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("past the tensor's 12 elements"), std::string::npos) << st.ToString();
  EXPECT_TRUE(s->ListTensors().empty());
  box.shard_offset = {2, 0};  // rows [2, 4): inside
  EXPECT_TRUE(s->CreateTensor(box).ok());
}

TEST(StoreTest, RetainedGenerationsAreReadable) {
  TempDir dir;
  StoreOptions opts = TestOptions();
  opts.retained_generations = 3;
  auto s = Unwrap(Store::Create(dir / "s", opts));
  auto t = NewTensor(s.get(), "w", kTestChunk / 2);
  Buf buf(kTestChunk);
  for (uint64_t g = 1; g <= 5; ++g) {
    WriteAll(s.get(), t, g, &buf);
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{g, {}})), g);
  }
  auto gens = s->ListGenerations();
  ASSERT_EQ(gens.size(), 3u);
  EXPECT_EQ(gens.front().generation, 3u);
  for (uint64_t g = 3; g <= 5; ++g) {
    auto v = Unwrap(s->OpenGeneration(g));
    EXPECT_EQ(v->info().step, g);
    CheckAll([&](const ChunkRef& r, void* b) { return v->ReadChunk(r, b); }, t, 0, g);
  }
  EXPECT_TRUE(s->OpenGeneration(2).status().IsNotFound());
  EXPECT_EQ(Unwrap(s->Stats()).referenced_extent_bytes, 3 * 6 * kTestChunk);  // 3 gens x 6 chunks
}

}  // namespace
}  // namespace optstate::vfs
