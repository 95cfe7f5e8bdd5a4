// Checkpoint format: escaping, manifest round trip and strict parsing, and the
// virtual-file layout checked against an independent reference (the fake
// view's bytes and a separate safetensors parser).
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>

#include "tests/vfs/checkpoint_fake_view.h"
#include "vfs/checkpoint.h"

namespace optstate::vfs {
namespace {

using testing::FakeView;
constexpr uint64_t kCs = 2 * kMiB;

TEST(CheckpointNames, EscapeRoundTrip) {
  std::vector<std::string> names = {"layer.0.weight", "a/b/c", "..", ".", "%", "%41", "", "x y",
                                    std::string("nul\0byte", 8), "\xc3\xa9t\xc3\xa9", "~tilde",
                                    std::string(4096, 'q'), std::string(300, '/')};
  std::set<std::string> seen;
  for (const std::string& n : names) {
    std::string e = EscapeName(n);
    EXPECT_EQ(e.find('/'), std::string::npos) << e;
    EXPECT_EQ(e.find('\0'), std::string::npos);
    EXPECT_NE(e, ".");
    EXPECT_NE(e, "..");
    auto back = UnescapeName(e);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, n);
    EXPECT_TRUE(seen.insert(e).second) << "collision: " << e;
    std::string f = FileNameForName(n);
    EXPECT_LE(f.size(), kMaxFileNameBytes);
    EXPECT_FALSE(f.empty());
  }
  EXPECT_EQ(EscapeName("a/b"), "a%2Fb");
  EXPECT_EQ(EscapeName(".."), "%2E%2E");
  EXPECT_NE(FileNameForName(std::string(4096, 'q')), FileNameForName(std::string(4095, 'q') + "r"));
}

TEST(CheckpointNames, UnescapeRejectsMalformed) {
  for (const char* bad : {"%", "%4", "%zz", "a%2f", "a/b", "a b", "%41"}) {
    if (std::string(bad) == "%") continue;  // "%" is the empty name
    EXPECT_FALSE(UnescapeName(bad).ok()) << bad;
  }
}

std::unique_ptr<FakeView> MakeView() {
  auto v = std::make_unique<FakeView>(kCs, 7, 42);
  v->Add("model.layers.0/attn.weight", 600000, 1, {600, 1000});  // 2.4 MB: 2 chunks per field
  v->Add("bias", 3, 2);                                       // 12 bytes
  v->Add("..", 524288, 3);                                      // exactly one chunk (2 MiB)
  v->Add("emb", 1048577, 4);                                    // 2 chunks + 4 bytes
  return v;
}

TEST(CheckpointManifest, RoundTripDeterministic) {
  auto v = MakeView();
  auto m = ManifestFromView(*v);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  std::string js = SerializeManifest(*m);
  EXPECT_EQ(js, SerializeManifest(*ManifestFromView(*v)));
  auto p = ParseManifest(js, "/x/manifest.json");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(SerializeManifest(*p), js);
  EXPECT_EQ(p->generation, 7u);
  EXPECT_EQ(p->step, 42u);
  EXPECT_EQ(p->chunk_size_bytes, kCs);
  ASSERT_EQ(p->groups.size(), 2u);
  EXPECT_DOUBLE_EQ(p->groups[1].hyper.at("lr"), 3.5e-4);
  ASSERT_EQ(p->tensors.size(), 4u);
  EXPECT_EQ(p->tensors[0].name, "..");
  EXPECT_EQ(p->tensors[0].file_name, "%2E%2E");
  const ManifestTensor& big = p->tensors[3];
  EXPECT_EQ(big.name, "model.layers.0/attn.weight");
  EXPECT_EQ(big.shape, (std::vector<uint64_t>{600, 1000}));
  ASSERT_EQ(big.fields.size(), 3u);
  ASSERT_EQ(big.fields[1].chunks.size(), 2u);
  uint32_t id = v->FindTensor(big.name)->id;
  const std::string& b = v->Bytes(id, 1);
  EXPECT_EQ(big.fields[1].chunks[1].xxh3, XXH3_64bits(b.data() + kCs, b.size() - kCs));
  EXPECT_EQ(big.fields[1].file, "tensors/model.layers.0%2Fattn.weight/exp_avg");
}

// The manifest checksums its own bytes: what the writer and the mount's
// layout produce verifies; any one flipped bit anywhere is kCorruption
// naming the source; a manifest without the key (written before) passes; the
// check does not depend on the JSON's layout (the same manifest dumped
// another way, with its checksum computed by an independent implementation,
// verifies).
TEST(CheckpointManifest, CarriesItsOwnChecksum) {
  auto v = MakeView();
  const std::string js = SerializeManifest(*ManifestFromView(*v));
  ASSERT_TRUE(VerifyManifestChecksum(js, "m").ok());
  auto l = CheckpointLayout::Build(v.get());
  ASSERT_TRUE(l.ok());
  EXPECT_EQ((*l)->manifest_json(), js);
  const std::string key = std::string("\"") + kManifestChecksumKey + "\"";
  const size_t at = js.find(key);
  ASSERT_NE(at, std::string::npos);
  const std::string recorded = js.substr(js.find('"', at + key.size() + 1) + 1, 16);
  // The recorded value is XXH3-64 of the bytes with that value zeroed.
  std::string zeroed = js;
  zeroed.replace(js.find(recorded), 16, std::string(16, '0'));
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(XXH3_64bits(zeroed.data(), zeroed.size())));
  EXPECT_EQ(recorded, hex);
  for (size_t i = 0; i < js.size(); ++i) {
    std::string flipped = js;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 7)));
    Status st = VerifyManifestChecksum(flipped, "/ckpt/manifest.json");
    ASSERT_FALSE(st.ok()) << "a flip at byte " << i << " passed: ..." << flipped.substr(i < 30 ? 0 : i - 30, 60);
    EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
    EXPECT_NE(st.message().find("/ckpt/manifest.json"), std::string::npos) << st.message();
  }
  nlohmann::json j = nlohmann::json::parse(js);
  EXPECT_TRUE(VerifyManifestChecksum(j.dump(4), "m").code() == StatusCode::kCorruption);
  std::string other = j.dump(4);
  const size_t q = other.find('"', other.find(':', other.find(key) + key.size())) + 1;
  other.replace(q, 16, std::string(16, '0'));
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(XXH3_64bits(other.data(), other.size())));
  other.replace(q, 16, hex);
  EXPECT_TRUE(VerifyManifestChecksum(other, "m").ok());
  j.erase(kManifestChecksumKey);
  j.erase("job");
  EXPECT_TRUE(VerifyManifestChecksum(j.dump(), "m").ok());  // written before: no checksum, no job
  j["manifest_xxh4"] = recorded;  // the key's name damaged: not taken for one written before
  EXPECT_EQ(VerifyManifestChecksum(j.dump(), "m").code(), StatusCode::kCorruption);
  j.erase("manifest_xxh4");
  EXPECT_TRUE(ParseManifest(j.dump(), "m").ok());
  std::string twice = js;
  twice.insert(twice.find("\"store\""), key + ": \"" + recorded + "\", ");
  EXPECT_EQ(VerifyManifestChecksum(twice, "m").code(), StatusCode::kCorruption);
}

// Edits one value of a valid manifest and expects an error naming the key.
void ExpectRejected(const std::function<void(nlohmann::json&)>& edit, const std::string& key_part) {
  auto v = MakeView();
  nlohmann::json j = nlohmann::json::parse(SerializeManifest(*ManifestFromView(*v)));
  edit(j);
  auto p = ParseManifest(j.dump(), "/ckpt/manifest.json");
  ASSERT_FALSE(p.ok()) << "accepted after edit of " << key_part;
  EXPECT_NE(p.status().message().find("/ckpt/manifest.json"), std::string::npos)
      << p.status().message();
  EXPECT_NE(p.status().message().find(key_part), std::string::npos) << p.status().message();
  if (key_part.find("hyperparameter ") != std::string::npos) {
    // A value out of its range also names the store the checkpoint is of.
    EXPECT_NE(p.status().message().find("(store " + j["store"]["name"].get<std::string>() + ")"), std::string::npos)
        << p.status().message();
  }
}

TEST(CheckpointManifest, StrictValidation) {
  ExpectRejected([](auto& j) { j.erase("step"); }, "step");
  ExpectRejected([](auto& j) { j["step"] = -1; }, "step");
  ExpectRejected([](auto& j) { j["step"] = "3"; }, "step");
  ExpectRejected([](auto& j) { j["format_version"] = 2; }, "format_version");
  ExpectRejected([](auto& j) { j["chunk_size_bytes"] = 12345; }, "chunk_size_bytes");
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"]["lr"] = "fast"; }, "hyper.lr");
  ExpectRejected([](auto& j) { j["groups"][1]["id"] = 0; }, "groups[1].id");
  ExpectRejected([](auto& j) { j["tensors"][1]["numel"] = 4; }, "shape");
  ExpectRejected([](auto& j) { j["tensors"][3]["shape"] = {600, 999}; }, "shape");
  ExpectRejected([](auto& j) { j["tensors"][3]["shard_offset"] = {1, 0}; }, "shard_offset");
  ExpectRejected([](auto& j) { j["tensors"][2]["file_name"] = "../evil"; }, "file_name");
  ExpectRejected([](auto& j) { j["tensors"][2]["fields"][0]["file"] = "/etc/passwd"; }, "file");
  ExpectRejected([](auto& j) { j["tensors"][2]["fields"][0]["dtype"] = "f64"; }, "dtype");
  ExpectRejected([](auto& j) { j["tensors"][2]["fields"][0]["chunks"][0]["xxh3"] = "zz"; }, "xxh3");
  ExpectRejected([](auto& j) { j["tensors"][2]["fields"][0]["chunks"][1]["offset"] = 0; },
                 "chunks[1].offset");
  ExpectRejected([](auto& j) { j["tensors"][2]["fields"][0]["chunks"].erase(1); }, "chunks");
  ExpectRejected([](auto& j) { j["tensors"][2]["fields"][1]["name"] = "main"; }, "duplicate");
  ExpectRejected([](auto& j) { j["tensors"][2] = j["tensors"][1]; }, "duplicate");
  ExpectRejected([](auto& j) { j["tensors"] = 5; }, "tensors");
  // Hyperparameters out of range, named with their group.
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"]["beta1"] = 7; }, "beta1 = 7");
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"]["beta1"] = 1.0; }, "group 0");
  ExpectRejected([](auto& j) { j["groups"][1]["hyper"]["beta2"] = -0.5; }, "beta2");
  ExpectRejected([](auto& j) { j["groups"][1]["hyper"]["eps"] = 0; }, "eps = 0");
  ExpectRejected([](auto& j) { j["groups"][1]["hyper"]["lr"] = -5; }, "lr = -5");
  ExpectRejected([](auto& j) { j["groups"][1]["hyper"]["weight_decay"] = -1e-3; }, "weight_decay");
  ExpectRejected([](auto& j) { j["groups"][1]["hyper"]["lr"] = 1e300 * 1e300; }, "hyper.lr");
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"]["adamw"] = 0.5; }, "hyper.adamw");
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"]["adamw"] = "yes"; }, "hyper.adamw");
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"]["eps"] = true; }, "hyper.eps");
  // SGD's and Lion's names by the same rules (one meaning per name in every rule).
  ExpectRejected([](auto& j) { j["groups"][1]["hyper"]["momentum"] = -0.5; },
                 "group 1: hyperparameter momentum = -0.5");
  ExpectRejected([](auto& j) { j["groups"][1]["hyper"]["nesterov"] = 0.5; }, "hyper.nesterov");
  ExpectRejected(
      [](auto& j) {
        j["groups"][0]["hyper"] = {{"lr", 0.1}, {"momentum", 0.9}, {"dampening", 0.25}, {"nesterov", true}};
      },
      "group 0: hyperparameter nesterov = true needs momentum > 0 and dampening 0");
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"] = {{"lr", 0.1}, {"nesterov", true}}; },
                 "hyperparameter nesterov = true needs momentum > 0");
  ExpectRejected([](auto& j) { j["groups"][0]["hyper"] = {{"lr", 1e-4}, {"beta1", 0.9}, {"beta2", 1.0}}; },
                 "hyperparameter beta2 = 1 is out of range");
  // A group that took more steps than the trainer.
  ExpectRejected([](auto& j) { j["groups"][0]["step_count"] = 43; }, "groups[0].step_count");
  // A tensor in a group the manifest does not have.
  ExpectRejected([](auto& j) { j["tensors"][1]["group"] = 5; }, "group 5 is not among");
  EXPECT_FALSE(ParseManifest("{", "m").ok());
  EXPECT_FALSE(ParseManifest("", "m").ok());
  EXPECT_FALSE(ParseManifest("[]", "m").ok());
}

TEST(CheckpointManifest, HyperparametersInRangeAndFlagsAsBooleans) {
  auto v = MakeView();
  nlohmann::json j = nlohmann::json::parse(SerializeManifest(*ManifestFromView(*v)));
  auto& h = j["groups"][0]["hyper"];
  h = {{"lr", 0.0}, {"beta1", 0.0}, {"beta2", 0.999}, {"eps", 1e-30}, {"weight_decay", 0.0},
       {"adamw", 1.0}, {"momentum_future", -3.0}};
  // A manifest written before flags were booleans ("adamw": 1.0) still reads.
  auto p = ParseManifest(j.dump(), "/old/manifest.json");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->groups[0].hyper.at("adamw"), 1.0);
  EXPECT_EQ(p->groups[0].hyper.at("momentum_future"), -3.0);
  // Written back, the flag is a JSON boolean; other values stay numbers.
  nlohmann::json w = nlohmann::json::parse(SerializeManifest(*p));
  EXPECT_TRUE(w["groups"][0]["hyper"]["adamw"].is_boolean()) << w["groups"][0]["hyper"].dump();
  EXPECT_EQ(w["groups"][0]["hyper"]["adamw"], true);
  EXPECT_TRUE(w["groups"][0]["hyper"]["lr"].is_number());
  h["adamw"] = false;
  p = ParseManifest(j.dump(), "/new/manifest.json");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->groups[0].hyper.at("adamw"), 0.0);
  EXPECT_EQ(nlohmann::json::parse(SerializeManifest(*p))["groups"][0]["hyper"]["adamw"], false);
  EXPECT_TRUE(IsFlagHyperparameter("adamw"));
  EXPECT_TRUE(IsFlagHyperparameter("nesterov"));
  EXPECT_TRUE(IsFlagHyperparameter("maximize"));
  EXPECT_FALSE(IsFlagHyperparameter("momentum"));
  EXPECT_FALSE(IsFlagHyperparameter("lr"));
  // A store that records no groups: its tensors' group ids are labels only.
  j["groups"] = nlohmann::json::array();
  EXPECT_TRUE(ParseManifest(j.dump(), "/nogroups/manifest.json").ok());
}

// Independent safetensors reader: 8-byte LE length, JSON header, data.
struct StEntry {
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t begin, end;
};
std::map<std::string, StEntry> ParseSafetensors(const std::string& file, uint64_t* data_start) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
  EXPECT_EQ((8 + n) % 8, 0u);
  auto j = nlohmann::json::parse(file.substr(8, n));
  std::map<std::string, StEntry> out;
  for (auto& [k, v] : j.items()) {
    if (k == "__metadata__") continue;
    out[k] = {v["dtype"], v["shape"].get<std::vector<uint64_t>>(), v["data_offsets"][0],
              v["data_offsets"][1]};
  }
  *data_start = 8 + n;
  return out;
}

std::string ReadAll(const CheckpointLayout& l, const CheckpointFile& f) {
  std::string out(f.size_bytes, '\0');
  auto n = l.Read(f, 0, out.data(), out.size() + 100);
  EXPECT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, f.size_bytes);
  return out;
}

TEST(CheckpointLayout, FilesMatchReference) {
  auto v = MakeView();
  auto l = CheckpointLayout::Build(v.get());
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  const auto& files = (*l)->files();
  ASSERT_EQ(files.size(), 2u + 4 * 3);
  EXPECT_EQ(files[0].path, "manifest.json");
  EXPECT_EQ(ReadAll(**l, files[0]), (*l)->manifest_json());
  std::map<std::string, std::string> raw;
  for (size_t i = 2; i < files.size(); ++i) {
    const auto& t = v->tensors()[files[i].tensor_index];
    std::string bytes = ReadAll(**l, files[i]);
    EXPECT_EQ(bytes, v->Bytes(t.id, files[i].field)) << files[i].path;
    raw[t.name + "/" + t.fields[files[i].field].name] = bytes;
    EXPECT_EQ((*l)->FindFile(files[i].path), &files[i]);
  }
  std::string st = ReadAll(**l, files[1]);
  uint64_t data_start;
  auto entries = ParseSafetensors(st, &data_start);
  ASSERT_EQ(entries.size(), raw.size());
  uint64_t covered = 0;
  for (auto& [name, e] : entries) {
    ASSERT_TRUE(raw.count(name)) << name;
    EXPECT_EQ(e.dtype, "F32");
    EXPECT_EQ(st.substr(data_start + e.begin, e.end - e.begin), raw[name]) << name;
    covered += e.end - e.begin;
  }
  EXPECT_EQ(data_start + covered, st.size());
  // The data section starts on a page (the mount fills state.safetensors'
  // page cache from the field files' pages), and each field file's place in
  // it is where the header says.
  EXPECT_EQ(data_start % CheckpointLayout::kSafetensorsDataAlignBytes, 0u);
  for (size_t i = 2; i < files.size(); ++i) {
    const auto& t = v->tensors()[files[i].tensor_index];
    const StEntry& e = entries[t.name + "/" + t.fields[files[i].field].name];
    EXPECT_EQ((*l)->SafetensorsOffsetOf(files[i]), std::optional<uint64_t>(data_start + e.begin)) << files[i].path;
  }
  EXPECT_EQ((*l)->SafetensorsOffsetOf(files[0]), std::nullopt);
  EXPECT_EQ((*l)->SafetensorsOffsetOf(files[1]), std::nullopt);
  CheckpointFile stranger = files[2];
  EXPECT_EQ((*l)->SafetensorsOffsetOf(stranger), std::nullopt);  // not the layout's own
  EXPECT_EQ(entries["model.layers.0/attn.weight/main"].shape, (std::vector<uint64_t>{600, 1000}));
  EXPECT_EQ(entries["bias/exp_avg"].shape, (std::vector<uint64_t>{3}));
  // __metadata__ names the generation and the store it came from, so that a
  // restore can tell a state.safetensors copied from another generation.
  auto meta = nlohmann::json::parse(st.substr(8, data_start - 8))["__metadata__"];
  EXPECT_EQ(meta["optstate.generation"], "7");
  EXPECT_EQ(meta["optstate.step"], "42");
  EXPECT_EQ(meta["optstate.store_uuid"], v->identity().uuid);
  EXPECT_FALSE(v->identity().uuid.empty());

  // Random ranges equal slices of the whole file; sequence numbers are monotone.
  std::mt19937_64 rng(5);
  for (int i = 0; i < 300; ++i) {
    const CheckpointFile& f = files[rng() % files.size()];
    std::string whole = f.kind == CheckpointFileKind::kSafetensors ? st : ReadAll(**l, f);
    uint64_t off = rng() % (f.size_bytes + 10), len = rng() % (3 * kCs);
    std::string got(len, '\0');
    auto n = (*l)->Read(f, off, got.data(), len);
    ASSERT_TRUE(n.ok());
    uint64_t want = off >= f.size_bytes ? 0 : std::min(len, f.size_bytes - off);
    ASSERT_EQ(*n, want);
    EXPECT_EQ(got.substr(0, want), want ? whole.substr(off, want) : "");
    uint64_t prev = 0;
    bool first = true;
    for (const auto& s : (*l)->MapRange(f, off, len)) {
      if (s.memory) continue;
      EXPECT_TRUE(first || s.chunk_seq == prev + 1);
      ChunkRef r = (*l)->ChunkAt(f, s.chunk_seq);
      EXPECT_EQ(r.tensor_id, s.chunk.tensor_id);
      EXPECT_EQ(r.field, s.chunk.field);
      EXPECT_EQ(r.index, s.chunk.index);
      prev = s.chunk_seq, first = false;
    }
  }
  uint64_t seqs = 0;
  for (size_t i = 2; i < files.size(); ++i) seqs += (*l)->ChunkSequenceLength(files[i]);
  EXPECT_EQ((*l)->ChunkSequenceLength(files[1]), seqs);

  // Chunk lengths agree with the view's chunk records, and the chunks of a
  // file's sequence hold exactly its bytes that are not the layout's own.
  for (const CheckpointFile& f : files) {
    uint64_t sum = 0;
    for (uint64_t i = 0; i < (*l)->ChunkSequenceLength(f); ++i) {
      auto c = v->Chunk((*l)->ChunkAt(f, i));
      ASSERT_TRUE(c.ok()) << f.path << " chunk " << i;
      EXPECT_EQ((*l)->ChunkLengthAt(f, i), c->length_bytes) << f.path << " chunk " << i;
      sum += (*l)->ChunkLengthAt(f, i);
    }
    uint64_t own = 0;
    for (const auto& s : (*l)->MapRange(f, 0, f.size_bytes)) own += s.memory != nullptr ? s.length_bytes : 0;
    EXPECT_EQ(sum + own, f.size_bytes) << f.path;
  }
}

TEST(CheckpointLayout, Directories) {
  auto v = MakeView();
  auto l = std::move(CheckpointLayout::Build(v.get()).value());
  EXPECT_EQ(*l->ListDir(""), (std::vector<std::string>{"manifest.json", "state.safetensors", "tensors"}));
  auto t = l->ListDir("tensors");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, (std::vector<std::string>{"%2E%2E", "bias", "emb", "model.layers.0%2Fattn.weight"}));
  EXPECT_EQ(*l->ListDir("tensors/bias"), (std::vector<std::string>{"exp_avg", "exp_avg_sq", "main"}));
  EXPECT_TRUE(l->IsDir("tensors/%2E%2E"));
  EXPECT_FALSE(l->IsDir("tensors/.."));
  EXPECT_FALSE(l->ListDir("tensors/nope").ok());
  EXPECT_EQ(l->FindFile("tensors/bias/nope"), nullptr);
  // Names are looked up by index, not by scan: near misses are misses.
  EXPECT_FALSE(l->IsDir("tensors/bias/main"));
  EXPECT_FALSE(l->IsDir("tensorsbias"));
  EXPECT_FALSE(l->IsDir("tensors/"));
  EXPECT_FALSE(l->IsDir("manifest.json"));
  EXPECT_EQ(l->FindFile(""), nullptr);
  EXPECT_EQ(l->FindFile("tensors"), nullptr);
  EXPECT_EQ(l->FindFile("tensors/bias"), nullptr);
  EXPECT_EQ(l->FindFile("tensors/bias/main/"), nullptr);
  ASSERT_NE(l->FindFile("tensors/bias/main"), nullptr);
  EXPECT_EQ(l->FindFile("tensors/bias/main")->path, "tensors/bias/main");
}

TEST(CheckpointLayout, CorruptChunkFailsRead) {
  auto v = MakeView();
  v->FreezeChecksums();
  uint32_t id = v->FindTensor("emb")->id;
  v->Corrupt(id, 2, kCs + 17);
  auto l = std::move(CheckpointLayout::Build(v.get()).value());
  const CheckpointFile* f = l->FindFile("tensors/emb/exp_avg_sq");
  ASSERT_NE(f, nullptr);
  std::string buf(1024, '\0');
  EXPECT_TRUE(l->Read(*f, 0, buf.data(), buf.size()).ok());
  auto bad = l->Read(*f, kCs, buf.data(), buf.size());
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().IsCorruption());
}

}  // namespace
}  // namespace optstate::vfs
