// vfs/io_buffer.h: alignment, zero fill, huge-page backing where the kernel
// offers transparent huge pages, and O_DIRECT round trips through registered
// io_uring buffers of both kinds.
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/vfs/io_test_util.h"
#include "vfs/file_system.h"
#include "vfs/io_buffer.h"
#include "vfs/io_engine.h"

namespace optstate::vfs {
namespace {

using testing::FillPattern;
using testing::TempDir;

constexpr uint64_t kMiB = 1ull << 20;

bool AllZero(const std::byte* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != std::byte{0}) return false;
  }
  return true;
}

// "AnonHugePages" of the mapping that holds p, in KiB, from /proc/self/smaps;
// -1 when no mapping holds it.
long AnonHugeKiBAt(const void* p) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  const auto a = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  while (std::getline(in, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= a && a < hi;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) return std::stol(line.substr(14));
  }
  return -1;
}

// THP as this kernel is set: "always" or "madvise" honour MADV_HUGEPAGE.
bool ThpHonoursMadvise() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return s.find("[always]") != std::string::npos || s.find("[madvise]") != std::string::npos;
}

TEST(IoBufferTest, BasePagesAreAlignedAndZero) {
  for (uint64_t bytes : {uint64_t{1}, uint64_t{4096}, 3 * kMiB + 123}) {
    IoBuffer b(bytes);
    ASSERT_TRUE(b.ok()) << bytes;
    EXPECT_EQ(b.size(), bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4096, 0u) << bytes;
    EXPECT_TRUE(AllZero(b.data(), bytes)) << bytes;
  }
  EXPECT_FALSE(IoBuffer(0).ok());
  EXPECT_FALSE(AllocateIoMemory(0).ok());
}

TEST(IoBufferTest, HugePagesAre2MiBAlignedZeroAndBackedByHugePages) {
  const uint64_t bytes = 8 * kMiB + 4096;  // not a multiple of 2 MiB
  IoBuffer b(bytes, IoPages::kHuge);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % (2 * kMiB), 0u);
  EXPECT_TRUE(AllZero(b.data(), bytes));
  std::memset(b.data(), 0xab, bytes);  // every byte is writable
  // Small blocks stay base pages whatever is asked.
  IoBuffer small(64 << 10, IoPages::kHuge);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % 4096, 0u);
  if (!ThpHonoursMadvise()) GTEST_SKIP() << "transparent huge pages are off on this kernel";
  // The first 8 MiB are whole aligned huge pages; the kernel backs at least
  // one of them with a huge page when the advice was given (faulted at once).
  EXPECT_GE(AnonHugeKiBAt(b.data()), 2048) << "MADV_HUGEPAGE had no effect on the buffer";
}

// Both kinds work as registered io_uring buffers for O_DIRECT I/O, also when
// one request spans several huge pages.
// The reference for MaxDeviceRequestBytes, found another way: the disk in
// /sys/block whose own or partition's `dev` file names path's device.
std::optional<uint64_t> MaxSectorsViaSysBlock(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  const std::string want = std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  std::error_code ec;
  for (const auto& disk : std::filesystem::directory_iterator("/sys/block", ec)) {
    std::vector<std::filesystem::path> devs = {disk.path() / "dev"};
    for (const auto& part : std::filesystem::directory_iterator(disk.path(), ec)) devs.push_back(part.path() / "dev");
    for (const auto& d : devs) {
      std::ifstream in(d);
      std::string id;
      if (!(in >> id) || id != want) continue;
      std::ifstream q(disk.path() / "queue" / "max_sectors_kb");
      uint64_t kib = 0;
      if (q >> kib) return kib << 10;
    }
  }
  return std::nullopt;
}

// PreferredIoPages: huge pages exactly where the device takes 2 MiB requests;
// a path on no block device (tmpfs) gets base pages and says why; a missing
// path is an errno error naming it.
TEST(IoBufferTest, PreferredPagesFollowTheDevicesLargestRequest) {
  TempDir dir;
  const std::optional<uint64_t> want = MaxSectorsViaSysBlock(dir.path());
  auto got = MaxDeviceRequestBytes(dir.path());
  if (!want) {
    EXPECT_FALSE(got.ok()) << "found " << *got << " where /sys/block has nothing for " << dir.path();
  } else {
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, *want);
    std::string why;
    EXPECT_EQ(PreferredIoPages(dir.path(), &why), *want >= 2 * kMiB ? IoPages::kHuge : IoPages::kBase);
    EXPECT_NE(why.find(std::to_string(*want >> 10) + " KiB"), std::string::npos) << why;
  }
  if (std::filesystem::is_directory("/dev/shm")) {
    EXPECT_EQ(MaxDeviceRequestBytes("/dev/shm").status().code(), StatusCode::kNotFound);
    std::string why;
    EXPECT_EQ(PreferredIoPages("/dev/shm", &why), IoPages::kBase);
    EXPECT_NE(why.find("/dev/shm"), std::string::npos) << why;
  }
  auto missing = MaxDeviceRequestBytes(dir.path() + "/nope");
  EXPECT_EQ(missing.status().err(), ENOENT) << missing.status().ToString();
  EXPECT_NE(missing.status().message().find("/nope"), std::string::npos);
}

TEST(IoBufferTest, DirectIoRoundTripInBothKinds) {
  TempDir dir;
  for (IoPages pages : {IoPages::kBase, IoPages::kHuge}) {
    const uint64_t len = 8 * kMiB;
    IoBuffer out(len, pages), back(len, pages);
    ASSERT_TRUE(out.ok() && back.ok());
    FillPattern(out.data(), len, pages == IoPages::kHuge ? 7 : 9);
    auto f = FileSystem::Default()->Open(dir.Sub(pages == IoPages::kHuge ? "huge" : "base"),
                                         OpenOptions{.create = true, .direct = true});
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    IoEngineOptions o;
    o.queue_depth = 4;
    o.registered_buffers = {out.span(), back.span()};
    auto e = IoEngine::NewUring(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    for (auto op : {IoRequest::Op::kWrite, IoRequest::Op::kRead}) {
      // Two requests, the second starting mid huge page.
      const uint64_t split = 3 * kMiB;
      std::byte* b = op == IoRequest::Op::kWrite ? out.data() : back.data();
      std::vector<IoRequest> reqs = {{op, f->get(), 0, split, b, 0},
                                     {op, f->get(), split, len - split, b + split, 1}};
      ASSERT_TRUE((*e)->Submit(reqs).ok());
      std::vector<IoCompletion> done;
      ASSERT_TRUE((*e)->Reap(&done, 2).ok());
      ASSERT_EQ(done.size(), 2u);
      for (const auto& c : done) EXPECT_TRUE(c.status.ok()) << c.status.ToString();
    }
    EXPECT_EQ(std::memcmp(out.data(), back.data(), len), 0);
  }
}

}  // namespace
}  // namespace optstate::vfs
