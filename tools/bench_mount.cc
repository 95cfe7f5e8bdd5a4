// optstate-bench mount: `cp -r` of a snapshot from the FUSE mount vs fio
// sequential O_DIRECT read of the same number of bytes, interleaved rounds.
// optstate-bench kernel: GPU only; points at kernels/bench (AdamStepCuda vs
// torch fused AdamW vs the card's copy bandwidth).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "kernels/adam.h"
#include "tools/internal/bench.h"
#include "vfs/io_buffer.h"
#include "tools/internal/cli.h"
#include "tools/internal/fio.h"
#include "tools/internal/process.h"
#include "vfs/store.h"

namespace optstate::tools::bench {
namespace {

namespace fs = std::filesystem;
constexpr const char* kTool = "optstate-bench mount";

struct MountOptions {
  std::string dir;
  std::string state_text = "1G";
  uint32_t rounds = 3;
  uint32_t readahead_chunks = 0;  // 0: optstate-mount's default
  uint32_t max_sqe_kib = 0;       // 0: optstate-mount's default
  uint32_t blksize_kib = 0;       // 0: optstate-mount's default
  int32_t prefetch_files = -1;    // -1: optstate-mount's default
  uint32_t prefetch_mib = 0;      // 0: optstate-mount's default
  uint64_t hidden = 0;            // 0: one tensor; else ParamMix of this hidden size
  std::string log;                // the daemon's log (default: in the scratch dir, removed)
  std::string cache;              // "" (optstate-mount's default), else its --page-cache
  bool fill = false;              // optstate-mount --fill-safetensors
  bool no_fill = false;           // optstate-mount --no-fill-safetensors
  bool keep = false;              // keep the test store (DIR/bench-mount/root) for manual runs
  bool json = false;
};

// A store of `bytes` of non-zero data in one tensor's three fields, committed
// and snapshotted as "bench".
// hidden 0: one tensor "w" of bytes / 12 parameters; else the step
// benchmark's transformer mix of that hidden size (ParamMix), one tensor per
// parameter, as a trainer's snapshot has.
Status MakeStore(const std::string& path, uint64_t bytes, uint64_t hidden) {
  vfs::StoreOptions so;
  OPTSTATE_ASSIGN_OR_RETURN(auto store, vfs::Store::Create(path, so));
  std::vector<std::pair<std::string, uint64_t>> params = {{"w", std::max<uint64_t>(1, bytes / 12)}};
  if (hidden > 0) params = ParamMix(bytes, hidden);
  const uint64_t chunk = store->chunk_size_bytes();
  vfs::IoBuffer buf(chunk);
  for (const auto& [name, numel] : params) {
    vfs::TensorSpec spec;
    spec.name = name;
    spec.numel = numel;
    OPTSTATE_ASSIGN_OR_RETURN(auto t, store->CreateTensor(spec));
    for (uint32_t f = 0; f < 3; ++f) {
      for (uint64_t c = 0; c < store->ChunkCount(t, f); ++c) {
        auto* w = buf.as<uint64_t>();
        for (uint64_t i = 0; i < chunk / 8; ++i) w[i] = (c * 0x9E3779B97F4A7C15ull) ^ (i + f + t.id);
        OPTSTATE_RETURN_IF_ERROR(store->WriteChunk({t.id, f, c}, buf.data()));
      }
    }
  }
  vfs::CommitInfo ci;
  ci.step = 1;
  OPTSTATE_RETURN_IF_ERROR(store->Commit(ci).status());
  return store->CreateSnapshot("bench").status();
}

// Evicts every file under each of `roots` from the page cache (fdatasync
// where the file system takes it, then POSIX_FADV_DONTNEED): the mount's
// files, which it serves through the page cache (state.safetensors,
// manifest.json: MountOptions::page_cache), and the store behind it, so that
// no timed read finds them there from an earlier one. Only these files: a
// machine-wide drop (sync + /proc/sys/vm/drop_caches) would also evict, and
// write back, the files of every other job and test on the machine. False
// when a file could not be evicted.
bool DropPageCache(const std::vector<std::string>& roots) {
  bool ok = true;
  for (const std::string& root : roots) {
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(root, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      std::error_code tec;
      if (!it->is_regular_file(tec)) continue;
      int fd = ::open(it->path().c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        ok = false;
        continue;
      }
      (void)::fdatasync(fd);  // the read-only mount refuses it: its pages are clean
      if (::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) ok = false;
      ::close(fd);
    }
    if (ec) ok = false;
  }
  return ok;
}

// Seconds `cp -r src dst` takes (dst removed first; page cache dropped
// unless `warm`).
// `store`: the store behind a mount source, whose files are evicted too.
Result<double> TimedCopy(const std::string& src, const std::string& dst, const std::string& store,
                         bool warm = false) {
  (void)RemoveTree(dst);
  if (!warm) (void)DropPageCache({src, store});
  double t0 = NowSeconds();
  auto c = RunCommand({"cp", "-r", src, dst});
  if (!c.ok() || c->exit_code != 0) {
    return IoError("cp -r " + src + " " + dst + " failed: " + (c.ok() ? c->err : c.status().ToString()));
  }
  return NowSeconds() - t0;
}

// Seconds to read every file under `src` once, front to back, in read(2)s of
// its st_blksize (what cp asks for), into one buffer: the mount's read speed
// without cp's writes.
Result<double> TimedRead(const std::string& src, const std::string& store, uint64_t want_bytes) {
  (void)DropPageCache({src, store});
  double t0 = NowSeconds();
  uint64_t total = 0;
  std::vector<char> buf;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(src, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const std::string path = it->path().string();
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open " + path, errno);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int e = errno;
      ::close(fd);
      return ErrnoStatus("stat " + path, e);
    }
    const size_t block = std::max<size_t>(4096, static_cast<size_t>(st.st_blksize));
    if (buf.size() < block) buf.resize(block);
    for (;;) {
      ssize_t n = ::read(fd, buf.data(), block);
      if (n < 0) {
        int e = errno;
        ::close(fd);
        return ErrnoStatus(fmt::format("read {} at byte {}", path, total), e);
      }
      if (n == 0) break;
      total += static_cast<uint64_t>(n);
    }
    ::close(fd);
  }
  if (ec) return ErrnoStatus("list " + src, ec.value());
  if (total != want_bytes) {
    return IoError(fmt::format("read {} bytes from {}, its files hold {}", total, src, want_bytes));
  }
  return NowSeconds() - t0;
}

int RunMount(const MountOptions& o) {
  auto state = ParseBytes(o.state_text);
  if (!state.ok()) return FailWith(kTool, state.status().WithContext("--state"));
  if (o.rounds < 1) return FailWith(kTool, InvalidArgument("--rounds must be >= 1"));
  if (!FioAvailable()) return FailWith(kTool, NotFound("fio is not installed (apt-get install fio)"));
  auto bin = FindTool("optstate-mount");
  if (!bin.ok()) return FailWith(kTool, bin.status());
  std::string dir = o.dir;
  if (dir.empty()) {
    auto d = MakeTempDir("optstate-bench-mount-", "/tmp");
    if (!d.ok()) return FailWith(kTool, d.status());
    dir = *d;
  }
  struct Cleanup { std::string d; ~Cleanup() { if (!d.empty()) (void)RemoveTree(d); } };
  std::string work = dir + "/bench-mount";
  fs::create_directories(work + "/root");
  fs::create_directories(work + "/mnt");
  Cleanup cleanup{o.keep ? std::string() : work};
  if (Status s = MakeStore(work + "/root/bench", *state, o.hidden); !s.ok()) return FailWith(kTool, s);
  std::vector<std::string> mount_argv = {*bin, "-f", work + "/root", work + "/mnt"};
  if (o.readahead_chunks > 0) {
    mount_argv.push_back("--readahead-chunks");
    mount_argv.push_back(std::to_string(o.readahead_chunks));
  }
  if (o.max_sqe_kib > 0) {
    mount_argv.push_back("--max-sqe-kib");
    mount_argv.push_back(std::to_string(o.max_sqe_kib));
  }
  if (o.prefetch_mib > 0) {
    mount_argv.push_back("--prefetch-mib");
    mount_argv.push_back(std::to_string(o.prefetch_mib));
  }
  if (o.prefetch_files >= 0) {
    mount_argv.push_back("--prefetch-files");
    mount_argv.push_back(std::to_string(o.prefetch_files));
  }
  if (o.blksize_kib > 0) {
    mount_argv.push_back("--blksize-kib");
    mount_argv.push_back(std::to_string(o.blksize_kib));
  }
  if (o.fill) mount_argv.push_back("--fill-safetensors");
  if (o.no_fill) mount_argv.push_back("--no-fill-safetensors");
  if (!o.cache.empty()) {
    mount_argv.push_back("--page-cache");
    mount_argv.push_back(o.cache);
  }
  const std::string log_path = o.log.empty() ? work + "/mount.log" : o.log;
  auto child = Child::Start(mount_argv, log_path);
  if (!child.ok()) return FailWith(kTool, child.status());
  bool mounted = false;
  for (int i = 0; i < 200 && !(mounted = IsFuseMounted(work + "/mnt")); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  if (!mounted) return FailWith(kTool, IoError("optstate-mount did not mount (log: " + log_path + ")"));
  std::string src = work + "/mnt/bench/snapshots/bench";
  auto bytes = TreeBytes(src);
  if (!bytes.ok()) return FailWith(kTool, bytes.status());
  // cp writes its copy to tmpfs when there is room, so the comparison is read
  // vs read: a copy on the same disk would charge cp for write-back that fio
  // (read only) never pays.
  std::string copy_dir = work + "/copy";
  std::string copy_where = "the scratch dir (same disk)";
  // With room for two copies in tmpfs, each round also times cp -r of the
  // first copy to a second one: the same cp, same tree, same destination, but
  // source bytes already in memory (no disk, no FUSE). That is as fast as
  // cp -r can copy these bytes on this machine: the ceiling for any mount.
  bool ceiling = false;
  {
    std::error_code ec;
    auto sp = fs::space("/dev/shm", ec);
    if (!ec && sp.available > *bytes + *bytes / 4 + (256ull << 20)) {
      auto d = MakeTempDir("optstate-bench-mount-copy-", "/dev/shm");
      if (d.ok()) {
        copy_dir = *d + "/copy";
        copy_where = "tmpfs (" + *d + ")";
        ceiling = sp.available > 2 * *bytes + *bytes / 4 + (256ull << 20);
      }
    }
  }
  struct CopyCleanup { std::string d; ~CopyCleanup() { (void)RemoveTree(d); } };
  CopyCleanup copy_cleanup{fs::path(copy_dir).parent_path().string()};
  if (copy_dir == work + "/copy") copy_cleanup.d = copy_dir;
  const std::string copy2_dir = copy_dir + "2";
  const std::string store_dir = work + "/root";
  const bool cache_dropped = DropPageCache({src, store_dir});
  std::vector<double> t_fio, t_cp, t_mem, t_read, t_warm;
  DiskPhase d_fio, d_cp, d_read, d_warm;
  for (uint32_t r = 0; r < o.rounds; ++r) {
    // The reference is the disk's sequential O_DIRECT read speed for the same
    // byte count: 1 MiB blocks at QD 32 (the project's fio reference, which
    // 8 MiB blocks at QD 8, the mount's own shape, do not beat).
    FioJob j;
    j.name = "seqread";
    j.filename = work + "/fio.dat";
    j.rw = "read";
    j.block_size_bytes = 1 << 20;
    j.iodepth = 32;
    j.size_bytes = *bytes / 4096 * 4096;
    DiskCounters before = ReadDiskCounters(work);
    auto f = RunFio({j});
    if (!f.ok()) return FailWith(kTool, f.status());
    t_fio.push_back(f->jobs[0].runtime_seconds);
    d_fio.Add(before, ReadDiskCounters(work), f->jobs[0].runtime_seconds);
    before = ReadDiskCounters(work);
    auto c = TimedCopy(src, copy_dir, store_dir);
    if (!c.ok()) return FailWith(kTool, c.status());
    t_cp.push_back(*c);
    d_cp.Add(before, ReadDiskCounters(work), *c);
    before = ReadDiskCounters(work);
    auto rd = TimedRead(src, store_dir, *bytes);
    if (!rd.ok()) return FailWith(kTool, rd.status());
    t_read.push_back(*rd);
    d_read.Add(before, ReadDiskCounters(work), *rd);
    if (ceiling) {
      // cp -r again right after the read(2) pass, the page cache kept: what
      // the copy costs once the mount's cached files are all in memory. Cold
      // minus warm is what filling the page cache (disk, daemon, FUSE) still
      // adds to a copy; warm against tmpfs to tmpfs is the kernel's cost of
      // reading the mount's pages (docs/BENCHMARKS.md "What bounds `cp -r`").
      before = ReadDiskCounters(work);
      auto w = TimedCopy(src, copy2_dir, store_dir, /*warm=*/true);
      if (!w.ok()) return FailWith(kTool, w.status());
      t_warm.push_back(*w);
      d_warm.Add(before, ReadDiskCounters(work), *w);
      (void)RemoveTree(copy2_dir);
      auto m = TimedCopy(copy_dir, copy2_dir, store_dir);
      if (!m.ok()) return FailWith(kTool, m.status());
      t_mem.push_back(*m);
      (void)RemoveTree(copy2_dir);
    }
    (void)RemoveTree(copy_dir);
  }
  (void)RunCommand({"fusermount3", "-u", work + "/mnt"});
  child->Stop();
  // The daemon's own account of the reads (logged at unmount).
  std::string served;
  {
    std::ifstream log(log_path);
    std::string line;
    while (std::getline(log, line)) {
      if (size_t at = line.find("; served "); at != std::string::npos) served = line.substr(at + 9);
    }
  }
  std::vector<double> ratios;
  for (size_t i = 0; i < t_cp.size(); ++i) ratios.push_back(t_fio[i] / t_cp[i]);
  double ratio = Median(ratios);
  std::vector<double> mem_ratios;
  for (size_t i = 0; i < t_mem.size(); ++i) mem_ratios.push_back(t_mem[i] / t_cp[i]);
  std::vector<double> warm_ratios;
  for (size_t i = 0; i < t_warm.size(); ++i) warm_ratios.push_back(t_warm[i] / t_cp[i]);
  double b = static_cast<double>(*bytes);
  nlohmann::json out = {{"machine", MachineInfo()}, {"bytes", *bytes}, {"rounds", o.rounds},
                        {"seconds",
                         {{"cp", t_cp},
                          {"fio", t_fio},
                          {"cp_from_tmpfs", t_mem},
                          {"read", t_read},
                          {"cp_warm", t_warm}}},
                        {"disk",
                         {{"fio", d_fio.Describe()},
                          {"cp", d_cp.Describe()},
                          {"read", d_read.Describe()},
                          {"cp_warm", d_warm.Describe()}}},
                        {"daemon_served", served},
                        {"cp_vs_fio", ratio},
                        {"cp_vs_cp_from_tmpfs",
                         mem_ratios.empty() ? nlohmann::json() : nlohmann::json(Median(mem_ratios))},
                        {"cp_vs_cp_warm",
                         warm_ratios.empty() ? nlohmann::json() : nlohmann::json(Median(warm_ratios))},
                        {"copy_to", copy_where},
                        {"page_cache_dropped", cache_dropped},
                        {"readahead_chunks", o.readahead_chunks},
                        {"max_sqe_kib", o.max_sqe_kib},
                        {"blksize_kib", o.blksize_kib},
                        {"hidden", o.hidden},
                        {"prefetch_files", o.prefetch_files}, {"prefetch_mib", o.prefetch_mib},
                        {"fill_safetensors", o.fill ? "on" : o.no_fill ? "off" : "default"},
                        {"cache", o.cache.empty() ? "default" : o.cache}};
  if (o.json) {
    PrintJson(out);
    return 0;
  }
  std::cout << fmt::format("optstate-bench mount: cp -r of a {} snapshot from the mount vs fio "
                           "sequential O_DIRECT read (1 MiB, QD 32), {} interleaved rounds\n"
                           "copy written to {}\nmachine: {}\n{}\n",
                           FormatBytes(*bytes), o.rounds, copy_where, MachineLine(),
                           cache_dropped ? "" : "(could not evict the mount's files from the page cache: they "
                                                "may be read from memory after the first round)\n");
  Table t({"method", "median", "GB/s", "disk during it (all rounds)"}, {false, true, true, false});
  t.AddRow({"cp -r from the mount", FormatSeconds(Median(t_cp)), FormatRate(b / Median(t_cp)), d_cp.Describe()});
  t.AddRow({"fio sequential read", FormatSeconds(Median(t_fio)), FormatRate(b / Median(t_fio)), d_fio.Describe()});
  t.AddRow({"read(2) from the mount, no copy", FormatSeconds(Median(t_read)), FormatRate(b / Median(t_read)),
            d_read.Describe()});
  if (!t_warm.empty()) {
    // Its disk reads are what the daemon loaded for pages the kernel held.
    t.AddRow({"cp -r from the mount again, page cache kept", FormatSeconds(Median(t_warm)),
              FormatRate(b / Median(t_warm)), d_warm.Describe()});
  }
  if (!t_mem.empty()) {
    t.AddRow({"cp -r tmpfs to tmpfs", FormatSeconds(Median(t_mem)), FormatRate(b / Median(t_mem)), ""});
  }
  std::cout << t.Render() << fmt::format("\ncp / fio: {:.2f}x (target >= 0.8)\n", ratio);
  if (!served.empty()) std::cout << "the daemon served " << served << "\n";
  if (!warm_ratios.empty()) {
    std::cout << fmt::format("cp from the mount, cold / again with the page cache kept: {:.2f}x (speed; 1.0 = "
                             "filling the page cache costs the copy nothing)\n",
                             Median(warm_ratios));
  }
  if (!mem_ratios.empty()) {
    std::cout << fmt::format("cp from the mount / cp from tmpfs: {:.2f}x (speed; 1.0 = as fast as cp copies "
                             "bytes already in memory to the same place, > 1 = faster)\n",
                             Median(mem_ratios));
  }
  return 0;
}

}  // namespace

void AddMountCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<MountOptions>();
  CLI::App* sub = app.add_subcommand("mount", "cp -r of a snapshot from optstate-mount vs fio sequential read");
  sub->add_option("--dir", o->dir, "scratch directory (default: a new dir in /tmp)");
  sub->add_option("--state", o->state_text, "state bytes of the test store (default 1G)");
  sub->add_option("--rounds", o->rounds, "interleaved rounds (default 3)");
  sub->add_option("--readahead-chunks", o->readahead_chunks,
                  "passed to optstate-mount --readahead-chunks (default: its default)");
  sub->add_option("--max-sqe-kib", o->max_sqe_kib,
                  "passed to optstate-mount --max-sqe-kib (default: its default)");
  sub->add_option("--hidden", o->hidden,
                  "store many tensors: the step benchmark's transformer mix of this hidden size "
                  "(default: one tensor)");
  sub->add_option("--prefetch-mib", o->prefetch_mib,
                  "passed to optstate-mount --prefetch-mib (default: its default)");
  sub->add_option("--prefetch-files", o->prefetch_files,
                  "passed to optstate-mount --prefetch-files (default: its default)");
  sub->add_option("--blksize-kib", o->blksize_kib,
                  "passed to optstate-mount --blksize-kib (default: its default)");
  sub->add_option("--page-cache", o->cache,
                  "none, small, mappable or all: passed to optstate-mount --page-cache (default: its default)")
      ->check(CLI::IsMember({"none", "small", "mappable", "all"}));
  sub->add_flag("--fill-safetensors", o->fill, "passed to optstate-mount (an A/B of the fill)");
  sub->add_flag("--no-fill-safetensors", o->no_fill, "passed to optstate-mount (an A/B of the fill)");
  sub->add_flag("--keep", o->keep, "keep the test store under DIR/bench-mount/root (with --dir)");
  sub->add_option("--log", o->log, "write the daemon's log here and keep it (default: scratch dir, removed)");
  sub->add_flag("--json", o->json, "print JSON");
  sub->callback([o, exit_code] { *exit_code = RunMount(*o); });
}

void AddKernelCommand(CLI::App& app, int* exit_code) {
  CLI::App* sub = app.add_subcommand("kernel", "GPU only: fused Adam kernel GB/s (see kernels/bench)");
  sub->callback([exit_code] {
    if (!kernels::CudaKernelsBuilt()) {
      std::cout << "optstate-bench kernel: this build has no CUDA kernels; skipped.\n";
    } else {
      std::cout << "optstate-bench kernel: run kernels/bench/run_h200.sh on the GPU machine "
                   "(AdamStepCuda vs torch.optim.AdamW(fused=True) vs the card's copy bandwidth).\n";
    }
    *exit_code = 0;
  });
}

}  // namespace optstate::tools::bench
