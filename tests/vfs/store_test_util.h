// Helpers shared by the store tests (namespace store_testing: vfs_test links
// other areas' helpers of the same names in vfs::testing), temp dirs, aligned buffers, and the
// deterministic chunk content used as an independent reference.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "vfs/store.h"

namespace optstate::vfs::store_testing {

inline constexpr uint64_t kTestChunk = 2 * kMiB;

// A fresh directory under /tmp, removed (recursively) on destruction.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/optstate-store-test-XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& s) const { return path_ + "/" + s; }

 private:
  std::string path_;
};

// 4096-aligned heap buffer.
class Buf {
 public:
  explicit Buf(uint64_t n) : n_(n), p_(static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {
    std::memset(p_, 0xAB, n_);
  }
  ~Buf() { std::free(p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  uint8_t* data() { return p_; }
  const uint8_t* data() const { return p_; }
  uint64_t size() const { return n_; }

 private:
  uint64_t n_;
  uint8_t* p_;
};

// splitmix64-based bytes: content = f(seed) for `len` bytes.
inline void FillPattern(void* dst, uint64_t len, uint64_t seed) {
  auto* p = static_cast<uint8_t*>(dst);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, 8);
  }
  for (; i < len; ++i) p[i] = static_cast<uint8_t>(seed + i);
}

inline uint64_t ChunkSeed(uint64_t gen, uint32_t tensor, uint32_t field, uint64_t chunk) {
  return (gen << 40) ^ (uint64_t{tensor} << 24) ^ (uint64_t{field} << 20) ^ chunk ^ 0x5bd1e995ull;
}

inline StoreOptions TestOptions() {
  StoreOptions o;
  o.chunk_size_bytes = kTestChunk;
  o.preallocate_step_bytes = 4 * kTestChunk;
  return o;
}

}  // namespace optstate::vfs::store_testing
