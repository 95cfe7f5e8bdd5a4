// The FUSE operations of optstate-mount (low-level API, read-only): each
// handler resolves its node id, answers from the StoreTree or the open
// file's ChunkReader, and converts a Status to an errno in one place.
#include "mount/internal/fuse_context.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mount/internal/open_handles.h"
#include "mount/internal/push_gate.h"
#include "mount/internal/safetensors_fill.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::mount::internal {
namespace {

Context* Ctx(fuse_req_t req) { return static_cast<Context*>(fuse_req_userdata(req)); }

// The one conversion of a Status to a FUSE errno.
int ToFuseErrno(const Status& st) {
  if (st.ok()) return 0;
  if (st.IsNotFound()) return ENOENT;
  if (st.code() == StatusCode::kInvalidArgument) return ENOTDIR;
  if (st.IsCorruption()) return EIO;
  int e = st.ToErrno();
  return e > 0 ? e : EIO;
}

void ReplyStatus(fuse_req_t req, const Status& st) { fuse_reply_err(req, ToFuseErrno(st)); }

void OpInit(void* userdata, struct fuse_conn_info* conn) {
  conn->max_read = kMaxReadBytes;  // must match -o max_read (libfuse checks)
  const MountOptions& o = static_cast<Context*>(userdata)->tree->options();
  if (BigFilesCached(o) && o.kernel_readahead_bytes > 0) {
    // The kernel's read-ahead goes out as background requests of 1 MiB; the
    // default of 12 at once is less than one window.
    conn->max_readahead = static_cast<unsigned>(std::min<uint64_t>(o.kernel_readahead_bytes, 1u << 30));
    conn->max_background = 64;
    conn->congestion_threshold = 48;
  }
}

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Context* c = Ctx(req);
  c->stats.lookups.fetch_add(1, std::memory_order_relaxed);
  auto ref = RefOf(c, parent);
  if (!ref.ok()) return ReplyStatus(req, ref.status());
  const std::string path = JoinPath(ref->path, name);
  // Under a pinned node the child comes from the same generation's layout;
  // elsewhere the tree resolves the path (and may move latest/ on).
  Result<Node> n = [&]() -> Result<Node> {
    if (ref->generation == 0) return c->tree->Resolve(path, CallerTid(req));
    OPTSTATE_ASSIGN_OR_RETURN(Node p, NodeFromRef(c, *ref, CallerTid(req)));
    return StoreTree::ResolveIn(p.gen, p.rel.empty() ? std::string(name) : p.rel + "/" + name, path);
  }();
  if (!n.ok()) return ReplyStatus(req, n.status());
  struct fuse_entry_param e;
  EntryOf(*c, path, *n, &e);
  if (!Hold(c, e.ino, path, *n)) return (void)fuse_reply_err(req, EIO);
  fuse_reply_entry(req, &e);
}

void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  Forget(Ctx(req), ino, nlookup);
  fuse_reply_none(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, struct fuse_forget_data* forgets) {
  for (size_t i = 0; i < count; ++i) Forget(Ctx(req), forgets[i].ino, forgets[i].nlookup);
  fuse_reply_none(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  Context* c = Ctx(req);
  c->stats.getattrs.fetch_add(1, std::memory_order_relaxed);
  struct stat st;
  if (std::shared_ptr<FileHandle> fh = HandleOf<FileHandle>(fi); fh != nullptr) {
    const std::shared_ptr<ChunkReader>& r = fh->reader;
    // An open file: the generation it was opened on.
    Node n;
    n.kind = NodeKind::kGenFile;
    n.file = &r->file();
    n.gen = r->shared_generation();
    n.mtime_unix_ms = r->generation().view->info().commit_time_unix_ms;
    n.rel = r->file().path;  // st_ino by tree rank, as stat by path gives it
    auto ref = RefOf(c, ino);
    FillStat(ref.ok() ? ref->path : std::string(), n, c->tree->options().st_blksize_bytes, &st);
    fuse_reply_attr(req, &st, AttrTimeoutS(n));
    return;
  }
  std::string path;
  auto n = NodeOf(c, ino, &path, CallerTid(req));
  if (!n.ok()) return ReplyStatus(req, n.status());
  FillStat(path, *n, c->tree->options().st_blksize_bytes, &st);
  fuse_reply_attr(req, &st, AttrTimeoutS(*n));
}

// A directory handle: its whole listing, built at opendir (a stable listing
// even if latest/ moves while it is read), served by entry index (READDIR and
// READDIRPLUS both: the kernel may send either for one handle).
struct DirHandle {
  struct Entry {
    std::string name;
    struct stat st;
  };
  std::vector<Entry> entries;  // ".", "..", then the listing
  std::string path;            // the directory's
  std::shared_ptr<const Generation> gen;  // set inside a generation: READDIRPLUS gives its entries as nodes
  std::string rel;             // the directory's path inside gen
  std::unique_ptr<PinUse> pin_use;  // inside latest/ pinned for the opener's process: keeps the pin
};

void OpOpendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  std::string path;
  auto n = NodeOf(Ctx(req), ino, &path, CallerTid(req));
  if (!n.ok()) return ReplyStatus(req, n.status());
  if (n->kind == NodeKind::kGenFile) return (void)fuse_reply_err(req, ENOTDIR);
  auto names = Ctx(req)->tree->List(*n);
  if (!names.ok()) return ReplyStatus(req, names.status());
  auto h = std::make_shared<DirHandle>();
  h->path = path;
  if (n->kind == NodeKind::kGenDir) {
    h->gen = n->gen;
    h->rel = n->rel;
    if (std::shared_ptr<LatestPin> pin = Ctx(req)->tree->PinOf(*n->gen, CallerTid(req)); pin != nullptr) {
      h->pin_use = std::make_unique<PinUse>(std::move(pin));
    }
  }
  h->entries.reserve(names->size() + 2);
  h->entries.push_back({".", {}});
  FillStat(path, *n, Ctx(req)->tree->options().st_blksize_bytes, &h->entries.back().st);
  h->entries.push_back({"..", {}});
  h->entries.back().st.st_mode = S_IFDIR;
  for (const std::string& name : *names) {
    std::string child = JoinPath(path, name.c_str());
    struct stat st;
    std::memset(&st, 0, sizeof(st));
    bool is_file = false;
    if (n->kind == NodeKind::kGenDir) {
      const std::string rel = n->rel.empty() ? name : n->rel + "/" + name;
      st.st_ino = TreeInodeOf(*n->gen, rel, child);
      is_file = !n->gen->layout->IsDir(rel);
    } else {
      st.st_ino = InodeOf(child);
    }
    st.st_mode = is_file ? (S_IFREG | 0444) : (S_IFDIR | 0555);
    h->entries.push_back({name, st});
  }
  fi->fh = NewHandle(std::move(h));
  if (fuse_reply_open(req, fi) != 0) DeleteHandle<DirHandle>(fi);  // no releasedir will come
}

// READDIR and READDIRPLUS from entry `off` on, as many as fit in `size`. With
// `plus`, an entry inside a generation goes to the kernel as a node (counted
// as a lookup, attributes and timeouts as LOOKUP gives them): a `cp -r` of a
// generation directory then holds state.safetensors' node from its listing
// on, which the state.safetensors fill needs, and sends no LOOKUP for the
// names it lists. Entries outside generations, and "." and "..", go as names
// only (node id 0).
void ReplyDir(fuse_req_t req, size_t size, off_t off, struct fuse_file_info* fi, bool plus) {
  std::shared_ptr<DirHandle> h = HandleOf<DirHandle>(fi);  // h outlives the reply
  if (h == nullptr) return (void)fuse_reply_err(req, EBADF);
  Context* c = Ctx(req);
  std::string buf(size, '\0');
  size_t used = 0;
  for (size_t i = off < 0 ? h->entries.size() : static_cast<size_t>(off); i < h->entries.size(); ++i) {
    const DirHandle::Entry& d = h->entries[i];
    const off_t next = static_cast<off_t>(i + 1);
    if (!plus) {
      const size_t need = fuse_add_direntry(req, nullptr, 0, d.name.c_str(), nullptr, 0);
      if (need > size - used) break;
      fuse_add_direntry(req, buf.data() + used, size - used, d.name.c_str(), &d.st, next);
      used += need;
      continue;
    }
    const size_t need = fuse_add_direntry_plus(req, nullptr, 0, d.name.c_str(), nullptr, 0);
    if (need > size - used) break;
    struct fuse_entry_param e;
    std::memset(&e, 0, sizeof(e));
    e.attr = d.st;
    if (h->gen != nullptr && i >= 2) {
      const std::string child = JoinPath(h->path, d.name.c_str());
      Result<Node> n = StoreTree::ResolveIn(h->gen, h->rel.empty() ? d.name : h->rel + "/" + d.name, child);
      if (n.ok()) {
        struct fuse_entry_param full;
        EntryOf(*c, child, *n, &full);
        if (Hold(c, full.ino, child, *n)) {
          e = full;
          c->stats.listed.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    fuse_add_direntry_plus(req, buf.data() + used, size - used, d.name.c_str(), &e, next);
    used += need;
  }
  fuse_reply_buf(req, buf.data(), used);
}

void OpReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  ReplyDir(req, size, off, fi, /*plus=*/false);
}

void OpReaddirplus(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  ReplyDir(req, size, off, fi, /*plus=*/true);
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  DeleteHandle<DirHandle>(fi);
  fuse_reply_err(req, 0);
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC) != 0) {
    return (void)fuse_reply_err(req, EROFS);
  }
  std::string path;
  auto n = NodeOf(Ctx(req), ino, &path, CallerTid(req));
  if (!n.ok()) return ReplyStatus(req, n.status());
  if (n->kind != NodeKind::kGenFile) return (void)fuse_reply_err(req, EISDIR);
  Context* c = Ctx(req);
  std::unique_ptr<ChunkReader> reader;
  if (c->prefetch != nullptr) reader = c->prefetch->Take(n->gen.get(), n->file);
  const bool taken = reader != nullptr;
  if (reader == nullptr) {
    auto r = ChunkReader::Open(n->gen, n->file, c->tree->options(), c->pool.get(), &c->stats);
    if (!r.ok()) {
      OPTSTATE_LOG_ERROR("{}", r.status().ToString());
      return ReplyStatus(req, r.status());
    }
    reader = std::move(r).value();
  }
  if (n->gen->layout->ChunkSequenceLength(*n->file) > 0) c->stats.opens.fetch_add(1, std::memory_order_relaxed);
  if (c->prefetch != nullptr) c->prefetch->Opened(n->gen, n->file, taken);
  const bool cached = CachedFile(c->tree->options(), *n->file);
  auto fh = std::make_shared<FileHandle>();
  if (std::shared_ptr<LatestPin> pin = c->tree->PinOf(*n->gen, CallerTid(req)); pin != nullptr) {
    fh->pin_use = std::make_unique<PinUse>(std::move(pin));
  }
  fh->reader = std::shared_ptr<ChunkReader>(std::move(reader));
  fh->fill = MakeSafetensorsFill(c, path, *n);
  if (cached && n->file->size_bytes > MountOptions::kSmallFileBytes) {
    std::shared_ptr<PushGate> gate = c->push_gate;
    std::shared_ptr<SafetensorsFill> fill = fh->fill;
    fh->pusher = std::make_unique<CachePusher>(
        fh->reader,
        [gate, ino, fill](uint64_t offset, std::span<const iovec> iov) {
          const int rc = gate->Store(ino, offset, iov);
          if (rc == 0 && fill != nullptr) fill->Store(offset, iov);
          return rc;
        },
        &c->stats);
  }
  fi->fh = NewHandle(std::move(fh));
  fi->direct_io = cached ? 0 : 1;
  fi->keep_cache = cached ? 1 : 0;  // a pinned node's bytes never change
  fi->nonseekable = 0;
  if (fuse_reply_open(req, fi) != 0) DeleteHandle<FileHandle>(fi);  // no release will come
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  // Our own reference: after the reply below the kernel may release the
  // handle while ReadWith still unpins the chunk the reply came from.
  std::shared_ptr<FileHandle> fh = HandleOf<FileHandle>(fi);
  if (fh == nullptr) return (void)fuse_reply_err(req, EBADF);
  if (off < 0) return (void)fuse_reply_err(req, EINVAL);
  const std::shared_ptr<ChunkReader>& r = fh->reader;
  if (fh->pin_use != nullptr) fh->pin_use->Touch();
  if (fh->pusher != nullptr) fh->pusher->OnRead(static_cast<uint64_t>(off), size);
  // Tests delay here so that the kernel holds this READ's pages locked while
  // a CachePusher's store of them waits in the kernel.
  OPTSTATE_TEST_SYNC_POINT("mount.read.before_serve");
  const auto start = std::chrono::steady_clock::now();
  Context* c = Ctx(req);  // req is gone once replied
  bool replied = false;
  auto n = r->ReadWith(static_cast<uint64_t>(off), std::min<uint64_t>(size, kMaxReadBytes),
                       [&](std::span<const iovec> iov) {
                         replied = true;
                         // A failed reply (the request was interrupted) has
                         // already been freed by libfuse: nothing to send.
                         if (iov.empty()) {
                           fuse_reply_buf(req, nullptr, 0);  // EOF
                         } else {
                           fuse_reply_iov(req, iov.data(), static_cast<int>(iov.size()));
                           // The reader has its bytes; the fill's store is off
                           // its path (with the chunks lent, not pinned: that
                           // store may wait in the kernel for another READ).
                           if (fh->fill != nullptr) fh->fill->Store(static_cast<uint64_t>(off), iov);
                         }
                         // Tests delay here, before the chunk is unpinned, so
                         // that the kernel sends RELEASE while this handler runs.
                         OPTSTATE_TEST_SYNC_POINT("mount.read.after_reply");
                         return Status();
                       },
                       /*count=*/true, /*lend=*/fh->fill != nullptr);
  if (!replied) ReplyStatus(req, n.ok() ? Internal("read replied nothing") : n.status());
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
  c->stats.serve_ns.fetch_add(static_cast<uint64_t>(ns.count()), std::memory_order_relaxed);
}

void OpRetrieveReply(fuse_req_t req, void* cookie, fuse_ino_t, off_t, struct fuse_bufvec* bufv) {
  Ctx(req)->push_gate->Answer(reinterpret_cast<uint64_t>(cookie), fuse_buf_size(bufv));
  fuse_reply_none(req);
}

void OpRelease(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  // The last reference (ours, or a read handler's still returning) stops the
  // reader's I/O thread.
  DeleteHandle<FileHandle>(fi);
  fuse_reply_err(req, 0);
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  struct statvfs sv;
  std::memset(&sv, 0, sizeof(sv));
  sv.f_bsize = 4096;
  sv.f_frsize = 4096;
  sv.f_namemax = 255;
  sv.f_flag = ST_RDONLY;
  fuse_reply_statfs(req, &sv);
}

// Everything that would change the tree.
void RoSetattr(fuse_req_t req, fuse_ino_t, struct stat*, int, struct fuse_file_info*) {
  fuse_reply_err(req, EROFS);
}
void RoMknod(fuse_req_t req, fuse_ino_t, const char*, mode_t, dev_t) { fuse_reply_err(req, EROFS); }
void RoMkdir(fuse_req_t req, fuse_ino_t, const char*, mode_t) { fuse_reply_err(req, EROFS); }
void RoName(fuse_req_t req, fuse_ino_t, const char*) { fuse_reply_err(req, EROFS); }
void RoSymlink(fuse_req_t req, const char*, fuse_ino_t, const char*) { fuse_reply_err(req, EROFS); }
void RoRename(fuse_req_t req, fuse_ino_t, const char*, fuse_ino_t, const char*, unsigned int) {
  fuse_reply_err(req, EROFS);
}
void RoLink(fuse_req_t req, fuse_ino_t, fuse_ino_t, const char*) { fuse_reply_err(req, EROFS); }
void RoWrite(fuse_req_t req, fuse_ino_t, const char*, size_t, off_t, struct fuse_file_info*) {
  fuse_reply_err(req, EROFS);
}
void RoCreate(fuse_req_t req, fuse_ino_t, const char*, mode_t, struct fuse_file_info*) {
  fuse_reply_err(req, EROFS);
}
void RoSetxattr(fuse_req_t req, fuse_ino_t, const char*, const char*, size_t, int) {
  fuse_reply_err(req, EROFS);
}
void RoFallocate(fuse_req_t req, fuse_ino_t, int, off_t, off_t, struct fuse_file_info*) {
  fuse_reply_err(req, EROFS);
}

}  // namespace

struct fuse_lowlevel_ops MakeOps() {
  struct fuse_lowlevel_ops ops;
  std::memset(&ops, 0, sizeof(ops));
  ops.init = OpInit;
  ops.lookup = OpLookup;
  ops.forget = OpForget;
  ops.forget_multi = OpForgetMulti;
  ops.getattr = OpGetattr;
  ops.opendir = OpOpendir;
  ops.readdir = OpReaddir;
  ops.readdirplus = OpReaddirplus;
  ops.releasedir = OpReleasedir;
  ops.open = OpOpen;
  ops.read = OpRead;
  ops.release = OpRelease;
  ops.retrieve_reply = OpRetrieveReply;
  ops.statfs = OpStatfs;
  ops.setattr = RoSetattr;
  ops.mknod = RoMknod;
  ops.mkdir = RoMkdir;
  ops.unlink = RoName;
  ops.rmdir = RoName;
  ops.symlink = RoSymlink;
  ops.rename = RoRename;
  ops.link = RoLink;
  ops.write = RoWrite;
  ops.create = RoCreate;
  ops.setxattr = RoSetxattr;
  ops.removexattr = RoName;
  ops.fallocate = RoFallocate;
  return ops;
}

}  // namespace optstate::mount::internal
