// Helpers shared by the checkpoint/restore and mount tests: temp dirs,
// deterministic store contents written straight through Store::WriteChunk,
// whole-generation byte dumps (the independent reference), and writing a
// checkpoint directory from a CheckpointLayout.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "vfs/checkpoint.h"
#include "vfs/store.h"

namespace optstate::vfs::testing {

inline std::string MakeTempDir(const std::string& tag) {
  std::string tmpl = (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") +
                     std::string("/optstate-") + tag + "-XXXXXX";
  char* d = mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr);
  return tmpl;
}

struct AlignedChunk {
  explicit AlignedChunk(uint64_t bytes)
      : size((bytes + 4095) / 4096 * 4096),
        p(static_cast<char*>(std::aligned_alloc(4096, size))) {
    std::memset(p, 0, size);
  }
  ~AlignedChunk() { std::free(p); }
  AlignedChunk(const AlignedChunk&) = delete;
  AlignedChunk& operator=(const AlignedChunk&) = delete;
  uint64_t size;
  char* p;
};

// The deterministic byte at `i` of a (seed, tensor, field) stream.
inline void FillPattern(char* out, uint64_t n, uint64_t seed, uint64_t start) {
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t x = (seed * 0x9E3779B97F4A7C15ull) ^ ((start + i) / 8 * 0xBF58476D1CE4E5B9ull);
    x ^= x >> 29;
    out[i] = static_cast<char>(x >> (8 * ((start + i) % 8)));
  }
}

struct TensorDef {
  std::string name;
  uint64_t numel;
  std::vector<uint64_t> shape;
};

inline std::vector<TensorDef> DefaultTensors() {
  return {{"layers.0/w", 700000, {700, 1000}},  // 2.8 MB per field: 2 chunks of 2 MiB
          {"layers.0/b", 1000, {}},
          {"emb", 524288, {}},                  // exactly one chunk
          {"odd name %..", 3, {}}};
}

// job: StoreOptions::job (empty: a new uuid); the rank stores of one job pass one.
inline std::unique_ptr<Store> CreateStore(const std::string& path, uint64_t chunk = 2 * kMiB,
                                          const std::string& job = "") {
  StoreOptions o;
  o.chunk_size_bytes = chunk;
  o.job = job;
  o.preallocate_step_bytes = 64 * kMiB;
  auto s = Store::Create(path, o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

inline void CreateTensors(Store* s, const std::vector<TensorDef>& defs, uint32_t groups = 2) {
  for (size_t i = 0; i < defs.size(); ++i) {
    TensorSpec spec;
    spec.name = defs[i].name;
    spec.numel = defs[i].numel;
    spec.shape = defs[i].shape;
    spec.group = static_cast<uint32_t>(i % groups);
    auto t = s->CreateTensor(spec);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
  }
}

// Writes every chunk of every field (seeded by `step`) except the chunks
// where skip(tensor index, field, chunk) is true, then commits step `step`.
inline uint64_t WriteStep(Store* s, uint64_t step, bool sparse = false) {
  const uint64_t cs = s->chunk_size_bytes();
  AlignedChunk buf(cs);
  std::vector<TensorInfo> ts = s->ListTensors();
  for (size_t ti = 0; ti < ts.size(); ++ti) {
    const TensorInfo& t = ts[ti];
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      uint64_t bytes = t.numel * 4;
      for (uint64_t c = 0; c < s->ChunkCount(t, f); ++c) {
        if (sparse && (c + f + ti) % 3 == 0) continue;  // leave some chunks as they were
        uint64_t len = std::min(cs, bytes - c * cs);
        std::memset(buf.p, 0, buf.size);
        FillPattern(buf.p, len, step * 1000 + t.id * 10 + f, c * cs);
        Status st = s->WriteChunk(ChunkRef{t.id, f, c}, buf.p);
        EXPECT_TRUE(st.ok()) << st.ToString();
      }
    }
  }
  CommitInfo ci;
  ci.step = step;
  ci.groups = {{0, step, {{"lr", 1e-3}, {"beta1", 0.9}}}, {1, step / 2, {{"lr", 2.5e-4}}}};
  auto g = s->Commit(ci);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  return g.ok() ? *g : 0;
}

// "tensor/field" -> every byte of that field, read chunk by chunk.
inline std::map<std::string, std::string> DumpView(const GenerationView& v) {
  std::map<std::string, std::string> out;
  const uint64_t cs = v.identity().chunk_size_bytes;
  AlignedChunk buf(cs);
  for (const TensorInfo& t : v.tensors()) {
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      std::string bytes;
      for (uint64_t c = 0; c < v.ChunkCount(t, f); ++c) {
        auto ci = v.Chunk(ChunkRef{t.id, f, c});
        EXPECT_TRUE(ci.ok());
        Status st = v.ReadChunk(ChunkRef{t.id, f, c}, buf.p);
        EXPECT_TRUE(st.ok()) << st.ToString();
        bytes.append(buf.p, ci->length_bytes);
      }
      out[t.name + "/" + t.fields[f].name] = std::move(bytes);
    }
  }
  return out;
}

inline std::map<std::string, std::string> DumpLatest(Store* s) {
  auto v = s->OpenGeneration(kLatest);
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  if (!v.ok()) return {};
  return DumpView(**v);
}

// Materialises a generation as a checkpoint directory (what `cp -r` of the
// mount produces), through the layout's synchronous Read.
inline void WriteCheckpointDir(const GenerationView& v, const std::string& dir) {
  auto l = CheckpointLayout::Build(&v);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  for (const CheckpointFile& f : (*l)->files()) {
    std::filesystem::path p = std::filesystem::path(dir) / f.path;
    std::filesystem::create_directories(p.parent_path());
    std::string bytes(f.size_bytes, '\0');
    auto n = (*l)->Read(f, 0, bytes.data(), bytes.size());
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    std::ofstream(p, std::ios::binary).write(bytes.data(), bytes.size());
  }
}

// An edited manifest's text with its own checksum ("manifest_xxh3") computed
// again over the edited bytes: what a deliberate edit must do to get past the
// checksum to the parser's and the data's checks. Text without the key is
// returned as it is.
inline std::string SealManifest(std::string text) {
  const std::string key = std::string("\"") + kManifestChecksumKey + "\"";
  const size_t at = text.find(key);
  if (at == std::string::npos) return text;
  const size_t q = text.find('"', text.find(':', at + key.size()));
  text.replace(q + 1, 16, std::string(16, '0'));
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(ChunkChecksum(text.data(), text.size())));
  text.replace(q + 1, 16, hex);
  return text;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace optstate::vfs::testing
