#define FUSE_USE_VERSION 312
#include "mount/fuse_mount.h"

#include <fuse3/fuse.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "mount/chunk_reader.h"
#include "vfs/log.h"

namespace optstate::mount {
namespace {

constexpr uint32_t kMaxReadBytes = 1u << 20;

struct Context {
  std::unique_ptr<StoreTree> tree;
  uint32_t readahead_chunks = 8;
};

Context* Ctx() { return static_cast<Context*>(fuse_get_context()->private_data); }

// The one conversion of a Status to a FUSE reply (negative errno).
int ToFuseError(const Status& st) {
  if (st.ok()) return 0;
  if (st.IsNotFound()) return -ENOENT;
  if (st.code() == StatusCode::kInvalidArgument) return -ENOTDIR;
  if (st.IsCorruption()) return -EIO;
  int e = st.ToErrno();
  return -(e > 0 ? e : EIO);
}

void FillStat(const std::string& path, const Node& n, struct stat* st) {
  std::memset(st, 0, sizeof(*st));
  st->st_ino = InodeOf(path);
  st->st_uid = getuid();
  st->st_gid = getgid();
  int64_t ms = n.mtime_unix_ms;
  st->st_mtim.tv_sec = ms / 1000;
  st->st_mtim.tv_nsec = (ms % 1000) * 1000000;
  st->st_ctim = st->st_mtim;
  st->st_atim = st->st_mtim;
  st->st_blksize = 1 << 20;
  if (n.kind == NodeKind::kGenFile) {
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_size = static_cast<off_t>(n.file->size_bytes);
    st->st_blocks = static_cast<blkcnt_t>((n.file->size_bytes + 511) / 512);
  } else {
    st->st_mode = S_IFDIR | 0555;
    st->st_nlink = 2;
    st->st_size = 4096;
    st->st_blocks = 8;
  }
}

std::string JoinPath(const char* dir, const std::string& name) {
  std::string p = dir;
  if (p.empty() || p.back() != '/') p += "/";
  return p + name;
}

void* OpInit(struct fuse_conn_info* conn, struct fuse_config* cfg) {
  conn->max_read = kMaxReadBytes;  // must match -o max_read (libfuse checks)
  cfg->use_ino = 1;
  cfg->readdir_ino = 1;
  cfg->direct_io = 1;
  cfg->kernel_cache = 0;
  // No kernel caching of names or attributes: latest/ changes with every commit.
  cfg->entry_timeout = 0;
  cfg->attr_timeout = 0;
  cfg->negative_timeout = 0;
  return fuse_get_context()->private_data;
}

int OpGetattr(const char* path, struct stat* st, struct fuse_file_info* fi) {
  if (fi != nullptr && fi->fh != 0) {
    auto* r = reinterpret_cast<ChunkReader*>(fi->fh);
    Node n;
    n.kind = NodeKind::kGenFile;
    n.file = &r->file();
    n.mtime_unix_ms = r->generation().view->info().commit_time_unix_ms;
    FillStat(path, n, st);
    return 0;
  }
  auto n = Ctx()->tree->Resolve(path);
  if (!n.ok()) return ToFuseError(n.status());
  FillStat(path, *n, st);
  return 0;
}

int OpReaddir(const char* path, void* buf, fuse_fill_dir_t filler, off_t, struct fuse_file_info*,
              enum fuse_readdir_flags) {
  auto n = Ctx()->tree->Resolve(path);
  if (!n.ok()) return ToFuseError(n.status());
  if (n->kind == NodeKind::kGenFile) return -ENOTDIR;
  auto names = Ctx()->tree->List(*n);
  if (!names.ok()) return ToFuseError(names.status());
  struct stat st;
  FillStat(path, *n, &st);
  filler(buf, ".", &st, 0, static_cast<fuse_fill_dir_flags>(0));
  filler(buf, "..", nullptr, 0, static_cast<fuse_fill_dir_flags>(0));
  for (const std::string& name : *names) {
    std::string child = JoinPath(path, name);
    std::memset(&st, 0, sizeof(st));
    st.st_ino = InodeOf(child);
    bool is_file = n->kind == NodeKind::kGenDir &&
                   !n->gen->layout->IsDir(n->rel.empty() ? name : n->rel + "/" + name);
    st.st_mode = is_file ? (S_IFREG | 0444) : (S_IFDIR | 0555);
    if (filler(buf, name.c_str(), &st, 0, static_cast<fuse_fill_dir_flags>(0)) != 0) break;
  }
  return 0;
}

int OpOpen(const char* path, struct fuse_file_info* fi) {
  if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC) != 0) return -EROFS;
  auto n = Ctx()->tree->Resolve(path);
  if (!n.ok()) return ToFuseError(n.status());
  if (n->kind != NodeKind::kGenFile) return -EISDIR;
  auto* r = new ChunkReader(n->gen, n->file, Ctx()->readahead_chunks);
  fi->fh = reinterpret_cast<uint64_t>(r);
  fi->direct_io = 1;
  fi->keep_cache = 0;
  fi->nonseekable = 0;
  return 0;
}

int OpRead(const char*, char* buf, size_t size, off_t off, struct fuse_file_info* fi) {
  auto* r = reinterpret_cast<ChunkReader*>(fi->fh);
  if (r == nullptr) return -EBADF;
  if (off < 0) return -EINVAL;
  auto n = r->Read(static_cast<uint64_t>(off), size, buf);
  if (!n.ok()) return ToFuseError(n.status());
  return static_cast<int>(*n);
}

int OpRelease(const char*, struct fuse_file_info* fi) {
  delete reinterpret_cast<ChunkReader*>(fi->fh);
  fi->fh = 0;
  return 0;
}

int OpStatfs(const char*, struct statvfs* sv) {
  std::memset(sv, 0, sizeof(*sv));
  sv->f_bsize = 4096;
  sv->f_frsize = 4096;
  sv->f_namemax = 255;
  sv->f_flag = ST_RDONLY;
  return 0;
}

// Everything that would change the tree.
int RoMknod(const char*, mode_t, dev_t) { return -EROFS; }
int RoMkdir(const char*, mode_t) { return -EROFS; }
int RoPath(const char*) { return -EROFS; }
int RoTwoPaths(const char*, const char*) { return -EROFS; }
int RoRename(const char*, const char*, unsigned int) { return -EROFS; }
int RoChmod(const char*, mode_t, struct fuse_file_info*) { return -EROFS; }
int RoChown(const char*, uid_t, gid_t, struct fuse_file_info*) { return -EROFS; }
int RoTruncate(const char*, off_t, struct fuse_file_info*) { return -EROFS; }
int RoWrite(const char*, const char*, size_t, off_t, struct fuse_file_info*) { return -EROFS; }
int RoCreate(const char*, mode_t, struct fuse_file_info*) { return -EROFS; }
int RoUtimens(const char*, const struct timespec[2], struct fuse_file_info*) { return -EROFS; }
int RoSetxattr(const char*, const char*, const char*, size_t, int) { return -EROFS; }
int RoRemovexattr(const char*, const char*) { return -EROFS; }
int RoFallocate(const char*, int, off_t, off_t, struct fuse_file_info*) { return -EROFS; }

struct fuse_operations MakeOps() {
  struct fuse_operations ops;
  std::memset(&ops, 0, sizeof(ops));
  ops.init = OpInit;
  ops.getattr = OpGetattr;
  ops.readdir = OpReaddir;
  ops.open = OpOpen;
  ops.read = OpRead;
  ops.release = OpRelease;
  ops.statfs = OpStatfs;
  ops.mknod = RoMknod;
  ops.mkdir = RoMkdir;
  ops.unlink = RoPath;
  ops.rmdir = RoPath;
  ops.symlink = RoTwoPaths;
  ops.link = RoTwoPaths;
  ops.rename = RoRename;
  ops.chmod = RoChmod;
  ops.chown = RoChown;
  ops.truncate = RoTruncate;
  ops.write = RoWrite;
  ops.create = RoCreate;
  ops.utimens = RoUtimens;
  ops.setxattr = RoSetxattr;
  ops.removexattr = RoRemovexattr;
  ops.fallocate = RoFallocate;
  return ops;
}

// /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
std::string UnescapeMountinfo(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      out.push_back(static_cast<char>(std::strtol(s.substr(i + 1, 3).c_str(), nullptr, 8)));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

}  // namespace

Status CheckMountpoint(const std::string& mountpoint) {
  struct stat st;
  if (::stat(mountpoint.c_str(), &st) != 0) {
    int e = errno;
    if (e == ENOTCONN) {
      return Busy(fmt::format(
          "mountpoint {} is a dead FUSE mount (its daemon exited); run `fusermount3 -u {}` "
          "and mount again",
          mountpoint, mountpoint));
    }
    return ErrnoStatus("mountpoint " + mountpoint, e);
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument("mountpoint " + mountpoint + " is not a directory");
  char real[PATH_MAX];
  if (::realpath(mountpoint.c_str(), real) == nullptr) return ErrnoStatus("realpath " + mountpoint, errno);
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string id, parent, dev, root, mp;
    ls >> id >> parent >> dev >> root >> mp;
    if (UnescapeMountinfo(mp) != real) continue;
    std::string tok, fstype, source;
    while (ls >> tok && tok != "-") {
    }
    ls >> fstype >> source;
    return Busy(fmt::format(
        "mountpoint {} is busy: {} is mounted there (source {}); unmount it first "
        "(`fusermount3 -u {}`)",
        mountpoint, fstype, source, mountpoint));
  }
  return Status();
}

int RunMount(const MountCommand& cmd) {
  Status st = CheckMountpoint(cmd.mountpoint);
  if (!st.ok()) {
    fmt::print(stderr, "optstate-mount: {}\n", st.message());
    return 1;
  }
  struct stat rs;
  if (::stat(cmd.tree.store_root.c_str(), &rs) != 0 || !S_ISDIR(rs.st_mode)) {
    fmt::print(stderr, "optstate-mount: STORE_ROOT {} is not a directory\n", cmd.tree.store_root);
    return 1;
  }

  std::string opts = fmt::format("default_permissions,max_read={},fsname=optstate:{},subtype=optstate",
                                 kMaxReadBytes, cmd.tree.store_root);
  if (cmd.allow_other) opts += ",allow_other";
  for (const std::string& o : cmd.fuse_opts) opts += "," + o;
  struct fuse_args args = FUSE_ARGS_INIT(0, nullptr);
  fuse_opt_add_arg(&args, "optstate-mount");
  fuse_opt_add_arg(&args, "-o");
  fuse_opt_add_arg(&args, opts.c_str());
  if (cmd.debug) fuse_opt_add_arg(&args, "-d");

  Context ctx;
  ctx.tree = std::make_unique<StoreTree>(cmd.tree);
  ctx.readahead_chunks = cmd.tree.readahead_chunks;
  struct fuse_operations ops = MakeOps();
  struct fuse* f = fuse_new(&args, &ops, sizeof(ops), &ctx);
  fuse_opt_free_args(&args);
  if (f == nullptr) {
    fmt::print(stderr, "optstate-mount: bad FUSE options '{}'\n", opts);
    return 1;
  }
  if (fuse_mount(f, cmd.mountpoint.c_str()) != 0) {
    fmt::print(stderr, "optstate-mount: cannot mount on {} (see the message above)\n",
               cmd.mountpoint);
    fuse_destroy(f);
    return 1;
  }
  struct fuse_session* se = fuse_get_session(f);
  int rc = 1;
  if (fuse_set_signal_handlers(se) != 0) {
    fmt::print(stderr, "optstate-mount: cannot install signal handlers\n");
  } else {
    if (fuse_daemonize(cmd.foreground || cmd.debug ? 1 : 0) == 0) {
      OPTSTATE_LOG_INFO("optstate-mount: serving {} at {} (pid {})", cmd.tree.store_root,
                        cmd.mountpoint, getpid());
      if (cmd.single_thread) {
        rc = fuse_loop(f);
      } else {
        struct fuse_loop_config* lc = fuse_loop_cfg_create();
        fuse_loop_cfg_set_max_threads(lc, cmd.max_threads);
        // Keep every worker: a pool that shrinks to a few idle threads creates
        // and destroys a thread (8 MiB stack mmap/munmap) every few requests
        // under a sequential reader, which showed up as 1-10 ms munmaps in the
        // read path.
        fuse_loop_cfg_set_idle_threads(lc, cmd.max_threads);
        rc = fuse_loop_mt(f, lc);
        fuse_loop_cfg_destroy(lc);
      }
      OPTSTATE_LOG_INFO("optstate-mount: {} unmounted", cmd.mountpoint);
    }
    fuse_remove_signal_handlers(se);
  }
  fuse_unmount(f);
  fuse_destroy(f);
  // libfuse reports the signal that ended the loop as its result.
  return (rc == 0 || rc == SIGINT || rc == SIGTERM || rc == SIGHUP) ? 0 : 1;
}

}  // namespace optstate::mount
