// Shared helpers of the reliability tests (tests/reliability): the
// deterministic store workload of tests/vfs/store_crash_workload.h driven
// in-process, and an independent check of a committed generation against it.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "vfs/store.h"

namespace optstate::reliability {

// Own copies of the store tests' workload helpers (tests/vfs/store_test_util.h
// and store_crash_workload.h), so that this harness does not break when those
// move: the same deterministic content, independent of the store.
namespace wl {

inline constexpr uint64_t kTestChunk = 2 * vfs::kMiB;

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/var/tmp/optstate-rel-test-XXXXXX";  // a real disk: O_DIRECT works
    path_ = ::mkdtemp(tmpl);
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

inline vfs::StoreOptions TestOptions() {
  vfs::StoreOptions o;
  o.chunk_size_bytes = kTestChunk;
  o.preallocate_step_bytes = 4 * kTestChunk;
  return o;
}

struct WorkloadTensor {
  const char* name;
  uint64_t numel;  // f32 elements
};
inline const std::vector<WorkloadTensor>& WorkloadTensors() {
  static const std::vector<WorkloadTensor> t = {
      {"layers.0.weight", kTestChunk / 4 + 1000},
      {"layers.1.weight", kTestChunk / 8 + 100},
      {"bias", 10},
  };
  return t;
}
inline uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// Does generation g write chunk (ti, f, c)? About 2/3 per generation; one never.
inline bool Writes(uint64_t g, uint32_t ti, uint32_t f, uint64_t c) {
  if (ti == 0 && f == 2 && c == 1) return false;
  return Mix(g * 1000003 + ti * 1009 + f * 101 + c) % 3 != 0;
}
inline uint64_t WrittenAt(uint64_t g, uint32_t ti, uint32_t f, uint64_t c) {
  for (uint64_t w = g; w >= 1; --w) {
    if (Writes(w, ti, f, c)) return w;
  }
  return 0;
}
inline uint64_t WorkloadSeed(uint64_t w, uint32_t ti, uint32_t f, uint64_t c) { return ChunkSeed(w, ti, f, c); }
inline uint64_t StepOf(uint64_t g) { return g * 10; }
inline vfs::StoreOptions WorkloadOptions() {
  vfs::StoreOptions o = TestOptions();
  o.retained_generations = 2;
  return o;
}

}  // namespace wl

using wl::Buf;
using wl::kTestChunk;

#define REL_ASSERT_OK(expr)                                 \
  do {                                                      \
    ::optstate::Status s_ = (expr);                         \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)

// Finds or creates the workload's tensors (in the pending generation).
inline Status EnsureWorkloadTensors(vfs::Store* store, std::vector<vfs::TensorInfo>* out) {
  out->clear();
  for (const auto& w : wl::WorkloadTensors()) {
    auto t = store->FindTensor(w.name);
    if (!t.ok()) {
      vfs::TensorSpec spec;
      spec.name = w.name;
      spec.numel = w.numel;
      t = store->CreateTensor(spec);
      if (!t.ok()) return t.status();
    }
    out->push_back(*t);
  }
  return Status::Ok();
}

// Writes generation g's chunks (store_crash_workload.h) without committing.
// `max_chunks` limits how many are written (a partial, uncommitted generation).
inline Status WriteWorkloadGeneration(vfs::Store* store, const std::vector<vfs::TensorInfo>& tensors, uint64_t g,
                                      uint64_t max_chunks = UINT64_MAX) {
  Buf buf(kTestChunk);
  uint64_t n = 0;
  for (uint32_t ti = 0; ti < tensors.size(); ++ti) {
    for (uint32_t f = 0; f < 3; ++f) {
      for (uint64_t c = 0; c < store->ChunkCount(tensors[ti], f); ++c) {
        if (!wl::Writes(g, ti, f, c)) continue;
        if (n++ >= max_chunks) return Status::Ok();
        wl::FillPattern(buf.data(), kTestChunk, wl::WorkloadSeed(g, ti, f, c));
        OPTSTATE_RETURN_IF_ERROR(store->WriteChunk(vfs::ChunkRef{tensors[ti].id, f, c}, buf.data()));
      }
    }
  }
  return Status::Ok();
}

inline vfs::CommitInfo WorkloadCommitInfo(uint64_t g) {
  vfs::CommitInfo ci;
  ci.step = wl::StepOf(g);
  ci.groups = {vfs::GroupInfo{0, g, {{"lr", 1.0 / static_cast<double>(g)}}}};
  return ci;
}

// Writes and commits generation g; returns the Commit result.
inline Result<uint64_t> CommitWorkloadGeneration(vfs::Store* store, uint64_t g) {
  std::vector<vfs::TensorInfo> tensors;
  OPTSTATE_RETURN_IF_ERROR(EnsureWorkloadTensors(store, &tensors));
  OPTSTATE_RETURN_IF_ERROR(WriteWorkloadGeneration(store, tensors, g));
  return store->Commit(WorkloadCommitInfo(g));
}

// Every chunk of `view` equals the reference of generation g, bit for bit.
inline ::testing::AssertionResult GenerationMatchesReference(const vfs::GenerationView& view, uint64_t g,
                                                             uint64_t* bytes_compared) {
  using namespace wl;  // NOLINT
  if (view.info().generation != g) {
    return ::testing::AssertionFailure() << "view is generation " << view.info().generation << ", expected " << g;
  }
  if (g == 0) return ::testing::AssertionSuccess();
  if (view.info().step != StepOf(g)) return ::testing::AssertionFailure() << "generation " << g << " step " << view.info().step;
  if (view.info().groups.size() != 1 || view.info().groups[0].step_count != g ||
      view.info().groups[0].hyper.count("lr") == 0 || view.info().groups[0].hyper.at("lr") != 1.0 / static_cast<double>(g)) {
    return ::testing::AssertionFailure() << "generation " << g << ": groups differ from the reference";
  }
  const auto& specs = WorkloadTensors();
  if (view.tensors().size() != specs.size()) return ::testing::AssertionFailure() << "tensor count " << view.tensors().size();
  Buf got(kTestChunk), want(kTestChunk);
  for (uint32_t ti = 0; ti < specs.size(); ++ti) {
    auto t = view.FindTensor(specs[ti].name);
    if (!t.ok()) return ::testing::AssertionFailure() << t.status().ToString();
    if (t->numel != specs[ti].numel) return ::testing::AssertionFailure() << specs[ti].name << " numel " << t->numel;
    for (uint32_t f = 0; f < 3; ++f) {
      for (uint64_t c = 0; c < view.ChunkCount(*t, f); ++c) {
        const uint64_t len = std::min(kTestChunk, t->field_bytes(f) - c * kTestChunk);
        Status s = view.ReadChunk(vfs::ChunkRef{t->id, f, c}, got.data());
        if (!s.ok()) return ::testing::AssertionFailure() << "generation " << g << ": " << s.ToString();
        const uint64_t w = WrittenAt(g, ti, f, c);
        if (w == 0) {
          std::memset(want.data(), 0, kTestChunk);
        } else {
          FillPattern(want.data(), kTestChunk, WorkloadSeed(w, ti, f, c));
        }
        if (std::memcmp(got.data(), want.data(), len) != 0) {
          return ::testing::AssertionFailure() << "generation " << g << " tensor " << specs[ti].name << " field " << f
                                               << " chunk " << c << " differs (expected bytes of generation " << w << ")";
        }
        if (bytes_compared) *bytes_compared += len;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Opens `path` on the real file system and checks: latest in [lo, hi], equal
// to its reference, Verify clean, and after GC no leaked extent. Returns the
// latest generation (or UINT64_MAX after a failure).
inline uint64_t CheckReopenedStore(const std::string& path, uint64_t lo, uint64_t hi, uint64_t* bytes_compared,
                                   const std::string& what) {
  auto s = vfs::Store::Open(path, wl::WorkloadOptions());
  EXPECT_TRUE(s.ok()) << what << ": reopen: " << s.status().ToString();
  if (!s.ok()) return UINT64_MAX;
  const uint64_t g = (*s)->LatestGeneration().generation;
  EXPECT_GE(g, lo) << what << ": an acknowledged generation was lost";
  EXPECT_LE(g, hi) << what;
  auto view = (*s)->OpenGeneration(vfs::kLatest);
  EXPECT_TRUE(view.ok()) << what << ": " << view.status().ToString();
  if (view.ok()) {
    EXPECT_TRUE(GenerationMatchesReference(**view, g, bytes_compared)) << what;
    view->reset();
  }
  Status gc = (*s)->CollectGarbage();
  EXPECT_TRUE(gc.ok()) << what << ": " << gc.ToString();
  auto rep = (*s)->Verify();
  EXPECT_TRUE(rep.ok()) << what << ": " << rep.status().ToString();
  if (rep.ok()) {
    EXPECT_TRUE(rep->problems.empty()) << what << ": " << (rep->problems.empty() ? "" : rep->problems[0]);
    EXPECT_EQ(rep->leaked_slots, 0u) << what;
  }
  return g;
}

}  // namespace optstate::reliability
