// A store costs disk in proportion to its state: a store of a small model
// holds, in allocated blocks of every file under its directory (what `du`
// counts: data file, index, marks), a small multiple of its state's bytes,
// not whole chunk slots or a preallocation step. (While open, RocksDB also
// holds its log's preallocation, the index's reserve for a full disk.)
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/vfs/store_test_util.h"
#include "vfs/store.h"

namespace optstate::vfs {
namespace {

using store_testing::Buf;
using store_testing::FillPattern;
using store_testing::TempDir;
using store_testing::Unwrap;

// Allocated bytes (st_blocks x 512) of every file under `dir`.
uint64_t AllocatedBytes(const std::string& dir) {
  uint64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    struct stat st;
    if (::lstat(e.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

TEST(StoreDiskTest, ASmallModelsStoreTakesDiskInProportionToItsState) {
  TempDir dir;
  StoreOptions o;  // the defaults: 8 MiB chunks, 1 GiB preallocation step
  auto s = Unwrap(Store::Create(dir / "s", o));
  // A 10k-param model: a 100 x 64 weight, its bias, a 3000-element embedding, a 536-element norm.
  const uint64_t sizes[] = {6400, 64, 3000, 536};
  std::vector<TensorInfo> ts;
  uint64_t state_bytes = 0;
  for (uint64_t i = 0; i < 4; ++i) {
    TensorSpec spec;
    spec.name = "p" + std::to_string(i);
    spec.numel = sizes[i];
    ts.push_back(Unwrap(s->CreateTensor(spec)));
    state_bytes += 12 * sizes[i];
  }
  ASSERT_EQ(state_bytes, 120000u);
  Buf buf(o.chunk_size_bytes);
  for (uint64_t g = 1; g <= 5; ++g) {
    for (const auto& t : ts) {
      for (uint32_t f = 0; f < 3; ++f) {
        FillPattern(buf.data(), 64 * 1024, g * 100 + t.id * 3 + f);
        ASSERT_OK(s->WriteChunk(ChunkRef{t.id, f, 0}, buf.data()));
      }
    }
    ASSERT_EQ(Unwrap(s->Commit(CommitInfo{g, {GroupInfo{0, g, {}}}})), g);
  }
  ASSERT_OK(s->CreateSnapshot("keep").status());
  // While open, the index holds RocksDB's preallocation of its log and
  // manifest (what lets a commit's index write succeed on a full disk),
  // released at close: counted apart.
  const uint64_t open_data = AllocatedBytes(dir / "s/data");
  const uint64_t open_index = AllocatedBytes(dir / "s/index");
  s.reset();
  const uint64_t closed_bytes = AllocatedBytes(dir / "s");
  // Two generations of the state in power-of-two pieces (<= 2x each, so 4x
  // the state), plus the index (closed: its log, manifest and options
  // files, a few KiB each) and the marks: within 8 x the state, where one
  // chunk slot alone is 70 x it.
  std::cout << "state " << state_bytes << " B; store on disk " << closed_bytes << " B closed; open: data "
            << open_data << " B, index " << open_index << " B\n";
  EXPECT_LE(closed_bytes, 8 * state_bytes);
  EXPECT_LE(open_data, 8 * state_bytes);
  EXPECT_LE(open_index, 24 * kMiB);
  // Reopened and stepped again: freed pieces are reused, nothing grows.
  s = Unwrap(Store::Open(dir / "s", o));
  for (const auto& t : ts) {
    for (uint32_t f = 0; f < 3; ++f) ASSERT_OK(s->WriteChunk(ChunkRef{t.id, f, 0}, buf.data()));
  }
  ASSERT_EQ(Unwrap(s->Commit(CommitInfo{6, {GroupInfo{0, 6, {}}}})), 6u);
  EXPECT_LE(AllocatedBytes(dir / "s/data"), 8 * state_bytes);
  auto rep = Unwrap(s->Verify());
  EXPECT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaked" : rep.problems[0]);
}

}  // namespace
}  // namespace optstate::vfs
