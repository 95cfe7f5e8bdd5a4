// Tests of FaultInjectionFileSystem: Nth-operation failures per class (once
// and persistent), short transfers through File and both IoEngines, simulated
// power loss (unsynced data, unsynced creations and renames), inactive mode.
#include "vfs/fault_injection.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/vfs/io_test_util.h"
#include "vfs/file_system.h"
#include "vfs/io_engine.h"

namespace optstate::vfs {
namespace {

using testing::AlignedBuf;
using testing::AllocAligned;
using testing::FillPattern;
using testing::TempDir;

std::string ReadRaw(const std::string& path) {
  auto s = FileSystem::Default()->ReadFileToString(path);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? *s : std::string();
}

// A small workload touching every class: open/create, fallocate, writes,
// fsync, an atomic small-file write (open, write, sync, rename, dir sync),
// reads. Returns the first failure.
Status Workload(FileSystem* fs, const std::string& dir) {
  OPTSTATE_RETURN_IF_ERROR(fs->CreateDir(dir + "/sub"));
  OPTSTATE_ASSIGN_OR_RETURN(auto f, fs->Open(dir + "/sub/data", OpenOptions{.create = true}));
  OPTSTATE_RETURN_IF_ERROR(f->Fallocate(0, 4 * 4096));
  std::vector<char> b(4096);
  for (int i = 0; i < 4; ++i) {
    FillPattern(b.data(), b.size(), i);
    OPTSTATE_RETURN_IF_ERROR(f->Pwrite(i * 4096, b.data(), b.size()));
  }
  OPTSTATE_RETURN_IF_ERROR(f->Fdatasync());
  OPTSTATE_RETURN_IF_ERROR(fs->WriteFileAtomic(dir + "/sub/manifest", "generation 1"));
  OPTSTATE_RETURN_IF_ERROR(fs->SyncDir(dir));
  for (int i = 0; i < 4; ++i) OPTSTATE_RETURN_IF_ERROR(f->Pread(i * 4096, b.data(), b.size()));
  OPTSTATE_ASSIGN_OR_RETURN(std::string m, fs->ReadFileToString(dir + "/sub/manifest"));
  if (m != "generation 1") return Internal("manifest mismatch: " + m);
  return Status::Ok();
}

TEST(FaultInjectionTest, CountsOperationsPerClass) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  EXPECT_NE(fs.hooks(), nullptr);
  ASSERT_TRUE(Workload(&fs, dir.path()).ok());
  // Counted by hand from Workload: open x3 (data, tmp, manifest read),
  // write 4 + 1, read 4 + 1, sync 1 fdatasync + 1 fsync + 2 dir syncs,
  // fallocate 1, metadata mkdir + rename.
  EXPECT_EQ(fs.OpCount(OpClass::kOpen), 3u);
  EXPECT_EQ(fs.OpCount(OpClass::kWrite), 5u);
  EXPECT_EQ(fs.OpCount(OpClass::kRead), 5u);
  EXPECT_EQ(fs.OpCount(OpClass::kSync), 4u);
  EXPECT_EQ(fs.OpCount(OpClass::kFallocate), 1u);
  EXPECT_EQ(fs.OpCount(OpClass::kMetadata), 2u);
  EXPECT_EQ(fs.TotalOpCount(), 20u);
  EXPECT_EQ(fs.InjectedCount(), 0u);
  fs.ResetCounters();
  EXPECT_EQ(fs.TotalOpCount(), 0u);
}

// For every class and every N: fail the Nth operation once. The workload must
// report an error that carries the injected errno and names the path.
TEST(FaultInjectionTest, FailNthOperationOfEachClass) {
  uint64_t runs = 0;
  for (OpClass c : {OpClass::kOpen, OpClass::kRead, OpClass::kWrite, OpClass::kSync, OpClass::kFallocate,
                    OpClass::kMetadata}) {
    uint64_t count;
    {
      TempDir dir;
      FaultInjectionFileSystem fs(FileSystem::Default());
      ASSERT_TRUE(Workload(&fs, dir.path()).ok());
      count = fs.OpCount(c);
    }
    ASSERT_GT(count, 0u) << OpClassName(c);
    for (uint64_t n = 1; n <= count; ++n) {
      SCOPED_TRACE(std::string(OpClassName(c)) + " #" + std::to_string(n));
      TempDir dir;
      FaultInjectionFileSystem fs(FileSystem::Default());
      fs.AddRule(FaultRule::FailNth(c, n));
      Status s = Workload(&fs, dir.path());
      ASSERT_FALSE(s.ok());
      EXPECT_EQ(s.err(), EIO) << s.ToString();
      EXPECT_NE(s.message().find("injected fault"), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find(dir.path()), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find(std::strerror(EIO)), std::string::npos) << s.ToString();
      EXPECT_EQ(fs.InjectedCount(), 1u);
      // A failed atomic write leaves no temporary file behind.
      if (auto names = FileSystem::Default()->ListDir(dir.Sub("sub")); names.ok()) {
        for (const auto& name : *names) EXPECT_EQ(name.find(".tmp"), std::string::npos) << name;
      }
      // Once: the same workload passes afterwards in a fresh directory.
      TempDir again;
      EXPECT_TRUE(Workload(&fs, again.path()).ok());
      ++runs;
    }
  }
  EXPECT_EQ(runs, 20u);
}

TEST(FaultInjectionTest, PersistentEnospcAndAnyClassRules) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  fs.AddRule(FaultRule::FailNth(OpClass::kWrite, 3, /*persistent=*/true, ENOSPC));
  auto f = fs.Open(dir.Sub("d"), OpenOptions{.create = true});
  ASSERT_TRUE(f.ok());
  char b[16] = {};
  EXPECT_TRUE((*f)->Pwrite(0, b, 16).ok());
  EXPECT_TRUE((*f)->Pwrite(16, b, 16).ok());
  for (int i = 0; i < 5; ++i) {
    Status s = (*f)->Pwrite(32, b, 16);
    EXPECT_TRUE(s.IsNoSpace()) << s.ToString();
    EXPECT_NE(s.message().find("offset 32 length 16"), std::string::npos) << s.ToString();
  }
  EXPECT_TRUE((*f)->Pread(0, b, 16).ok());  // reads are unaffected
  fs.ClearRules();
  EXPECT_TRUE((*f)->Pwrite(32, b, 16).ok());

  fs.AddRule(FaultRule::FailNthAny(2));
  EXPECT_TRUE((*f)->Pread(0, b, 16).ok());
  EXPECT_FALSE((*f)->Fsync().ok());
  EXPECT_TRUE((*f)->Fsync().ok());
  fs.ClearRules();

  FaultRule only_manifest = FaultRule::FailNth(OpClass::kOpen, 1, true, EACCES);
  only_manifest.path_contains = "manifest";
  fs.AddRule(only_manifest);
  EXPECT_TRUE(fs.Open(dir.Sub("other"), OpenOptions{.create = true}).ok());
  auto m = fs.Open(dir.Sub("manifest.json"), OpenOptions{.create = true});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().err(), EACCES);
}

TEST(FaultInjectionTest, ShortTransfersThroughFileAreCompleted) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  fs.AddRule(FaultRule::ShortNth(OpClass::kWrite, 1, 100, /*persistent=*/true));
  fs.AddRule(FaultRule::ShortNth(OpClass::kRead, 1, 7, /*persistent=*/true));
  auto f = fs.Open(dir.Sub("d"), OpenOptions{.create = true});
  ASSERT_TRUE(f.ok());
  std::vector<char> data(10000), back(10000);
  FillPattern(data.data(), data.size(), 3);
  ASSERT_TRUE((*f)->Pwrite(5, data.data(), data.size()).ok());
  ASSERT_TRUE((*f)->Pread(5, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
  EXPECT_EQ(ReadRaw(dir.Sub("d")).substr(5), std::string(data.begin(), data.end()));
  EXPECT_EQ(fs.InjectedCount(), 2u);
}

// The hooks reach both engines: faults, short transfers, op counts and the
// tracking of unsynced writes all work for io_uring and sync requests.
TEST(FaultInjectionTest, HooksReachBothEngines) {
  for (bool uring : {true, false}) {
    SCOPED_TRACE(uring ? "io_uring" : "sync");
    TempDir dir;
    FaultInjectionFileSystem fs(FileSystem::Default());
    auto f = fs.Open(dir.Sub("d"), OpenOptions{.create = true, .direct = true});
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    ASSERT_TRUE((*f)->Fallocate(0, 1 << 20).ok());
    ASSERT_TRUE((*f)->Fsync().ok());
    std::unique_ptr<IoEngine> engine;
    if (uring) {
      IoEngineOptions o;
      o.queue_depth = 4;
      auto e = IoEngine::NewUring(o);
      ASSERT_TRUE(e.ok()) << e.status().ToString();
      engine = std::move(*e);
    } else {
      auto e = IoEngine::NewSync(64 << 10);
      ASSERT_TRUE(e.ok());
      engine = std::move(*e);
    }
    constexpr uint64_t kReq = 64 << 10;
    AlignedBuf buf = AllocAligned(8 * kReq), back = AllocAligned(8 * kReq);
    FillPattern(buf.get(), 8 * kReq, 9);
    fs.ResetCounters();
    fs.AddRule(FaultRule::ShortNth(OpClass::kWrite, 2, 4096, /*persistent=*/true));  // writes 2..8 short
    fs.AddRule(FaultRule::FailNth(OpClass::kWrite, 5));                               // write 5 fails
    fs.AddRule(FaultRule::FailNth(OpClass::kRead, 3, false, ENOSPC));                 // read 3 fails
    std::vector<IoRequest> reqs;
    for (uint64_t i = 0; i < 8; ++i) {
      reqs.push_back({IoRequest::Op::kWrite, f->get(), i * kReq, kReq, buf.get() + i * kReq, i});
    }
    ASSERT_TRUE(engine->Submit(reqs).ok());
    std::vector<IoCompletion> done;
    ASSERT_TRUE(engine->Reap(&done, 8).ok());
    ASSERT_EQ(done.size(), 8u);
    for (const auto& c : done) {
      if (c.tag == 4) {
        EXPECT_FALSE(c.status.ok());
        EXPECT_NE(c.status.message().find(dir.Sub("d")), std::string::npos) << c.status.ToString();
        EXPECT_NE(c.status.message().find("offset " + std::to_string(4 * kReq)), std::string::npos);
      } else {
        EXPECT_TRUE(c.status.ok()) << c.tag << ": " << c.status.ToString();
      }
    }
    EXPECT_EQ(fs.OpCount(OpClass::kWrite), 8u);
    EXPECT_EQ(fs.UnsyncedBytes(), 7 * kReq);  // AfterWrite for every successful write
    std::string raw = ReadRaw(dir.Sub("d"));
    for (uint64_t i = 0; i < 8; ++i) {
      std::string want = i == 4 ? std::string(kReq, '\0')
                                : std::string(reinterpret_cast<char*>(buf.get()) + i * kReq, kReq);
      EXPECT_EQ(raw.substr(i * kReq, kReq), want) << "request " << i;
    }
    for (auto& r : reqs) {
      r.op = IoRequest::Op::kRead;
      r.buf = back.get() + (static_cast<std::byte*>(r.buf) - buf.get());
    }
    ASSERT_TRUE(engine->Submit(reqs).ok());
    done.clear();
    ASSERT_TRUE(engine->Reap(&done, 8).ok());
    ASSERT_EQ(done.size(), 8u);
    for (const auto& c : done) {
      if (c.tag == 2) {
        EXPECT_TRUE(c.status.IsNoSpace()) << c.status.ToString();
      } else {
        EXPECT_TRUE(c.status.ok()) << c.tag << ": " << c.status.ToString();
        if (c.tag != 4) {
          EXPECT_EQ(std::memcmp(back.get() + c.tag * kReq, buf.get() + c.tag * kReq, kReq), 0) << c.tag;
        }
      }
    }
    EXPECT_EQ(fs.OpCount(OpClass::kRead), 8u);
    EXPECT_EQ(fs.InjectedCount(), 1u + 1u + 6u);  // 2 failures + 6 short writes (#2..#8 but #5 failed)
  }
}

TEST(FaultInjectionTest, DropUnsyncedDataAllZeroesExactlyTheUnsyncedRanges) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  const std::string path = dir.Sub("d");
  auto f = fs.Open(path, OpenOptions{.create = true});
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(fs.SyncDir(dir.path()).ok());
  std::string model(64 << 10, '\0');
  std::vector<char> b(64 << 10);
  FillPattern(b.data(), b.size(), 1);
  ASSERT_TRUE((*f)->Pwrite(0, b.data(), b.size()).ok());
  std::memcpy(model.data(), b.data(), b.size());
  ASSERT_TRUE((*f)->Fdatasync().ok());  // all of it durable
  // Unsynced: two overlapping writes and one separate one.
  FillPattern(b.data(), b.size(), 2);
  ASSERT_TRUE((*f)->Pwrite(1000, b.data(), 3000).ok());
  ASSERT_TRUE((*f)->Pwrite(3500, b.data(), 1000).ok());
  ASSERT_TRUE((*f)->Pwrite(20000, b.data(), 5).ok());
  EXPECT_EQ(fs.UnsyncedBytes(), (4500u - 1000u) + 5u);
  f->reset();
  ASSERT_TRUE(fs.DropUnsyncedData(DropMode::kAll).ok());
  std::memset(model.data() + 1000, 0, 3500);
  std::memset(model.data() + 20000, 0, 5);
  EXPECT_EQ(ReadRaw(path), model);
  EXPECT_EQ(fs.UnsyncedBytes(), 0u);
}

TEST(FaultInjectionTest, DropUnsyncedDataRandomSubsetIsSeededAndBlockwise) {
  std::vector<std::string> results;
  for (uint64_t seed : {7, 7, 8}) {
    TempDir dir;
    FaultInjectionFileSystem fs(FileSystem::Default());
    const std::string path = dir.Sub("d");
    auto f = fs.Open(path, OpenOptions{.create = true});
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(fs.SyncDir(dir.path()).ok());
    std::vector<char> b(256 << 10);
    FillPattern(b.data(), b.size(), 5);
    ASSERT_TRUE((*f)->Pwrite(0, b.data(), b.size()).ok());
    f->reset();
    ASSERT_TRUE(fs.DropUnsyncedData(DropMode::kRandomSubset, seed).ok());
    std::string raw = ReadRaw(path);
    ASSERT_EQ(raw.size(), b.size());
    int kept = 0, dropped = 0;
    for (size_t blk = 0; blk < b.size(); blk += 4096) {
      std::string got = raw.substr(blk, 4096);
      if (got == std::string(b.data() + blk, 4096)) {
        ++kept;
      } else {
        EXPECT_EQ(got, std::string(4096, '\0')) << "block at " << blk << " is neither kept nor zero";
        ++dropped;
      }
    }
    EXPECT_GT(kept, 8);
    EXPECT_GT(dropped, 8);
    results.push_back(raw);
  }
  EXPECT_EQ(results[0], results[1]);  // same seed, same loss
  EXPECT_NE(results[0], results[2]);
}

TEST(FaultInjectionTest, DropRemovesCreationsSinceTheLastDirSync) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  ASSERT_TRUE(fs.CreateDir(dir.Sub("a/b")).ok());  // a is new in dir
  {
    auto f = fs.Open(dir.Sub("synced"), OpenOptions{.create = true});
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->Pwrite(0, "x", 1).ok());
    ASSERT_TRUE((*f)->Fsync().ok());
  }
  ASSERT_TRUE(fs.SyncDir(dir.path()).ok());  // a and synced are durable entries
  {
    auto f = fs.Open(dir.Sub("unsynced"), OpenOptions{.create = true});
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->Pwrite(0, "y", 1).ok());
    ASSERT_TRUE((*f)->Fsync().ok());  // data synced, directory entry not
    auto g = fs.Open(dir.Sub("a/b/in_b"), OpenOptions{.create = true});
    ASSERT_TRUE(g.ok());
    // Reopening an existing file creates nothing.
    auto h = fs.Open(dir.Sub("synced"), OpenOptions{.create = true});
    ASSERT_TRUE(h.ok());
  }
  ASSERT_TRUE(fs.CreateDir(dir.Sub("a/c")).ok());
  ASSERT_TRUE(fs.SyncDir(dir.Sub("a")).ok());  // a/c durable; a/b/in_b still not
  std::vector<std::string> want = {dir.Sub("a/b/in_b"), dir.Sub("unsynced")};
  EXPECT_EQ(fs.UnsyncedCreations(), want);
  ASSERT_TRUE(fs.DropUnsyncedData(DropMode::kAll).ok());
  FileSystem* real = FileSystem::Default();
  EXPECT_TRUE(*real->Exists(dir.Sub("synced")));
  EXPECT_EQ(ReadRaw(dir.Sub("synced")), "x");
  EXPECT_FALSE(*real->Exists(dir.Sub("unsynced")));
  EXPECT_FALSE(*real->Exists(dir.Sub("a/b/in_b")));
  EXPECT_TRUE(*real->Exists(dir.Sub("a/b")));
  EXPECT_TRUE(*real->Exists(dir.Sub("a/c")));
}

TEST(FaultInjectionTest, UnsyncedRenameOverAFileIsUndoneAndSyncedOneKept) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  ASSERT_TRUE(fs.WriteFileAtomic(dir.Sub("manifest"), "gen 1").ok());  // durable (dir synced)
  EXPECT_TRUE(fs.UnsyncedCreations().empty());
  // A hand-made atomic write without the final directory sync.
  {
    auto f = fs.Open(dir.Sub("manifest.tmp"), OpenOptions{.create = true});
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE((*f)->Pwrite(0, "gen 2", 5).ok());
    ASSERT_TRUE((*f)->Fsync().ok());
  }
  ASSERT_TRUE(fs.Rename(dir.Sub("manifest.tmp"), dir.Sub("manifest")).ok());
  EXPECT_EQ(ReadRaw(dir.Sub("manifest")), "gen 2");
  ASSERT_TRUE(fs.DropUnsyncedData(DropMode::kAll).ok());
  EXPECT_EQ(ReadRaw(dir.Sub("manifest")), "gen 1");
  EXPECT_FALSE(*FileSystem::Default()->Exists(dir.Sub("manifest.tmp")));

  ASSERT_TRUE(fs.WriteFileAtomic(dir.Sub("manifest"), "gen 3").ok());
  ASSERT_TRUE(fs.DropUnsyncedData(DropMode::kAll).ok());
  EXPECT_EQ(ReadRaw(dir.Sub("manifest")), "gen 3");
  EXPECT_EQ(fs.ListDir(dir.path())->size(), 1u);
}

// A store is created in a temporary directory that is renamed into place:
// what is tracked below the directory follows it.
TEST(FaultInjectionTest, DirectoryRenameCarriesTracking) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  ASSERT_TRUE(fs.CreateDir(dir.Sub("tmp/index")).ok());
  ASSERT_TRUE(fs.SyncDir(dir.Sub("tmp")).ok());
  {
    auto synced = fs.Open(dir.Sub("tmp/synced"), OpenOptions{.create = true});
    ASSERT_TRUE(synced.ok());
    ASSERT_TRUE((*synced)->Pwrite(0, "abcd", 4).ok());
    ASSERT_TRUE((*synced)->Fsync().ok());
    ASSERT_TRUE((*synced)->Pwrite(1, "XY", 2).ok());  // unsynced
    auto created = fs.Open(dir.Sub("tmp/index/wal"), OpenOptions{.create = true});  // entry unsynced
    ASSERT_TRUE(created.ok());
  }
  ASSERT_TRUE(fs.SyncDir(dir.Sub("tmp")).ok());
  ASSERT_TRUE(fs.Rename(dir.Sub("tmp"), dir.Sub("store")).ok());
  ASSERT_TRUE(fs.SyncDir(dir.path()).ok());  // "store" is durable
  std::vector<std::string> want = {dir.Sub("store/index/wal")};
  EXPECT_EQ(fs.UnsyncedCreations(), want);
  EXPECT_EQ(fs.UnsyncedBytes(), 2u);
  ASSERT_TRUE(fs.DropUnsyncedData(DropMode::kAll).ok());
  EXPECT_EQ(ReadRaw(dir.Sub("store/synced")), std::string("a\0\0d", 4));
  EXPECT_FALSE(*FileSystem::Default()->Exists(dir.Sub("store/index/wal")));
  EXPECT_TRUE(*FileSystem::Default()->Exists(dir.Sub("store/index")));
}

TEST(FaultInjectionTest, InactiveFilesystemFailsEverything) {
  TempDir dir;
  FaultInjectionFileSystem fs(FileSystem::Default());
  auto f = fs.Open(dir.Sub("d"), OpenOptions{.create = true, .direct = true});
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Fallocate(0, 8192).ok());
  IoEngineOptions o;
  o.queue_depth = 2;
  auto e = IoEngine::NewUring(o);
  ASSERT_TRUE(e.ok());
  AlignedBuf b = AllocAligned(4096);
  fs.SetFilesystemActive(false);
  EXPECT_FALSE(fs.filesystem_active());
  uint64_t before = fs.TotalOpCount();
  EXPECT_FALSE((*f)->Pwrite(0, b.get(), 4096).ok());
  EXPECT_FALSE((*f)->Pread(0, b.get(), 4096).ok());
  EXPECT_FALSE((*f)->Fsync().ok());
  EXPECT_FALSE((*f)->Fallocate(0, 1 << 20).ok());
  EXPECT_FALSE(fs.Open(dir.Sub("d2"), OpenOptions{.create = true}).ok());
  EXPECT_FALSE(fs.CreateDir(dir.Sub("x")).ok());
  EXPECT_FALSE(fs.SyncDir(dir.path()).ok());
  EXPECT_FALSE(fs.Rename(dir.Sub("d"), dir.Sub("e")).ok());
  EXPECT_FALSE(fs.Remove(dir.Sub("d")).ok());
  EXPECT_FALSE(fs.Exists(dir.Sub("d")).ok());
  EXPECT_FALSE(fs.ListDir(dir.path()).ok());
  EXPECT_FALSE(fs.ReadFileToString(dir.Sub("d")).ok());
  Status w = fs.WriteFileAtomic(dir.Sub("m"), "x");
  EXPECT_FALSE(w.ok());
  EXPECT_NE(w.message().find("inactive"), std::string::npos) << w.ToString();
  IoRequest r{IoRequest::Op::kWrite, f->get(), 0, 4096, b.get(), 1};
  ASSERT_TRUE((*e)->Submit({&r, 1}).ok());
  std::vector<IoCompletion> done;
  ASSERT_TRUE((*e)->Reap(&done, 1).ok());
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].status.ok());
  EXPECT_EQ(fs.TotalOpCount(), before);  // nothing counted while inactive
  // Nothing reached the disk.
  EXPECT_EQ(FileSystem::Default()->ListDir(dir.path())->size(), 1u);
  EXPECT_EQ(ReadRaw(dir.Sub("d")), std::string(8192, '\0'));
  fs.SetFilesystemActive(true);
  EXPECT_TRUE((*f)->Pwrite(0, b.get(), 4096).ok());
}

}  // namespace
}  // namespace optstate::vfs
