// Shared helpers of the memmgr tests (host backend in memmgr_test, cuda
// backend in memmgr_gpu_test: the same tests, built twice).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "tests/common/status_test_util.h"
#include "tests/common/test_util.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "vfs/store.h"

namespace optstate::memmgr::testing {

#ifdef MEMMGR_TEST_CUDA
inline constexpr Backend kTestBackend = Backend::kCuda;
#define MEMMGR_REQUIRE_BACKEND()                                                   \
  do {                                                                             \
    if (!::optstate::memmgr::CudaAvailable()) GTEST_SKIP() << "no CUDA device visible (cuda backend test)"; \
  } while (0)
#else
inline constexpr Backend kTestBackend = Backend::kHost;
#define MEMMGR_REQUIRE_BACKEND() \
  do {                           \
  } while (0)
#endif

inline constexpr uint64_t kChunk = 2ull << 20;  // smallest legal chunk: most chunk boundaries per byte

// A fresh directory under OPTSTATE_TEST_DIR (or /var/tmp: a real disk, so
// O_DIRECT works), removed (recursively) on destruction.
class TempDir : public test_util::TempDir {
 public:
  TempDir() : test_util::TempDir(test_util::EnvDirOr("OPTSTATE_TEST_DIR", "/var/tmp") + "/memmgr_test.") {}
};

inline vfs::StoreOptions TestStoreOptions() {
  vfs::StoreOptions o;
  o.chunk_size_bytes = kChunk;
  o.preallocate_step_bytes = 64ull << 20;
  return o;
}

inline MemoryManagerOptions TestMmOptions(uint64_t budget_bytes) {
  MemoryManagerOptions o;
  o.backend = kTestBackend;
  o.device_budget_bytes = budget_bytes;
  o.queue_depth = 32;
  o.host_cache_bytes = 0;  // tests count disk reads; the host cache tier's tests set it
  return o;
}

// A store in a temp dir and its memory manager (TestStoreOptions /
// TestMmOptions), opened and closed as a test needs.
struct StoreEnv {
  TempDir dir;
  std::unique_ptr<vfs::Store> store;
  std::unique_ptr<MemoryManager> mm;
  std::string path() const { return dir.path() + "/store"; }
  void Open(bool create, uint64_t budget, uint64_t host_cache_bytes = 0) {
    store = create ? MUST(vfs::Store::Create(path(), TestStoreOptions()))
                   : MUST(vfs::Store::Open(path(), TestStoreOptions()));
    MemoryManagerOptions o = TestMmOptions(budget);
    o.host_cache_bytes = host_cache_bytes;
    mm = MUST(MemoryManager::Create(store.get(), o));
  }
  void Close() {
    mm.reset();
    store.reset();
  }
};

// Group 0: AdamW, lr 1e-2, weight decay 0.01.
inline ParamGroup TestGroup() {
  ParamGroup g;
  g.id = 0;
  g.lr = 1e-2;
  g.weight_decay = 0.01;
  return g;
}

// Deterministic pseudo-random values (splitmix64).
inline uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline float RandF(uint64_t seed, uint64_t i) {
  return static_cast<float>(static_cast<int64_t>(Mix(seed * 0x100000001B3ull + i) >> 40) - (1 << 23)) /
         static_cast<float>(1 << 23);
}

// Device buffer through the manager (host memory on the host backend).
class DeviceBuffer {
 public:
  DeviceBuffer(MemoryManager* mm, uint64_t bytes) : mm_(mm), bytes_(bytes) {
    ptr_ = MUST(mm->AllocDevice(bytes ? bytes : 4));
  }
  ~DeviceBuffer() { (void)mm_->FreeDevice(ptr_); }
  void* get() const { return ptr_; }
  void Upload(const void* h) { EXPECT_TRUE(mm_->CopyToDevice(ptr_, h, bytes_).ok()); }
  void Download(void* h) const { EXPECT_TRUE(mm_->CopyToHost(h, ptr_, bytes_).ok()); }

 private:
  MemoryManager* mm_;
  uint64_t bytes_;
  void* ptr_;
};

// Reads a whole field through pins of at most one chunk each.
inline std::vector<float> ReadField(MemoryManager* mm, const std::string& tensor, const std::string& field,
                                    uint64_t numel) {
  std::vector<float> out(numel);
  const uint64_t per = kChunk / 4;
  for (uint64_t first = 0; first < numel; first += per) {
    uint64_t n = std::min(per, numel - first);
    auto pin = mm->Pin(tensor, field, first, n, Access::kRead);
    if (!pin.ok()) {
      ADD_FAILURE() << "pin " << tensor << "/" << field << ": " << pin.status().ToString();
      return out;
    }
    EXPECT_TRUE(mm->CopyToHost(out.data() + first, pin->data(), n * 4).ok());
  }
  return out;
}

// The kernel's parameters for one step of a param of group g whose own step
// count (after this step) is `step`.
inline kernels::AdamParams AdamParamsOf(const ParamGroup& g, uint64_t step) {
  kernels::AdamParams ap;
  ap.lr = g.lr;
  ap.beta1 = g.beta1;
  ap.beta2 = g.beta2;
  ap.eps = g.eps;
  ap.weight_decay = g.weight_decay;
  ap.mode = g.adamw ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
  ap.step = step;
  return ap;
}

// All bytes of a field of the latest committed generation, chunk by chunk at
// the field's own chunk stride.
inline std::vector<uint8_t> FieldBytes(vfs::Store* store, const std::string& tensor, const std::string& field) {
  auto view = MUST(store->OpenGeneration(vfs::kLatest));
  const vfs::TensorInfo t = MUST(view->FindTensor(tensor));
  const uint32_t f = static_cast<uint32_t>(t.FieldIndexOf(field));
  const uint64_t stride = t.field_chunk_bytes(f, store->chunk_size_bytes());
  std::vector<uint8_t> out(t.field_bytes(f));
  std::unique_ptr<void, decltype(&std::free)> buf(std::aligned_alloc(4096, store->chunk_size_bytes()), &std::free);
  for (uint64_t c = 0; c < view->ChunkCount(t, f); ++c) {
    EXPECT_TRUE(view->ReadChunk(vfs::ChunkRef{t.id, f, c}, buf.get()).ok());
    std::memcpy(out.data() + c * stride, buf.get(), std::min(stride, out.size() - c * stride));
  }
  return out;
}

// got (FieldBytes) holds exactly want's bytes.
template <typename T>
void ExpectBytes(const std::vector<uint8_t>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size() * sizeof(T)) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << what;
}

// Number of q8 blocks (one fp32 absmax each) over n elements.
inline uint64_t Blocks(uint64_t n) { return (n + kernels::kQ8BlockElems - 1) / kernels::kQ8BlockElems; }

}  // namespace optstate::memmgr::testing
