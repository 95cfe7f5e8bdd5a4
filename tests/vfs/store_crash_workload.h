// The deterministic workload of the crash tests, shared by the child that
// runs it (crash_child.cc) and the parent that checks what survived
// (store_crash_test.cc): which chunks generation g writes and with what bytes,
// so the expected state of any committed generation is computed independently
// of the store.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tests/vfs/store_test_util.h"

namespace optstate::vfs::store_testing {

struct WorkloadTensor {
  const char* name;
  uint64_t numel;  // f32 elements
};

// 2 + 1 + 1 chunks per field with 2 MiB chunks (the last ones partial).
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

// Does generation g write chunk (ti, f, c)? About 2/3 of chunks per generation;
// some are never written and must read as zeros.
inline bool Writes(uint64_t g, uint32_t ti, uint32_t f, uint64_t c) {
  if (ti == 0 && f == 2 && c == 1) return false;  // never written
  return Mix(g * 1000003 + ti * 1009 + f * 101 + c) % 3 != 0;
}

// The generation whose bytes chunk (ti, f, c) holds in committed generation g; 0 = zeros.
inline uint64_t WrittenAt(uint64_t g, uint32_t ti, uint32_t f, uint64_t c) {
  for (uint64_t w = g; w >= 1; --w) {
    if (Writes(w, ti, f, c)) return w;
  }
  return 0;
}

inline uint64_t WorkloadSeed(uint64_t w, uint32_t ti, uint32_t f, uint64_t c) { return ChunkSeed(w, ti, f, c); }

inline uint64_t StepOf(uint64_t g) { return g * 10; }

inline StoreOptions WorkloadOptions() {
  StoreOptions o = TestOptions();
  o.retained_generations = 2;
  return o;
}

}  // namespace optstate::vfs::store_testing
