// optstate-bench io: the io_uring engine vs fio vs the synchronous baseline.
//
// Per chunk size and round, in this order: fio, our io_uring engine, the sync
// engine (miles' NVMe streaming). Each writes `size` bytes of chunk-sized
// blocks into a fresh preallocated file at queue depth QD, then reads them
// back, then runs a 50/50 read/write mix over the same file. Writes and the
// mix include the fdatasync that makes them durable (fio: end_fsync=1, which
// fio counts in its job runtime). Ratios are medians over the rounds of the
// per-round ratio.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "tools/internal/bench.h"
#include "vfs/io_buffer.h"
#include "tools/internal/cli.h"
#include "tools/internal/fio.h"
#include "tools/internal/process.h"
#include "vfs/file_system.h"
#include "vfs/io_engine.h"

namespace optstate::tools::bench {

namespace {

constexpr const char* kTool = "optstate-bench io";

struct IoOptions {
  std::string dir;
  std::string size_text = "2G";
  std::string chunk_sizes_text = "8M";
  uint32_t queue_depth = 32;
  uint32_t rounds = 3;
  bool json = false;
  bool no_fio = false;
  bool no_mixed = false;
  bool huge_pages = false;
  bool base_pages = false;
  std::string max_sqe_text = "0";
};

enum Phase { kWrite = 0, kRead = 1, kMixed = 2, kPhases = 3 };
const char* kPhaseNames[kPhases] = {"write", "read", "mixed"};
enum Method { kFio = 0, kOurs = 1, kSync = 2, kMethods = 3 };
const char* kMethodNames[kMethods] = {"fio", "io_uring engine", "sync baseline"};
const char* kMethodKeys[kMethods] = {"fio", "ours", "sync"};

// Seconds per phase; NaN when not run.
struct PhaseTimes {
  double seconds[kPhases] = {NAN, NAN, NAN};
};

// Runs all requests (block i at offset i*bs), keeping <= qd in flight. The
// op of block i is op_of(i). Each write stamps the block index into the
// buffer's first 8 bytes; each read checks it (catches misplaced I/O).
template <typename OpOf>
Status RunBlocks(vfs::IoEngine* engine, vfs::File* file, uint64_t blocks, uint64_t bs, uint32_t qd,
                 std::vector<vfs::IoBuffer>& bufs, OpOf op_of, ProgressBar* bar, uint64_t* done_all) {
  std::vector<int64_t> slot_block(bufs.size(), -1);
  std::vector<uint32_t> free_slots;
  for (uint32_t s = 0; s < bufs.size(); ++s) free_slots.push_back(s);
  uint64_t next = 0, done = 0;
  std::vector<vfs::IoCompletion> comps;
  std::vector<vfs::IoRequest> batch;
  while (done < blocks) {
    batch.clear();
    while (next < blocks && !free_slots.empty() && engine->in_flight() + batch.size() < qd) {
      uint32_t s = free_slots.back();
      free_slots.pop_back();
      vfs::IoRequest r;
      r.op = op_of(next);
      r.file = file;
      r.offset = next * bs;
      r.length = bs;
      r.buf = bufs[s].data();
      r.tag = s;
      if (r.op == vfs::IoRequest::Op::kWrite) std::memcpy(bufs[s].data(), &next, sizeof(next));
      slot_block[s] = static_cast<int64_t>(next);
      batch.push_back(r);
      ++next;
    }
    if (!batch.empty()) OPTSTATE_RETURN_IF_ERROR(engine->Submit(batch));
    comps.clear();
    OPTSTATE_RETURN_IF_ERROR(engine->Reap(&comps, 1));
    for (const auto& c : comps) {
      OPTSTATE_RETURN_IF_ERROR(c.status);
      uint32_t s = static_cast<uint32_t>(c.tag);
      uint64_t b = static_cast<uint64_t>(slot_block[s]);
      if (op_of(b) == vfs::IoRequest::Op::kRead) {
        uint64_t stamp;
        std::memcpy(&stamp, bufs[s].data(), sizeof(stamp));
        if (stamp != b) {
          return Internal(fmt::format("{}: block {} of {} read back stamp {} (misplaced I/O)",
                                      engine->name(), b, file->path(), stamp));
        }
      }
      free_slots.push_back(s);
      ++done;
      ++*done_all;
      if (bar) bar->Update(*done_all);
    }
  }
  return Status::Ok();
}

Result<PhaseTimes> RunEngineRound(Method m, const std::string& path, uint64_t size, uint64_t bs,
                                  uint32_t qd, bool mixed, vfs::IoPages pages, uint64_t max_sqe,
                                  ProgressBar* bar, uint64_t* done_all) {
  uint32_t nbufs = m == kSync ? 1 : qd;
  std::vector<vfs::IoBuffer> bufs;
  for (uint32_t i = 0; i < nbufs; ++i) {
    bufs.emplace_back(bs, pages);
    if (!bufs.back().ok()) return ResourceExhausted(fmt::format("cannot allocate {} bytes", bs));
    // Non-zero, not trivially compressible payload.
    uint64_t x = 0x9E3779B97F4A7C15ull * (i + 1);
    auto* w = bufs.back().as<uint64_t>();
    for (uint64_t k = 0; k < bs / 8; ++k) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      w[k] = x;
    }
  }
  std::unique_ptr<vfs::IoEngine> engine;
  if (m == kOurs) {
    vfs::IoEngineOptions eo;
    eo.queue_depth = qd;
    eo.max_sqe_bytes = max_sqe;
    for (auto& b : bufs) eo.registered_buffers.push_back(b.span());
    OPTSTATE_ASSIGN_OR_RETURN(engine, vfs::IoEngine::NewUring(eo));
  } else {
    OPTSTATE_ASSIGN_OR_RETURN(engine, vfs::IoEngine::NewSync(bs));
  }
  vfs::FileSystem* fs = vfs::FileSystem::Default();
  vfs::OpenOptions oo;
  oo.create = true;
  oo.direct = true;
  (void)fs->Remove(path);
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<vfs::File> file, fs->Open(path, oo));
  OPTSTATE_RETURN_IF_ERROR(file->Fallocate(0, size));
  uint64_t blocks = size / bs;
  uint32_t depth = m == kSync ? 1 : qd;
  PhaseTimes t;
  using Op = vfs::IoRequest::Op;

  double t0 = NowSeconds();
  OPTSTATE_RETURN_IF_ERROR(RunBlocks(engine.get(), file.get(), blocks, bs, depth, bufs,
                                     [](uint64_t) { return Op::kWrite; }, bar, done_all));
  OPTSTATE_RETURN_IF_ERROR(file->Fdatasync());
  t.seconds[kWrite] = NowSeconds() - t0;

  t0 = NowSeconds();
  OPTSTATE_RETURN_IF_ERROR(RunBlocks(engine.get(), file.get(), blocks, bs, depth, bufs,
                                     [](uint64_t) { return Op::kRead; }, bar, done_all));
  t.seconds[kRead] = NowSeconds() - t0;

  if (mixed) {
    t0 = NowSeconds();
    OPTSTATE_RETURN_IF_ERROR(RunBlocks(
        engine.get(), file.get(), blocks, bs, depth, bufs,
        [](uint64_t i) { return i % 2 ? Op::kWrite : Op::kRead; }, bar, done_all));
    OPTSTATE_RETURN_IF_ERROR(file->Fdatasync());
    t.seconds[kMixed] = NowSeconds() - t0;
  }
  file.reset();
  OPTSTATE_RETURN_IF_ERROR(fs->Remove(path));
  return t;
}

Result<PhaseTimes> RunFioRound(const std::string& path, uint64_t size, uint64_t bs, uint32_t qd,
                               bool mixed) {
  std::vector<FioJob> jobs;
  FioJob w;
  w.name = "write";
  w.filename = path;
  w.rw = "write";
  w.block_size_bytes = bs;
  w.iodepth = qd;
  w.size_bytes = size;
  w.end_fsync = true;
  jobs.push_back(w);
  FioJob r = w;
  r.name = "read";
  r.rw = "read";
  r.end_fsync = false;
  r.stonewall = true;
  jobs.push_back(r);
  if (mixed) {
    FioJob x = w;
    x.name = "mixed";
    x.rw = "rw";
    x.rwmixread = 50;
    x.stonewall = true;
    jobs.push_back(x);
  }
  std::error_code ec;
  std::filesystem::remove(path, ec);
  auto res = RunFio(jobs);
  std::filesystem::remove(path, ec);
  if (!res.ok()) return res.status();
  PhaseTimes t;
  for (const auto& j : res->jobs) {
    int p = j.name == "write" ? kWrite : j.name == "read" ? kRead : kMixed;
    uint64_t moved = j.read_bytes + j.write_bytes;
    if (moved != size) {
      return IoError(fmt::format("fio job {} moved {} bytes, expected {}", j.name, moved, size));
    }
    t.seconds[p] = j.runtime_seconds;
  }
  return t;
}

int RunIo(const IoOptions& o) {
  auto size = ParseBytes(o.size_text);
  if (!size.ok()) return FailWith(kTool, size.status().WithContext("--size"));
  auto chunks = ParseBytesList(o.chunk_sizes_text);
  if (!chunks.ok()) return FailWith(kTool, chunks.status().WithContext("--chunk-sizes"));
  auto max_sqe = ParseBytes(o.max_sqe_text);
  if (!max_sqe.ok()) return FailWith(kTool, max_sqe.status().WithContext("--max-sqe"));
  for (uint64_t c : *chunks) {
    if (c == 0 || c % 4096 != 0) {
      return FailWith(kTool, InvalidArgument(fmt::format(
                                 "--chunk-sizes: {} is not a positive multiple of 4 KiB", c)));
    }
    if (*size < c) {
      return FailWith(kTool, InvalidArgument(fmt::format(
                                 "--size {} is smaller than the chunk size {}", *size, c)));
    }
  }
  if (o.rounds < 1) return FailWith(kTool, InvalidArgument("--rounds must be >= 1"));
  if (o.queue_depth < 1 || o.queue_depth > 4096) {
    return FailWith(kTool, InvalidArgument("--qd must be in 1..4096"));
  }
  std::string dir = o.dir;
  bool own_dir = false;
  if (dir.empty()) {
    auto d = MakeTempDir("optstate-bench-io-", "/tmp");
    if (!d.ok()) return FailWith(kTool, d.status());
    dir = *d;
    own_dir = true;
  } else if (!std::filesystem::is_directory(dir)) {
    return FailWith(kTool, NotFound(fmt::format("--dir {} is not a directory", dir)));
  }
  bool use_fio = !o.no_fio && FioAvailable();
  if (!o.no_fio && !use_fio) Note("fio not found: comparing the engine with the sync baseline only");
  bool mixed = !o.no_mixed;
  // Our buffers' pages: as asked, else what the memory manager's staging
  // would use on this disk (MemoryManagerOptions::staging_pages kAuto).
  std::string pages_why;
  const vfs::IoPages pages = o.huge_pages   ? vfs::IoPages::kHuge
                             : o.base_pages ? vfs::IoPages::kBase
                                            : vfs::PreferredIoPages(dir, &pages_why);
  const std::string pages_text = fmt::format("{}{}", pages == vfs::IoPages::kHuge ? "huge pages" : "base pages",
                                             pages_why.empty() ? "" : " (auto: " + pages_why + ")");

  nlohmann::json out;
  out["pages"] = pages_text;
  out["machine"] = MachineInfo();
  out["dir"] = dir;
  out["size_bytes"] = *size;
  out["queue_depth"] = o.queue_depth;
  out["rounds"] = o.rounds;
  out["results"] = nlohmann::json::array();

  Table table({"chunk", "phase", "fio", "ours", "sync", "ours/fio", "ours/sync", "sync/fio"},
              {false, false, true, true, true, true, true, true});
  int rc = 0;
  for (uint64_t bs : *chunks) {
    uint64_t sz = *size / bs * bs;
    uint64_t blocks = sz / bs;
    // times[method][phase][round]
    std::vector<double> times[kMethods][kPhases];
    uint64_t total_blocks = blocks * (mixed ? 3 : 2) * 2 * o.rounds;
    ProgressBar bar(fmt::format("io {} x{}", FormatBytes(bs), o.rounds), total_blocks);
    uint64_t done_all = 0;
    for (uint32_t round = 0; round < o.rounds; ++round) {
      for (int m = 0; m < kMethods; ++m) {
        if (m == kFio && !use_fio) continue;
        Result<PhaseTimes> t =
            m == kFio ? RunFioRound(dir + "/fio.dat", sz, bs, o.queue_depth, mixed)
                      : RunEngineRound(static_cast<Method>(m), dir + "/" + kMethodKeys[m] + ".dat",
                                       sz, bs, o.queue_depth, mixed,
                                       pages,
                                       *max_sqe, &bar, &done_all);
        if (!t.ok()) {
          bar.Finish();
          if (own_dir) (void)RemoveTree(dir);
          return FailWith(kTool, t.status().WithContext(
                                     fmt::format("{} round {} chunk {}", kMethodNames[m], round + 1,
                                                 FormatBytes(bs))));
        }
        for (int p = 0; p < kPhases; ++p) {
          if (!std::isnan(t->seconds[p])) times[m][p].push_back(t->seconds[p]);
        }
      }
    }
    bar.Finish();
    for (int p = 0; p < kPhases; ++p) {
      if (p == kMixed && !mixed) continue;
      nlohmann::json row;
      row["chunk_bytes"] = bs;
      row["phase"] = kPhaseNames[p];
      row["bytes"] = sz;
      double gbps[kMethods];
      for (int m = 0; m < kMethods; ++m) {
        std::vector<double> rates;
        for (double s : times[m][p]) rates.push_back(static_cast<double>(sz) / s);
        gbps[m] = Median(rates);
        row[kMethodKeys[m]] = {{"seconds", times[m][p]}, {"median_bytes_per_second", gbps[m]}};
      }
      // Median of per-round ratios (interleaved rounds share the disk's mood).
      auto ratio = [&](int a, int b) {
        std::vector<double> r;
        for (size_t i = 0; i < times[a][p].size() && i < times[b][p].size(); ++i) {
          r.push_back(times[b][p][i] / times[a][p][i]);
        }
        return Median(r);
      };
      double ours_fio = ratio(kOurs, kFio), ours_sync = ratio(kOurs, kSync),
             sync_fio = ratio(kSync, kFio);
      row["ours_vs_fio"] = ours_fio;
      row["ours_vs_sync"] = ours_sync;
      row["sync_vs_fio"] = sync_fio;
      out["results"].push_back(row);
      auto fr = [](double r) { return std::isnan(r) ? std::string("-") : fmt::format("{:.2f}x", r); };
      table.AddRow({FormatBytes(bs), kPhaseNames[p], use_fio ? FormatRate(gbps[kFio]) : "-",
                    FormatRate(gbps[kOurs]), FormatRate(gbps[kSync]), fr(ours_fio), fr(ours_sync),
                    fr(sync_fio)});
    }
  }
  if (own_dir) (void)RemoveTree(dir);
  if (o.json) {
    PrintJson(out);
  } else {
    std::cout << fmt::format(
        "optstate-bench io: {} per run, QD {}, {} interleaved rounds (fio, ours, sync), O_DIRECT, "
        "fdatasync included\nour buffers: {}\nmachine: {}\ndir: {}\n\n",
        FormatBytes(*size), o.queue_depth, o.rounds, pages_text, MachineLine(), dir);
    std::cout << table.Render();
    std::cout << "\nGB/s are medians; ratios are medians of per-round throughput ratios "
                 "(> 1: the first is faster).\n";
  }
  return rc;
}

}  // namespace

void AddIoCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<IoOptions>();
  CLI::App* sub = app.add_subcommand(
      "io", "io_uring engine vs fio (io_uring, direct=1) vs the synchronous baseline");
  sub->add_option("--dir", o->dir, "directory for the test files (default: a new dir in /tmp)");
  sub->add_option("--size", o->size_text, "bytes per run, e.g. 2G (default 2G)");
  sub->add_option("--chunk-sizes,--chunk-size", o->chunk_sizes_text,
                  "block (chunk) sizes, comma-separated, e.g. 2M,4M,8M,16M (default 8M)");
  sub->add_option("--qd", o->queue_depth, "queue depth (default 32)");
  sub->add_option("--rounds", o->rounds, "interleaved rounds (default 3)");
  sub->add_flag("--json", o->json, "print JSON instead of a table");
  sub->add_flag("--no-fio", o->no_fio, "skip fio");
  sub->add_flag("--no-mixed", o->no_mixed, "skip the 50/50 read/write phase");
  sub->add_flag("--huge-pages", o->huge_pages,
                "our engines' buffers in 2 MiB huge pages (fio's always are: glibc.malloc.hugetlb=1); "
                "default: as the disk under --dir suggests, like the memory manager's staging");
  sub->add_flag("--base-pages", o->base_pages, "our engines' buffers in base pages");
  sub->add_option("--max-sqe", o->max_sqe_text,
                  "our engine sends each block as parallel SQEs of at most N bytes "
                  "(IoEngineOptions::max_sqe_bytes); 0 = one SQE per block");
  sub->callback([o, exit_code] { *exit_code = RunIo(*o); });
}

}  // namespace optstate::tools::bench
