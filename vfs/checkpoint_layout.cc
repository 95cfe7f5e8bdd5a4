// Checkpoint format: the virtual-file layout of a generation
// (CheckpointLayout): the file list, state.safetensors' header, and the
// mapping of file byte ranges to chunks.
#include "vfs/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "vfs/internal/checkpoint_util.h"
#include "vfs/io_buffer.h"

namespace optstate::vfs {
namespace {

using OJson = nlohmann::ordered_json;
using internal::CeilDiv;

}  // namespace

std::string SafetensorsHeader(const Manifest& m) {
  OJson header;
  OJson meta = OJson::object();
  meta["format"] = "pt";
  meta[kSafetensorsStoreKey] = m.store_name;
  meta[kSafetensorsStoreUuidKey] = m.store_uuid;
  meta[kSafetensorsGenerationKey] = std::to_string(m.generation);
  meta[kSafetensorsStepKey] = std::to_string(m.step);
  header["__metadata__"] = meta;
  uint64_t data_off = 0;
  for (const ManifestTensor& mt : m.tensors) {
    for (const ManifestField& mf : mt.fields) {
      OJson e;
      e["dtype"] = SafetensorsDTypeName(mf.dtype);
      e["shape"] = FieldShape(mt, mf);
      e["data_offsets"] = OJson::array({data_off, data_off + mf.bytes});
      header[mt.name + "/" + mf.name] = e;
      data_off += mf.bytes;
    }
  }
  std::string hjson = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  while ((8 + hjson.size()) % CheckpointLayout::kSafetensorsDataAlignBytes != 0) hjson.push_back(' ');
  const uint64_t hlen = hjson.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((hlen >> (8 * i)) & 0xff);
  out += hjson;
  return out;
}

Result<std::unique_ptr<CheckpointLayout>> CheckpointLayout::Build(const GenerationView* view) {
  std::unique_ptr<CheckpointLayout> l(new CheckpointLayout());
  l->view_ = view;
  l->chunk_size_ = view->identity().chunk_size_bytes;
  if (l->chunk_size_ == 0) return Internal("checkpoint layout: store chunk size is 0");
  OPTSTATE_ASSIGN_OR_RETURN(l->manifest_, ManifestFromView(*view));
  l->manifest_json_ = SerializeManifest(l->manifest_);

  // The manifest's tensors are sorted by name, as are view->tensors(); map
  // manifest index -> view index by name anyway.
  const auto& vt = view->tensors();
  uint64_t data_off = 0, seq = 0;
  std::vector<CheckpointFile> field_files;
  for (const ManifestTensor& mt : l->manifest_.tensors) {
    auto it = std::find_if(vt.begin(), vt.end(), [&](const TensorInfo& t) { return t.name == mt.name; });
    if (it == vt.end()) return Internal("checkpoint layout: tensor vanished: " + mt.name);
    uint32_t ti = static_cast<uint32_t>(it - vt.begin());
    for (uint32_t f = 0; f < mt.fields.size(); ++f) {
      const ManifestField& mf = mt.fields[f];
      const uint64_t stride = mf.chunk_bytes != 0 ? mf.chunk_bytes : l->chunk_size_;
      l->spans_.push_back({ti, f, data_off, mf.bytes, seq, stride});
      data_off += mf.bytes;
      seq += mf.chunks.size();
      field_files.push_back({mf.file, CheckpointFileKind::kField, mf.bytes, ti, f, stride});
    }
  }
  l->st_chunks_ = seq;
  l->st_header_ = SafetensorsHeader(l->manifest_);

  l->files_.push_back({kManifestFileName, CheckpointFileKind::kManifest, l->manifest_json_.size(), 0, 0});
  l->files_.push_back(
      {kSafetensorsFileName, CheckpointFileKind::kSafetensors, l->st_header_.size() + data_off, 0, 0});
  for (auto& f : field_files) l->files_.push_back(std::move(f));
  for (uint32_t i = 0; i < l->files_.size(); ++i) l->file_index_.emplace(l->files_[i].path, i);
  for (uint32_t i = 0; i < l->manifest_.tensors.size(); ++i) {
    l->tensor_dirs_.emplace(l->manifest_.tensors[i].file_name, i);
  }
  return l;
}

std::optional<uint64_t> CheckpointLayout::SafetensorsOffsetOf(const CheckpointFile& f) const {
  if (f.kind != CheckpointFileKind::kField) return std::nullopt;
  auto it = file_index_.find(f.path);
  // files_: manifest.json, state.safetensors, then the field files in the
  // order of spans_.
  if (it == file_index_.end() || &files_[it->second] != &f || it->second < 2) return std::nullopt;
  return st_header_.size() + spans_[it->second - 2].data_offset;
}

const CheckpointFile* CheckpointLayout::FindFile(std::string_view path) const {
  auto it = file_index_.find(path);
  return it == file_index_.end() ? nullptr : &files_[it->second];
}

namespace {
// The tensor directory name of "tensors/<name>", or nullopt.
std::optional<std::string_view> TensorDirName(std::string_view path) {
  constexpr std::string_view kPrefix = "tensors/";
  static_assert(kPrefix.substr(0, kPrefix.size() - 1) == kTensorsDirName);
  if (path.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  return path.substr(kPrefix.size());
}
}  // namespace

bool CheckpointLayout::IsDir(std::string_view path) const {
  if (path.empty() || path == kTensorsDirName) return true;
  std::optional<std::string_view> name = TensorDirName(path);
  return name.has_value() && tensor_dirs_.count(*name) > 0;
}

Result<std::vector<std::string>> CheckpointLayout::ListDir(std::string_view path) const {
  std::vector<std::string> out;
  if (path.empty()) {
    out = {kManifestFileName, kSafetensorsFileName, kTensorsDirName};
  } else if (path == kTensorsDirName) {
    for (const ManifestTensor& t : manifest_.tensors) out.push_back(t.file_name);
  } else {
    std::optional<std::string_view> name = TensorDirName(path);
    auto it = name.has_value() ? tensor_dirs_.find(*name) : tensor_dirs_.end();
    if (it == tensor_dirs_.end()) return NotFound(fmt::format("checkpoint: no directory '{}'", path));
    for (const ManifestField& f : manifest_.tensors[it->second].fields) out.push_back(FileNameForName(f.name));
  }
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t CheckpointLayout::ChunkSequenceLength(const CheckpointFile& f) const {
  switch (f.kind) {
    case CheckpointFileKind::kManifest: return 0;
    case CheckpointFileKind::kSafetensors: return st_chunks_;
    case CheckpointFileKind::kField: return CeilDiv(f.size_bytes, f.chunk_bytes);
  }
  return 0;
}

ChunkRef CheckpointLayout::ChunkAt(const CheckpointFile& f, uint64_t seq) const {
  if (f.kind == CheckpointFileKind::kField) {
    return ChunkRef{view_->tensors()[f.tensor_index].id, f.field, seq};
  }
  const FieldSpan& sp = SpanOfSeq(seq);
  return ChunkRef{view_->tensors()[sp.tensor_index].id, sp.field, seq - sp.first_seq};
}

uint64_t CheckpointLayout::ChunkLengthAt(const CheckpointFile& f, uint64_t seq) const {
  if (f.kind == CheckpointFileKind::kField) return std::min(f.chunk_bytes, f.size_bytes - seq * f.chunk_bytes);
  const FieldSpan& sp = SpanOfSeq(seq);
  return std::min(sp.chunk_bytes, sp.bytes - (seq - sp.first_seq) * sp.chunk_bytes);
}

const CheckpointLayout::FieldSpan& CheckpointLayout::SpanOfSeq(uint64_t seq) const {
  // The span whose first_seq <= seq.
  auto it = std::upper_bound(spans_.begin(), spans_.end(), seq,
                             [](uint64_t s, const FieldSpan& sp) { return s < sp.first_seq; });
  // Skip empty spans that share first_seq with the next one.
  --it;
  while (it->bytes == 0 || seq >= it->first_seq + CeilDiv(it->bytes, it->chunk_bytes)) ++it;
  return *it;
}

std::vector<CheckpointSegment> CheckpointLayout::MapRange(const CheckpointFile& f, uint64_t offset,
                                                          uint64_t len) const {
  std::vector<CheckpointSegment> segs;
  if (offset >= f.size_bytes) return segs;
  len = std::min(len, f.size_bytes - offset);
  uint64_t dst = 0;
  if (f.kind == CheckpointFileKind::kManifest) {
    CheckpointSegment s;
    s.dst_offset = 0;
    s.length_bytes = len;
    s.memory = manifest_json_.data() + offset;
    segs.push_back(s);
    return segs;
  }
  if (f.kind == CheckpointFileKind::kField) {
    const uint32_t tid = view_->tensors()[f.tensor_index].id;
    while (len > 0) {
      uint64_t idx = offset / f.chunk_bytes, in = offset % f.chunk_bytes;
      uint64_t n = std::min(len, f.chunk_bytes - in);
      CheckpointSegment s;
      s.dst_offset = dst;
      s.length_bytes = n;
      s.chunk = ChunkRef{tid, f.field, idx};
      s.chunk_offset = in;
      s.chunk_seq = idx;
      segs.push_back(s);
      offset += n, dst += n, len -= n;
    }
    return segs;
  }
  // Safetensors: header bytes, then field data.
  const uint64_t h = st_header_.size();
  if (offset < h) {
    uint64_t n = std::min(len, h - offset);
    CheckpointSegment s;
    s.dst_offset = 0;
    s.length_bytes = n;
    s.memory = st_header_.data() + offset;
    segs.push_back(s);
    offset += n, dst += n, len -= n;
  }
  if (len == 0) return segs;
  uint64_t pos = offset - h;  // in the data section
  auto it = std::upper_bound(spans_.begin(), spans_.end(), pos,
                             [](uint64_t p, const FieldSpan& sp) { return p < sp.data_offset; });
  --it;  // spans_[0].data_offset == 0 <= pos
  while (len > 0) {
    while (pos >= it->data_offset + it->bytes) ++it;  // skips empty spans too
    uint64_t in_field = pos - it->data_offset;
    uint64_t idx = in_field / it->chunk_bytes, in = in_field % it->chunk_bytes;
    uint64_t n = std::min({len, it->chunk_bytes - in, it->bytes - in_field});
    CheckpointSegment s;
    s.dst_offset = dst;
    s.length_bytes = n;
    s.chunk = ChunkRef{view_->tensors()[it->tensor_index].id, it->field, idx};
    s.chunk_offset = in;
    s.chunk_seq = it->first_seq + idx;
    segs.push_back(s);
    pos += n, dst += n, len -= n;
  }
  return segs;
}

Result<uint64_t> CheckpointLayout::Read(const CheckpointFile& f, uint64_t offset, void* buf,
                                        uint64_t len) const {
  std::vector<CheckpointSegment> segs = MapRange(f, offset, len);
  uint64_t total = 0;
  IoBuffer bounce;
  ChunkRef have{UINT32_MAX, UINT32_MAX, UINT64_MAX};
  for (const CheckpointSegment& s : segs) {
    char* out = static_cast<char*>(buf) + s.dst_offset;
    if (s.memory) {
      std::memcpy(out, s.memory, s.length_bytes);
    } else {
      if (!bounce.ok()) {
        bounce = IoBuffer(chunk_size_);
        if (!bounce.ok()) return ResourceExhausted("checkpoint read: out of memory for a chunk buffer");
      }
      if (have.tensor_id != s.chunk.tensor_id || have.field != s.chunk.field ||
          have.index != s.chunk.index) {
        OPTSTATE_RETURN_IF_ERROR(view_->ReadChunk(s.chunk, bounce.data()));
        have = s.chunk;
      }
      std::memcpy(out, bounce.as<char>() + s.chunk_offset, s.length_bytes);
    }
    total += s.length_bytes;
  }
  return total;
}

}  // namespace optstate::vfs
