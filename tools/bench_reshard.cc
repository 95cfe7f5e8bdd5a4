// optstate-bench reshard: optstate-reshard against fio moving the same bytes.
//
// Setup: N source checkpoints (exported from N stores, each a row block of
// four [R, 4096] f32 tensors with Adam's three fields, R from --size), their
// pages dropped from the page cache before every round so that the sources
// are read from the disk as a resumed job reads them. Per round, in this
// order: fio (io_uring, direct=1) reading the sources' field bytes and then
// writing as many bytes as the reshard writes (its field files and, unless
// --no-safetensors, state.safetensors; end_fsync), then vfs::Reshard to M ranks (every chunk
// verified, every file fsynced). The ratio is the median of per-round
// fio time / reshard time (> 1: the reshard is faster).
#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "tools/internal/bench.h"
#include "tools/internal/cli.h"
#include "tools/internal/fio.h"
#include "tools/internal/process.h"
#include "vfs/checkpoint.h"
#include "vfs/io_buffer.h"
#include "vfs/reshard.h"
#include "vfs/store.h"

namespace optstate::tools::bench {

namespace {

namespace fs = std::filesystem;
constexpr const char* kTool = "optstate-bench reshard";
constexpr uint64_t kCols = 4096;
constexpr int kTensors = 4;

struct ReshardBenchOptions {
  std::string dir;
  std::string size_text = "1G";
  std::string chunk_text = "8M";
  uint32_t from = 4;
  uint32_t to = 3;
  std::string split = "columns";
  uint32_t rounds = 3;
  bool json = false;
  bool no_fio = false;
  bool no_safetensors = false;  // the reshard writes no state.safetensors
};

std::vector<vfs::GlobalTensor> Globals(uint64_t rows) {
  std::vector<vfs::GlobalTensor> out;
  for (int i = 0; i < kTensors; ++i) out.push_back({fmt::format("layers.{}.w", i), {rows, kCols}});
  return out;
}

// Rank r's store (its row block of every tensor, non-zero bytes), exported.
Status WriteSource(const std::string& dir, uint32_t r, const vfs::TargetLayout& layout, uint64_t rows,
                   uint64_t chunk) {
  vfs::StoreOptions so;
  so.chunk_size_bytes = chunk;
  so.job = "optstate-bench-reshard";  // the ranks of one job: reshard merges only those
  const std::string store_path = fmt::format("{}/store-{}", dir, r);
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<vfs::Store> store, vfs::Store::Create(store_path, so));
  vfs::IoBuffer buf(chunk);
  if (!buf.ok()) return ResourceExhausted("out of memory for a chunk buffer");
  uint64_t x = 0x9E3779B97F4A7C15ull * (r + 1);
  for (const auto& [name, box] : layout.ranks[r]) {
    vfs::TensorSpec spec;
    spec.name = name;
    spec.numel = box.shape[0] * box.shape[1];
    spec.shape = box.shape;
    spec.global_shape = {rows, kCols};
    spec.shard_offset = box.offset;
    OPTSTATE_ASSIGN_OR_RETURN(vfs::TensorInfo t, store->CreateTensor(spec));
    (void)t;
  }
  for (const vfs::TensorInfo& t : store->ListTensors()) {
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      for (uint64_t c = 0; c < store->ChunkCount(t, f); ++c) {
        auto* w = buf.as<uint64_t>();
        for (uint64_t k = 0; k < chunk / 8; ++k) {
          x ^= x << 13;
          x ^= x >> 7;
          x ^= x << 17;
          w[k] = x;
        }
        OPTSTATE_RETURN_IF_ERROR(store->WriteChunk({t.id, f, c}, buf.data()));
      }
    }
  }
  vfs::CommitInfo ci;
  ci.step = 100;
  ci.groups.push_back({0, 100, {{"lr", 1e-4}}});
  OPTSTATE_RETURN_IF_ERROR(store->Commit(ci).status());
  OPTSTATE_RETURN_IF_ERROR(vfs::ExportCheckpoint(store.get(), fmt::format("{}/src/{}", dir, vfs::ReshardRankDirName(r)))
                               .status());
  store.reset();
  return RemoveTree(store_path);
}

// Drops a tree's pages from the page cache (its files are fsynced).
void DropCache(const std::string& root) {
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

int RunReshardBench(const ReshardBenchOptions& o) {
  auto size = ParseBytes(o.size_text);
  if (!size.ok()) return FailWith(kTool, size.status().WithContext("--size"));
  auto chunk = ParseBytes(o.chunk_text);
  if (!chunk.ok()) return FailWith(kTool, chunk.status().WithContext("--chunk-size"));
  if (*chunk == 0 || *chunk % vfs::kChunkAlignBytes != 0) {
    return FailWith(kTool, InvalidArgument("--chunk-size must be a multiple of 2M"));
  }
  if (o.from == 0 || o.to == 0 || o.rounds == 0) {
    return FailWith(kTool, InvalidArgument("--from, --to and --rounds must be >= 1"));
  }
  const uint64_t rows = std::max<uint64_t>(o.from, *size / (kTensors * 3 * kCols * 4));
  std::string dir = o.dir;
  bool own_dir = false;
  if (dir.empty()) {
    auto d = MakeTempDir("optstate-bench-reshard-", "/var/tmp");
    if (!d.ok()) return FailWith(kTool, d.status());
    dir = *d;
    own_dir = true;
  } else if (!fs::is_directory(dir)) {
    return FailWith(kTool, NotFound(fmt::format("--dir {} is not a directory", dir)));
  }
  // What this run made goes when it ends: the whole directory it created,
  // or under --dir the sources it wrote (so that the same --dir serves the
  // next run); a src/ that was there before is the user's and stays.
  const bool made_src = !fs::exists(dir + "/src");
  auto cleanup = [&] {
    if (own_dir) {
      (void)RemoveTree(dir);
    } else if (made_src) {
      (void)RemoveTree(dir + "/src");
    }
  };
  auto fail = [&](const Status& st) {
    cleanup();
    return FailWith(kTool, st);
  };
  const bool use_fio = !o.no_fio && FioAvailable();
  if (!o.no_fio && !use_fio) Note("fio not found: timing the reshard only");
  const vfs::TargetLayout from = vfs::MakeEvenLayout(Globals(rows), o.from, vfs::SplitKind::kRows);
  const vfs::TargetLayout to =
      vfs::MakeEvenLayout(Globals(rows), o.to, o.split == "rows" ? vfs::SplitKind::kRows : vfs::SplitKind::kColumns);
  if (Status st = vfs::FileSystem::Default()->CreateDir(dir + "/src"); !st.ok()) return fail(st);
  for (uint32_t r = 0; r < o.from; ++r) {
    Status st = WriteSource(dir, r, from, rows, *chunk);
    if (!st.ok()) return fail(st);
  }
  std::vector<std::string> sources;
  for (uint32_t r = 0; r < o.from; ++r) sources.push_back(dir + "/src/" + vfs::ReshardRankDirName(r));

  std::vector<double> fio_s, reshard_s, ratios;
  uint64_t read_bytes = 0, written_bytes = 0;
  // With fio, a first untimed round learns how many bytes the reshard
  // writes (fio's write job writes as many).
  const uint32_t warmup = use_fio ? 1 : 0;
  for (uint32_t round = 0; round < o.rounds + warmup; ++round) {
    const std::string out = fmt::format("{}/out-{}", dir, round);
    double fio_time = NAN;
    if (use_fio && written_bytes > 0) {
      std::vector<FioJob> jobs;
      FioJob prep;
      prep.name = "prep";
      prep.filename = dir + "/fio-read.dat";
      prep.rw = "write";
      prep.block_size_bytes = *chunk;
      prep.size_bytes = (read_bytes + *chunk - 1) / *chunk * *chunk;
      auto p = RunFio({prep});
      if (!p.ok()) return fail(p.status().WithContext("fio (preparing the read file)"));
      FioJob rd = prep;
      rd.name = "read";
      rd.rw = "read";
      FioJob wr;
      wr.name = "write";
      wr.filename = dir + "/fio-write.dat";
      wr.rw = "write";
      wr.block_size_bytes = *chunk;
      wr.size_bytes = (written_bytes + *chunk - 1) / *chunk * *chunk;
      wr.end_fsync = true;
      wr.stonewall = true;
      auto f = RunFio({rd, wr});
      if (!f.ok()) return fail(f.status().WithContext("fio"));
      fio_time = 0;
      for (const FioJobResult& j : f->jobs) fio_time += j.runtime_seconds;
      std::error_code ec;
      fs::remove(dir + "/fio-read.dat", ec);
      fs::remove(dir + "/fio-write.dat", ec);
    }
    DropCache(dir + "/src");
    const double t0 = NowSeconds();
    vfs::ReshardOptions ro;
    ro.safetensors = !o.no_safetensors;
    auto r = vfs::Reshard(sources, to, out, ro);
    const double t = NowSeconds() - t0;
    if (!r.ok()) return fail(r.status());
    read_bytes = r->bytes_read;
    written_bytes = r->bytes_written;
    (void)RemoveTree(out);
    if (round < warmup) continue;
    reshard_s.push_back(t);
    if (!std::isnan(fio_time)) {
      fio_s.push_back(fio_time);
      ratios.push_back(fio_time / t);
    }
  }
  cleanup();
  const double ratio = ratios.empty() ? NAN : Median(ratios);
  nlohmann::json j;
  j["machine"] = MachineInfo();
  j["from_ranks"] = o.from;
  j["to_ranks"] = o.to;
  j["split"] = o.split;
  j["safetensors"] = !o.no_safetensors;
  j["chunk_bytes"] = *chunk;
  j["source_bytes"] = read_bytes;
  j["written_bytes"] = written_bytes;
  j["reshard_seconds"] = reshard_s;
  j["fio_seconds"] = fio_s;
  j["reshard_vs_fio"] = JsonNumber(ratio);
  if (o.json) {
    PrintJson(j);
    return 0;
  }
  Table table({"method", "seconds (median)", "source GB/s", "vs fio"}, {false, true, true, true});
  const double rs = Median(reshard_s);
  if (!fio_s.empty()) {
    const double fs_med = Median(fio_s);
    table.AddRow({"fio read + write", FormatSeconds(fs_med), FormatRate(read_bytes / fs_med), "1.00x"});
  }
  table.AddRow({"optstate-reshard", FormatSeconds(rs), FormatRate(read_bytes / rs),
                std::isnan(ratio) ? "-" : fmt::format("{:.2f}x", ratio)});
  std::cout << fmt::format(
      "optstate-bench reshard: {} ranks -> {} ranks ({} split), {} of sources read, {} written "
      "({}), chunk {}, {} rounds; sources dropped from the page cache "
      "before each reshard; fio: io_uring, direct=1, reads the source bytes then writes the written bytes "
      "(end_fsync)\nmachine: {}\n\n",
      o.from, o.to, o.split, FormatBytes(read_bytes), FormatBytes(written_bytes),
      o.no_safetensors ? "field files" : "field files + state.safetensors", FormatBytes(*chunk),
      reshard_s.size(), MachineLine());
  std::cout << table.Render();
  std::cout << "\nvs fio: median of per-round fio time / reshard time (> 1: the reshard is faster).\n";
  return 0;
}

}  // namespace

void AddReshardCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<ReshardBenchOptions>();
  CLI::App* sub = app.add_subcommand("reshard", "optstate-reshard vs fio reading and writing the same bytes");
  sub->add_option("--dir", o->dir, "directory for the checkpoints (default: a new dir in /var/tmp)");
  sub->add_option("--size", o->size_text, "source state bytes, all ranks (default 1G)");
  sub->add_option("--chunk-size", o->chunk_text, "chunk size of the sources (default 8M)");
  sub->add_option("--from", o->from, "source ranks (row blocks; default 4)");
  sub->add_option("--to", o->to, "destination ranks (default 3)");
  sub->add_option("--split", o->split, "destination split: rows or columns (default columns)")
      ->check(CLI::IsMember({"rows", "columns"}));
  sub->add_option("--rounds", o->rounds, "timed rounds (default 3)");
  sub->add_flag("--json", o->json, "print JSON instead of a table");
  sub->add_flag("--no-fio", o->no_fio, "skip fio");
  sub->add_flag("--no-safetensors", o->no_safetensors, "the reshard writes no state.safetensors");
  sub->callback([o, exit_code] { *exit_code = RunReshardBench(*o); });
}

}  // namespace optstate::tools::bench
