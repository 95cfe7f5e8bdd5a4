// The staging plan of a step's slice pipeline (internal/slice_pipeline.h),
// internal to memmgr: how many slices it stages at once, how many staging
// buffers it takes and how big the automatic staging pool grows for a state
// (a full slice's chunks: 3 with AdamW's f32 moments, 4 with bf16 moments,
// 8 with q8 moments; internal/slice_layout.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "memmgr/internal/slice_layout.h"
#include "memmgr/memory_manager.h"

namespace optstate::memmgr::internal {

// A slice of at most this many bytes per field goes into a small set.
constexpr uint64_t kSmallSliceBytes = 256ull << 10;

// Requests the pipeline's ring holds: with depths counted in bytes, a queue of
// small slices has more requests in flight than chunks.
inline uint32_t RingRequests(const MemoryManagerOptions& o) {
  return 4 * (std::max<uint32_t>(o.queue_depth, 6) + o.write_queue_depth);
}

// The size of a full slice: its chunks (buffers, device pages) and the bytes
// it moves each way in whole chunks (SliceLayout). The default, three chunks
// of three fields, sizes the staging pool before an optimizer sizes it to its
// state.
struct SliceSize {
  uint32_t chunks = 3;
  uint32_t bytes_in_chunks = 3;
};
inline SliceSize SizeOf(const SliceLayout& l) { return SliceSize{l.slice_chunks(), l.slice_bytes_in_chunks()}; }

// Slices the pipeline stages at once: read_ahead_chunks, or (0 = auto) enough
// to fill both depth limits (counted in chunks' bytes) with slices of this
// size, plus four being computed: a slice that moves twice the bytes (q8
// AdamW against f32) needs half as many to keep the disk as busy.
inline uint32_t StepPipelineSlices(const MemoryManagerOptions& o, SliceSize z) {
  if (o.read_ahead_chunks != 0) return o.read_ahead_chunks;
  return (o.queue_depth + o.write_queue_depth) / z.bytes_in_chunks + 4;
}

// The staging pool's automatic size for slices of this size: a set per
// slice, plus two the pipeline leaves for concurrent pins and two spare
// (ManagerImpl::Init for the default size, GrowStaging for wider slices).
inline uint32_t StepPipelineStaging(const MemoryManagerOptions& o, SliceSize z) {
  return z.chunks * StepPipelineSlices(o, z) + 4;
}

// Staging buffers a step's pipeline takes from a pool of `pool` (a set per
// slice, leaving two for concurrent pins when the pool has them beyond the
// pipeline's minimum, `min_bufs`: a full slice's chunks, or one buffer when
// every slice of the state is small): SlicePipeline::Begin, and the bound of
// what a Prefetch stages for it to adopt.
inline size_t StepPipelineBuffers(size_t pool, const MemoryManagerOptions& o, SliceSize z, size_t min_bufs = 0) {
  if (min_bufs == 0) min_bufs = z.chunks;
  const size_t max_bufs = pool >= min_bufs + 2 ? pool - 2 : pool;
  return std::min<size_t>(max_bufs, size_t{z.chunks} * StepPipelineSlices(o, z));
}

// The slices of a state, for sizing the staging pool to it: big slices (a
// field's chunk over kSmallSliceBytes) take a chunk-sized buffer per chunk,
// small ones kSmallSliceBytes pieces of one.
struct StateSlices {
  uint64_t big = 0;
  uint64_t small = 0;
  // The state's bytes in params of whole-tensor rules (units: Muon's
  // matrices) and of elementwise ones (slices).
  uint64_t unit_bytes = 0;
  uint64_t slice_bytes = 0;
};

// Small staging sets worth having: as many small slices as the pipeline's
// ring can have in flight at once, at most the state's.
inline uint64_t SmallSetsFor(const MemoryManagerOptions& o, SliceSize z, const StateSlices& s) {
  return std::min<uint64_t>(s.small, RingRequests(o) / z.chunks);
}

// The automatic staging pool for a state: the smaller of the throughput plan
// (StepPipelineStaging) and what the state's slices can use at once (a set
// per big slice up to the plan's depth, pieces for the small sets of
// SmallSetsFor, at least one full slice when any slice is big), plus two
// buffers for concurrent pins; 0 for no state. A state of a few small tensors
// then takes a few buffers, not the plan's dozens.
inline uint32_t StateStaging(const MemoryManagerOptions& o, SliceSize z, uint64_t chunk_bytes,
                             const StateSlices& s) {
  if (s.big == 0 && s.small == 0) return 0;  // no state yet: nothing to grow for
  const uint64_t bufs = z.chunks;
  const uint64_t plan = StepPipelineStaging(o, z);
  const uint64_t pieces_per_buffer = std::max<uint64_t>(1, chunk_bytes / kSmallSliceBytes);
  uint64_t need = bufs * std::min<uint64_t>(s.big, StepPipelineSlices(o, z));
  need += (SmallSetsFor(o, z, s) * bufs + pieces_per_buffer - 1) / pieces_per_buffer;
  if (s.big > 0) need = std::max(need, bufs);
  return static_cast<uint32_t>(std::min(plan, need + 2));
}

}  // namespace optstate::memmgr::internal
