#include "tools/internal/convert_moments.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "kernels/adam.h"
#include "vfs/checkpoint.h"
#include "vfs/io_buffer.h"

namespace optstate::tools {
namespace {

// Reads exactly len bytes at offset of fd; kIoError naming path otherwise.
Status ReadExact(int fd, const std::string& path, uint64_t offset, void* buf, uint64_t len) {
  uint64_t done = 0;
  while (done < len) {
    ssize_t n = pread(fd, static_cast<char*>(buf) + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError(fmt::format("reading {} at byte {}: {}", path, offset + done, std::strerror(errno)));
    if (n == 0) {
      return Corruption(fmt::format("{}: ends at byte {}, the manifest says {} bytes", path, offset + done,
                                    offset + len));
    }
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

void Store(DType d, void* p, uint64_t i, float f) {
  switch (d) {
    case DType::kF32: static_cast<float*>(p)[i] = f; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = kernels::FloatToBf16(f); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = kernels::FloatToHalf(f); break;
    case DType::kQ8S:
    case DType::kQ8U: break;  // quantized per block (ConvertMoment)
  }
}

// One checkpoint file of a field, its chunks read in order and each checked
// against the manifest's XXH3 before use.
class ChunkFile {
 public:
  ~ChunkFile() {
    if (fd_ >= 0) close(fd_);
  }
  Status Open(const std::string& dir, const vfs::ManifestField& mf, const std::string& tensor) {
    mf_ = &mf;
    tensor_ = tensor;
    path_ = dir + "/" + mf.file;
    fd_ = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return IoError(fmt::format("opening {}: {}", path_, std::strerror(errno)));
    return Status::Ok();
  }
  // Chunk c into buf (verified); its length in *len.
  Status Read(uint64_t c, void* buf, uint64_t* len) {
    if (c >= mf_->chunks.size()) {
      return Corruption(fmt::format("{}: no chunk {} (tensor '{}' field {})", path_, c, tensor_, mf_->name));
    }
    const vfs::ManifestChunk& mc = mf_->chunks[c];
    OPTSTATE_RETURN_IF_ERROR(ReadExact(fd_, path_, mc.offset_bytes, buf, mc.length_bytes));
    if (vfs::ChunkChecksum(buf, mc.length_bytes) != mc.xxh3) {
      return Corruption(fmt::format("{}: bytes [{}, {}) do not match the manifest's XXH3 (tensor '{}' field {}); "
                                    "nothing restored",
                                    path_, mc.offset_bytes, mc.offset_bytes + mc.length_bytes, tensor_, mf_->name));
    }
    *len = mc.length_bytes;
    return Status::Ok();
  }
  uint64_t chunks() const { return mf_->chunks.size(); }

 private:
  const vfs::ManifestField* mf_ = nullptr;
  std::string tensor_, path_;
  int fd_ = -1;
};

// A moment field of the checkpoint as fp32, chunk by chunk: exact for f32,
// bf16 and f16; q8 codes decode to map[code] x their block's absmax (the
// values the step uses).
Status ForEachDecodedChunk(const std::string& dir, const vfs::ManifestTensor& mt, const vfs::ManifestField& mf,
                           uint64_t chunk_bytes, uint64_t* done, uint64_t total,
                           const std::function<void(uint64_t, uint64_t)>& progress,
                           const std::function<Status(const float*, uint64_t)>& fn) {
  ChunkFile codes, scales;
  OPTSTATE_RETURN_IF_ERROR(codes.Open(dir, mf, mt.name));
  const bool q8 = IsQ8(mf.dtype);
  if (q8) {
    const vfs::ManifestField* sf = nullptr;
    for (const vfs::ManifestField& f : mt.fields) {
      if (f.name == vfs::Q8ScalesField(mf.name)) sf = &f;
    }
    if (sf == nullptr) {
      return Corruption(fmt::format("{}: tensor '{}' field {} has no scales field {}", dir, mt.name, mf.name,
                                    vfs::Q8ScalesField(mf.name)));
    }
    OPTSTATE_RETURN_IF_ERROR(scales.Open(dir, *sf, mt.name));
  }
  vfs::IoBuffer buf(chunk_bytes), sbuf(q8 ? chunk_bytes : 4096);
  if (!buf.ok() || !sbuf.ok()) return ResourceExhausted("cannot allocate chunk buffers");
  std::vector<float> out;
  for (uint64_t c = 0; c < codes.chunks(); ++c) {
    uint64_t len = 0, slen = 0;
    OPTSTATE_RETURN_IF_ERROR(codes.Read(c, buf.data(), &len));
    if (q8) {
      OPTSTATE_RETURN_IF_ERROR(scales.Read(c, sbuf.data(), &slen));
      out.resize(len);
      kernels::Q8Dequantize(mf.dtype == DType::kQ8S, buf.as<uint8_t>(), sbuf.as<float>(), len, out.data());
      *done += slen;
    } else {
      const uint64_t n = len / DTypeSize(mf.dtype);
      out.resize(n);
      for (uint64_t i = 0; i < n; ++i) out[i] = kernels::ElementAsFloat(mf.dtype, buf.data(), i);
    }
    OPTSTATE_RETURN_IF_ERROR(fn(out.data(), out.size()));
    *done += len;
    if (progress) progress(*done, total);
  }
  return Status::Ok();
}

// Writes moment field `field` of the new store (dtype `to`; q8 with its
// scales field `scales_field`) from fp32 values given in order.
class MomentWriter {
 public:
  MomentWriter(vfs::Store* store, const vfs::TensorInfo& t, uint32_t field, DType to, int scales_field,
               vfs::IoBuffer* dst, vfs::IoBuffer* sdst)
      : store_(store), t_(t), field_(field), to_(to), scales_(scales_field), dst_(dst), sdst_(sdst),
        per_chunk_(store->chunk_size_bytes() / DTypeSize(to)) {}
  Status Add(const float* x, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
      pending_.push_back(x[i]);
      if (pending_.size() == per_chunk_) OPTSTATE_RETURN_IF_ERROR(Flush());
    }
    return Status::Ok();
  }
  Status Flush() {
    if (pending_.empty()) return Status::Ok();
    const uint64_t chunk = store_->chunk_size_bytes();
    std::memset(dst_->data(), 0, chunk);
    if (IsQ8(to_)) {
      // The quantizer of the step: absmax = max |x| per 256, nearest code.
      std::memset(sdst_->data(), 0, chunk);
      kernels::Q8Quantize(to_ == DType::kQ8S, pending_.data(), pending_.size(), dst_->as<uint8_t>(),
                          sdst_->as<float>());
      OPTSTATE_RETURN_IF_ERROR(
          store_->WriteChunk(vfs::ChunkRef{t_.id, static_cast<uint32_t>(scales_), index_}, sdst_->data()));
    } else {
      for (uint64_t i = 0; i < pending_.size(); ++i) Store(to_, dst_->data(), i, pending_[i]);
    }
    OPTSTATE_RETURN_IF_ERROR(store_->WriteChunk(vfs::ChunkRef{t_.id, field_, index_}, dst_->data()));
    ++index_;
    pending_.clear();
    return Status::Ok();
  }

 private:
  vfs::Store* store_;
  const vfs::TensorInfo& t_;
  uint32_t field_;
  DType to_;
  int scales_;
  vfs::IoBuffer* dst_;
  vfs::IoBuffer* sdst_;
  uint64_t per_chunk_;
  uint64_t index_ = 0;
  std::vector<float> pending_;
};

// True when `name` holds the scales of a q8 field of mt.
bool IsScalesField(const vfs::ManifestTensor& mt, std::string_view name) {
  for (const vfs::ManifestField& f : mt.fields) {
    if (IsQ8(f.dtype) && vfs::Q8ScalesField(f.name) == name) return true;
  }
  return false;
}

// Writes one field of the new store from its checkpoint file, converting
// from `from` to `to`, source chunk by source chunk (each verified first).
Status ConvertField(vfs::Store* store, const vfs::TensorInfo& t, uint32_t field, const std::string& dir,
                    const vfs::ManifestField& mf, DType to, vfs::IoBuffer* src, vfs::IoBuffer* dst,
                    uint64_t* done, uint64_t total, const std::function<void(uint64_t, uint64_t)>& progress) {
  const std::string path = dir + "/" + mf.file;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError(fmt::format("opening {}: {}", path, std::strerror(errno)));
  const uint32_t from_size = DTypeSize(mf.dtype), to_size = DTypeSize(to);
  const uint64_t chunk = store->chunk_size_bytes();
  const uint64_t dst_per_chunk = chunk / to_size;
  uint64_t dst_fill = 0, dst_index = 0;
  auto flush = [&]() -> Status {
    if (dst_fill == 0) return Status::Ok();
    std::memset(dst->as<char>() + dst_fill * to_size, 0, chunk - dst_fill * to_size);
    OPTSTATE_RETURN_IF_ERROR(store->WriteChunk(vfs::ChunkRef{t.id, field, dst_index}, dst->data()));
    ++dst_index;
    dst_fill = 0;
    return Status::Ok();
  };
  Status st;
  for (const vfs::ManifestChunk& c : mf.chunks) {
    st = ReadExact(fd, path, c.offset_bytes, src->data(), c.length_bytes);
    if (!st.ok()) break;
    if (vfs::ChunkChecksum(src->data(), c.length_bytes) != c.xxh3) {
      st = Corruption(fmt::format("{}: bytes [{}, {}) do not match the manifest's XXH3 (tensor '{}' field {}); "
                                  "nothing restored",
                                  path, c.offset_bytes, c.offset_bytes + c.length_bytes, t.name, mf.name));
      break;
    }
    const uint64_t n = c.length_bytes / from_size;
    for (uint64_t i = 0; i < n; ++i) {
      Store(to, dst->data(), dst_fill++, kernels::ElementAsFloat(mf.dtype, src->data(), i));
      if (dst_fill == dst_per_chunk) {
        st = flush();
        if (!st.ok()) break;
      }
    }
    if (!st.ok()) break;
    *done += c.length_bytes;
    if (progress) progress(*done, total);
  }
  if (st.ok()) st = flush();
  close(fd);
  return st;
}

Result<uint64_t> Convert(vfs::Store* store, const vfs::Manifest& m, const std::string& dir, MomentDType moments,
                         const std::function<void(uint64_t, uint64_t)>& progress) {
  uint64_t total = 0, done = 0;
  for (const auto& t : m.tensors) {
    for (const auto& f : t.fields) total += f.bytes;
  }
  vfs::IoBuffer src(store->chunk_size_bytes()), dst(store->chunk_size_bytes());
  if (!src.ok() || !dst.ok()) return ResourceExhausted("cannot allocate two chunk buffers");
  vfs::IoBuffer sdst(store->chunk_size_bytes());
  if (!sdst.ok()) return ResourceExhausted("cannot allocate a chunk buffer");
  const uint64_t cs = store->chunk_size_bytes();
  for (const vfs::ManifestTensor& mt : m.tensors) {
    const vfs::TensorSpec src_spec = vfs::TensorSpecOf(mt);
    // The new tensor: the checkpoint's fields without q8 scales, moments
    // re-typed, and the scales of q8 moments after them.
    vfs::TensorSpec spec = src_spec;
    spec.fields.clear();
    std::vector<int> src_of;  // new field -> checkpoint field (-1: scales written with their codes)
    for (uint32_t f = 0; f < mt.fields.size(); ++f) {
      if (IsScalesField(mt, mt.fields[f].name)) continue;
      vfs::FieldSpec fs = src_spec.fields[f];
      if (IsMomentField(fs.name)) {
        fs = vfs::FieldSpec{fs.name, MomentFieldDType(moments, fs.name)};
      }
      spec.fields.push_back(fs);
      src_of.push_back(static_cast<int>(f));
    }
    if (moments == MomentDType::kQ8) {
      const std::vector<vfs::FieldSpec> q8 = vfs::AdamQ8Fields(mt.numel, cs);
      for (const vfs::FieldSpec& f : q8) {
        if (f.numel != 0) {  // the scales fields
          spec.fields.push_back(f);
          src_of.push_back(-1);
        }
      }
    }
    OPTSTATE_ASSIGN_OR_RETURN(vfs::TensorInfo info, store->CreateTensor(spec));
    for (uint32_t f = 0; f < spec.fields.size(); ++f) {
      if (src_of[f] < 0) continue;
      const vfs::ManifestField& mf = mt.fields[static_cast<uint32_t>(src_of[f])];
      if (!IsMomentField(mf.name)) {
        OPTSTATE_RETURN_IF_ERROR(ConvertField(store, info, f, dir, mf, spec.fields[f].dtype, &src, &dst, &done, total,
                                              progress));
        continue;
      }
      const int scales = info.FieldIndexOf(vfs::Q8ScalesField(mf.name));
      MomentWriter w(store, info, f, spec.fields[f].dtype, scales, &dst, &sdst);
      OPTSTATE_RETURN_IF_ERROR(ForEachDecodedChunk(dir, mt, mf, cs, &done, total, progress,
                                                   [&](const float* x, uint64_t n) { return w.Add(x, n); }));
      OPTSTATE_RETURN_IF_ERROR(w.Flush());
    }
  }
  vfs::CommitInfo ci;
  ci.step = m.step;
  ci.groups = m.groups;
  OPTSTATE_ASSIGN_OR_RETURN(ci.tensor_steps, vfs::TensorStepsOf(store, m));
  return store->Commit(ci);
}

}  // namespace

bool IsMomentField(std::string_view field) { return field == "exp_avg" || field == "exp_avg_sq"; }

Result<std::unique_ptr<vfs::Store>> CreateStoreWithMoments(const std::string& dir, const std::string& store_path,
                                                           vfs::StoreOptions opts, MomentDType moments,
                                                           const std::function<void(uint64_t, uint64_t)>& progress) {
  const std::string manifest_path = dir + "/manifest.json";
  OPTSTATE_ASSIGN_OR_RETURN(vfs::Manifest m, vfs::ReadManifestFile(manifest_path));
  opts.chunk_size_bytes = m.chunk_size_bytes;
  if (opts.name.empty()) opts.name = m.store_name;
  if (opts.job.empty()) opts.job = m.job;
  auto store = vfs::CreateStoreFilled(store_path, opts, [&](vfs::Store* s) -> Status {
    auto g = Convert(s, m, dir, moments, progress);
    if (!g.ok()) {
      return g.status().WithContext(fmt::format("restoring {} into {} with {} moments", dir, store_path,
                                                MomentDTypeName(moments)));
    }
    return Status();
  });
  return store;
}

}  // namespace optstate::tools
