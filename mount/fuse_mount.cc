// optstate-mount's daemon (mount/fuse_mount.h): RunMount checks the
// mountpoint, mounts, serves the FUSE operations (fuse_ops.cc) until
// unmounted or signalled, and drains what the kernel still owes at exit.
// The pieces: internal/fuse_context.h (shared state, node ids), fuse_ops.cc,
// fuse_nodes.cc, safetensors_fill.cc, internal/open_handles.h,
// internal/push_gate.h, fuse_connection.cc.
#include "mount/fuse_mount.h"

#include <unistd.h>

#include <csignal>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "mount/internal/fuse_connection.h"
#include "mount/internal/fuse_context.h"
#include "mount/internal/open_handles.h"
#include "mount/internal/push_gate.h"
#include "base/log.h"

namespace optstate::mount {

using internal::BigFilesCached;
using internal::ConnectionAbortPath;
using internal::Context;
using internal::DrainPushes;
using internal::Guardian;
using internal::GuardianDone;
using internal::KernelHolds;
using internal::kMaxReadBytes;
using internal::MakeOps;
using internal::MountedDevice;
using internal::OpenHandles;
using internal::PinSweeper;
using internal::PushGate;
using internal::SetKernelReadahead;
using internal::StartGuardian;

int RunMount(const MountCommand& cmd) {
  Status st = CheckMountpoint(cmd.mountpoint);
  if (!st.ok()) {
    fmt::print(stderr, "optstate-mount: error: {}\n", st.message());
    return 1;
  }
  st = CheckStoreRoot(cmd.tree.store_root);
  if (!st.ok()) {
    fmt::print(stderr, "optstate-mount: error: {}\n", st.message());
    return 1;
  }
  const std::optional<std::string> hidden = HiddenByMountWarning(cmd.mountpoint);
  if (hidden) fmt::print(stderr, "optstate-mount: warning: {}\n", *hidden);

  std::string opts = fmt::format("ro,default_permissions,max_read={},fsname=optstate:{},subtype=optstate",
                                 kMaxReadBytes, cmd.tree.store_root);
  if (cmd.allow_other) opts += ",allow_other";
  for (const std::string& o : cmd.fuse_opts) opts += "," + o;
  struct fuse_args args = FUSE_ARGS_INIT(0, nullptr);
  fuse_opt_add_arg(&args, "optstate-mount");
  fuse_opt_add_arg(&args, "-o");
  fuse_opt_add_arg(&args, opts.c_str());
  if (cmd.debug) fuse_opt_add_arg(&args, "-d");

  if (!cmd.log_file.empty()) {
    std::string why;
    if (!LogToFile(cmd.log_file, &why)) {
      fmt::print(stderr, "optstate-mount: error: --log {}: {}\n", cmd.log_file, why);
      return 1;
    }
    if (hidden) OPTSTATE_LOG_WARN("optstate-mount: {}", *hidden);
  }
  Context ctx;
  ctx.tree = std::make_unique<StoreTree>(cmd.tree);
  ctx.pool = std::make_unique<ChunkBufferPool>(cmd.tree.buffer_pool_bytes);
  struct fuse_lowlevel_ops ops = MakeOps();
  struct fuse_session* se = fuse_session_new(&args, &ops, sizeof(ops), &ctx);
  fuse_opt_free_args(&args);
  if (se == nullptr) {
    fmt::print(stderr, "optstate-mount: error: bad FUSE options '{}'\n", opts);
    return 1;
  }
  ctx.push_gate = std::make_shared<PushGate>(se);
  // Handlers before the mount: a SIGTERM that comes as soon as the mount is
  // visible (a supervisor, a test) must end the loop and unmount, not kill the
  // process with the default action and leave a dead mount behind.
  if (fuse_set_signal_handlers(se) != 0) {
    fmt::print(stderr, "optstate-mount: error: cannot install signal handlers\n");
    fuse_session_destroy(se);
    return 1;
  }
  if (fuse_session_mount(se, cmd.mountpoint.c_str()) != 0) {
    fmt::print(stderr, "optstate-mount: error: cannot mount on {} (see the message above)\n",
               cmd.mountpoint);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return 1;
  }
  // Pushes (and so the guardian) and a wider kernel read-ahead only where big
  // files are cached.
  std::string abort_path;
  if (BigFilesCached(cmd.tree)) {
    const std::string dev = MountedDevice(cmd.mountpoint);
    if (cmd.tree.kernel_readahead_bytes > 0) SetKernelReadahead(dev, cmd.tree.kernel_readahead_bytes);
    abort_path = ConnectionAbortPath(dev);
  }
  int rc = 1;
  Guardian guardian;
  if (fuse_daemonize(cmd.foreground || cmd.debug ? 1 : 0) == 0) {
    // Before any thread (a fork copies only the calling one).
    if (BigFilesCached(cmd.tree)) guardian = StartGuardian(se, abort_path);
    // Threads only after fuse_daemonize: it forks, and the child that serves
    // the mount has none of the parent's threads (a Prefetcher made before it
    // had no thread in the daemon: nothing was ever opened ahead, and its
    // destructor joined a thread of another process).
    if (cmd.tree.prefetch_files > 0) {
      // A file the kernel holds is opened without loading; asking needs a
      // FUSE worker free to take the kernel's answer (not with -s).
      Prefetcher::HeldFn held;
      if (!cmd.single_thread) {
        held = [c = &ctx](const Generation& g, const vfs::CheckpointFile& f) { return KernelHolds(c, g, f); };
      }
      ctx.prefetch = std::make_unique<Prefetcher>(cmd.tree, ctx.pool.get(), &ctx.stats, std::move(held));
    }
    PinSweeper sweeper(ctx.tree.get());
    OPTSTATE_LOG_INFO("optstate-mount: serving {} at {} (pid {})", cmd.tree.store_root,
                      cmd.mountpoint, getpid());
    if (cmd.single_thread) {
      rc = fuse_session_loop(se);
    } else {
      struct fuse_loop_config* lc = fuse_loop_cfg_create();
      fuse_loop_cfg_set_max_threads(lc, cmd.max_threads);
      // Keep every worker: a pool that shrinks to a few idle threads creates
      // and destroys a thread (8 MiB stack mmap/munmap) every few requests
      // under a sequential reader, which showed up as 1-10 ms munmaps in the
      // read path.
      fuse_loop_cfg_set_idle_threads(lc, cmd.max_threads);
      rc = fuse_session_loop_mt(se, lc);
      fuse_loop_cfg_destroy(lc);
    }
    // The prefetcher's thread asks the session and the push gate whether the
    // kernel holds a file's pages: stop it (refused asks return at once) while
    // both still live. Left to ctx's destructor, it outlived the gate.
    ctx.push_gate->Refuse();
    ctx.prefetch.reset();
    OPTSTATE_LOG_INFO("optstate-mount: {} unmounted; served {}", cmd.mountpoint, ctx.stats.Summary());
  }
  const bool pushes_done = DrainPushes(se, ctx.push_gate.get(), abort_path, std::chrono::milliseconds(2000));
  fuse_remove_signal_handlers(se);
  fuse_session_unmount(se);
  if (pushes_done) {
    fuse_session_destroy(se);
    // Before ctx goes: their readers use its pool and stats.
    if (size_t n = OpenHandles::Get().FreeAll(); n > 0) {
      OPTSTATE_LOG_DEBUG("optstate-mount: {} handles the kernel had not released, freed at exit", n);
    }
  } else {
    // Not under a thread inside the session's writev; the exit ends it.
    OPTSTATE_LOG_WARN("optstate-mount: a page-cache push is still in flight at exit");
  }
  GuardianDone(guardian);
  // libfuse reports the signal that ended the loop as its result.
  return (rc == 0 || rc == SIGINT || rc == SIGTERM || rc == SIGHUP) ? 0 : 1;
}

}  // namespace optstate::mount
