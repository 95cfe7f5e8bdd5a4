// Simulated power loss through FaultInjectionFileSystem (vfs/fault_injection.h):
// a store (data files AND RocksDB's index files, which the store's hooked
// rocksdb::FileSystem reports to the same hooks) commits generations of the
// deterministic workload; then the "machine loses power": the file system
// turns inactive, the Store is dropped, and every byte written since its
// file's last fsync is zeroed (all of them, or a seeded random half of the
// 4 KiB blocks), and every file created since its directory's last sync is
// removed. Reopened on the real file system, the store must hold every
// acknowledged generation (Commit returned OK) bit for bit, Verify clean, no
// leaked extent after GC.
//
// Two shapes: (1) crash after acknowledged commits (with a partly written
// pending generation), several rounds on the same store, for several seeds
// and both drop modes; (2) crash at EVERY operation of a 3-generation workload
// (the fault wrapper fails operation N and everything after it, i.e. power is
// lost just before operation N reaches the disk), where the generation whose
// Commit was in flight may or may not survive, but nothing acknowledged is lost.
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <gtest/gtest.h>

#include "tests/reliability/reliability_util.h"
#include "vfs/fault_injection.h"

namespace optstate::reliability {
namespace {

using vfs::DropMode;
using vfs::FaultInjectionFileSystem;
using vfs::FaultRule;
using vfs::FileSystem;
using vfs::Store;
using vfs::StoreOptions;
using wl::TempDir;
using wl::WorkloadOptions;

const char* ModeName(DropMode m) { return m == DropMode::kAll ? "all" : "random-subset"; }

TEST(PowerLossTest, AcknowledgedGenerationsSurviveDropOfUnsyncedData) {
  uint64_t bytes = 0, crashes = 0, dropped_bytes = 0, dropped_files = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    for (DropMode mode : {DropMode::kAll, DropMode::kRandomSubset}) {
      TempDir dir;
      const std::string path = dir / "store";
      std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(mode));
      uint64_t acked = 0;
      for (int round = 0; round < 3; ++round) {
        const std::string what = "seed " + std::to_string(seed) + " mode " + ModeName(mode) + " round " +
                                  std::to_string(round);
        FaultInjectionFileSystem fs(FileSystem::Default());
        StoreOptions opts = WorkloadOptions();
        opts.fs = &fs;
        {
          auto s = round == 0 ? Store::Create(path, opts) : Store::Open(path, opts);
          ASSERT_TRUE(s.ok()) << what << ": " << s.status().ToString();
          const uint64_t gens = 1 + rng() % 4;
          for (uint64_t i = 0; i < gens; ++i) {
            const uint64_t g = acked + 1;
            auto c = CommitWorkloadGeneration(s->get(), g);
            ASSERT_TRUE(c.ok()) << what << ": " << c.status().ToString();
            ASSERT_EQ(*c, g);
            acked = g;
            if (rng() % 3 == 0) {
              auto snap = (*s)->CreateSnapshot("p" + std::to_string(g));
              ASSERT_TRUE(snap.ok()) << snap.status().ToString();
            }
            if (rng() % 4 == 0) REL_ASSERT_OK((*s)->CollectGarbage());
          }
          // A partly written next generation that is never committed.
          std::vector<vfs::TensorInfo> tensors;
          REL_ASSERT_OK(EnsureWorkloadTensors(s->get(), &tensors));
          REL_ASSERT_OK(WriteWorkloadGeneration(s->get(), tensors, acked + 1, rng() % 6));
          // Power loss: nothing reaches the disk any more, then the process dies.
          fs.SetFilesystemActive(false);
        }
        dropped_bytes += fs.UnsyncedBytes();
        dropped_files += fs.UnsyncedCreations().size();
        REL_ASSERT_OK(fs.DropUnsyncedData(mode, seed * 1000 + round));
        ++crashes;
        const uint64_t g = CheckReopenedStore(path, acked, acked, &bytes, what);
        if (HasFailure()) return;
        ASSERT_EQ(g, acked);
      }
    }
  }
  std::printf("power loss: %llu crashes, %llu unsynced bytes dropped, %llu unsynced creations removed, "
              "%llu bytes compared\n",
              static_cast<unsigned long long>(crashes), static_cast<unsigned long long>(dropped_bytes),
              static_cast<unsigned long long>(dropped_files), static_cast<unsigned long long>(bytes));
}

// Power lost just before operation N, for every N of the workload.
TEST(PowerLossTest, PowerLostBeforeEveryOperation) {
  TempDir dir;
  const std::string path = dir / "store";
  const std::string golden = dir / "golden";
  {
    auto s = Store::Create(path, WorkloadOptions());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto c = CommitWorkloadGeneration(s->get(), 1);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
  }
  std::filesystem::copy(path, golden, std::filesystem::copy_options::recursive);
  auto reset = [&] {
    std::filesystem::remove_all(path);
    std::filesystem::copy(golden, path, std::filesystem::copy_options::recursive);
  };
  // Generations 2..3, a snapshot and a GC; returns the last acknowledged one.
  auto workload = [&](FaultInjectionFileSystem* fs, uint64_t* acked) {
    StoreOptions opts = WorkloadOptions();
    opts.fs = fs;
    auto s = Store::Open(path, opts);
    if (!s.ok()) return;
    for (uint64_t g = 2; g <= 3; ++g) {
      auto c = CommitWorkloadGeneration(s->get(), g);
      if (!c.ok()) break;
      *acked = g;
      if (g == 2 && !(*s)->CreateSnapshot("two").ok()) break;
      if (g == 3 && !(*s)->ReleaseSnapshot("two").ok()) break;
    }
    fs->SetFilesystemActive(false);  // the crash: the process's last state never reaches disk
  };
  uint64_t total = 0;
  {
    reset();
    FaultInjectionFileSystem fs(FileSystem::Default());
    uint64_t acked = 1;
    workload(&fs, &acked);
    ASSERT_EQ(acked, 3u);
    total = fs.TotalOpCount();
  }
  ASSERT_GT(total, 20u);
  uint64_t bytes = 0;
  std::map<uint64_t, uint64_t> survived;  // (latest - acked) -> count
  uint64_t artifacts = 0;
  for (uint64_t n = 1; n <= total; ++n) {
    reset();
    const DropMode mode = n % 2 ? DropMode::kAll : DropMode::kRandomSubset;
    FaultInjectionFileSystem fs(FileSystem::Default());
    fs.AddRule(FaultRule::FailNthAny(n, /*persistent=*/true));
    uint64_t acked = 1;
    workload(&fs, &acked);
    // RocksDB renames CURRENT through its own file system, which the store's
    // hooked wrapper does not report (vfs/internal/rocks_util.cc has no
    // RenameFile hook), so the wrapper would remove a MANIFEST whose creation
    // was not yet dir-synced while keeping the CURRENT that names it: a state
    // no ordered-metadata file system (ext4, xfs) can produce. Such N are
    // counted, not checked (docs/RELIABILITY.md, "Limitations").
    bool artifact = false;
    {
      std::ifstream cur(path + "/index/CURRENT");
      std::string manifest;
      std::getline(cur, manifest);
      for (const auto& c : fs.UnsyncedCreations()) {
        if (!manifest.empty() && c.size() >= manifest.size() &&
            c.compare(c.size() - manifest.size(), manifest.size(), manifest) == 0) {
          artifact = true;
        }
      }
    }
    if (artifact) {
      ++artifacts;
      continue;
    }
    REL_ASSERT_OK(fs.DropUnsyncedData(mode, n));
    const std::string what = "power lost before operation " + std::to_string(n) + " of " + std::to_string(total) +
                             " (drop " + ModeName(mode) + ", acknowledged generation " + std::to_string(acked) + ")";
    const uint64_t g = CheckReopenedStore(path, acked, acked + 1, &bytes, what);
    if (HasFailure()) return;
    ++survived[g - acked];
  }
  std::printf("power lost before each of %llu operations; in-flight commit survived %llu times, lost %llu times; "
              "%llu bytes compared; %llu points skipped (unhooked RocksDB rename of CURRENT)\n",
              static_cast<unsigned long long>(total), static_cast<unsigned long long>(survived[1]),
              static_cast<unsigned long long>(survived[0]), static_cast<unsigned long long>(bytes),
              static_cast<unsigned long long>(artifacts));
  EXPECT_LT(artifacts, total / 4) << "too few operations were checked";
}

}  // namespace
}  // namespace optstate::reliability
