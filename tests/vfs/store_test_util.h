// Helpers of the store tests (namespace store_testing: vfs_test links other
// areas' helpers of the same names in vfs::testing): temp dirs, aligned
// buffers and the deterministic chunk content used as an independent
// reference, all from tests/common/test_util.h, plus the store options the
// tests use; the Status/Result assertions from tests/common/status_test_util.h.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "tests/common/status_test_util.h"
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

using test_util::Unwrap;

// Creates tensor `name` of `numel` elements (group 0, fp32) in s's pending
// generation; a failure fails the test and aborts it.
inline TensorInfo NewTensor(Store* s, const std::string& name, uint64_t numel) {
  TensorSpec spec;
  spec.name = name;
  spec.numel = numel;
  return Unwrap(s->CreateTensor(spec));
}

inline StoreOptions TestOptions() {
  StoreOptions o;
  o.chunk_size_bytes = kTestChunk;
  o.preallocate_step_bytes = 4 * kTestChunk;
  return o;
}

}  // namespace optstate::vfs::store_testing
