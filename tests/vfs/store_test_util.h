// Helpers of the store tests (namespace store_testing: vfs_test links other
// areas' helpers of the same names in vfs::testing): temp dirs, aligned
// buffers and the deterministic chunk content used as an independent
// reference, all from tests/common/test_util.h, plus the store options the
// tests use and the Status/Result assertions.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "tests/common/test_util.h"
#include "vfs/store.h"

// Fails the test (and returns) when a Status is not OK, with its message.
#define ASSERT_OK(expr)                    \
  do {                                     \
    auto _s = (expr);                      \
    ASSERT_TRUE(_s.ok()) << _s.ToString(); \
  } while (0)

namespace optstate::vfs::store_testing {

inline constexpr uint64_t kTestChunk = 2 * kMiB;

// A fresh directory under /tmp, removed (recursively) on destruction.
class TempDir : public test_util::TempDir {
 public:
  TempDir() : test_util::TempDir("/tmp/optstate-store-test-") {}
};

using test_util::Buf;
using test_util::ChunkSeed;
using test_util::FillPattern;

// The value of r; a failed Result fails the test and aborts it (the callers
// need the value to go on).
template <typename T>
T Unwrap(Result<T> r) {
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) std::abort();
  return std::move(r).value();
}

inline StoreOptions TestOptions() {
  StoreOptions o;
  o.chunk_size_bytes = kTestChunk;
  o.preallocate_step_bytes = 4 * kTestChunk;
  return o;
}

}  // namespace optstate::vfs::store_testing
