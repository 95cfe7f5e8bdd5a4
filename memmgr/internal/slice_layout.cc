#include "memmgr/internal/slice_layout.h"

#include <algorithm>
#include <string>

namespace optstate::memmgr::internal {

Result<SliceLayout> SliceLayout::Make(const UpdateRule& rule, uint64_t chunk_bytes) {
  const std::vector<RuleField>& fields = rule.Fields();
  const std::string what = std::string("update rule ") + std::string(rule.name());
  if (fields.empty() || fields.size() > kMaxRuleFields || fields[0].name != "main" ||
      fields[0].dtype != DType::kF32 || fields[0].elems_per_value != 1) {
    return InvalidArgument(what + ": needs 1 to " + std::to_string(kMaxRuleFields) +
                           " fields, the first \"main\" (f32, one value per element)");
  }
  if (chunk_bytes == 0) return InvalidArgument(what + ": chunk size 0");
  SliceLayout l;
  l.n_fields_ = static_cast<uint32_t>(fields.size());
  l.chunk_bytes_ = chunk_bytes;
  // Fields of one value per element: a chunk is the store's chunk.
  for (uint32_t f = 0; f < l.n_fields_; ++f) {
    if (fields[f].elems_per_value == 0) return InvalidArgument(what + ": field " + fields[f].name + " has 0 elements per value");
    l.value_size_[f] = DTypeSize(fields[f].dtype);
    l.elems_per_value_[f] = fields[f].elems_per_value;
    if (fields[f].elems_per_value != 1) continue;
    l.field_chunk_bytes_[f] = chunk_bytes;
    l.chunk_elems_[f] = chunk_bytes / l.value_size_[f];
    l.slice_elems_ = std::max(l.slice_elems_, l.chunk_elems_[f]);
  }
  l.piece_elems_ = l.slice_elems_;
  for (uint32_t f = 0; f < l.n_fields_; ++f) {
    if (fields[f].elems_per_value == 1) {
      l.piece_elems_ = std::min(l.piece_elems_, l.chunk_elems_[f]);
      continue;
    }
    // A field of one value per block: one chunk covers a whole slice.
    if (l.slice_elems_ % fields[f].elems_per_value != 0) {
      return InvalidArgument(what + ": field " + fields[f].name + " blocks do not divide a slice");
    }
    l.chunk_elems_[f] = l.slice_elems_;
    l.field_chunk_bytes_[f] = l.slice_elems_ / fields[f].elems_per_value * l.value_size_[f];
  }
  uint64_t slice_bytes = 0;
  for (uint32_t f = 0; f < l.n_fields_; ++f) {
    if (l.slice_elems_ % l.chunk_elems_[f] != 0 || l.piece_elems_ % l.elems_per_value_[f] != 0) {
      return InvalidArgument(what + ": field " + fields[f].name + " does not cut into whole chunks of a slice");
    }
    l.slice_chunks_ += static_cast<uint32_t>(l.slice_elems_ / l.chunk_elems_[f]);
    slice_bytes += l.FieldBytes(f, l.slice_elems_);
  }
  if (l.slice_chunks_ > kMaxSliceChunks) {
    return InvalidArgument(what + ": a slice would hold " + std::to_string(l.slice_chunks_) + " chunks (at most " +
                           std::to_string(kMaxSliceChunks) + ")");
  }
  l.slice_bytes_in_chunks_ = static_cast<uint32_t>(std::max<uint64_t>(1, slice_bytes / chunk_bytes));
  return l;
}

uint64_t SliceLayout::ElemsFitting(uint64_t bytes) const {
  uint64_t e = slice_elems_;
  for (uint32_t f = 0; f < n_fields_; ++f) {
    // Per value-per-element field a buffer holds at most one chunk's elements.
    if (elems_per_value_[f] == 1) e = std::min(e, bytes / value_size_[f]);
  }
  return e;
}

void SliceLayout::SliceOf(uint64_t numel, uint64_t c, Slice* out) const {
  out->first_elem = c * slice_elems_;
  out->elems = std::min(slice_elems_, numel - out->first_elem);
  out->n = 0;
  for (uint32_t f = 0; f < n_fields_; ++f) {
    out->field_first[f] = out->n;
    const uint64_t per_slice = slice_elems_ / chunk_elems_[f];
    for (uint64_t k = 0, e = 0; e < out->elems; ++k, e += chunk_elems_[f]) {
      Chunk& ch = out->chunks[out->n++];
      ch.rule_field = f;
      ch.index = c * per_slice + k;
      ch.len = FieldBytes(f, std::min(chunk_elems_[f], out->elems - e));
    }
  }
}

uint64_t SliceLayout::Piece(const Slice& s, void* const* bufs, uint64_t off, void* out[kMaxRuleFields]) const {
  for (uint32_t f = 0; f < n_fields_; ++f) {
    const uint64_t k = off / chunk_elems_[f];
    const uint64_t in_chunk = off % chunk_elems_[f];
    out[f] = static_cast<char*>(bufs[s.field_first[f] + k]) + in_chunk / elems_per_value_[f] * value_size_[f];
  }
  return std::min(piece_elems_, s.elems - off);
}

std::vector<vfs::FieldSpec> SliceLayout::FieldSpecs(const UpdateRule& rule, uint64_t numel) const {
  std::vector<vfs::FieldSpec> out;
  for (uint32_t f = 0; f < n_fields_; ++f) {
    const RuleField& rf = rule.Fields()[f];
    vfs::FieldSpec spec{rf.name, rf.dtype};
    if (rf.elems_per_value != 1) {
      // 0 (the defaults) for a field of one value per element.
      spec.numel = (numel + rf.elems_per_value - 1) / rf.elems_per_value;
      spec.chunk_bytes = field_chunk_bytes_[f];
    }
    out.push_back(std::move(spec));
  }
  return out;
}

TensorUnitSize TensorUnitOf(const UpdateRule& rule, const SliceLayout& layout, const vfs::TensorInfo& t) {
  auto align = [](uint64_t b) { return (b + 255) / 256 * 256; };
  TensorUnitSize u;
  uint64_t at = 0;
  for (uint32_t f = 0; f < layout.fields(); ++f) {
    u.field_offset[f] = at;
    u.field_bytes[f] = layout.field_bytes(f, t.numel);
    at = align(at + u.field_bytes[f]);
  }
  u.workspace_offset = at;
  u.workspace = rule.WorkspaceBytes(t);
  u.bytes = align(at + u.workspace);
  const uint64_t page = layout.chunk_bytes();
  u.pages = std::max<uint64_t>(1, (u.bytes + page - 1) / page);
  return u;
}

}  // namespace optstate::memmgr::internal
