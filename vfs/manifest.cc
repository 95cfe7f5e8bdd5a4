// Checkpoint format: the manifest of a generation (build from a view,
// deterministic JSON), the hyperparameter rules, and the manifest's tensor as
// a store TensorSpec. The strict parser is in manifest_parse.cc.
#include "vfs/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/log.h"
#include "vfs/internal/checkpoint_util.h"

namespace optstate::vfs {
namespace {

using OJson = nlohmann::ordered_json;
using internal::Hex16;

constexpr const char* kZeroChecksum = "0000000000000000";

std::vector<FieldSpec> FieldsOf(const TensorInfo& t) {
  if (!t.fields.empty()) return t.fields;
  return {{"main", DType::kF32}, {"exp_avg", DType::kF32}, {"exp_avg_sq", DType::kF32}};
}

}  // namespace

bool IsFlagHyperparameter(std::string_view name) {
  return name == "adamw" || name == "nesterov" || name == "maximize";
}

Status ValidateHyperparameters(const GroupInfo& g) {
  // One meaning per name across the update rules (AdamW, Lion, SGD, ...), so
  // the store checks every rule's groups without knowing which rule wrote
  // them; the optimizer that opens the store checks its own rule's ranges.
  for (const auto& [k, v] : g.hyper) {
    auto bad = [&](std::string_view want) {
      return InvalidArgument(
          fmt::format("group {}: hyperparameter {} = {} is out of range ({})", g.id, k, v, want));
    };
    if (!std::isfinite(v)) return bad("must be finite");
    if (IsFlagHyperparameter(k)) {
      if (v != 0.0 && v != 1.0) return bad("a flag: 0 or 1");
    } else if (k == "lr" || k == "weight_decay" || k == "momentum") {
      if (!(v >= 0)) return bad("must be >= 0");
    } else if (k == "beta1" || k == "beta2") {
      if (!(v >= 0 && v < 1)) return bad("must be in [0, 1)");
    } else if (k == "eps") {
      if (!(v > 0)) return bad("must be > 0");
    }
  }
  // SGD's Nesterov momentum needs a momentum and no dampening (as torch.optim.SGD
  // requires).
  auto value = [&](const char* k) {
    auto it = g.hyper.find(k);
    return it == g.hyper.end() ? 0.0 : it->second;
  };
  if (value("nesterov") == 1.0 && (value("momentum") <= 0 || value("dampening") != 0)) {
    return InvalidArgument(fmt::format(
        "group {}: hyperparameter nesterov = true needs momentum > 0 and dampening 0 (momentum {}, dampening {})",
        g.id, value("momentum"), value("dampening")));
  }
  return Status();
}

Result<Manifest> ManifestFromView(const GenerationView& view) {
  Manifest m;
  m.format_version = kCheckpointFormatVersion;
  m.store_uuid = view.identity().uuid;
  m.store_name = view.identity().name;
  m.job = view.identity().job;
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
    mt.step_count = TensorStepCount(view.info(), t);
    mt.shape = t.shape.empty() ? std::vector<uint64_t>{t.numel} : t.shape;
    mt.global_shape = t.global_shape.empty() ? mt.shape : t.global_shape;
    mt.shard_offset = t.shard_offset.empty() ? std::vector<uint64_t>(mt.global_shape.size(), 0)
                                             : t.shard_offset;
    std::vector<FieldSpec> fields = FieldsOf(t);
    TensorSpec geo = t;  // the field geometry, with the default fields filled in
    geo.fields = fields;
    for (uint32_t f = 0; f < fields.size(); ++f) {
      ManifestField mf;
      mf.name = fields[f].name;
      mf.dtype = fields[f].dtype;
      mf.file = fmt::format("{}/{}/{}", kTensorsDirName, mt.file_name, FileNameForName(mf.name));
      mf.bytes = geo.field_bytes(f);
      if (geo.field_numel(f) != t.numel) mf.numel = geo.field_numel(f);
      if (geo.field_chunk_bytes(f, m.chunk_size_bytes) != m.chunk_size_bytes) {
        mf.chunk_bytes = geo.field_chunk_bytes(f, m.chunk_size_bytes);
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
  j[kManifestChecksumKey] = kZeroChecksum;  // filled in below
  j["store"] = OJson{{"uuid", m.store_uuid}, {"name", m.store_name}};
  if (!m.job.empty()) j["job"] = m.job;
  j["generation"] = m.generation;
  j["step"] = m.step;
  j["chunk_size_bytes"] = m.chunk_size_bytes;
  // Only when false: a checkpoint with state.safetensors keeps the bytes it
  // had before the key existed (the mount serves them).
  if (!m.has_safetensors) j[kManifestSafetensorsKey] = false;
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
    jt["dtype"] = DTypeName(t.dtype);
    jt["numel"] = t.numel;
    jt["group"] = t.group;
    jt["step_count"] = t.step_count;
    jt["shape"] = t.shape;
    jt["global_shape"] = t.global_shape;
    jt["shard_offset"] = t.shard_offset;
    OJson fields = OJson::array();
    for (const ManifestField& f : t.fields) {
      OJson jf;
      jf["name"] = f.name;
      jf["dtype"] = DTypeName(f.dtype);
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
  std::string out = j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  // The checksum covers every byte, whatever fields the manifest holds: hash
  // the file with the placeholder, then write the hash over the placeholder.
  const std::string placeholder = fmt::format("\"{}\": \"{}\"", kManifestChecksumKey, kZeroChecksum);
  const size_t at = out.find(placeholder);
  if (at != std::string::npos) {
    const std::string hex = Hex16(ChunkChecksum(out.data(), out.size()));
    out.replace(at + placeholder.size() - 17, 16, hex);
  }
  return out;
}

Status VerifyManifestChecksum(std::string_view bytes, std::string_view source) {
  const std::string key = fmt::format("\"{}\"", kManifestChecksumKey);
  const size_t at = bytes.find(key);
  auto bad = [&](const std::string& what) {
    return Corruption(fmt::format("manifest {}: {}: the manifest is damaged or was edited", source, what));
  };
  if (at == std::string_view::npos) {
    // Written before manifests had a checksum: such a manifest is a JSON
    // object of exactly these keys. Anything else lost its checksum key to
    // damage (a flipped bit in the key's name), and is not taken unchecked.
    static const std::set<std::string, std::less<>> kKeysBefore = {
        "format", "format_version", "store", "generation", "step", "chunk_size_bytes", "groups", "tensors"};
    const nlohmann::json j = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return bad(fmt::format("not a JSON object, and no '{}' to check it by", kManifestChecksumKey));
    }
    for (const auto& [k, v] : j.items()) {
      (void)v;
      if (!kKeysBefore.count(k)) {
        return bad(fmt::format("it carries no '{}' but has the key '{}', which manifests written before '{}' "
                               "existed never had (a damaged key name?)",
                               kManifestChecksumKey, k, kManifestChecksumKey));
      }
    }
    OPTSTATE_LOG_INFO("manifest {} carries no {} (written before manifests had their own checksum): its bytes "
                      "are not checked as a whole",
                      source, kManifestChecksumKey);
    return Status();
  }
  // Inside a JSON string every '"' is escaped, so the key's quoted form
  // appears only as a key: exactly once, at the top level, as written.
  if (bytes.find(key, at + 1) != std::string_view::npos) return bad(fmt::format("'{}' appears twice", kManifestChecksumKey));
  size_t i = at + key.size();
  auto skip_ws = [&]() {
    while (i < bytes.size() && (bytes[i] == ' ' || bytes[i] == '\t' || bytes[i] == '\n' || bytes[i] == '\r')) ++i;
  };
  skip_ws();
  if (i >= bytes.size() || bytes[i] != ':') return bad(fmt::format("'{}' is not followed by ':'", kManifestChecksumKey));
  ++i;
  skip_ws();
  if (i + 18 > bytes.size() || bytes[i] != '"' || bytes[i + 17] != '"') {
    return bad(fmt::format("'{}' is not a string of 16 hex digits", kManifestChecksumKey));
  }
  const size_t hex_at = i + 1;
  uint64_t recorded = 0;
  for (size_t k = 0; k < 16; ++k) {
    const char ch = bytes[hex_at + k];
    int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
    if (d < 0) return bad(fmt::format("'{}' is not a string of 16 lower-case hex digits", kManifestChecksumKey));
    recorded = (recorded << 4) | static_cast<uint64_t>(d);
  }
  std::string copy(bytes);
  copy.replace(hex_at, 16, kZeroChecksum);
  const uint64_t actual = ChunkChecksum(copy.data(), copy.size());
  if (actual != recorded) {
    return Corruption(fmt::format(
        "manifest {}: its bytes have XXH3 {} ({} zeroed), the manifest records {}: the manifest is damaged or "
        "was edited (a changed hyperparameter, step or chunk checksum would otherwise be taken as written)",
        source, Hex16(actual), kManifestChecksumKey, Hex16(recorded)));
  }
  return Status();
}

Result<Manifest> ReadManifestFile(const std::string& path, FileSystem* fs) {
  if (fs == nullptr) fs = FileSystem::Default();
  OPTSTATE_ASSIGN_OR_RETURN(std::string text, fs->ReadFileToString(path));
  OPTSTATE_RETURN_IF_ERROR(VerifyManifestChecksum(text, path));
  return ParseManifest(text, path);
}

Result<std::map<uint32_t, uint64_t>> TensorStepsOf(Store* store, const Manifest& m) {
  std::map<uint32_t, uint64_t> steps;
  for (const ManifestTensor& mt : m.tensors) {
    OPTSTATE_ASSIGN_OR_RETURN(TensorInfo t, store->FindTensor(mt.name));
    steps[t.id] = mt.step_count;
  }
  return steps;
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
