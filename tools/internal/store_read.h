// Reading a field of a tensor out of a committed generation, chunk by chunk,
// with statistics. Used by optstate-inspect (show, diff), optstate-demo and
// the tests.
//
// Thread-safety: free functions; FieldStats is a value.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "base/status.h"
#include "vfs/store.h"

namespace optstate::tools {

// Element i of a buffer ForEachRange handed over for a field of dtype d, as
// double (q8 fields arrive decoded, as fp32).
double ElementAsDouble(DType d, const void* base, uint64_t i);

// Statistics over a stream of values. min/max/mean/L2 are over finite values;
// NaN and +-Inf are counted.
struct FieldStats {
  uint64_t count = 0;     // all values, NaN/Inf included
  uint64_t nan = 0;
  uint64_t inf = 0;
  double min = std::numeric_limits<double>::infinity();
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0;
  double sum_sq = 0;
  void Add(double v);
  uint64_t finite() const { return count - nan - inf; }
  double mean() const;    // NaN when no finite value
  double l2() const;
};

// Calls fn(first_elem, data, count) for each piece of [begin, end) of `field`
// in chunk order; data points at `count` elements of the field's dtype (q8
// codes: decoded, map[code] x absmax, as fp32), valid only during the call. Reads go through view.ReadChunk (checksum-verified).
using ChunkFn = std::function<Status(uint64_t first_elem, const void* data, uint64_t count)>;
Status ForEachRange(const vfs::GenerationView& view, const vfs::TensorInfo& t, uint32_t field,
                    uint64_t begin, uint64_t end, const ChunkFn& fn);

// Field index by name in a TensorInfo; NotFound naming the tensor and its fields.
Result<uint32_t> FieldByName(const vfs::TensorInfo& t, const std::string& field);

// Compares every tensor, field and byte of two generations. Returns the list
// of differences (empty: bit-for-bit equal), each naming tensor, field and the
// first differing element; also differences in the tensor sets and metadata.
Result<std::vector<std::string>> CompareGenerations(const vfs::GenerationView& a,
                                                    const vfs::GenerationView& b);

// What writing every chunk of every field of `tensors` once takes (a
// StreamedAdam step rewrites them all, each to a fresh extent): the fields'
// logical bytes and the disk space of those versions (vfs::ChunkAllocatedBytes).
struct FullWrite {
  uint64_t params = 0;           // sum of numel
  uint64_t chunks = 0;
  uint64_t logical_bytes = 0;    // sum of field bytes
  uint64_t allocated_bytes = 0;  // sum of vfs::ChunkAllocatedBytes over the chunks
};
FullWrite WriteOfEveryChunk(const std::vector<vfs::TensorInfo>& tensors, uint64_t chunk_size_bytes);

}  // namespace optstate::tools
