#include "vfs/internal/store_format.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>

namespace optstate::vfs::internal {
namespace {

using nlohmann::json;

void PutBe32(std::string* s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutBe64(std::string* s, uint64_t v) {
  for (int i = 7; i >= 0; --i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetBe(std::string_view s, size_t pos, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | static_cast<uint8_t>(s[pos + i]);
  return v;
}
void PutLe(std::string* s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(std::string_view s, size_t pos, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[pos + i]);
  return v;
}

json HyperToJson(const std::map<std::string, double>& h) {
  json j = json::object();
  for (const auto& [k, v] : h) {
    if (std::isfinite(v)) {
      j[k] = v;
    } else {
      j[k] = std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
    }
  }
  return j;
}
std::map<std::string, double> HyperFromJson(const json& j) {
  std::map<std::string, double> h;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it->is_string()) {
      const std::string s = it->get<std::string>();
      h[it.key()] = s == "nan"   ? std::numeric_limits<double>::quiet_NaN()
                    : s == "inf" ? std::numeric_limits<double>::infinity()
                                 : -std::numeric_limits<double>::infinity();
    } else {
      h[it.key()] = it->get<double>();
    }
  }
  return h;
}

template <typename F>
auto ParseJson(std::string_view text, std::string_view what, F&& f) -> decltype(f(json())) {
  try {
    json j = json::parse(text.begin(), text.end());
    return f(j);
  } catch (const std::exception& e) {
    return Corruption(std::string(what) + ": bad record: " + e.what());
  }
}

}  // namespace

std::string EncodeU64(uint64_t v) {
  std::string s;
  PutBe64(&s, v);
  return s;
}
Result<uint64_t> DecodeU64(std::string_view s, std::string_view what) {
  if (s.size() != 8) return Corruption(std::string(what) + ": counter is not 8 bytes");
  return GetBe(s, 0, 8);
}

std::string TensorKey(std::string_view name) { return std::string(kTensorPrefix) + std::string(name); }
std::string DroppedKey(uint32_t tensor) {
  std::string k(kDroppedPrefix);
  PutBe32(&k, tensor);
  return k;
}
std::string SnapshotKey(std::string_view name) {
  return std::string(kSnapshotPrefix) + std::string(name);
}
std::string GenerationKey(uint64_t gen) {
  std::string s(kGenerationPrefix);
  PutBe64(&s, gen);
  return s;
}
Result<uint64_t> ParseGenerationKey(std::string_view key) {
  if (key.size() != kGenerationPrefix.size() + 8) return Corruption("bad generation key");
  return GetBe(key, kGenerationPrefix.size(), 8);
}
std::string ChunkKey(uint32_t tensor, uint32_t field, uint64_t chunk, uint64_t gen) {
  std::string s(kChunkPrefix);
  PutBe32(&s, tensor);
  PutBe32(&s, field);
  PutBe64(&s, chunk);
  PutBe64(&s, ~gen);
  return s;
}
Result<ChunkKeyParts> ParseChunkKey(std::string_view key) {
  const size_t p = kChunkPrefix.size();
  if (key.size() != p + 24) return Corruption("bad chunk key of " + std::to_string(key.size()) + " bytes");
  ChunkKeyParts k;
  k.tensor = static_cast<uint32_t>(GetBe(key, p, 4));
  k.field = static_cast<uint32_t>(GetBe(key, p + 4, 4));
  k.chunk = GetBe(key, p + 8, 8);
  k.gen = ~GetBe(key, p + 16, 8);
  return k;
}

std::string EncodeExtent(const Extent& e) {
  std::string s;
  PutLe(&s, e.dir, 4);
  PutLe(&s, e.file_offset, 8);
  PutLe(&s, e.length, 8);
  PutLe(&s, e.checksum, 8);
  return s;
}
Result<Extent> DecodeExtent(std::string_view v) {
  if (v.size() != 28) return Corruption("bad extent record of " + std::to_string(v.size()) + " bytes");
  Extent e;
  e.dir = static_cast<uint32_t>(GetLe(v, 0, 4));
  e.file_offset = GetLe(v, 4, 8);
  e.length = GetLe(v, 12, 8);
  e.checksum = GetLe(v, 20, 8);
  return e;
}

std::string PackKey(uint64_t gen, uint32_t pack) {
  std::string s(kPackPrefix);
  PutBe64(&s, gen);
  PutBe32(&s, pack);
  return s;
}
Result<PackKeyParts> ParsePackKey(std::string_view key) {
  const size_t p = kPackPrefix.size();
  if (key.size() != p + 12) return Corruption("bad chunk-map pack key of " + std::to_string(key.size()) + " bytes");
  return PackKeyParts{GetBe(key, p, 8), static_cast<uint32_t>(GetBe(key, p + 8, 4))};
}

namespace {
constexpr std::string_view kPackMagic = "OSPK";
constexpr size_t kPackedVersionBytes = 4 + 4 + 8 + 28;
}  // namespace

std::string EncodePack(const std::vector<PackedVersion>& versions) {
  std::string s(kPackMagic);
  s.reserve(s.size() + 4 + versions.size() * kPackedVersionBytes + 8);
  PutLe(&s, versions.size(), 4);
  for (const PackedVersion& v : versions) {
    PutLe(&s, v.tensor, 4);
    PutLe(&s, v.field, 4);
    PutLe(&s, v.chunk, 8);
    s += EncodeExtent(v.ext);
  }
  PutLe(&s, ChunkChecksum(s.data(), s.size()), 8);
  return s;
}

Result<std::vector<PackedVersion>> DecodePack(std::string_view v, std::string_view where) {
  const size_t head = kPackMagic.size() + 4;
  if (v.size() < head + 8 || !v.starts_with(kPackMagic)) {
    return Corruption(std::string(where) + ": bad chunk-map pack record of " + std::to_string(v.size()) + " bytes");
  }
  const uint64_t n = GetLe(v, kPackMagic.size(), 4);
  if (v.size() != head + n * kPackedVersionBytes + 8) {
    return Corruption(std::string(where) + ": chunk-map pack record of " + std::to_string(v.size()) +
                      " bytes for " + std::to_string(n) + " chunk versions");
  }
  if (ChunkChecksum(v.data(), v.size() - 8) != GetLe(v, v.size() - 8, 8)) {
    return Corruption(std::string(where) + ": chunk-map pack record fails its checksum");
  }
  std::vector<PackedVersion> out(n);
  for (uint64_t i = 0; i < n; ++i) {
    const size_t o = head + i * kPackedVersionBytes;
    out[i].tensor = static_cast<uint32_t>(GetLe(v, o, 4));
    out[i].field = static_cast<uint32_t>(GetLe(v, o + 4, 4));
    out[i].chunk = GetLe(v, o + 8, 8);
    OPTSTATE_ASSIGN_OR_RETURN(out[i].ext, DecodeExtent(v.substr(o + 16, 28)));
  }
  return out;
}

std::optional<std::string> RelativeToStore(std::string_view dir, std::string_view store_path) {
  while (store_path.size() > 1 && store_path.back() == '/') store_path.remove_suffix(1);
  if (store_path.empty() || !dir.starts_with(store_path)) return std::nullopt;
  std::string_view rest = dir.substr(store_path.size());
  if (rest.empty()) return std::string();
  if (rest[0] != '/' && store_path != "/") return std::nullopt;
  while (!rest.empty() && rest[0] == '/') rest.remove_prefix(1);
  return std::string(rest);
}

std::string NewUuid() {
  std::random_device rd;
  char u[40];
  const uint64_t a = (uint64_t{rd()} << 32) | rd(), b = (uint64_t{rd()} << 32) | rd();
  snprintf(u, sizeof(u), "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32),
           static_cast<unsigned>((a >> 16) & 0xffff), static_cast<unsigned>(a & 0xfff),
           static_cast<unsigned>(0x8000 | ((b >> 48) & 0x3fff)),
           static_cast<unsigned long long>(b & 0xffffffffffffull));
  return u;
}

std::string EncodeIdentity(const StoreIdentity& id, std::string_view store_path) {
  json j;
  j["format_version"] = id.format_version;
  j["uuid"] = id.uuid;
  if (!id.job.empty()) j["job"] = id.job;
  j["name"] = id.name;
  j["chunk_size_bytes"] = id.chunk_size_bytes;
  std::vector<std::string> dirs;
  for (const auto& d : id.data_dirs) {
    auto rel = d.starts_with("/") ? RelativeToStore(d, store_path) : std::optional<std::string>(d);
    dirs.push_back(rel ? (rel->empty() ? "." : *rel) : d);
  }
  j["data_dirs"] = dirs;
  j["create_time_unix_ms"] = id.create_time_unix_ms;
  return j.dump(2) + "\n";
}
Result<StoreIdentity> DecodeIdentity(std::string_view text, std::string_view where) {
  return ParseJson(text, where, [&](const json& j) -> Result<StoreIdentity> {
    StoreIdentity id;
    id.format_version = j.at("format_version").get<uint32_t>();
    if (id.format_version < kMinFormatVersion || id.format_version > kFormatVersion) {
      return Corruption(std::string(where) + ": format version " + std::to_string(id.format_version) +
                        ", this build reads versions " + std::to_string(kMinFormatVersion) + " to " +
                        std::to_string(kFormatVersion));
    }
    id.uuid = j.at("uuid").get<std::string>();
    id.name = j.at("name").get<std::string>();
    if (auto job = j.find("job"); job != j.end()) id.job = job->get<std::string>();  // absent: unknown
    id.chunk_size_bytes = j.at("chunk_size_bytes").get<uint64_t>();
    id.data_dirs = j.at("data_dirs").get<std::vector<std::string>>();
    id.create_time_unix_ms = j.at("create_time_unix_ms").get<int64_t>();
    if (id.uuid.empty() || id.data_dirs.empty() || id.chunk_size_bytes == 0 ||
        id.chunk_size_bytes % kChunkAlignBytes != 0) {
      return Corruption(std::string(where) + ": identity has an empty uuid, no data dirs or a bad chunk size");
    }
    for (const auto& d : id.data_dirs) {
      if (d.empty() || (d[0] != '/' && (d == ".." || d.starts_with("../") || d.find("/../") != std::string::npos ||
                                        d.ends_with("/..")))) {
        return Corruption(std::string(where) + ": data dir '" + d +
                          "' is empty or leaves the store directory (a relative data dir lies inside it)");
      }
    }
    return id;
  });
}

std::string EncodeDataFileOwner(const DataFileOwner& o) {
  json j;
  j["uuid"] = o.uuid;
  j["store"] = o.store_path;
  j["store_dev"] = o.store_dev;
  j["store_ino"] = o.store_ino;
  j["data_dev"] = o.data_dev;
  j["data_ino"] = o.data_ino;
  j["data_btime_ns"] = o.data_btime_ns;
  return j.dump(2) + "\n";
}
Result<DataFileOwner> DecodeDataFileOwner(std::string_view text, std::string_view where) {
  return ParseJson(text, where, [&](const json& j) -> Result<DataFileOwner> {
    DataFileOwner o;
    o.uuid = j.at("uuid").get<std::string>();
    o.store_path = j.at("store").get<std::string>();
    o.store_dev = j.at("store_dev").get<uint64_t>();
    o.store_ino = j.at("store_ino").get<uint64_t>();
    o.data_dev = j.at("data_dev").get<uint64_t>();
    o.data_ino = j.at("data_ino").get<uint64_t>();
    o.data_btime_ns = j.value("data_btime_ns", uint64_t{0});
    return o;
  });
}

std::string EncodeTensor(const TensorInfo& t) {
  json j;
  j["id"] = t.id;
  j["name"] = t.name;
  j["dtype"] = DTypeName(t.dtype);
  j["numel"] = t.numel;
  j["group"] = t.group;
  j["shape"] = t.shape;
  j["global_shape"] = t.global_shape;
  j["shard_offset"] = t.shard_offset;
  json fields = json::array();
  for (const auto& f : t.fields) {
    json jf = {{"name", f.name}, {"dtype", DTypeName(f.dtype)}};
    // Recorded only where they differ from the defaults, so records of
    // tensors without them read as before.
    if (f.numel != 0) jf["numel"] = f.numel;
    if (f.chunk_bytes != 0) jf["chunk_bytes"] = f.chunk_bytes;
    fields.push_back(jf);
  }
  j["fields"] = fields;
  j["created_generation"] = t.created_generation;
  if (t.dropped_generation != 0) j["dropped_generation"] = t.dropped_generation;
  return j.dump();
}
Result<TensorInfo> DecodeTensor(std::string_view text) {
  return ParseJson(text, "tensor record", [&](const json& j) -> Result<TensorInfo> {
    TensorInfo t;
    t.id = j.at("id").get<uint32_t>();
    t.name = j.at("name").get<std::string>();
    OPTSTATE_ASSIGN_OR_RETURN(t.dtype, ParseDType(j.at("dtype").get<std::string>()));
    t.numel = j.at("numel").get<uint64_t>();
    t.group = j.at("group").get<uint32_t>();
    t.shape = j.at("shape").get<std::vector<uint64_t>>();
    t.global_shape = j.at("global_shape").get<std::vector<uint64_t>>();
    t.shard_offset = j.at("shard_offset").get<std::vector<uint64_t>>();
    for (const auto& f : j.at("fields")) {
      FieldSpec fs;
      fs.name = f.at("name").get<std::string>();
      OPTSTATE_ASSIGN_OR_RETURN(fs.dtype, ParseDType(f.at("dtype").get<std::string>()));
      if (f.contains("numel")) fs.numel = f.at("numel").get<uint64_t>();
      if (f.contains("chunk_bytes")) fs.chunk_bytes = f.at("chunk_bytes").get<uint64_t>();
      t.fields.push_back(fs);
    }
    t.created_generation = j.at("created_generation").get<uint64_t>();
    if (j.contains("dropped_generation")) t.dropped_generation = j.at("dropped_generation").get<uint64_t>();
    return t;
  });
}

std::string EncodeGeneration(const GenerationInfo& g) {
  json j;
  j["generation"] = g.generation;
  j["step"] = g.step;
  j["commit_time_unix_ms"] = g.commit_time_unix_ms;
  if (g.index_digest != 0) j["index_digest"] = g.index_digest;
  json groups = json::array();
  for (const auto& gr : g.groups) {
    groups.push_back({{"id", gr.id}, {"step_count", gr.step_count}, {"hyper", HyperToJson(gr.hyper)}});
  }
  j["groups"] = groups;
  // Recorded only when some tensor's count differs from its group's, so a
  // generation without such tensors reads as before.
  if (!g.tensor_steps.empty()) {
    json steps = json::array();
    for (const auto& [id, n] : g.tensor_steps) steps.push_back({id, n});
    j["tensor_steps"] = steps;
  }
  return j.dump();
}
Result<GenerationInfo> DecodeGeneration(std::string_view text) {
  return ParseJson(text, "generation record", [&](const json& j) -> Result<GenerationInfo> {
    GenerationInfo g;
    g.generation = j.at("generation").get<uint64_t>();
    g.step = j.at("step").get<uint64_t>();
    g.commit_time_unix_ms = j.at("commit_time_unix_ms").get<int64_t>();
    if (j.contains("index_digest")) g.index_digest = j.at("index_digest").get<uint64_t>();
    for (const auto& gr : j.at("groups")) {
      GroupInfo info;
      info.id = gr.at("id").get<uint32_t>();
      info.step_count = gr.at("step_count").get<uint64_t>();
      info.hyper = HyperFromJson(gr.at("hyper"));
      g.groups.push_back(std::move(info));
    }
    if (j.contains("tensor_steps")) {
      for (const auto& e : j.at("tensor_steps")) {
        g.tensor_steps[e.at(0).get<uint32_t>()] = e.at(1).get<uint64_t>();
      }
    }
    return g;
  });
}

std::string EncodeSnapshot(const SnapshotInfo& s) {
  json j;
  j["generation"] = s.generation;
  j["create_time_unix_ms"] = s.create_time_unix_ms;
  return j.dump();
}
Result<SnapshotInfo> DecodeSnapshot(std::string_view name, std::string_view text) {
  return ParseJson(text, "snapshot record", [&](const json& j) -> Result<SnapshotInfo> {
    SnapshotInfo s;
    s.name = std::string(name);
    s.generation = j.at("generation").get<uint64_t>();
    s.create_time_unix_ms = j.at("create_time_unix_ms").get<int64_t>();
    return s;
  });
}

}  // namespace optstate::vfs::internal
