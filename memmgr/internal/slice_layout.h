// SliceLayout: the chunk geometry of an update rule's fields in a store of a
// given chunk size (internal to memmgr). One place derives, from the rule's
// declared fields, the fields' chunk sizes (for creating a tensor), which
// chunks of which field make slice c of a tensor (for the step, its prefetch
// and the staging plan), and where each kernel call's operands start inside
// a slice's buffers.
//
// Field f stores one value of value_size[f] bytes per elems_per_value[f]
// tensor elements. A field of one value per element is cut into chunks of
// the store's chunk size; a field of one value per block (q8 scales) into
// chunks that cover a whole slice's elements, so that chunk c of it belongs
// to slice c. A slice covers the elements of one chunk of the field with the
// most elements per chunk; the kernel runs on pieces of the elements of one
// chunk of the field with the fewest (every field is contiguous there).
// Thread-safety: immutable after Make.
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"
#include "memmgr/update_rule.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

class SliceLayout {
 public:
  // One chunk of a slice: the rule's field (index into Fields()), the chunk
  // index in that field and its logical bytes.
  struct Chunk {
    uint32_t rule_field = 0;
    uint64_t index = 0;
    uint64_t len = 0;
  };
  // The chunks of one slice, field by field (all of field 0's first).
  struct Slice {
    uint64_t first_elem = 0;
    uint64_t elems = 0;
    uint32_t n = 0;                                   // chunks
    Chunk chunks[kMaxSliceChunks];
    uint32_t field_first[kMaxRuleFields] = {};        // index in chunks of each field's first chunk
  };

  SliceLayout() = default;
  // kInvalidArgument when the rule's fields do not make slices of at most
  // kMaxSliceChunks chunks in chunks of chunk_bytes (a multiple of 2 MiB).
  static Result<SliceLayout> Make(const UpdateRule& rule, uint64_t chunk_bytes);

  uint32_t fields() const { return n_fields_; }
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  // Elements of a full slice.
  uint64_t slice_elems() const { return slice_elems_; }
  // Chunks in a full slice (buffers and device pages it holds).
  uint32_t slice_chunks() const { return slice_chunks_; }
  // Bytes a full slice moves each way, in whole chunks (at least 1).
  uint32_t slice_bytes_in_chunks() const { return slice_bytes_in_chunks_; }
  // Elements of a slice at most whose every buffer fits `bytes`.
  uint64_t ElemsFitting(uint64_t bytes) const;
  // Slices of a tensor of numel elements.
  uint64_t Slices(uint64_t numel) const { return (numel + slice_elems_ - 1) / slice_elems_; }

  // Slice c of a tensor of numel elements. REQUIRES: c < Slices(numel).
  void SliceOf(uint64_t numel, uint64_t c, Slice* out) const;

  // The operands' field pointers of the kernel call on the slice's elements
  // [off, off + count): bufs are the slice's buffers in Slice order.
  // Returns count (the piece's elements, at most piece_elems()).
  uint64_t Piece(const Slice& s, void* const* bufs, uint64_t off, void* out[kMaxRuleFields]) const;

  // Bytes of one chunk of field f, and of field f of a tensor of numel
  // elements.
  uint64_t field_chunk_bytes(uint32_t f) const { return field_chunk_bytes_[f]; }
  uint64_t field_bytes(uint32_t f, uint64_t numel) const { return FieldBytes(f, numel); }

  // The vfs fields of a new tensor of numel elements.
  std::vector<vfs::FieldSpec> FieldSpecs(const UpdateRule& rule, uint64_t numel) const;

 private:
  // Bytes of e elements of field f from a value boundary.
  uint64_t FieldBytes(uint32_t f, uint64_t e) const {
    return (e + elems_per_value_[f] - 1) / elems_per_value_[f] * value_size_[f];
  }
  uint32_t n_fields_ = 0;
  uint64_t chunk_bytes_ = 0;
  uint64_t slice_elems_ = 0;
  uint64_t piece_elems_ = 0;
  uint32_t slice_chunks_ = 0;
  uint32_t slice_bytes_in_chunks_ = 1;
  uint32_t value_size_[kMaxRuleFields] = {};
  uint32_t elems_per_value_[kMaxRuleFields] = {};
  uint64_t field_chunk_bytes_[kMaxRuleFields] = {};  // bytes of one chunk of field f
  uint64_t chunk_elems_[kMaxRuleFields] = {};        // tensor elements one chunk of field f covers
};

// A whole-tensor unit in the device window: each field contiguous, then
// the rule's workspace, every part starting 256-byte aligned.
struct TensorUnitSize {
  uint64_t field_offset[kMaxRuleFields] = {};
  uint64_t field_bytes[kMaxRuleFields] = {};
  uint64_t workspace_offset = 0;
  uint64_t workspace = 0;
  uint64_t bytes = 0;  // fields and workspace, with the alignment
  uint64_t pages = 0;  // whole chunk-sized pages of the window
};
TensorUnitSize TensorUnitOf(const UpdateRule& rule, const SliceLayout& layout, const vfs::TensorInfo& t);

}  // namespace optstate::memmgr::internal
