// Node ids the kernel holds, their attributes, and how long the kernel may
// cache names, attributes and pages (mount/internal/fuse_context.h).
#include "mount/internal/fuse_context.h"

#include <unistd.h>

#include <cstring>
#include <string>

#include <fmt/format.h>

#include "mount/internal/push_gate.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::mount::internal {

// How long the kernel may cache a name or attributes it got from us, in
// seconds. Inside a pinned generation nothing changes: an hour. The name of a
// snapshot's directory: as long as the daemon itself trusts a held snapshot
// without a catch-up (MountOptions::snapshot_recheck_ms), so a released
// snapshot's paths still go within about that long. A store's snapshots/ is
// there as long as the store is, and its node id is its path's: an hour too
// (a path walk looks the store up again within a second, which fails once it
// is gone); generations/ likewise, and a generation's directory name as a
// snapshot's. latest/: not at all. It names another generation for each
// process (StoreTree: pinned at the process's first walk), and the kernel's
// dentry is shared by all of them: every walk through latest/ must reach the
// daemon with its caller's pid, or a copier would start on (and then leave)
// another process's generation. The cost: one LOOKUP per path walk, cheap
// for a pinned process (no catch-up), about a quarter of a `cp -r` of
// latest/'s requests. A store's name: a second, like its attributes, so a
// removed store's paths go within a second (a new one shows at once: a
// failed lookup is not cached); looked up again on every path walk, the
// store's name would be three of a `cp -r`'s four LOOKUPs per file. Their
// attributes (mode 0555, an mtime) may be a second old: with
// default_permissions the kernel checks every directory of a path walk
// against its attributes, and with none cached it sends a GETATTR for the
// root, the store and snapshots/ on every walk (five of the nine requests of
// each path walk of a `cp -r`).
constexpr double kInGenerationTimeoutS = 3600.0;
constexpr double kOutsideAttrTimeoutS = 1.0;

fuse_ino_t NodeIdOf(const std::string& path, uint64_t generation) {
  if (path == "/") return FUSE_ROOT_ID;
  if (generation == 0) return InodeOf(path);
  std::string key = path;
  key.push_back('\0');  // no path holds one
  key += std::to_string(generation);
  return InodeOf(key);
}

Status StaleNode(const std::string& what) { return ErrnoStatus(what, ESTALE); }

uint32_t CallerTid(fuse_req_t req) {
  const struct fuse_ctx* x = fuse_req_ctx(req);
  return x != nullptr && x->pid > 0 ? static_cast<uint32_t>(x->pid) : 0;
}

Result<NodeRef> RefOf(Context* c, fuse_ino_t ino) {
  NodeRef ref;
  if (ino == FUSE_ROOT_ID) {
    ref.path = "/";
    return ref;
  }
  MutexLock l(&c->mu);
  auto it = c->nodes.find(ino);
  if (it == c->nodes.end()) return StaleNode(fmt::format("node id {:#x} (not looked up)", ino));
  return it->second;
}

Result<Node> NodeFromRef(Context* c, const NodeRef& ref, uint32_t caller_tid) {
  if (ref.generation == 0) return c->tree->Resolve(ref.path, caller_tid);
  std::shared_ptr<const Generation> g = ref.gen.lock();
  if (g == nullptr) {
    const std::string dir = ref.path.substr(0, ref.path.size() - ref.rel.size() - (ref.rel.empty() ? 0 : 1));
    OPTSTATE_ASSIGN_OR_RETURN(Node d, c->tree->Resolve(dir, caller_tid));
    if (d.gen == nullptr || d.gen->generation() != ref.generation) {
      return StaleNode(fmt::format("{}: generation {} is no longer served there (now {})", ref.path,
                                   ref.generation, d.gen != nullptr ? d.gen->generation() : 0));
    }
    g = std::move(d.gen);
  }
  return StoreTree::ResolveIn(std::move(g), ref.rel, ref.path);
}

Result<Node> NodeOf(Context* c, fuse_ino_t ino, std::string* path, uint32_t caller_tid) {
  OPTSTATE_ASSIGN_OR_RETURN(NodeRef ref, RefOf(c, ino));
  *path = ref.path;
  return NodeFromRef(c, ref, caller_tid);
}

double EntryTimeoutS(const Context& c, const Node& n) {
  if (n.gen == nullptr) {
    return n.kind == NodeKind::kSnapshotsDir || n.kind == NodeKind::kGenerationsDir ? kInGenerationTimeoutS
                                                                                    : kOutsideAttrTimeoutS;
  }
  if (!n.rel.empty()) return kInGenerationTimeoutS;
  if (n.gen->dir_label == "latest") return 0;
  return c.tree->options().snapshot_recheck_ms / 1000.0;
}
double AttrTimeoutS(const Node& n) { return n.gen != nullptr ? kInGenerationTimeoutS : kOutsideAttrTimeoutS; }

void FillStat(const std::string& path, const Node& n, uint64_t blksize, struct stat* st) {
  std::memset(st, 0, sizeof(*st));
  st->st_ino = n.gen != nullptr ? TreeInodeOf(*n.gen, n.rel, path) : InodeOf(path);
  st->st_uid = getuid();
  st->st_gid = getgid();
  int64_t ms = n.mtime_unix_ms;
  st->st_mtim.tv_sec = ms / 1000;
  st->st_mtim.tv_nsec = (ms % 1000) * 1000000;
  st->st_ctim = st->st_mtim;
  st->st_atim = st->st_mtim;
  if (n.kind == NodeKind::kGenFile) {
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_size = static_cast<off_t>(n.file->size_bytes);
    st->st_blocks = static_cast<blkcnt_t>((n.file->size_bytes + 511) / 512);
    // cp sizes its buffer from st_blksize (MountOptions::st_blksize_bytes).
    if (blksize == 0) blksize = n.gen->view->identity().chunk_size_bytes;
    st->st_blksize = static_cast<blksize_t>(blksize);
  } else {
    st->st_mode = S_IFDIR | 0555;
    st->st_nlink = 2;
    st->st_size = 4096;
    st->st_blocks = 8;
    st->st_blksize = 4096;
  }
}

std::string JoinPath(const std::string& dir, const char* name) {
  std::string p;
  const size_t name_len = std::strlen(name);
  p.reserve(dir.size() + 1 + name_len);
  p.append(dir);
  if (p.empty() || p.back() != '/') p.push_back('/');
  p.append(name, name_len);
  return p;
}

bool BigFilesCached(const MountOptions& o) {
  return o.page_cache == MountOptions::PageCache::kMappable || o.page_cache == MountOptions::PageCache::kAll;
}

void EntryOf(const Context& c, const std::string& path, const Node& n, struct fuse_entry_param* e) {
  std::memset(e, 0, sizeof(*e));
  e->ino = NodeIdOf(path, n.gen != nullptr ? n.gen->generation() : 0);
  FillStat(path, n, c.tree->options().st_blksize_bytes, &e->attr);
  e->attr_timeout = AttrTimeoutS(n);
  e->entry_timeout = EntryTimeoutS(c, n);
}

bool Hold(Context* c, fuse_ino_t ino, const std::string& path, const Node& n) {
  const uint64_t generation = n.gen != nullptr ? n.gen->generation() : 0;
  MutexLock l(&c->mu);
  auto [it, inserted] = c->nodes.try_emplace(ino);
  NodeRef& r = it->second;
  if (inserted) {
    r.path = path;
    r.generation = generation;
    r.rel = n.rel;
    r.gen = n.gen;
  } else if (r.path != path || r.generation != generation) {
    OPTSTATE_LOG_ERROR("optstate-mount: node id collision: {} (generation {}) and {} (generation {})", r.path,
                       r.generation, path, generation);
    return false;
  }
  ++r.nlookup;
  return true;
}

void Forget(Context* c, fuse_ino_t ino, uint64_t nlookup) {
  MutexLock l(&c->mu);
  auto it = c->nodes.find(ino);
  if (it == c->nodes.end()) return;
  if (it->second.nlookup <= nlookup) {
    c->nodes.erase(it);
    c->safetensors_pages.erase(ino);
  } else {
    it->second.nlookup -= nlookup;
  }
}

bool CachedFile(const MountOptions& o, const vfs::CheckpointFile& f) {
  switch (o.page_cache) {
    case MountOptions::PageCache::kNone: return false;
    case MountOptions::PageCache::kSmall: return f.size_bytes <= MountOptions::kSmallFileBytes;
    case MountOptions::PageCache::kMappable:
      return f.kind != vfs::CheckpointFileKind::kField || f.size_bytes <= MountOptions::kSmallFileBytes;
    case MountOptions::PageCache::kAll: return true;
  }
  return false;
}

bool KernelHolds(Context* c, const Generation& g, const vfs::CheckpointFile& f) {
  if (!CachedFile(c->tree->options(), f) || f.size_bytes == 0 || c->push_gate == nullptr) return false;
  const fuse_ino_t ino = NodeIdOf("/" + g.store_name + "/" + g.dir_label + "/" + f.path, g.generation());
  {
    MutexLock l(&c->mu);
    if (!c->nodes.count(ino)) return false;  // not a node the kernel holds: no pages either
  }
  OPTSTATE_TEST_SYNC_POINT("mount.kernel_holds.before_ask");
  const uint64_t last_page = (f.size_bytes - 1) / CachePusher::kPageBytes * CachePusher::kPageBytes;
  return c->push_gate->Cached(ino, 0) && (last_page == 0 || c->push_gate->Cached(ino, last_page));
}

}  // namespace optstate::mount::internal
