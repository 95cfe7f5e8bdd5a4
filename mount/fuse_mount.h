// The FUSE daemon of optstate-mount: binds StoreTree + ChunkReader to libfuse's
// low-level API and runs its multithreaded loop.
//
// Read-only: every call that would change anything replies EROFS. Mounted with
// default_permissions (the kernel checks the 0444/0555 modes) and max_read=1 MiB
// (also set as conn->max_read in init, which libfuse requires), and ro. Files
// go through the page cache (MountOptions::page_cache, default all: they can
// be mmap'd), and a CachePusher stores a big file's verified chunks there
// ahead of a sequential reader; direct_io files (`small`, `none`) get 1 MiB
// requests, answered with fuse_reply_iov straight from the verified chunk
// buffers. Node ids are a hash of the path, and inside a generation of the
// path and the generation's number (stable across remounts), so the kernel
// may cache names, attributes and pages inside a generation; listings are
// sorted. SIGINT/SIGTERM/SIGHUP end the loop and unmount cleanly (pushes in
// flight drained first). Where big files are cached the daemon has one child
// process, a guardian that aborts the FUSE connection (fusectl) if the daemon
// dies uncleanly, so that a push stuck in the kernel cannot keep a dead
// daemon's mount hanging.
//
// Thread-safety: Run() blocks until unmounted; one per process.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mount/store_tree.h"
#include "base/status.h"

namespace optstate::mount {

struct MountCommand {
  MountOptions tree;                  // store_root etc.
  std::string mountpoint;
  bool foreground = false;            // -f
  bool debug = false;                 // -d: libfuse request log (implies -f)
  // --allow-other: let users other than the one who mounted read the files
  // (FUSE refuses every other user otherwise, root included unless it mounted;
  // needs user_allow_other in /etc/fuse.conf when not mounted by root).
  bool allow_other = false;
  bool single_thread = false;         // -s
  uint32_t max_threads = 16;          // worker threads of the multithreaded loop
  std::vector<std::string> fuse_opts; // extra -o options, passed to libfuse
  // --log: the log goes to this file (appended), opened before the daemon
  // detaches; empty = stderr, which fuse_daemonize points at /dev/null.
  std::string log_file;
};

// Checks that `mountpoint` can be mounted on: exists, is a directory, is not
// already a mount point (per /proc/self/mountinfo) and is not a dead FUSE mount
// (ENOTCONN); the error says what to do.
Status CheckMountpoint(const std::string& mountpoint);

// Checks that `store_root` (a realpath) is a directory of stores, not a store
// itself (it holds an IDENTITY file): a store's own directory would show its
// RocksDB index as a store. The error names the parent to mount instead.
// Also refuses a STORE_ROOT on a read-only bind mount of a writable filesystem,
// where no store could be read (vfs::CheckReaderFilesystem).
Status CheckStoreRoot(const std::string& store_root);

// The entries of `mountpoint` (a directory) that a mount there hides, or
// none: a warning names it and how many.
std::optional<std::string> HiddenByMountWarning(const std::string& mountpoint);

// Mounts and serves until unmounted or signalled. Returns the process exit code.
int RunMount(const MountCommand& cmd);

}  // namespace optstate::mount
