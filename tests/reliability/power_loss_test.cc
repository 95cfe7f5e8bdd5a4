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
// Renames are modelled too: one not followed by a sync of its directory is
// reverted (the replaced file gets its old contents back), including RocksDB's
// rename of CURRENT, which the store's rocksdb::FileSystem reports.
#include <stdio.h>

#include <algorithm>
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
            if (rng() % 4 == 0) ASSERT_OK((*s)->CollectGarbage());
          }
          // A partly written next generation that is never committed.
          std::vector<vfs::TensorInfo> tensors;
          ASSERT_OK(EnsureWorkloadTensors(s->get(), &tensors));
          ASSERT_OK(WriteWorkloadGeneration(s->get(), tensors, acked + 1, rng() % 6));
          // Power loss: nothing reaches the disk any more, then the process dies.
          fs.SetFilesystemActive(false);
        }
        dropped_bytes += fs.UnsyncedBytes();
        dropped_files += fs.UnsyncedCreations().size();
        ASSERT_OK(fs.DropUnsyncedData(mode, seed * 1000 + round));
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
  uint64_t unsynced_current = 0, names_unsynced_manifest = 0;
  for (uint64_t n = 1; n <= total; ++n) {
    reset();
    const DropMode mode = n % 2 ? DropMode::kAll : DropMode::kRandomSubset;
    FaultInjectionFileSystem fs(FileSystem::Default());
    fs.AddRule(FaultRule::FailNthAny(n, /*persistent=*/true));
    uint64_t acked = 1;
    workload(&fs, &acked);
    // RocksDB installs CURRENT by renaming a temp file over it and then
    // syncing the directory; the store's rocksdb::FileSystem reports the
    // rename (FaultHooks::BeforeRename/AfterRename), so a crash between the
    // two restores the old CURRENT (and removes the new, unsynced MANIFEST it
    // names). Count those points: they must occur and be checked.
    const std::string current = std::filesystem::path(path + "/index/CURRENT").lexically_normal().string();
    const auto replaced = fs.UnsyncedReplacements();
    if (std::find(replaced.begin(), replaced.end(), current) != replaced.end()) {
      ++unsynced_current;
      // Without the rename model the drop would keep this CURRENT and remove
      // the MANIFEST it names: the case the model exists for.
      std::ifstream cur(current);
      std::string manifest;
      std::getline(cur, manifest);
      for (const auto& c : fs.UnsyncedCreations()) {
        if (!manifest.empty() && std::filesystem::path(c).filename() == manifest) ++names_unsynced_manifest;
      }
    }
    ASSERT_OK(fs.DropUnsyncedData(mode, n));
    const std::string what = "power lost before operation " + std::to_string(n) + " of " + std::to_string(total) +
                             " (drop " + ModeName(mode) + ", acknowledged generation " + std::to_string(acked) + ")";
    const uint64_t g = CheckReopenedStore(path, acked, acked + 1, &bytes, what);
    if (HasFailure()) return;
    ++survived[g - acked];
  }
  std::printf("power lost before each of %llu operations; in-flight commit survived %llu times, lost %llu times; "
              "%llu bytes compared; %llu crashes with an unsynced rename of CURRENT (reverted; %llu of them named "
              "an unsynced MANIFEST)\n",
              static_cast<unsigned long long>(total), static_cast<unsigned long long>(survived[1]),
              static_cast<unsigned long long>(survived[0]), static_cast<unsigned long long>(bytes),
              static_cast<unsigned long long>(unsynced_current),
              static_cast<unsigned long long>(names_unsynced_manifest));
  EXPECT_EQ(survived[0] + survived[1], total) << "every point is checked";
  EXPECT_GE(unsynced_current, 1u) << "no crash fell between RocksDB's rename of CURRENT and its directory sync";
  EXPECT_GE(names_unsynced_manifest, 1u);
}

// Power lost before every operation of Store::Open (which makes RocksDB write
// a new MANIFEST and rename a new CURRENT over the old one), in both drop
// modes, on a store with 3 acknowledged generations and a snapshot: the store
// reopens at generation 3 exactly, the snapshot intact.
TEST(PowerLossTest, PowerLostDuringOpenKeepsEverything) {
  TempDir dir;
  const std::string path = dir / "store";
  const std::string golden = dir / "golden";
  {
    auto s = Store::Create(path, WorkloadOptions());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    for (uint64_t g = 1; g <= 3; ++g) {
      auto c = CommitWorkloadGeneration(s->get(), g);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      if (g == 2) {
        auto snap = (*s)->CreateSnapshot("two");
        ASSERT_TRUE(snap.ok()) << snap.status().ToString();
      }
    }
  }
  std::filesystem::copy(path, golden, std::filesystem::copy_options::recursive);
  auto reset = [&] {
    std::filesystem::remove_all(path);
    std::filesystem::copy(golden, path, std::filesystem::copy_options::recursive);
  };
  uint64_t total = 0;
  {
    reset();
    FaultInjectionFileSystem fs(FileSystem::Default());
    StoreOptions opts = WorkloadOptions();
    opts.fs = &fs;
    auto s = Store::Open(path, opts);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    total = fs.TotalOpCount();
  }
  ASSERT_GT(total, 5u);
  const std::string current = std::filesystem::path(path + "/index/CURRENT").lexically_normal().string();
  uint64_t bytes = 0, unsynced_current = 0, checked = 0;
  for (uint64_t n = 1; n <= total; ++n) {
    for (DropMode mode : {DropMode::kAll, DropMode::kRandomSubset}) {
      reset();
      const std::string what = "power lost before operation " + std::to_string(n) + " of " +
                               std::to_string(total) + " of Open (drop " + ModeName(mode) + ")";
      FaultInjectionFileSystem fs(FileSystem::Default());
      fs.AddRule(FaultRule::FailNthAny(n, /*persistent=*/true));
      {
        StoreOptions opts = WorkloadOptions();
        opts.fs = &fs;
        auto s = Store::Open(path, opts);
        fs.SetFilesystemActive(false);
      }
      const auto replaced = fs.UnsyncedReplacements();
      unsynced_current += std::find(replaced.begin(), replaced.end(), current) != replaced.end();
      ASSERT_OK(fs.DropUnsyncedData(mode, n));
      EXPECT_EQ(CheckReopenedStore(path, 3, 3, &bytes, what), 3u) << what;
      {
        auto s = Store::Open(path, WorkloadOptions());
        ASSERT_TRUE(s.ok()) << what << ": " << s.status().ToString();
        auto snap = (*s)->OpenSnapshot("two");
        ASSERT_TRUE(snap.ok()) << what << ": " << snap.status().ToString();
        EXPECT_TRUE(GenerationMatchesReference(**snap, 2, &bytes)) << what;
      }
      if (HasFailure()) return;
      ++checked;
    }
  }
  std::printf("power lost during Open: %llu crash points x 2 drop modes checked, %llu with an unsynced rename of "
              "CURRENT (reverted), %llu bytes compared\n",
              static_cast<unsigned long long>(total), static_cast<unsigned long long>(unsynced_current),
              static_cast<unsigned long long>(bytes));
  EXPECT_EQ(checked, 2 * total);
  EXPECT_GE(unsynced_current, 2u) << "no crash fell between RocksDB's rename of CURRENT and its directory sync";
}

// The rename model itself, without RocksDB: a file replaced by a rename that
// is reported through FaultHooks (as the store's rocksdb::FileSystem reports
// RocksDB's CURRENT) gets its old contents back at power loss unless the
// directory was synced after the rename; the renamed-away temp file (created
// unsynced) disappears either way.
TEST(PowerLossTest, ReportedRenameIsRevertedUnlessDirectorySynced) {
  for (const bool dir_synced : {false, true}) {
    for (DropMode mode : {DropMode::kAll, DropMode::kRandomSubset}) {
      const std::string what = std::string(dir_synced ? "dir synced" : "dir not synced") + ", drop " + ModeName(mode);
      TempDir dir;
      const std::string current = dir / "CURRENT", tmp = dir / "000009.dbtmp";
      {
        std::ofstream out(current);  // durable before the wrapper exists
        out << "MANIFEST-000005\n";
      }
      FaultInjectionFileSystem fs(FileSystem::Default());
      {
        auto f = fs.Open(tmp, vfs::OpenOptions{.create = true, .exclusive = true});
        ASSERT_TRUE(f.ok()) << f.status().ToString();
        const std::string next = "MANIFEST-000009\n";
        ASSERT_OK((*f)->Pwrite(0, next.data(), next.size()));
        ASSERT_OK((*f)->Fsync());
      }
      vfs::FaultHooks* hooks = fs.hooks();
      ASSERT_OK(hooks->BeforeRename(tmp, current));
      ASSERT_EQ(::rename(tmp.c_str(), current.c_str()), 0);
      hooks->AfterRename(tmp, current);
      ASSERT_EQ(fs.UnsyncedReplacements().size(), 1u) << what;
      if (dir_synced) {
        ASSERT_OK(fs.SyncDir(dir.path()));
        EXPECT_TRUE(fs.UnsyncedReplacements().empty()) << what;
      }
      fs.SetFilesystemActive(false);
      // A crashed process cannot rename any more.
      EXPECT_FALSE(hooks->BeforeRename(dir / "x", dir / "y").ok()) << what;
      ASSERT_OK(fs.DropUnsyncedData(mode, 7));
      std::ifstream in(current);
      std::string got;
      std::getline(in, got);
      EXPECT_EQ(got, dir_synced ? "MANIFEST-000009" : "MANIFEST-000005") << what;
      EXPECT_FALSE(std::filesystem::exists(tmp)) << what;
    }
  }
}

}  // namespace
}  // namespace optstate::reliability
