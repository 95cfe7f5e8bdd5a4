#include "tools/internal/store_read.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "kernels/adam.h"
#include "vfs/chunk_space.h"
#include "vfs/io_buffer.h"

namespace optstate::tools {

double ElementAsDouble(DType d, const void* base, uint64_t i) {
  // ForEachRange hands q8 fields over decoded, as fp32.
  return kernels::ElementAsFloat(IsQ8(d) ? DType::kF32 : d, base, i);
}

void FieldStats::Add(double v) {
  ++count;
  if (std::isnan(v)) {
    ++nan;
    return;
  }
  if (std::isinf(v)) {
    ++inf;
    return;
  }
  if (v < min) min = v;
  if (v > max) max = v;
  sum += v;
  sum_sq += v * v;
}

double FieldStats::mean() const {
  uint64_t n = finite();
  return n ? sum / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN();
}

double FieldStats::l2() const { return std::sqrt(sum_sq); }

Status ForEachRange(const vfs::GenerationView& view, const vfs::TensorInfo& t, uint32_t field,
                    uint64_t begin, uint64_t end, const ChunkFn& fn) {
  if (field >= t.fields.size()) {
    return InvalidArgument(fmt::format("tensor {}: no field #{}", t.name, field));
  }
  const uint64_t numel = t.field_numel(field);
  if (end > numel || begin > end) {
    return InvalidArgument(fmt::format("tensor {} field {}: range [{}, {}) outside its {} elements", t.name,
                                       t.fields[field].name, begin, end, numel));
  }
  if (begin == end) return Status::Ok();
  const DType dtype = t.fields[field].dtype;
  const uint64_t esize = DTypeSize(dtype);
  const uint64_t chunk_bytes = view.identity().chunk_size_bytes;
  const uint64_t per_chunk = t.field_chunk_bytes(field, chunk_bytes) / esize;
  int scales = -1;
  if (IsQ8(dtype)) {
    scales = t.FieldIndexOf(vfs::Q8ScalesField(t.fields[field].name));
    if (scales < 0) {
      return Corruption(fmt::format("tensor {} field {}: its scales field {} is missing", t.name,
                                    t.fields[field].name, vfs::Q8ScalesField(t.fields[field].name)));
    }
  }
  vfs::IoBuffer buf(chunk_bytes), sbuf(scales >= 0 ? chunk_bytes : 4096);
  if (!buf.ok() || !sbuf.ok()) return ResourceExhausted(fmt::format("cannot allocate {} bytes", 2 * chunk_bytes));
  std::vector<float> decoded;
  for (uint64_t c = begin / per_chunk; c * per_chunk < end; ++c) {
    vfs::ChunkRef ref{t.id, field, c};
    OPTSTATE_RETURN_IF_ERROR(view.ReadChunk(ref, buf.data()));
    uint64_t first = std::max(begin, c * per_chunk);
    uint64_t last = std::min(end, (c + 1) * per_chunk);
    if (scales >= 0) {
      // Codes decode with chunk c of their scales (the same elements).
      OPTSTATE_RETURN_IF_ERROR(view.ReadChunk(vfs::ChunkRef{t.id, static_cast<uint32_t>(scales), c}, sbuf.data()));
      const uint64_t n = std::min(per_chunk, numel - c * per_chunk);
      decoded.resize(n);
      kernels::Q8Dequantize(dtype == DType::kQ8S, buf.as<uint8_t>(), sbuf.as<float>(), n, decoded.data());
      OPTSTATE_RETURN_IF_ERROR(fn(first, decoded.data() + (first - c * per_chunk), last - first));
      continue;
    }
    OPTSTATE_RETURN_IF_ERROR(fn(first, buf.data() + (first - c * per_chunk) * esize, last - first));
  }
  return Status::Ok();
}

Result<uint32_t> FieldByName(const vfs::TensorInfo& t, const std::string& field) {
  std::string names;
  for (uint32_t i = 0; i < t.fields.size(); ++i) {
    if (t.fields[i].name == field) return i;
    names += (i ? ", " : "") + t.fields[i].name;
  }
  return NotFound(fmt::format("tensor {} has no field '{}' (fields: {})", t.name, field, names));
}

Result<std::vector<std::string>> CompareGenerations(const vfs::GenerationView& a,
                                                    const vfs::GenerationView& b) {
  std::vector<std::string> diffs;
  const auto& ta = a.tensors();
  const auto& tb = b.tensors();
  if (a.info().step != b.info().step) {
    diffs.push_back(fmt::format("step differs: {} vs {}", a.info().step, b.info().step));
  }
  if (a.info().groups.size() != b.info().groups.size()) {
    diffs.push_back(fmt::format("group count differs: {} vs {}", a.info().groups.size(),
                                b.info().groups.size()));
  } else {
    for (size_t g = 0; g < a.info().groups.size(); ++g) {
      const auto& ga = a.info().groups[g];
      const auto& gb = b.info().groups[g];
      if (ga.id != gb.id || ga.step_count != gb.step_count || ga.hyper != gb.hyper) {
        diffs.push_back(fmt::format("group {} differs (step count {} vs {})", ga.id, ga.step_count,
                                    gb.step_count));
      }
    }
  }
  for (const auto& x : ta) {
    auto y = b.FindTensor(x.name);
    if (!y.ok()) {
      diffs.push_back(fmt::format("tensor {} only in the first", x.name));
      continue;
    }
    if (x.numel != y->numel || x.fields.size() != y->fields.size() || x.dtype != y->dtype ||
        x.group != y->group) {
      diffs.push_back(fmt::format("tensor {}: layout differs (numel {} vs {})", x.name, x.numel,
                                  y->numel));
      continue;
    }
    for (uint32_t f = 0; f < x.fields.size(); ++f) {
      if (x.fields[f].name != y->fields[f].name || x.fields[f].dtype != y->fields[f].dtype) {
        diffs.push_back(fmt::format("tensor {}: field #{} differs", x.name, f));
        continue;
      }
      const uint64_t esize = DTypeSize(x.fields[f].dtype);
      const uint64_t chunk_bytes = a.identity().chunk_size_bytes;
      const uint64_t stride = x.field_chunk_bytes(f, chunk_bytes);
      if (chunk_bytes != b.identity().chunk_size_bytes) {
        return InvalidArgument("the two stores have different chunk sizes");
      }
      vfs::IoBuffer ba(chunk_bytes), bb(chunk_bytes);
      uint64_t chunks = a.ChunkCount(x, f);
      for (uint64_t c = 0; c < chunks; ++c) {
        OPTSTATE_RETURN_IF_ERROR(a.ReadChunk({x.id, f, c}, ba.data()));
        OPTSTATE_RETURN_IF_ERROR(b.ReadChunk({y->id, f, c}, bb.data()));
        uint64_t len = std::min(stride, x.field_bytes(f) - c * stride);
        if (std::memcmp(ba.data(), bb.data(), len) != 0) {
          uint64_t i = 0;
          while (i < len && ba.data()[i] == bb.data()[i]) ++i;
          uint64_t elem = (c * stride + i) / esize;
          diffs.push_back(fmt::format("tensor {} field {}: differs at element {} (chunk {})",
                                      x.name, x.fields[f].name, elem, c));
          break;
        }
      }
    }
  }
  for (const auto& y : tb) {
    if (!a.FindTensor(y.name).ok()) diffs.push_back(fmt::format("tensor {} only in the second", y.name));
  }
  return diffs;
}

FullWrite WriteOfEveryChunk(const std::vector<vfs::TensorInfo>& tensors, uint64_t chunk_size_bytes) {
  FullWrite w;
  for (const vfs::TensorInfo& t : tensors) {
    w.params += t.numel;
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      const uint64_t bytes = t.field_bytes(f);
      const uint64_t per = t.field_chunk_bytes(f, chunk_size_bytes);
      w.logical_bytes += bytes;
      if (per == 0) continue;  // no chunk geometry (never for an opened store)
      for (uint64_t at = 0; at < bytes; at += per) {
        ++w.chunks;
        w.allocated_bytes += vfs::ChunkAllocatedBytes(std::min(per, bytes - at), chunk_size_bytes);
      }
    }
  }
  return w;
}

}  // namespace optstate::tools
