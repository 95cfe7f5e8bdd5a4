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

// Element i of a field buffer of dtype d, as fp32 (exact for every dtype).
float Load(vfs::DType d, const void* p, uint64_t i) {
  switch (d) {
    case vfs::DType::kF32: return static_cast<const float*>(p)[i];
    case vfs::DType::kBF16: return kernels::Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case vfs::DType::kF16: return kernels::HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

void Store(vfs::DType d, void* p, uint64_t i, float f) {
  switch (d) {
    case vfs::DType::kF32: static_cast<float*>(p)[i] = f; break;
    case vfs::DType::kBF16: static_cast<uint16_t*>(p)[i] = kernels::FloatToBf16(f); break;
    case vfs::DType::kF16: static_cast<uint16_t*>(p)[i] = kernels::FloatToHalf(f); break;
  }
}

// Writes one field of the new store from its checkpoint file, converting
// from `from` to `to`, source chunk by source chunk (each verified first).
Status ConvertField(vfs::Store* store, const vfs::TensorInfo& t, uint32_t field, const std::string& dir,
                    const vfs::ManifestField& mf, vfs::DType to, vfs::IoBuffer* src, vfs::IoBuffer* dst,
                    uint64_t* done, uint64_t total, const std::function<void(uint64_t, uint64_t)>& progress) {
  const std::string path = dir + "/" + mf.file;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError(fmt::format("opening {}: {}", path, std::strerror(errno)));
  const uint32_t from_size = vfs::DTypeSize(mf.dtype), to_size = vfs::DTypeSize(to);
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
      Store(to, dst->data(), dst_fill++, Load(mf.dtype, src->data(), i));
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

Result<uint64_t> Convert(vfs::Store* store, const vfs::Manifest& m, const std::string& dir, vfs::DType moments,
                         const std::function<void(uint64_t, uint64_t)>& progress) {
  uint64_t total = 0, done = 0;
  for (const auto& t : m.tensors) {
    for (const auto& f : t.fields) total += f.bytes;
  }
  vfs::IoBuffer src(store->chunk_size_bytes()), dst(store->chunk_size_bytes());
  if (!src.ok() || !dst.ok()) return ResourceExhausted("cannot allocate two chunk buffers");
  for (const vfs::ManifestTensor& mt : m.tensors) {
    vfs::TensorSpec spec = vfs::TensorSpecOf(mt);
    for (vfs::FieldSpec& f : spec.fields) {
      if (IsMomentField(f.name)) f.dtype = moments;
    }
    OPTSTATE_ASSIGN_OR_RETURN(vfs::TensorInfo info, store->CreateTensor(spec));
    for (uint32_t f = 0; f < mt.fields.size(); ++f) {
      OPTSTATE_RETURN_IF_ERROR(ConvertField(store, info, f, dir, mt.fields[f], spec.fields[f].dtype, &src, &dst,
                                            &done, total, progress));
    }
  }
  vfs::CommitInfo ci;
  ci.step = m.step;
  ci.groups = m.groups;
  return store->Commit(ci);
}

}  // namespace

bool IsMomentField(std::string_view field) { return field == "exp_avg" || field == "exp_avg_sq"; }

Result<std::unique_ptr<vfs::Store>> CreateStoreWithMoments(const std::string& dir, const std::string& store_path,
                                                           vfs::StoreOptions opts, vfs::DType moments,
                                                           const std::function<void(uint64_t, uint64_t)>& progress) {
  if (moments != vfs::DType::kF32 && moments != vfs::DType::kBF16) {
    return InvalidArgument(fmt::format("moment dtype {} is not supported (f32, bf16)", vfs::DTypeName(moments)));
  }
  const std::string manifest_path = dir + "/manifest.json";
  std::ifstream in(manifest_path, std::ios::binary);
  if (!in) return NotFound(fmt::format("{}: cannot open ({})", manifest_path, std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  OPTSTATE_ASSIGN_OR_RETURN(vfs::Manifest m, vfs::ParseManifest(text.str(), manifest_path));
  opts.chunk_size_bytes = m.chunk_size_bytes;
  if (opts.name.empty()) opts.name = m.store_name;
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<vfs::Store> store, vfs::Store::Create(store_path, opts));
  auto g = Convert(store.get(), m, dir, moments, progress);
  if (!g.ok()) {
    (void)store->AbortPending();
    store.reset();
    std::error_code ec;
    std::filesystem::remove_all(store_path, ec);
    return g.status().WithContext(fmt::format("restoring {} into {} with {} moments", dir, store_path,
                                              vfs::DTypeName(moments)));
  }
  return store;
}

}  // namespace optstate::tools
