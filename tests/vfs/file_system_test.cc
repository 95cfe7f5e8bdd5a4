// Tests of the POSIX file system (vfs/posix_file_system.cc) against plain
// pread/pwrite/stat on the same files.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/vfs/io_test_util.h"
#include "vfs/file_system.h"
#include "vfs/internal/posix_file.h"

namespace optstate::vfs {
namespace {

using testing::AllocAligned;
using testing::FillPattern;
using testing::TempDir;

TEST(OpClassNameTest, NamesEveryClass) {
  EXPECT_STREQ(OpClassName(OpClass::kRead), "read");
  EXPECT_STREQ(OpClassName(OpClass::kWrite), "write");
  EXPECT_STREQ(OpClassName(OpClass::kSync), "sync");
  EXPECT_STREQ(OpClassName(OpClass::kOpen), "open");
  EXPECT_STREQ(OpClassName(OpClass::kFallocate), "fallocate");
  EXPECT_STREQ(OpClassName(OpClass::kMetadata), "metadata");
  EXPECT_STREQ(OpClassName(OpClass::kIndexWrite), "index_write");
  EXPECT_STREQ(OpClassName(OpClass::kIndexSync), "index_sync");
}

TEST(PosixFileSystemTest, DefaultIsStableAndHasNoHooks) {
  EXPECT_EQ(FileSystem::Default(), FileSystem::Default());
  EXPECT_EQ(FileSystem::Default()->hooks(), nullptr);
}

TEST(PosixFileSystemTest, BufferedRoundTripMatchesIndependentRead) {
  TempDir dir;
  FileSystem* fs = FileSystem::Default();
  std::string path = dir.Sub("data");
  auto f = fs->Open(path, OpenOptions{.create = true});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->path(), path);
  EXPECT_FALSE((*f)->direct());
  EXPECT_EQ((*f)->hooks(), nullptr);
  std::vector<char> data(100003);
  FillPattern(data.data(), data.size(), 1);
  ASSERT_TRUE((*f)->Pwrite(777, data.data(), data.size()).ok());
  ASSERT_TRUE((*f)->Fdatasync().ok());
  auto size = (*f)->Size();
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 777u + data.size());

  // Independent reference: plain pread on a separate descriptor.
  int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<char> ref(data.size());
  ASSERT_EQ(::pread(fd, ref.data(), ref.size(), 777), static_cast<ssize_t>(ref.size()));
  ::close(fd);
  EXPECT_EQ(ref, data);

  std::vector<char> back(data.size());
  ASSERT_TRUE((*f)->Pread(777, back.data(), back.size()).ok());
  EXPECT_EQ(back, data);
}

TEST(PosixFileSystemTest, DirectRoundTripOnDisk) {
  TempDir dir;
  FileSystem* fs = FileSystem::Default();
  std::string path = dir.Sub("direct");
  auto f = fs->Open(path, OpenOptions{.create = true, .direct = true});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  if (!(*f)->direct()) GTEST_SKIP() << "filesystem of " << path << " refuses O_DIRECT";
  constexpr size_t kLen = 1 << 20;
  auto buf = AllocAligned(kLen);
  auto back = AllocAligned(kLen);
  FillPattern(buf.get(), kLen, 2);
  ASSERT_TRUE((*f)->Fallocate(0, 4 * kLen).ok());
  EXPECT_EQ(*(*f)->Size(), 4 * kLen);
  ASSERT_TRUE((*f)->Pwrite(2 * kLen, buf.get(), kLen).ok());
  ASSERT_TRUE((*f)->Fsync().ok());
  ASSERT_TRUE((*f)->Pread(2 * kLen, back.get(), kLen).ok());
  EXPECT_EQ(std::memcmp(buf.get(), back.get(), kLen), 0);
  // Preallocated, never written space reads as zeros.
  ASSERT_TRUE((*f)->Pread(0, back.get(), kLen).ok());
  std::vector<std::byte> zeros(kLen);
  EXPECT_EQ(std::memcmp(zeros.data(), back.get(), kLen), 0);
}

TEST(PosixFileSystemTest, DirectRefusedFallsBackWithOneWarning) {
  TempDir dir("/dev/shm");
  FileSystem* fs = FileSystem::Default();
  internal::SetDirectRefusedForTesting(true);
  uint64_t fallbacks0 = internal::DirectFallbackCount();
  std::vector<std::unique_ptr<File>> files;
  for (int i = 0; i < 3; ++i) {
    auto f = fs->Open(dir.Sub("f" + std::to_string(i)),
                      OpenOptions{.create = true, .exclusive = true, .direct = true});
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_FALSE((*f)->direct());
    files.push_back(std::move(*f));
  }
  internal::SetDirectRefusedForTesting(false);
  EXPECT_EQ(internal::DirectFallbackCount() - fallbacks0, 3u);
  EXPECT_EQ(internal::DirectFallbackWarningCount(), 1u);  // once per process
  // The buffered file works, with unaligned I/O too.
  std::string s = "hello, tmpfs";
  ASSERT_TRUE(files[0]->Pwrite(3, s.data(), s.size()).ok());
  std::string back(s.size(), '\0');
  ASSERT_TRUE(files[0]->Pread(3, back.data(), back.size()).ok());
  EXPECT_EQ(back, s);
  int flags = ::fcntl(files[0]->fd(), F_GETFL);
  EXPECT_EQ(flags & O_DIRECT, 0);
}

TEST(PosixFileSystemTest, ReadPastEndNamesPathOffsetAndLength) {
  TempDir dir;
  FileSystem* fs = FileSystem::Default();
  std::string path = dir.Sub("short");
  ASSERT_TRUE(fs->WriteFileAtomic(path, std::string(100, 'x')).ok());
  auto f = fs->Open(path, OpenOptions{.read_only = true});
  ASSERT_TRUE(f.ok());
  std::vector<char> buf(200);
  Status s = (*f)->Pread(50, buf.data(), 200);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("offset 50"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("length 200"), std::string::npos) << s.ToString();
}

TEST(PosixFileSystemTest, ErrorsCarryErrnoAndPath) {
  TempDir dir;
  FileSystem* fs = FileSystem::Default();
  std::string missing = dir.Sub("nope/file");
  auto f = fs->Open(missing, OpenOptions{.read_only = true});
  ASSERT_FALSE(f.ok());
  EXPECT_TRUE(f.status().IsNotFound());
  EXPECT_EQ(f.status().err(), ENOENT);
  EXPECT_NE(f.status().message().find(missing), std::string::npos);
  EXPECT_NE(f.status().message().find(std::strerror(ENOENT)), std::string::npos);

  // Writing through a read-only descriptor: EBADF with path, offset, length.
  std::string path = dir.Sub("ro");
  ASSERT_TRUE(fs->WriteFileAtomic(path, "abc").ok());
  auto ro = fs->Open(path, OpenOptions{.read_only = true});
  ASSERT_TRUE(ro.ok());
  Status s = (*ro)->Pwrite(4096, "zz", 2);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.err(), EBADF);
  EXPECT_NE(s.message().find(path), std::string::npos);
  EXPECT_NE(s.message().find("offset 4096"), std::string::npos);
  EXPECT_NE(s.message().find(std::strerror(EBADF)), std::string::npos) << s.ToString();

  auto ex = fs->Open(path, OpenOptions{.create = true, .exclusive = true});
  ASSERT_FALSE(ex.ok());
  EXPECT_EQ(ex.status().code(), StatusCode::kAlreadyExists);
}

TEST(PosixFileSystemTest, DirectoryOperations) {
  TempDir dir;
  FileSystem* fs = FileSystem::Default();
  std::string nested = dir.Sub("a/b/c");
  ASSERT_TRUE(fs->CreateDir(nested).ok());
  ASSERT_TRUE(fs->CreateDir(nested).ok());  // exists: OK
  EXPECT_TRUE(*fs->Exists(nested));
  EXPECT_FALSE(*fs->Exists(dir.Sub("a/zz")));
  ASSERT_TRUE(fs->WriteFileAtomic(nested + "/y", "2").ok());
  ASSERT_TRUE(fs->WriteFileAtomic(nested + "/x", "1").ok());
  ASSERT_TRUE(fs->CreateDir(nested + "/sub").ok());
  auto names = fs->ListDir(nested);
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"sub", "x", "y"}));  // sorted, no temp files
  ASSERT_TRUE(fs->SyncDir(nested).ok());
  ASSERT_TRUE(fs->Rename(nested + "/x", nested + "/z").ok());
  EXPECT_EQ(*fs->ReadFileToString(nested + "/z"), "1");
  ASSERT_TRUE(fs->Remove(nested + "/z").ok());
  EXPECT_FALSE(*fs->Exists(nested + "/z"));
  Status rm = fs->Remove(nested + "/z");
  EXPECT_TRUE(rm.IsNotFound());
  ASSERT_TRUE(fs->RemoveAll(dir.Sub("a")).ok());
  EXPECT_FALSE(*fs->Exists(dir.Sub("a")));
  ASSERT_TRUE(fs->RemoveAll(dir.Sub("a")).ok());  // missing: OK
}

TEST(PosixFileSystemTest, WriteFileAtomicReplacesWholeFile) {
  TempDir dir;
  FileSystem* fs = FileSystem::Default();
  std::string path = dir.Sub("manifest.json");
  ASSERT_TRUE(fs->WriteFileAtomic(path, std::string(10000, 'a')).ok());
  ASSERT_TRUE(fs->WriteFileAtomic(path, "short").ok());
  EXPECT_EQ(*fs->ReadFileToString(path), "short");
  ASSERT_TRUE(fs->WriteFileAtomic(path, "").ok());
  EXPECT_EQ(*fs->ReadFileToString(path), "");
  EXPECT_EQ(fs->ListDir(dir.path())->size(), 1u);  // no leftover temp file
  Status s = fs->WriteFileAtomic(dir.Sub("missing_dir/f"), "x");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("missing_dir/f"), std::string::npos);
}

TEST(PosixFileSystemTest, ConcurrentWritersToDisjointRanges) {
  TempDir dir;
  FileSystem* fs = FileSystem::Default();
  auto f = fs->Open(dir.Sub("shared"), OpenOptions{.create = true});
  ASSERT_TRUE(f.ok());
  File* file = f->get();
  constexpr int kThreads = 4;
  constexpr size_t kLen = 65536;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([file, t] {
      std::vector<char> b(kLen);
      FillPattern(b.data(), kLen, 100 + t);
      EXPECT_TRUE(file->Pwrite(t * kLen, b.data(), kLen).ok());
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    std::vector<char> want(kLen), got(kLen);
    FillPattern(want.data(), kLen, 100 + t);
    ASSERT_TRUE(file->Pread(t * kLen, got.data(), kLen).ok());
    EXPECT_EQ(got, want) << "thread " << t;
  }
}

}  // namespace
}  // namespace optstate::vfs
