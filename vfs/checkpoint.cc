// Checkpoint format: name escaping, manifest (build, serialize, strict parse)
// and the virtual-file layout of a generation. Restore is in restore.cc.
#include "vfs/checkpoint.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "vfs/io_buffer.h"

namespace optstate::vfs {
namespace {

using OJson = nlohmann::ordered_json;
using Json = nlohmann::json;

constexpr uint64_t kMaxChunkBytes = 1ull << 30;
constexpr size_t kMaxTensorNameBytes = 4096;
constexpr size_t kMaxRank = 16;

bool SafeByte(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

// Local dtype helpers so the format code does not depend on the store's
// definitions (same names as DTypeName/ParseDType).
const char* DtName(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kQ8S: return "q8s";
    case DType::kQ8U: return "q8u";
  }
  return "?";
}
const char* SafetensorsDtName(DType d) {
  switch (d) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kQ8S:
    case DType::kQ8U: return "U8";
  }
  return "?";
}
uint32_t DtSize(DType d) { return d == DType::kF32 ? 4 : IsQ8(d) ? 1 : 2; }
bool DtParse(std::string_view s, DType* out) {
  if (s == "f32") { *out = DType::kF32; return true; }
  if (s == "bf16") { *out = DType::kBF16; return true; }
  if (s == "f16") { *out = DType::kF16; return true; }
  if (s == "q8s") { *out = DType::kQ8S; return true; }
  if (s == "q8u") { *out = DType::kQ8U; return true; }
  return false;
}

std::vector<FieldSpec> FieldsOf(const TensorInfo& t) {
  if (!t.fields.empty()) return t.fields;
  return {{"main", DType::kF32}, {"exp_avg", DType::kF32}, {"exp_avg_sq", DType::kF32}};
}

std::string Hex16(uint64_t v) { return fmt::format("{:016x}", v); }

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// Multiplication with overflow detection.
bool MulOk(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

}  // namespace

// ---- names ------------------------------------------------------------------

std::string EscapeName(std::string_view name) {
  if (name.empty()) return "%";
  if (name == ".") return "%2E";
  if (name == "..") return "%2E%2E";
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(name.size());
  for (char ch : name) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (SafeByte(c)) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

Result<std::string> UnescapeName(std::string_view e) {
  if (e == "%") return std::string();
  auto hexval = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < e.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(e[i]);
    if (c == '%') {
      if (i + 2 >= e.size()) {
        return InvalidArgument(fmt::format("escaped name '{}': truncated %XX at byte {}", e, i));
      }
      int hi = hexval(e[i + 1]), lo = hexval(e[i + 2]);
      if (hi < 0 || lo < 0) {
        return InvalidArgument(fmt::format("escaped name '{}': bad %XX at byte {}", e, i));
      }
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (SafeByte(c)) {
      out.push_back(static_cast<char>(c));
    } else {
      return InvalidArgument(fmt::format("escaped name '{}': byte 0x{:02x} at {} must be escaped",
                                         e, c, i));
    }
  }
  if (EscapeName(out) != e) {
    return InvalidArgument(fmt::format("escaped name '{}' is not in canonical form", e));
  }
  return out;
}

std::string FileNameForName(std::string_view name) {
  std::string e = EscapeName(name);
  if (e.size() <= kMaxFileNameBytes) return e;
  size_t keep = kMaxFileNameBytes - 17;
  // Do not cut a %XX in half.
  while (keep > 0 && (e[keep - 1] == '%' || (keep >= 2 && e[keep - 2] == '%'))) --keep;
  return e.substr(0, keep) + "~" + Hex16(XXH3_64bits(name.data(), name.size()));
}

// ---- manifest -----------------------------------------------------------------

bool IsFlagHyperparameter(std::string_view name) { return name == "adamw"; }

Status ValidateHyperparameters(const GroupInfo& g) {
  for (const auto& [k, v] : g.hyper) {
    auto bad = [&](std::string_view want) {
      return InvalidArgument(
          fmt::format("group {}: hyperparameter {} = {} is out of range ({})", g.id, k, v, want));
    };
    if (!std::isfinite(v)) return bad("must be finite");
    if (IsFlagHyperparameter(k)) {
      if (v != 0.0 && v != 1.0) return bad("a flag: 0 or 1");
    } else if (k == "lr" || k == "weight_decay") {
      if (!(v >= 0)) return bad("must be >= 0");
    } else if (k == "beta1" || k == "beta2") {
      if (!(v >= 0 && v < 1)) return bad("must be in [0, 1)");
    } else if (k == "eps") {
      if (!(v > 0)) return bad("must be > 0");
    }
  }
  return Status();
}

Result<Manifest> ManifestFromView(const GenerationView& view) {
  Manifest m;
  m.format_version = kCheckpointFormatVersion;
  m.store_uuid = view.identity().uuid;
  m.store_name = view.identity().name;
  m.generation = view.info().generation;
  m.step = view.info().step;
  m.chunk_size_bytes = view.identity().chunk_size_bytes;
  m.groups = view.info().groups;
  std::sort(m.groups.begin(), m.groups.end(),
            [](const GroupInfo& a, const GroupInfo& b) { return a.id < b.id; });
  for (const TensorInfo& t : view.tensors()) {
    ManifestTensor mt;
    mt.name = t.name;
    mt.file_name = FileNameForName(t.name);
    mt.dtype = t.dtype;
    mt.numel = t.numel;
    mt.group = t.group;
    mt.shape = t.shape.empty() ? std::vector<uint64_t>{t.numel} : t.shape;
    mt.global_shape = t.global_shape.empty() ? mt.shape : t.global_shape;
    mt.shard_offset = t.shard_offset.empty() ? std::vector<uint64_t>(mt.global_shape.size(), 0)
                                             : t.shard_offset;
    std::vector<FieldSpec> fields = FieldsOf(t);
    for (uint32_t f = 0; f < fields.size(); ++f) {
      ManifestField mf;
      mf.name = fields[f].name;
      mf.dtype = fields[f].dtype;
      mf.file = fmt::format("{}/{}/{}", kTensorsDirName, mt.file_name, FileNameForName(mf.name));
      mf.bytes = t.field_bytes(f);
      if (t.field_numel(f) != t.numel) mf.numel = t.field_numel(f);
      if (t.field_chunk_bytes(f, m.chunk_size_bytes) != m.chunk_size_bytes) {
        mf.chunk_bytes = t.field_chunk_bytes(f, m.chunk_size_bytes);
      }
      if (IsQ8(mf.dtype)) {
        mf.scales = Q8ScalesField(mf.name);
        mf.block_size = kQ8BlockElems;
      }
      uint64_t n = view.ChunkCount(t, f);
      mf.chunks.reserve(n);
      for (uint64_t i = 0; i < n; ++i) {
        OPTSTATE_ASSIGN_OR_RETURN(ChunkInfo ci, view.Chunk(ChunkRef{t.id, f, i}));
        mf.chunks.push_back({ci.offset_bytes, ci.length_bytes, ci.checksum});
      }
      mt.fields.push_back(std::move(mf));
    }
    m.tensors.push_back(std::move(mt));
  }
  std::sort(m.tensors.begin(), m.tensors.end(),
            [](const ManifestTensor& a, const ManifestTensor& b) { return a.name < b.name; });
  return m;
}

std::string SerializeManifest(const Manifest& m) {
  OJson j;
  j["format"] = "optstate-checkpoint";
  j["format_version"] = m.format_version;
  j["store"] = OJson{{"uuid", m.store_uuid}, {"name", m.store_name}};
  j["generation"] = m.generation;
  j["step"] = m.step;
  j["chunk_size_bytes"] = m.chunk_size_bytes;
  OJson groups = OJson::array();
  for (const GroupInfo& g : m.groups) {
    OJson hyper = OJson::object();
    for (const auto& [k, v] : g.hyper) {  // std::map: sorted
      if (IsFlagHyperparameter(k) && (v == 0.0 || v == 1.0)) {
        hyper[k] = (v == 1.0);
      } else {
        hyper[k] = v;
      }
    }
    groups.push_back(OJson{{"id", g.id}, {"step_count", g.step_count}, {"hyper", hyper}});
  }
  j["groups"] = groups;
  OJson tensors = OJson::array();
  for (const ManifestTensor& t : m.tensors) {
    OJson jt;
    jt["name"] = t.name;
    jt["file_name"] = t.file_name;
    jt["dtype"] = DtName(t.dtype);
    jt["numel"] = t.numel;
    jt["group"] = t.group;
    jt["shape"] = t.shape;
    jt["global_shape"] = t.global_shape;
    jt["shard_offset"] = t.shard_offset;
    OJson fields = OJson::array();
    for (const ManifestField& f : t.fields) {
      OJson jf;
      jf["name"] = f.name;
      jf["dtype"] = DtName(f.dtype);
      jf["file"] = f.file;
      jf["bytes"] = f.bytes;
      if (f.numel != 0) jf["numel"] = f.numel;
      if (f.chunk_bytes != 0) jf["chunk_bytes"] = f.chunk_bytes;
      if (!f.scales.empty()) {
        jf["scales"] = f.scales;
        jf["block_size"] = f.block_size;
      }
      OJson chunks = OJson::array();
      for (const ManifestChunk& c : f.chunks) {
        chunks.push_back(OJson{{"offset", c.offset_bytes}, {"length", c.length_bytes},
                               {"xxh3", Hex16(c.xxh3)}});
      }
      jf["chunks"] = std::move(chunks);
      fields.push_back(std::move(jf));
    }
    jt["fields"] = std::move(fields);
    tensors.push_back(std::move(jt));
  }
  j["tensors"] = std::move(tensors);
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

namespace {

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
    if (!DtParse(s, out)) return Err(path + "dtype", fmt::format("unknown dtype '{}'", s));
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
  OPTSTATE_RETURN_IF_ERROR(p.U64(j, "", "generation", UINT64_MAX - 1, &m->generation));
  OPTSTATE_RETURN_IF_ERROR(p.U64(j, "", "step", UINT64_MAX, &m->step));
  OPTSTATE_RETURN_IF_ERROR(p.U64(j, "", "chunk_size_bytes", kMaxChunkBytes, &m->chunk_size_bytes));
  if (m->chunk_size_bytes == 0 || m->chunk_size_bytes % kChunkAlignBytes != 0) {
    return p.Err("chunk_size_bytes", fmt::format("{} is not a positive multiple of 2 MiB",
                                                 m->chunk_size_bytes));
  }
  const uint64_t cs = m->chunk_size_bytes;

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
      return InvalidArgument(fmt::format("manifest {}: key '{}hyper': {}", p.source(), path,
                                         hs.message()));
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
    if (t.global_shape.size() != t.shape.size() || t.shard_offset.size() != t.shape.size()) {
      return p.Err(path + "global_shape",
                   "shape, global_shape and shard_offset must have the same rank");
    }
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (t.shard_offset[d] > t.global_shape[d] ||
          t.shape[d] > t.global_shape[d] - t.shard_offset[d]) {
        return p.Err(path + "shard_offset",
                     fmt::format("dimension {}: offset {} + extent {} exceeds global {}", d,
                                 t.shard_offset[d], t.shape[d], t.global_shape[d]));
      }
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
      uint64_t want_bytes = fnumel * DtSize(f.dtype);  // numel <= 2^56: no overflow
      if (f.bytes != want_bytes) {
        return p.Err(fpath + "bytes", fmt::format("{} != numel {} x {} bytes", f.bytes, fnumel,
                                                  DtSize(f.dtype)));
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

// ---- layout -------------------------------------------------------------------

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
  OJson header;
  OJson meta = OJson::object();
  meta["format"] = "pt";
  meta[kSafetensorsStoreKey] = l->manifest_.store_name;
  meta[kSafetensorsStoreUuidKey] = l->manifest_.store_uuid;
  meta[kSafetensorsGenerationKey] = std::to_string(l->manifest_.generation);
  meta[kSafetensorsStepKey] = std::to_string(l->manifest_.step);
  header["__metadata__"] = meta;
  uint64_t data_off = 0, seq = 0;
  std::vector<CheckpointFile> field_files;
  for (const ManifestTensor& mt : l->manifest_.tensors) {
    auto it = std::find_if(vt.begin(), vt.end(), [&](const TensorInfo& t) { return t.name == mt.name; });
    if (it == vt.end()) return Internal("checkpoint layout: tensor vanished: " + mt.name);
    uint32_t ti = static_cast<uint32_t>(it - vt.begin());
    for (uint32_t f = 0; f < mt.fields.size(); ++f) {
      const ManifestField& mf = mt.fields[f];
      OJson e;
      e["dtype"] = SafetensorsDtName(mf.dtype);
      e["shape"] = FieldShape(mt, mf);
      e["data_offsets"] = OJson::array({data_off, data_off + mf.bytes});
      header[mt.name + "/" + mf.name] = e;
      const uint64_t stride = mf.chunk_bytes != 0 ? mf.chunk_bytes : l->chunk_size_;
      l->spans_.push_back({ti, f, data_off, mf.bytes, seq, stride});
      data_off += mf.bytes;
      seq += mf.chunks.size();
      field_files.push_back({mf.file, CheckpointFileKind::kField, mf.bytes, ti, f, stride});
    }
  }
  l->st_chunks_ = seq;
  std::string hjson = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  while ((8 + hjson.size()) % kSafetensorsDataAlignBytes != 0) hjson.push_back(' ');
  uint64_t hlen = hjson.size();
  l->st_header_.resize(8);
  for (int i = 0; i < 8; ++i) l->st_header_[i] = static_cast<char>((hlen >> (8 * i)) & 0xff);
  l->st_header_ += hjson;

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

TensorSpec TensorSpecOf(const ManifestTensor& mt) {
  TensorSpec spec;
  spec.name = mt.name;
  spec.dtype = mt.dtype;
  spec.numel = mt.numel;
  spec.group = mt.group;
  spec.shape = mt.shape;
  spec.global_shape = mt.global_shape;
  spec.shard_offset = mt.shard_offset;
  for (const ManifestField& f : mt.fields) spec.fields.push_back({f.name, f.dtype, f.numel, f.chunk_bytes});
  return spec;
}

}  // namespace optstate::vfs
