// Checkpoint format: the strict manifest parser (ParseManifest). Every
// failure names the source and the JSON key path; no input makes it throw or
// crash.
#include "vfs/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "vfs/internal/checkpoint_util.h"
#include "vfs/reshard.h"

namespace optstate::vfs {
namespace {

using Json = nlohmann::json;
using internal::CeilDiv;

constexpr uint64_t kMaxChunkBytes = 1ull << 30;
constexpr size_t kMaxTensorNameBytes = 4096;
constexpr size_t kMaxRank = 16;

// Multiplication with overflow detection.
bool MulOk(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }


// Strict accessors: every failure names the source and the JSON key path.
class Parser {
 public:
  explicit Parser(std::string_view source) : source_(source) {}

  Status Err(const std::string& key, const std::string& what) const {
    return InvalidArgument(fmt::format("manifest {}: key '{}': {}", source_, key, what));
  }

  Status Object(const Json& j, const std::string& key) const {
    return j.is_object() ? Status() : Err(key, "expected an object");
  }

  const Json* Member(const Json& obj, const std::string& path, const char* name, Status* st) const {
    auto it = obj.find(name);
    if (it == obj.end()) {
      *st = Err(path + name, "missing");
      return nullptr;
    }
    return &*it;
  }

  Status U64(const Json& obj, const std::string& path, const char* name, uint64_t max,
             uint64_t* out) const {
    Status st;
    const Json* v = Member(obj, path, name, &st);
    if (!v) return st;
    if (!v->is_number_unsigned() && !(v->is_number_integer() && v->get<int64_t>() >= 0)) {
      return Err(path + name, "expected a non-negative integer");
    }
    uint64_t x = v->get<uint64_t>();
    if (x > max) return Err(path + name, fmt::format("{} is out of range (max {})", x, max));
    *out = x;
    return Status();
  }

  Status U64Elem(const Json& v, const std::string& key, uint64_t* out) const {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
      return Err(key, "expected a non-negative integer");
    }
    *out = v.get<uint64_t>();
    return Status();
  }

  Status Str(const Json& obj, const std::string& path, const char* name, size_t max_len,
             std::string* out) const {
    Status st;
    const Json* v = Member(obj, path, name, &st);
    if (!v) return st;
    if (!v->is_string()) return Err(path + name, "expected a string");
    const std::string& s = v->get_ref<const std::string&>();
    if (s.size() > max_len) return Err(path + name, fmt::format("longer than {} bytes", max_len));
    *out = s;
    return Status();
  }

  Status U64Array(const Json& obj, const std::string& path, const char* name,
                  std::vector<uint64_t>* out) const {
    Status st;
    const Json* v = Member(obj, path, name, &st);
    if (!v) return st;
    if (!v->is_array()) return Err(path + name, "expected an array of integers");
    if (v->size() > kMaxRank) return Err(path + name, fmt::format("rank > {}", kMaxRank));
    out->clear();
    for (size_t i = 0; i < v->size(); ++i) {
      uint64_t x = 0;
      OPTSTATE_RETURN_IF_ERROR(U64Elem((*v)[i], fmt::format("{}{}[{}]", path, name, i), &x));
      out->push_back(x);
    }
    return Status();
  }

  Status Dtype(const Json& obj, const std::string& path, DType* out) const {
    std::string s;
    OPTSTATE_RETURN_IF_ERROR(Str(obj, path, "dtype", 16, &s));
    std::optional<DType> d = ParseDTypeName(s);
    if (!d) return Err(path + "dtype", fmt::format("unknown dtype '{}'", s));
    *out = *d;
    return Status();
  }

  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

Status ParseInto(const Json& j, const Parser& p, Manifest* m) {
  OPTSTATE_RETURN_IF_ERROR(p.Object(j, "(root)"));
  std::string format;
  OPTSTATE_RETURN_IF_ERROR(p.Str(j, "", "format", 64, &format));
  if (format != "optstate-checkpoint") {
    return p.Err("format", fmt::format("'{}' is not 'optstate-checkpoint'", format));
  }
  uint64_t v = 0;
  OPTSTATE_RETURN_IF_ERROR(p.U64(j, "", "format_version", UINT32_MAX, &v));
  if (v != kCheckpointFormatVersion) {
    return p.Err("format_version", fmt::format("version {} is not supported (this build reads {})",
                                               v, kCheckpointFormatVersion));
  }
  m->format_version = static_cast<uint32_t>(v);
  Status st;
  const Json* store = p.Member(j, "", "store", &st);
  if (!store) return st;
  OPTSTATE_RETURN_IF_ERROR(p.Object(*store, "store"));
  OPTSTATE_RETURN_IF_ERROR(p.Str(*store, "store.", "uuid", 256, &m->store_uuid));
  OPTSTATE_RETURN_IF_ERROR(p.Str(*store, "store.", "name", 4096, &m->store_name));
  if (j.contains("job")) {  // absent in manifests written before (job unknown)
    OPTSTATE_RETURN_IF_ERROR(p.Str(j, "", "job", 256, &m->job));
    if (m->job.empty()) return p.Err("job", "empty (omit the key for an unknown job)");
  }
  OPTSTATE_RETURN_IF_ERROR(p.U64(j, "", "generation", UINT64_MAX - 1, &m->generation));
  OPTSTATE_RETURN_IF_ERROR(p.U64(j, "", "step", UINT64_MAX, &m->step));
  OPTSTATE_RETURN_IF_ERROR(p.U64(j, "", "chunk_size_bytes", kMaxChunkBytes, &m->chunk_size_bytes));
  if (m->chunk_size_bytes == 0 || m->chunk_size_bytes % kChunkAlignBytes != 0) {
    return p.Err("chunk_size_bytes", fmt::format("{} is not a positive multiple of 2 MiB",
                                                 m->chunk_size_bytes));
  }
  const uint64_t cs = m->chunk_size_bytes;
  if (auto it = j.find(kManifestSafetensorsKey); it != j.end()) {  // absent: the checkpoint has the file
    if (!it->is_boolean()) return p.Err(kManifestSafetensorsKey, "expected true or false");
    m->has_safetensors = it->get<bool>();
  }

  const Json* groups = p.Member(j, "", "groups", &st);
  if (!groups) return st;
  if (!groups->is_array()) return p.Err("groups", "expected an array");
  std::set<uint32_t> group_ids;
  for (size_t gi = 0; gi < groups->size(); ++gi) {
    const Json& jg = (*groups)[gi];
    std::string path = fmt::format("groups[{}].", gi);
    OPTSTATE_RETURN_IF_ERROR(p.Object(jg, fmt::format("groups[{}]", gi)));
    GroupInfo g;
    OPTSTATE_RETURN_IF_ERROR(p.U64(jg, path, "id", UINT32_MAX, &v));
    g.id = static_cast<uint32_t>(v);
    if (!group_ids.insert(g.id).second) return p.Err(path + "id", fmt::format("duplicate group {}", g.id));
    OPTSTATE_RETURN_IF_ERROR(p.U64(jg, path, "step_count", UINT64_MAX, &g.step_count));
    const Json* hyper = p.Member(jg, path, "hyper", &st);
    if (!hyper) return st;
    OPTSTATE_RETURN_IF_ERROR(p.Object(*hyper, path + "hyper"));
    for (const auto& [k, hv] : hyper->items()) {
      if (k.empty() || k.size() > 256) return p.Err(path + "hyper", "bad hyperparameter name");
      if (IsFlagHyperparameter(k)) {
        // A boolean; manifests written before held 1.0 / 0.0.
        if (hv.is_boolean()) {
          g.hyper[k] = hv.get<bool>() ? 1.0 : 0.0;
          continue;
        }
        if (!hv.is_number() || (hv.get<double>() != 0.0 && hv.get<double>() != 1.0)) {
          return p.Err(path + "hyper." + k,
                       fmt::format("expected true or false (group {})", g.id));
        }
      } else if (!hv.is_number() || !std::isfinite(hv.get<double>())) {
        return p.Err(path + "hyper." + k, fmt::format("expected a finite number (group {})", g.id));
      }
      g.hyper[k] = hv.get<double>();
    }
    if (Status hs = ValidateHyperparameters(g); !hs.ok()) {
      return InvalidArgument(fmt::format("manifest {} (store {}): key '{}hyper': {}", p.source(), m->store_name,
                                         path, hs.message()));
    }
    if (!m->groups.empty() && m->groups.back().id > g.id) {
      return p.Err(path + "id", "groups are not sorted by id");
    }
    if (g.step_count > m->step) {
      return p.Err(path + "step_count",
                   fmt::format("group {} took {} steps, more than the checkpoint's step {}", g.id,
                               g.step_count, m->step));
    }
    m->groups.push_back(std::move(g));
  }

  const Json* tensors = p.Member(j, "", "tensors", &st);
  if (!tensors) return st;
  if (!tensors->is_array()) return p.Err("tensors", "expected an array");
  std::set<std::string> file_names;
  for (size_t ti = 0; ti < tensors->size(); ++ti) {
    const Json& jt = (*tensors)[ti];
    std::string path = fmt::format("tensors[{}].", ti);
    OPTSTATE_RETURN_IF_ERROR(p.Object(jt, fmt::format("tensors[{}]", ti)));
    ManifestTensor t;
    OPTSTATE_RETURN_IF_ERROR(p.Str(jt, path, "name", kMaxTensorNameBytes, &t.name));
    if (t.name.empty() || t.name.find('\0') != std::string::npos) {
      return p.Err(path + "name", "must be 1..4096 bytes without NUL");
    }
    if (!m->tensors.empty() && !(m->tensors.back().name < t.name)) {
      return p.Err(path + "name", fmt::format("tensor '{}' is a duplicate or out of name order", t.name));
    }
    path = fmt::format("tensors[{}] ('{}').", ti, t.name);
    OPTSTATE_RETURN_IF_ERROR(p.Str(jt, path, "file_name", 255, &t.file_name));
    if (t.file_name != FileNameForName(t.name)) {
      return p.Err(path + "file_name", fmt::format("'{}' is not the escaped name '{}'", t.file_name,
                                                   FileNameForName(t.name)));
    }
    if (!file_names.insert(t.file_name).second) {
      return p.Err(path + "file_name", "duplicate file name");
    }
    OPTSTATE_RETURN_IF_ERROR(p.Dtype(jt, path, &t.dtype));
    OPTSTATE_RETURN_IF_ERROR(p.U64(jt, path, "numel", 1ull << 56, &t.numel));
    OPTSTATE_RETURN_IF_ERROR(p.U64(jt, path, "group", UINT32_MAX, &v));
    t.group = static_cast<uint32_t>(v);
    if (!group_ids.empty() && group_ids.count(t.group) == 0) {
      return p.Err(path + "group", fmt::format("group {} is not among the manifest's groups ({})",
                                               t.group, fmt::join(group_ids, ", ")));
    }
    // A manifest written before per-tensor counts: the group's count.
    for (const GroupInfo& g : m->groups) {
      if (g.id == t.group) t.step_count = g.step_count;
    }
    if (jt.contains("step_count")) {
      OPTSTATE_RETURN_IF_ERROR(p.U64(jt, path, "step_count", UINT64_MAX, &t.step_count));
      if (t.step_count > m->step) {
        return p.Err(path + "step_count", fmt::format("tensor '{}' took {} steps, more than the checkpoint's step {}",
                                                      t.name, t.step_count, m->step));
      }
    }
    OPTSTATE_RETURN_IF_ERROR(p.U64Array(jt, path, "shape", &t.shape));
    OPTSTATE_RETURN_IF_ERROR(p.U64Array(jt, path, "global_shape", &t.global_shape));
    OPTSTATE_RETURN_IF_ERROR(p.U64Array(jt, path, "shard_offset", &t.shard_offset));
    uint64_t prod = 1;
    for (uint64_t d : t.shape) {
      if (!MulOk(prod, d, &prod)) return p.Err(path + "shape", "product overflows");
    }
    if (prod != t.numel) {
      return p.Err(path + "shape", fmt::format("product {} != numel {}", prod, t.numel));
    }
    if (Status g = CheckShardGeometry(t.numel, t.shape, t.global_shape, t.shard_offset); !g.ok()) {
      return p.Err(path + "shard_offset", g.message());
    }
    const Json* fields = p.Member(jt, path, "fields", &st);
    if (!fields) return st;
    if (!fields->is_array() || fields->empty() || fields->size() > 64) {
      return p.Err(path + "fields", "expected an array of 1..64 fields");
    }
    std::set<std::string> field_names;
    for (size_t fi = 0; fi < fields->size(); ++fi) {
      const Json& jf = (*fields)[fi];
      std::string fpath = fmt::format("{}fields[{}].", path, fi);
      OPTSTATE_RETURN_IF_ERROR(p.Object(jf, fmt::format("{}fields[{}]", path, fi)));
      ManifestField f;
      OPTSTATE_RETURN_IF_ERROR(p.Str(jf, fpath, "name", 255, &f.name));
      if (f.name.empty() || f.name.find('\0') != std::string::npos) {
        return p.Err(fpath + "name", "must be 1..255 bytes without NUL");
      }
      if (!field_names.insert(f.name).second) {
        return p.Err(fpath + "name", fmt::format("duplicate field '{}'", f.name));
      }
      if (!field_names.insert("\x01" + FileNameForName(f.name)).second) {
        return p.Err(fpath + "name", "two fields map to the same file name");
      }
      OPTSTATE_RETURN_IF_ERROR(p.Dtype(jf, fpath, &f.dtype));
      OPTSTATE_RETURN_IF_ERROR(p.Str(jf, fpath, "file", 1024, &f.file));
      std::string want =
          fmt::format("{}/{}/{}", kTensorsDirName, t.file_name, FileNameForName(f.name));
      if (f.file != want) {
        return p.Err(fpath + "file", fmt::format("'{}' is not '{}'", f.file, want));
      }
      OPTSTATE_RETURN_IF_ERROR(p.U64(jf, fpath, "bytes", UINT64_MAX, &f.bytes));
      // A field with its own element count and chunk bytes (q8 scales)
      // says so; the others have the tensor's numel and the chunk size.
      if (jf.contains("numel")) {
        OPTSTATE_RETURN_IF_ERROR(p.U64(jf, fpath, "numel", 1ull << 56, &f.numel));
        if (f.numel == 0) return p.Err(fpath + "numel", "must be positive where present");
      }
      if (jf.contains("chunk_bytes")) {
        OPTSTATE_RETURN_IF_ERROR(p.U64(jf, fpath, "chunk_bytes", cs, &f.chunk_bytes));
        if (f.chunk_bytes == 0 || f.chunk_bytes % 4096 != 0) {
          return p.Err(fpath + "chunk_bytes", fmt::format("{} is not a positive multiple of 4096", f.chunk_bytes));
        }
      }
      if (IsQ8(f.dtype)) {
        OPTSTATE_RETURN_IF_ERROR(p.Str(jf, fpath, "scales", 255, &f.scales));
        OPTSTATE_RETURN_IF_ERROR(p.U64(jf, fpath, "block_size", UINT64_MAX, &f.block_size));
        if (f.scales != Q8ScalesField(f.name)) {
          return p.Err(fpath + "scales", fmt::format("'{}' is not '{}'", f.scales, Q8ScalesField(f.name)));
        }
        if (f.block_size != kQ8BlockElems) {
          return p.Err(fpath + "block_size", fmt::format("{} is not {}", f.block_size, kQ8BlockElems));
        }
      }
      const uint64_t fnumel = f.numel != 0 ? f.numel : t.numel;
      const uint64_t stride = f.chunk_bytes != 0 ? f.chunk_bytes : cs;
      uint64_t want_bytes = fnumel * DTypeSize(f.dtype);  // numel <= 2^56: no overflow
      if (f.bytes != want_bytes) {
        return p.Err(fpath + "bytes", fmt::format("{} != numel {} x {} bytes", f.bytes, fnumel,
                                                  DTypeSize(f.dtype)));
      }
      const Json* chunks = p.Member(jf, fpath, "chunks", &st);
      if (!chunks) return st;
      uint64_t nchunks = CeilDiv(f.bytes, stride);
      if (!chunks->is_array() || chunks->size() != nchunks) {
        return p.Err(fpath + "chunks",
                     fmt::format("expected an array of {} chunks ({} bytes / chunk size {})",
                                 nchunks, f.bytes, stride));
      }
      f.chunks.reserve(nchunks);
      for (uint64_t ci = 0; ci < nchunks; ++ci) {
        const Json& jc = (*chunks)[ci];
        std::string cpath = fmt::format("{}chunks[{}].", fpath, ci);
        OPTSTATE_RETURN_IF_ERROR(p.Object(jc, fmt::format("{}chunks[{}]", fpath, ci)));
        ManifestChunk c;
        OPTSTATE_RETURN_IF_ERROR(p.U64(jc, cpath, "offset", UINT64_MAX, &c.offset_bytes));
        OPTSTATE_RETURN_IF_ERROR(p.U64(jc, cpath, "length", UINT64_MAX, &c.length_bytes));
        uint64_t want_off = ci * stride;
        uint64_t want_len = std::min(stride, f.bytes - want_off);
        if (c.offset_bytes != want_off || c.length_bytes != want_len) {
          return p.Err(cpath + "offset",
                       fmt::format("chunk range [{}, +{}) should be [{}, +{})", c.offset_bytes,
                                   c.length_bytes, want_off, want_len));
        }
        std::string hex;
        OPTSTATE_RETURN_IF_ERROR(p.Str(jc, cpath, "xxh3", 16, &hex));
        if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
          return p.Err(cpath + "xxh3", fmt::format("'{}' is not 16 lower-case hex digits", hex));
        }
        c.xxh3 = std::strtoull(hex.c_str(), nullptr, 16);
        f.chunks.push_back(c);
      }
      t.fields.push_back(std::move(f));
    }
    // The q8 fields' scales: present, f32, one per block, chunk c covering
    // the same elements as the codes' chunk c.
    if (Status v = ValidateFields(TensorSpecOf(t), cs, fmt::format("manifest {}", p.source())); !v.ok()) {
      return v;
    }
    m->tensors.push_back(std::move(t));
  }
  return Status();
}

}  // namespace

Result<Manifest> ParseManifest(std::string_view json, std::string_view source) {
  Json j = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return InvalidArgument(fmt::format("manifest {}: not valid JSON", source));
  }
  Manifest m;
  Parser p(source);
  try {
    OPTSTATE_RETURN_IF_ERROR(ParseInto(j, p, &m));
  } catch (const std::exception& e) {  // defensive: a type error we did not foresee
    return InvalidArgument(fmt::format("manifest {}: {}", source, e.what()));
  }
  return m;
}

}  // namespace optstate::vfs
