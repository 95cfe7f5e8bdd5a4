// Helpers of the store tests (namespace store_testing: vfs_test links other
// areas' helpers of the same names in vfs::testing): temp dirs, aligned
// buffers and the deterministic chunk content used as an independent
// reference, all from tests/common/test_util.h, plus the store options the
// tests use.
#pragma once

#include <cstdint>
#include <string>

#include "tests/common/test_util.h"
#include "vfs/store.h"

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

inline StoreOptions TestOptions() {
  StoreOptions o;
  o.chunk_size_bytes = kTestChunk;
  o.preallocate_step_bytes = 4 * kTestChunk;
  return o;
}

}  // namespace optstate::vfs::store_testing
