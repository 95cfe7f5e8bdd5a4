// Helpers shared by the I/O layer tests: temporary directories on the repo's
// disk (O_DIRECT-capable ext4) and on tmpfs (/dev/shm), aligned buffers and
// deterministic patterns.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "vfs/file_system.h"

namespace optstate::vfs::testing {

// A fresh directory under base, removed (with its contents) on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& base = DefaultBase()) {
    std::string templ = base + "/optstate_io_test.XXXXXX";
    char* p = ::mkdtemp(templ.data());
    if (p == nullptr && base != DefaultBase()) {  // no /dev/shm here: the disk will do
      templ = DefaultBase() + "/optstate_io_test.XXXXXX";
      p = ::mkdtemp(templ.data());
    }
    EXPECT_NE(p, nullptr) << "mkdtemp " << templ << ": " << std::strerror(errno);
    path_ = templ;
  }
  ~TempDir() { (void)FileSystem::Default()->RemoveAll(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

  // On the repo's disk (not /tmp, which may be tmpfs): TEST_TMPDIR, else the
  // build tree's working directory.
  static std::string DefaultBase() {
    if (const char* t = std::getenv("TEST_TMPDIR"); t != nullptr && *t != '\0') return t;
    char cwd[4096];
    if (::getcwd(cwd, sizeof(cwd)) != nullptr) return cwd;
    return "/tmp";
  }

 private:
  std::string path_;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<std::byte, FreeDeleter>;

inline AlignedBuf AllocAligned(size_t bytes, size_t align = 4096) {
  void* p = nullptr;
  if (::posix_memalign(&p, align, bytes == 0 ? align : bytes) != 0) return nullptr;
  std::memset(p, 0, bytes == 0 ? align : bytes);
  return AlignedBuf(static_cast<std::byte*>(p));
}

inline void FillPattern(void* buf, size_t len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* b = static_cast<unsigned char*>(buf);
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    uint64_t v = rng();
    std::memcpy(b + i, &v, 8);
  }
  uint64_t v = rng();
  std::memcpy(b + i, &v, len - i);
}

}  // namespace optstate::vfs::testing
