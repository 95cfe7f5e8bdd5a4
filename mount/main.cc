// optstate-mount STORE_ROOT MOUNTPOINT [-f] [-d] [-s] [--allow-other] [-o OPT[,OPT...]]
//                [--readahead-chunks N] [--buffer-pool-mib N] [--max-sqe-kib N] [--blksize-kib N]
//                [--prefetch-files N] [--prefetch-mib N] [--page-cache none|small|mappable|all]
//                [--kernel-readahead-mib N] [--fill-safetensors | --no-fill-safetensors]
//                [--latest-pin-s N] [--threads N] [--log FILE]
// Serves every store under STORE_ROOT read-only at MOUNTPOINT (see mount/fuse_mount.h).
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "mount/fuse_mount.h"

namespace {

const char kUsage[] =
    "usage: optstate-mount STORE_ROOT MOUNTPOINT [options]\n"
    "\n"
    "Serves every optimizer-state store under STORE_ROOT (directories with an IDENTITY file)\n"
    "as read-only files at MOUNTPOINT:\n"
    "  MOUNTPOINT/<store>/latest/            newest committed generation; one process sees\n"
    "                                        one generation there (see --latest-pin-s)\n"
    "  MOUNTPOINT/<store>/generations/<g>/   each generation the store retains\n"
    "  MOUNTPOINT/<store>/snapshots/<name>/  each snapshot\n"
    "      manifest.json  state.safetensors  tensors/<tensor>/{main,exp_avg,exp_avg_sq}\n"
    "Stores are opened without their lock, so a trainer may keep writing. Unmount with\n"
    "`fusermount3 -u MOUNTPOINT` or SIGINT/SIGTERM to the daemon.\n"
    "\n"
    "options:\n"
    "  -f                    stay in the foreground\n"
    "  -d                    FUSE debug log (implies -f)\n"
    "  -s                    single-threaded loop (default: multithreaded)\n"
    "  --allow-other         let other users read the mount (FUSE otherwise refuses every\n"
    "                        user but the one who mounted); non-root mounters need\n"
    "                        user_allow_other in /etc/fuse.conf. Permissions stay 0444/0555.\n"
    "  -o OPT[,OPT...]       extra FUSE mount options\n"
    "  --readahead-chunks N  read-ahead per open file, in whole chunks' worth of bytes\n"
    "                        (default 8)\n"
    "  --buffer-pool-mib N   most MiB of read-ahead chunk buffers over all open files\n"
    "                        (default 1024)\n"
    "  --max-sqe-kib N       send each chunk read as parallel io_uring SQEs of at most N KiB\n"
    "                        (a multiple of 4; default: one SQE per chunk)\n"
    "  --prefetch-files N    files opened ahead of a reader that goes through a generation\n"
    "                        in tree order, as cp -r, tar and rsync do: at most N\n"
    "                        (0..64; default 32) ...\n"
    "  --prefetch-mib N      ... and no more once they load N MiB (1..4096; default 32)\n"
    "  --blksize-kib N       st_blksize of the files, the buffer size cp reads with\n"
    "                        (a multiple of 4 up to 65536; default 1024; 8192 copies one\n"
    "                        big tensor faster)\n"
    "  --page-cache WHICH    files read through the kernel's page cache, which can then be\n"
    "                        mmap'd (safetensors.safe_open, numpy.memmap need it); the\n"
    "                        others' read(2)s go straight to the daemon: all (default),\n"
    "                        small (files of at most 128 KiB: faster on VMs where fresh\n"
    "                        pages are costly), mappable (... and state.safetensors,\n"
    "                        manifest.json), none\n"
    "  --kernel-readahead-mib N  the kernel's read-ahead for the mount's cached files\n"
    "                        (root only; default 0: the kernel's own, 128 KiB; the\n"
    "                        daemon fills the page cache ahead of a sequential reader)\n"
    "  --fill-safetensors    fill state.safetensors' page cache from the bytes read from\n"
    "                        the field files, so a cp -r of a snapshot reads every chunk\n"
    "                        off the disk once, not twice (default: on with 8 or more\n"
    "                        cores; it costs CPU beside the reader's)\n"
    "  --no-fill-safetensors do not\n"
    "  --latest-pin-s N      latest/ stays on the generation a process first saw there\n"
    "                        until the process exits or has had nothing open there and\n"
    "                        sent no request for N seconds (1..86400; default 60)\n"
    "  --threads N           maximum FUSE worker threads (default 16)\n"
    "  --log FILE            append the daemon's log to FILE (default: stderr, which a\n"
    "                        daemon without -f closes); also -o log=FILE (fstab)\n"
    "  -h, --help            this text\n";

bool ParseU32(const char* s, uint32_t* out, unsigned long max = 4096) {
  char* end = nullptr;
  unsigned long v = std::strtoul(s, &end, 10);
  if (end == s || *end != '\0' || v == 0 || v > max) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

// One -o list: our own `log=FILE` (the only way to pass --log through
// mount.fuse3 and an fstab line) is taken out; the rest goes to libfuse.
void TakeOptions(const std::string& list, optstate::mount::MountCommand* cmd) {
  std::string rest, item;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i < list.size() && list[i] != ',') {
      item += list[i];
      continue;
    }
    if (item.rfind("log=", 0) == 0) {
      cmd->log_file = item.substr(4);
    } else if (!item.empty()) {
      rest += (rest.empty() ? "" : ",") + item;
    }
    item.clear();
  }
  if (!rest.empty()) cmd->fuse_opts.push_back(rest);
}

}  // namespace

int main(int argc, char** argv) {
  optstate::mount::MountCommand cmd;
  std::vector<std::string> pos;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto need = [&](const char* what) -> const char* {
      if (i + 1 >= argc) {
        fmt::print(stderr, "optstate-mount: error: {} needs a value\n{}", what, kUsage);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      fmt::print("{}", kUsage);
      return 0;
    } else if (a == "-f") {
      cmd.foreground = true;
    } else if (a == "-d") {
      cmd.debug = true;
    } else if (a == "-s") {
      cmd.single_thread = true;
    } else if (a == "--allow-other") {
      cmd.allow_other = true;
    } else if (a == "-o") {
      TakeOptions(need("-o"), &cmd);
    } else if (a.rfind("-o", 0) == 0 && a.size() > 2) {
      TakeOptions(a.substr(2), &cmd);
    } else if (a == "--readahead-chunks") {
      if (!ParseU32(need(a.c_str()), &cmd.tree.readahead_chunks)) {
        fmt::print(stderr, "optstate-mount: error: --readahead-chunks wants 1..4096\n");
        return 2;
      }
    } else if (a == "--buffer-pool-mib") {
      uint32_t mib = 0;
      if (!ParseU32(need(a.c_str()), &mib)) {
        fmt::print(stderr, "optstate-mount: error: --buffer-pool-mib wants 1..4096\n");
        return 2;
      }
      cmd.tree.buffer_pool_bytes = uint64_t{mib} << 20;
    } else if (a == "--max-sqe-kib") {
      uint32_t kib = 0;
      if (!ParseU32(need(a.c_str()), &kib) || kib % 4 != 0) {
        fmt::print(stderr, "optstate-mount: error: --max-sqe-kib wants a multiple of 4 in 4..4096\n");
        return 2;
      }
      cmd.tree.max_sqe_bytes = uint64_t{kib} << 10;
    } else if (a == "--prefetch-files") {
      const char* v = need(a.c_str());
      if (std::string(v) == "0") {
        cmd.tree.prefetch_files = 0;
      } else if (!ParseU32(v, &cmd.tree.prefetch_files) || cmd.tree.prefetch_files > 64) {
        fmt::print(stderr, "optstate-mount: error: --prefetch-files wants 0..64\n");
        return 2;
      }
    } else if (a == "--prefetch-mib") {
      uint32_t mib = 0;
      if (!ParseU32(need(a.c_str()), &mib)) {
        fmt::print(stderr, "optstate-mount: error: --prefetch-mib wants 1..4096\n");
        return 2;
      }
      cmd.tree.prefetch_bytes = uint64_t{mib} << 20;
    } else if (a == "--log") {
      cmd.log_file = need(a.c_str());
    } else if (a == "--blksize-kib") {
      uint32_t kib = 0;
      // Up to 64 MiB: the chunk sizes a store may have (8 MiB, the old
      // default, is still best for cp -r of one big tensor).
      if (!ParseU32(need(a.c_str()), &kib, 65536) || kib % 4 != 0) {
        fmt::print(stderr, "optstate-mount: error: --blksize-kib wants a multiple of 4 in 4..65536\n");
        return 2;
      }
      cmd.tree.st_blksize_bytes = uint64_t{kib} << 10;
    } else if (a == "--page-cache") {
      using PageCache = optstate::mount::MountOptions::PageCache;
      const std::string v = need(a.c_str());
      if (v == "none") {
        cmd.tree.page_cache = PageCache::kNone;
      } else if (v == "small") {
        cmd.tree.page_cache = PageCache::kSmall;
      } else if (v == "mappable") {
        cmd.tree.page_cache = PageCache::kMappable;
      } else if (v == "all") {
        cmd.tree.page_cache = PageCache::kAll;
      } else {
        fmt::print(stderr, "optstate-mount: error: --page-cache wants none, small, mappable or all (got '{}')\n", v);
        return 2;
      }
    } else if (a == "--kernel-readahead-mib") {
      uint32_t mib = 0;
      if (!ParseU32(need(a.c_str()), &mib) || mib > 1024) {
        fmt::print(stderr, "optstate-mount: error: --kernel-readahead-mib wants 0..1024\n");
        return 2;
      }
      cmd.tree.kernel_readahead_bytes = uint64_t{mib} << 20;
    } else if (a == "--no-fill-safetensors") {
      cmd.tree.fill_safetensors = optstate::mount::MountOptions::Fill::kOff;
    } else if (a == "--fill-safetensors") {
      cmd.tree.fill_safetensors = optstate::mount::MountOptions::Fill::kOn;
    } else if (a == "--latest-pin-s") {
      uint32_t secs = 0;
      if (!ParseU32(need(a.c_str()), &secs, 86400)) {
        fmt::print(stderr, "optstate-mount: error: --latest-pin-s wants 1..86400\n");
        return 2;
      }
      cmd.tree.latest_pin_idle_ms = secs * 1000;
    } else if (a == "--threads") {
      if (!ParseU32(need(a.c_str()), &cmd.max_threads)) {
        fmt::print(stderr, "optstate-mount: error: --threads wants 1..4096\n");
        return 2;
      }
    } else if (!a.empty() && a[0] == '-') {
      fmt::print(stderr, "optstate-mount: error: unknown option {}\n{}", a, kUsage);
      return 2;
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 2) {
    fmt::print(stderr, "optstate-mount: error: expected STORE_ROOT and MOUNTPOINT\n{}", kUsage);
    return 2;
  }
  char real[PATH_MAX];
  if (::realpath(pos[0].c_str(), real) == nullptr) {
    fmt::print(stderr, "optstate-mount: error: STORE_ROOT {}: {}\n", pos[0], std::strerror(errno));
    return 1;
  }
  cmd.tree.store_root = real;
  cmd.mountpoint = pos[1];
  return optstate::mount::RunMount(cmd);
}
