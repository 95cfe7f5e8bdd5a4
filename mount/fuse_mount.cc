#define FUSE_USE_VERSION 312
#include "mount/fuse_mount.h"

#include <fuse3/fuse_lowlevel.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <bitset>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "mount/cache_pusher.h"
#include "mount/chunk_reader.h"
#include "mount/prefetcher.h"
#include "vfs/log.h"

namespace optstate::mount {
namespace {

constexpr uint32_t kMaxReadBytes = 1u << 20;

// A node id the kernel holds. Nodes inside a generation (its directory and
// everything below it) are pinned to that generation: their node ids hash its
// number with the path, so after a commit the name latest/ leads to new node
// ids, and everything under one node id is immutable, which lets the kernel
// cache those names and attributes (kInGenerationTimeoutS) instead of sending
// a LOOKUP per path component on every path walk (six per file of a snapshot;
// `cp -r` walks each file's path several times).
struct NodeRef {
  std::string path;       // as the user sees it: "/s/latest/tensors/x/main"
  uint64_t nlookup = 0;   // the kernel's lookup count
  uint64_t generation = 0;  // pinned to this one; 0 = outside generations
  std::string rel;          // path inside the generation ("" = its directory)
  // Weak: the kernel keeps node ids as long as it likes (until it forgets
  // them), and they must not keep an old generation's extents from the
  // writer's GC. The tree holds the generations it serves.
  std::weak_ptr<const Generation> gen;
};

// What CachePushers store through (fuse_lowlevel_notify_store): the session
// while it serves. A store waits in the kernel (uninterruptibly) for pages
// whose READ is in flight, so at exit, once the loop has ended, one can wait
// for a READ that nobody will answer: RunMount refuses new stores, answers
// what the kernel still sends until the stores in flight are done, and aborts
// the connection if one still waits (DrainPushes). The Prefetcher asks
// through it too, whether the kernel holds a page (Cached). Thread-safe.
class PushGate {
 public:
  explicit PushGate(struct fuse_session* se) : se_(se) {}
  int Store(fuse_ino_t ino, uint64_t offset, std::span<const iovec> iov) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (refused_) return -ESHUTDOWN;
      ++in_flight_;
    }
    // One fuse_bufvec over every iovec: one notification for the range.
    std::vector<char> mem(sizeof(struct fuse_bufvec) + iov.size() * sizeof(struct fuse_buf));
    auto* bv = reinterpret_cast<struct fuse_bufvec*>(mem.data());
    bv->count = iov.size();
    for (size_t i = 0; i < iov.size(); ++i) {
      bv->buf[i] = fuse_buf{};
      bv->buf[i].size = iov[i].iov_len;
      bv->buf[i].mem = iov[i].iov_base;
    }
    const int rc = fuse_lowlevel_notify_store(se_, ino, static_cast<off_t>(offset), bv, fuse_buf_copy_flags{});
    std::lock_guard<std::mutex> l(mu_);
    --in_flight_;
    return rc;
  }
  // Whether the kernel's page cache holds the page at `offset` of node ino
  // (FUSE_NOTIFY_RETRIEVE: the kernel answers with the cached bytes from
  // there, as a request that OpRetrieveReply hands to Answer). False when it
  // does not, when the kernel does not hold the node, when no answer came
  // within kRetrieveWait, or once the daemon is exiting.
  bool Cached(fuse_ino_t ino, uint64_t offset) {
    uint64_t cookie;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (refused_) return false;
      ++in_flight_;  // the session stays until the call returns (as for Store)
      cookie = ++next_cookie_;
      answers_.emplace(cookie, std::nullopt);
    }
    const int rc = fuse_lowlevel_notify_retrieve(se_, ino, kPageBytes, static_cast<off_t>(offset),
                                                 reinterpret_cast<void*>(cookie));
    std::unique_lock<std::mutex> l(mu_);
    --in_flight_;
    if (rc == 0) answered_.wait_for(l, kRetrieveWait, [&] { return answers_[cookie].has_value(); });
    const size_t got = answers_[cookie].value_or(0);
    answers_.erase(cookie);
    return got > 0;
  }
  void Answer(uint64_t cookie, size_t bytes) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = answers_.find(cookie);
    if (it == answers_.end()) return;  // the asker stopped waiting
    it->second = bytes;
    answered_.notify_all();
  }
  void Refuse() {
    std::lock_guard<std::mutex> l(mu_);
    refused_ = true;
  }
  int InFlight() {
    std::lock_guard<std::mutex> l(mu_);
    return in_flight_;
  }

 private:
  static constexpr uint64_t kPageBytes = CachePusher::kPageBytes;
  // An answer is a round trip through the FUSE loop (tens of us); beyond this
  // the page counts as not cached.
  static constexpr std::chrono::milliseconds kRetrieveWait{20};

  struct fuse_session* const se_;
  std::mutex mu_;
  std::condition_variable answered_;
  bool refused_ = false;  // guarded by mu_
  int in_flight_ = 0;     // guarded by mu_
  uint64_t next_cookie_ = 0;                                     // guarded by mu_
  std::unordered_map<uint64_t, std::optional<size_t>> answers_;  // cookie -> bytes retrieved; guarded by mu_
};

// The low-level API (not the path-based one): a read is answered with
// fuse_reply_iov straight from the verified chunk buffer, so the only copy of
// the bytes in the daemon's path is the kernel's into the reader's buffer (the
// path-based API mallocs a reply buffer per request and needs a memcpy into it).
struct Context {
  std::unique_ptr<StoreTree> tree;
  std::unique_ptr<ChunkBufferPool> pool;
  ReadStats stats;  // logged at unmount
  std::unique_ptr<Prefetcher> prefetch;  // null with --prefetch-files 0; declared after pool: closed first

  // Every node id the kernel holds (NodeIdOf; root: FUSE_ROOT_ID, never in
  // the map); an entry goes at its last forget.
  std::mutex mu;
  std::unordered_map<fuse_ino_t, NodeRef> nodes;  // guarded by mu
  // What the fills of each state.safetensors node the kernel holds share (an
  // entry goes when the node does).
  std::unordered_map<fuse_ino_t, std::shared_ptr<struct SafetensorsPages>> safetensors_pages;  // guarded by mu
  std::shared_ptr<PushGate> push_gate;
};

// The fill of one state.safetensors node: the pages that two field files
// share (a field whose size is not a whole number of pages ends inside one),
// assembled until both halves came.
struct SafetensorsPages {
  static constexpr uint64_t kPage = CachePusher::kPageBytes;
  // Pages left half filled (a field file read only in part) are dropped,
  // lowest first, beyond this many.
  static constexpr size_t kMaxPartialPages = 256;
  struct Partial {
    std::bitset<kPage> have;
    char bytes[kPage];
  };
  std::mutex mu;
  std::map<uint64_t, std::unique_ptr<Partial>> partial;     // page index -> bytes so far; guarded by mu
};

// Fills state.safetensors' page cache from one field file's bytes as the
// kernel gets them (MountOptions::fill_safetensors): every range the field
// file's READs and CachePusher hand the kernel is stored again at its place in
// state.safetensors; the first field's first range brings the header pages
// with it (from the layout's memory), so every pass over the field files
// stores them once, also after the kernel dropped them. A `cp -r` of a
// generation directory reads tensors/ before state.safetensors
// (GenerationDirNames), so state.safetensors is then read from memory, not
// from the disk a second time: the two views hold the same bytes. The kernel
// marks a page up to date only when one store fills it whole (or up to EOF),
// so a page that two fields share is assembled in SafetensorsPages until both
// halves came. It needs the kernel to hold state.safetensors' node, which a
// READDIRPLUS of the generation directory (cp's listing) gives: a field file
// opened while it does not gets no fill (MakeSafetensorsFill). A store that
// fails (the node forgotten since, the daemon exiting) stops this file's
// fill; the kernel READs what is missing, as without a fill. Thread-safe.
class SafetensorsFill {
 public:
  SafetensorsFill(std::shared_ptr<PushGate> gate, std::shared_ptr<SafetensorsPages> pages, ReadStats* stats,
                  fuse_ino_t st_ino, uint64_t base, uint64_t field_bytes, uint64_t st_bytes,
                  const std::string* header)
      : gate_(std::move(gate)), pages_(std::move(pages)), stats_(stats), st_ino_(st_ino), base_(base),
        field_bytes_(field_bytes), st_bytes_(st_bytes), header_(header) {}

  // The kernel got the bytes of iov at `offset` of the field file.
  void Store(uint64_t offset, std::span<const iovec> iov) {
    if (stopped_.load(std::memory_order_relaxed) || offset >= field_bytes_) return;
    uint64_t len = 0;
    for (const iovec& v : iov) len += v.iov_len;
    len = std::min(len, field_bytes_ - offset);
    if (len == 0) return;
    if (offset == 0 && base_ == header_->size()) {  // the first field: the header pages too
      const iovec h{const_cast<char*>(header_->data()), header_->size()};  // whole pages: padded to one
      if (!Check(gate_->Store(st_ino_, 0, std::span<const iovec>(&h, 1)))) return;
    }
    // [s, e) in state.safetensors; whole pages [ps, pe) go straight in.
    const uint64_t s = base_ + offset, e = s + len;
    const uint64_t ps = (s + kPage - 1) / kPage * kPage;
    const uint64_t pe = e == st_bytes_ ? e : e / kPage * kPage;
    if (ps < pe) {
      std::vector<iovec> cut = Slice(iov, ps - s, pe - ps);
      if (!Check(gate_->Store(st_ino_, ps, cut))) return;
      stats_->filled_bytes.fetch_add(pe - ps, std::memory_order_relaxed);
    }
    if (s < ps) Assemble(iov, s, std::min(e, ps), s);
    if (pe < e && pe >= ps) Assemble(iov, pe, e, s);
  }

 private:
  static constexpr uint64_t kPage = SafetensorsPages::kPage;

  // [a, b) of state.safetensors, inside one page, from iov (whose byte 0 is
  // at s): into that page's partial copy; stores the page once it is whole.
  void Assemble(std::span<const iovec> iov, uint64_t a, uint64_t b, uint64_t s) {
    SafetensorsPages* pages = pages_.get();
    const uint64_t page = a / kPage, start = page * kPage;
    const uint64_t want = std::min(kPage, st_bytes_ - start);  // the last page ends at EOF
    char whole[kPage];
    {
      std::lock_guard<std::mutex> l(pages->mu);
      std::unique_ptr<SafetensorsPages::Partial>& p = pages->partial[page];
      if (p == nullptr) p = std::make_unique<SafetensorsPages::Partial>();
      uint64_t at = a;
      for (const iovec& v : Slice(iov, a - s, b - a)) {
        std::memcpy(p->bytes + (at - start), v.iov_base, v.iov_len);
        for (uint64_t i = at - start; i < at - start + v.iov_len; ++i) p->have.set(i);
        at += v.iov_len;
      }
      if (p->have.count() < want) {
        while (pages->partial.size() > SafetensorsPages::kMaxPartialPages) pages->partial.erase(pages->partial.begin());
        return;
      }
      std::memcpy(whole, p->bytes, want);
      pages->partial.erase(page);
    }
    const iovec v{whole, want};
    if (Check(gate_->Store(st_ino_, start, std::span<const iovec>(&v, 1)))) {
      stats_->filled_bytes.fetch_add(want, std::memory_order_relaxed);
    }
  }
  // The bytes [from, from + n) of iov, as iovecs into it.
  static std::vector<iovec> Slice(std::span<const iovec> iov, uint64_t from, uint64_t n) {
    std::vector<iovec> out;
    for (const iovec& v : iov) {
      if (n == 0) break;
      if (from >= v.iov_len) {
        from -= v.iov_len;
        continue;
      }
      const uint64_t take = std::min<uint64_t>(n, v.iov_len - from);
      out.push_back({static_cast<char*>(v.iov_base) + from, take});
      from = 0;
      n -= take;
    }
    return out;
  }
  // rc of a store: false and the fill stops unless it is 0.
  bool Check(int rc) {
    if (rc == 0) return true;
    if (!stopped_.exchange(true, std::memory_order_relaxed)) {
      OPTSTATE_LOG_DEBUG("optstate-mount: state.safetensors fill from its bytes {}..{} stops: {}", base_,
                         base_ + field_bytes_, std::strerror(-rc));
    }
    return false;
  }

  const std::shared_ptr<PushGate> gate_;
  const std::shared_ptr<SafetensorsPages> pages_;  // this node's, shared with the other field files' fills
  ReadStats* const stats_;                          // the Context's
  const fuse_ino_t st_ino_;
  const uint64_t base_;         // where byte 0 of the field lies in state.safetensors
  const uint64_t field_bytes_;
  const uint64_t st_bytes_;     // state.safetensors' size
  const std::string* const header_;  // the layout's; the handle's reader holds the generation
  std::atomic<bool> stopped_{false};
};

struct FileHandle {
  std::unique_ptr<PinUse> pin_use;  // under latest/ pinned for the opener's process: keeps the pin
  std::shared_ptr<ChunkReader> reader;
  std::shared_ptr<SafetensorsFill> fill;  // a field file's, or null
  std::unique_ptr<CachePusher> pusher;
};

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

// fi->fh of an open file or directory: a heap-allocated shared reference,
// deleted by release/releasedir. Every other handler takes its own reference
// before it replies and holds it until it returns: the kernel may send
// RELEASE as soon as it has copied the reply to the last request of a handle,
// while that request's handler is still running (a read still unpins its
// chunk after fuse_reply_iov; the reply's iovecs point into the handle's
// buffers). Without this a release could free a ChunkReader under a read
// that then unpinned (a write) into freed memory, and ASan saw releasedir free
// a listing that readdir's writev still read: the likely cause of the daemon's
// SIGSEGV in fuse_send_msg under the kill loop and of a hung `cp -r`. Taking
// the reference is safe: the kernel sends no RELEASE while a request on the
// handle is unanswered.
//
// Every handle not yet released is also in OpenHandles, which frees the
// ones left at exit: the kernel sends RELEASE asynchronously after the last
// close, so it can come after the loop has stopped (a `cp -r` closes its
// last file just before the unmount), and LeakSanitizer saw that handle,
// its reader and its buffers left over in the ASan run of
// MountTest.WalksIntoASnapshotLookUpEachNameOnce (the daemon exited 1).
class OpenHandles {
 public:
  static OpenHandles& Get() {
    static OpenHandles* const h = new OpenHandles();  // never destroyed: handlers may run until exit
    return *h;
  }
  void Add(uint64_t fh, void (*free_fn)(uint64_t)) {
    std::lock_guard<std::mutex> l(mu_);
    live_.emplace(fh, free_fn);
  }
  void Remove(uint64_t fh) {
    std::lock_guard<std::mutex> l(mu_);
    live_.erase(fh);
  }
  // REQUIRES: no handler runs any more (the loop has ended).
  size_t FreeAll() {
    std::unordered_map<uint64_t, void (*)(uint64_t)> left;
    {
      std::lock_guard<std::mutex> l(mu_);
      left.swap(live_);
    }
    for (const auto& [fh, free_fn] : left) free_fn(fh);
    return left.size();
  }

 private:
  std::mutex mu_;
  std::unordered_map<uint64_t, void (*)(uint64_t)> live_;  // guarded by mu_
};

template <typename T>
uint64_t NewHandle(std::shared_ptr<T> h) {
  const uint64_t fh = reinterpret_cast<uint64_t>(new std::shared_ptr<T>(std::move(h)));
  OpenHandles::Get().Add(fh, [](uint64_t v) { delete reinterpret_cast<std::shared_ptr<T>*>(v); });
  return fh;
}
template <typename T>
std::shared_ptr<T> HandleOf(const struct fuse_file_info* fi) {
  if (fi == nullptr || fi->fh == 0) return nullptr;
  return *reinterpret_cast<const std::shared_ptr<T>*>(fi->fh);
}
template <typename T>
void DeleteHandle(struct fuse_file_info* fi) {
  OpenHandles::Get().Remove(fi->fh);
  delete reinterpret_cast<std::shared_ptr<T>*>(fi->fh);
  fi->fh = 0;
}

// Test hook (tests/mount): milliseconds a read handler waits after its reply
// before it unpins and returns, to widen the window in which the kernel sends
// RELEASE for the handle (OPTSTATE_MOUNT_TEST_AFTER_REPLY_MS; default 0).
uint32_t AfterReplyDelayMs() {
  static const uint32_t ms = [] {
    const char* e = std::getenv("OPTSTATE_MOUNT_TEST_AFTER_REPLY_MS");
    return e != nullptr ? static_cast<uint32_t>(std::strtoul(e, nullptr, 10)) : 0u;
  }();
  return ms;
}
void AfterReply() {
  if (uint32_t ms = AfterReplyDelayMs(); ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}
// Test hook (tests/mount): milliseconds a read handler waits before it
// serves a READ, so that the kernel holds that READ's pages locked and a
// CachePusher's store of them waits in the kernel
// (OPTSTATE_MOUNT_TEST_BEFORE_READ_MS; default 0).
void BeforeRead() {
  static const uint32_t ms = [] {
    const char* e = std::getenv("OPTSTATE_MOUNT_TEST_BEFORE_READ_MS");
    return e != nullptr ? static_cast<uint32_t>(std::strtoul(e, nullptr, 10)) : 0u;
  }();
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

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
// latest/'s requests (dev VM, 4000 files: 33k -> 43k lookups, 3.8-4.3 ->
// 4.3-4.5 s when that was measured). A store's name: a second, like its attributes, so a
// removed store's paths go within a second (a new one shows at once: a
// failed lookup is not cached); looked up again on every path walk, the
// store's name was three of a `cp -r`'s four LOOKUPs per file (dev VM, a
// 4000-file snapshot: 33k -> 11k lookups, 3.7-3.8 -> 3.3-3.4 s). Their
// attributes (mode 0555, an mtime) may be a second old: with
// default_permissions the kernel checks every directory of a path walk
// against its attributes, and with none cached it sent a GETATTR for the root,
// the store and snapshots/ on every walk (dev VM, `cp -r` of a snapshot: five
// of the nine requests of each path walk).
constexpr double kInGenerationTimeoutS = 3600.0;
constexpr double kOutsideAttrTimeoutS = 1.0;

// Node ids are stable across remounts: a path's hash, with the generation's
// number for nodes pinned to one. Outside generations they equal the st_ino
// that stat shows; inside, st_ino is TreeInodeOf (by tree rank, not pinned).
fuse_ino_t NodeIdOf(const std::string& path, uint64_t generation) {
  if (path == "/") return FUSE_ROOT_ID;
  if (generation == 0) return InodeOf(path);
  std::string key = path;
  key.push_back('\0');  // no path holds one
  key += std::to_string(generation);
  return InodeOf(key);
}

Status StaleNode(const std::string& what) { return ErrnoStatus(what, ESTALE); }

// The thread that sent req (0 when it is not in our pid namespace), which
// latest/ is resolved for (StoreTree).
uint32_t CallerTid(fuse_req_t req) {
  const struct fuse_ctx* x = fuse_req_ctx(req);
  return x != nullptr && x->pid > 0 ? static_cast<uint32_t>(x->pid) : 0;
}

// A copy of the kernel-held node ino (the root: path "/"), or ESTALE.
Result<NodeRef> RefOf(Context* c, fuse_ino_t ino) {
  NodeRef ref;
  if (ino == FUSE_ROOT_ID) {
    ref.path = "/";
    return ref;
  }
  std::lock_guard<std::mutex> l(c->mu);
  auto it = c->nodes.find(ino);
  if (it == c->nodes.end()) return StaleNode(fmt::format("node id {:#x} (not looked up)", ino));
  return it->second;
}

// The node a NodeRef names. Inside a generation it comes from that
// generation's layout (no store lock, no catch-up) while the tree still serves
// that Generation; else through the tree, and only while the path's generation
// directory still shows that generation: ESTALE once it does not (a shell
// whose working directory was latest/ before the commits that retired its
// generation).
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

// The node of a node id the kernel holds, and its path.
Result<Node> NodeOf(Context* c, fuse_ino_t ino, std::string* path, uint32_t caller_tid) {
  OPTSTATE_ASSIGN_OR_RETURN(NodeRef ref, RefOf(c, ino));
  *path = ref.path;
  return NodeFromRef(c, ref, caller_tid);
}

// Timeouts for a node the kernel gets from a lookup (see kInGenerationTimeoutS).
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

// blksize: st_blksize of files; 0 = the chunk size (MountOptions::st_blksize_bytes).
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

// Whether files bigger than one read-ahead request go through the page cache
// (then the kernel's read-ahead is widened for them).
bool BigFilesCached(const MountOptions& o) {
  return o.page_cache == MountOptions::PageCache::kMappable || o.page_cache == MountOptions::PageCache::kAll;
}

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

// The entry (node id, attributes, timeouts) of node n at path.
void EntryOf(const Context& c, const std::string& path, const Node& n, struct fuse_entry_param* e) {
  std::memset(e, 0, sizeof(*e));
  e->ino = NodeIdOf(path, n.gen != nullptr ? n.gen->generation() : 0);
  FillStat(path, n, c.tree->options().st_blksize_bytes, &e->attr);
  e->attr_timeout = AttrTimeoutS(n);
  e->entry_timeout = EntryTimeoutS(c, n);
}

// Counts one more kernel lookup of node id ino (n at path), as a LOOKUP reply
// or a READDIRPLUS entry gives the kernel. False (and nothing counted) if ino
// already names another path.
bool Hold(Context* c, fuse_ino_t ino, const std::string& path, const Node& n) {
  const uint64_t generation = n.gen != nullptr ? n.gen->generation() : 0;
  std::lock_guard<std::mutex> l(c->mu);
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

void Forget(Context* c, fuse_ino_t ino, uint64_t nlookup) {
  std::lock_guard<std::mutex> l(c->mu);
  auto it = c->nodes.find(ino);
  if (it == c->nodes.end()) return;
  if (it->second.nlookup <= nlookup) {
    c->nodes.erase(it);
    c->safetensors_pages.erase(ino);
  } else {
    it->second.nlookup -= nlookup;
  }
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

// Whether reads of `f` go through the page cache (MountOptions::page_cache).
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

// The fill of state.safetensors from field file n (at `path`), or null: off,
// not a field file, state.safetensors not read through the page cache, or its
// node not held by the kernel.
std::shared_ptr<SafetensorsFill> MakeSafetensorsFill(Context* c, const std::string& path, const Node& n) {
  const MountOptions& o = c->tree->options();
  if (!FillsSafetensors(o) || n.gen == nullptr || n.file->kind != vfs::CheckpointFileKind::kField) return nullptr;
  const vfs::CheckpointLayout& layout = *n.gen->layout;
  const vfs::CheckpointFile* st = layout.FindFile(vfs::kSafetensorsFileName);
  std::optional<uint64_t> base = layout.SafetensorsOffsetOf(*n.file);
  if (st == nullptr || !CachedFile(o, *st) || !base.has_value() || path.size() <= n.rel.size()) return nullptr;
  const std::string dir = path.substr(0, path.size() - n.rel.size() - 1);
  const fuse_ino_t st_ino = NodeIdOf(JoinPath(dir, vfs::kSafetensorsFileName), n.gen->generation());
  std::shared_ptr<SafetensorsPages> pages;
  {
    std::lock_guard<std::mutex> l(c->mu);
    if (!c->nodes.count(st_ino)) return nullptr;  // the kernel could not take the stores
    std::shared_ptr<SafetensorsPages>& p = c->safetensors_pages[st_ino];
    if (p == nullptr) p = std::make_shared<SafetensorsPages>();
    pages = p;
  }
  return std::make_shared<SafetensorsFill>(c->push_gate, std::move(pages), &c->stats, st_ino, *base,
                                           n.file->size_bytes, st->size_bytes, &layout.safetensors_header());
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
  BeforeRead();
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
                         AfterReply();
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

// Whether the kernel holds the first and last pages of file f of g in its
// page cache (Prefetcher::HeldFn), asked through the node a path walk into g
// gives it.
bool KernelHolds(Context* c, const Generation& g, const vfs::CheckpointFile& f) {
  if (!CachedFile(c->tree->options(), f) || f.size_bytes == 0 || c->push_gate == nullptr) return false;
  const fuse_ino_t ino = NodeIdOf("/" + g.store_name + "/" + g.dir_label + "/" + f.path, g.generation());
  {
    std::lock_guard<std::mutex> l(c->mu);
    if (!c->nodes.count(ino)) return false;  // not a node the kernel holds: no pages either
  }
  const uint64_t last_page = (f.size_bytes - 1) / CachePusher::kPageBytes * CachePusher::kPageBytes;
  return c->push_gate->Cached(ino, 0) && (last_page == 0 || c->push_gate->Cached(ino, last_page));
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

// The mount on top at `real_path` (a realpath), per /proc/self/mountinfo.
struct MountEntry {
  std::string dev;     // "MAJOR:MINOR"
  std::string fstype;  // "fuse.optstate"
  std::string source;
};
std::optional<MountEntry> TopMountAt(const std::string& real_path) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  std::optional<MountEntry> top;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string id, parent, dev, root, mp;
    ls >> id >> parent >> dev >> root >> mp;
    if (UnescapeMountinfo(mp) != real_path) continue;
    MountEntry e;
    e.dev = dev;
    std::string tok;
    while (ls >> tok && tok != "-") {
    }
    ls >> e.fstype >> e.source;
    top = std::move(e);  // later lines are mounted over earlier ones
  }
  return top;
}

// The device number ("MAJOR:MINOR") of the mount just made at `mountpoint`,
// or "". From mountinfo, not stat(): a stat of the mount would wait for this
// daemon, which does not serve yet.
std::string MountedDevice(const std::string& mountpoint) {
  char real[PATH_MAX];
  if (::realpath(mountpoint.c_str(), real) == nullptr) return "";
  const std::optional<MountEntry> m = TopMountAt(real);
  return m ? m->dev : std::string();
}

// The mount's backing device info (/sys/class/bdi/MAJOR:MINOR) gets
// read_ahead_kb: FUSE_INIT can only lower the kernel's 128 KiB default.
void SetKernelReadahead(const std::string& dev, uint64_t bytes) {
  if (dev.empty()) return;
  const std::string path = "/sys/class/bdi/" + dev + "/read_ahead_kb";
  std::ofstream out(path);
  out << (bytes >> 10) << "\n";
  out.close();
  if (!out) {
    OPTSTATE_LOG_WARN("optstate-mount: cannot set {} to {} (kernel read-ahead stays at its default): {}", path,
                      bytes >> 10, std::strerror(errno));
  }
}

// The connection's abort file in fusectl (/sys/fs/fuse/connections/N/abort,
// N the minor of the mount's device `dev`), or "" when there is none: fusectl
// not mounted and not mountable (not root) here.
std::string ConnectionAbortPath(const std::string& dev) {
  if (dev.rfind("0:", 0) != 0) return "";
  constexpr const char* kFusectl = "/sys/fs/fuse/connections";
  const std::string path = std::string(kFusectl) + "/" + dev.substr(2) + "/abort";
  if (::access(path.c_str(), W_OK) != 0 && ::access(kFusectl, F_OK) == 0) {
    // systemd mounts fusectl; a bare system or a container may not have.
    (void)::mount("fusectl", kFusectl, "fusectl", 0, nullptr);
  }
  return ::access(path.c_str(), W_OK) == 0 ? path : "";
}

// Async-signal-safe: writes "1" to an abort file (fails every request of the
// connection: waiting readers get ENOTCONN, pushes return).
void AbortConnection(const char* abort_path) {
  if (abort_path == nullptr || abort_path[0] == '\0') return;
  int fd = ::open(abort_path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)!::write(fd, "1", 1);
  ::close(fd);
}

// The loop has ended: answer what the kernel still sends (READs that stores
// in flight wait for) until none is in flight, for up to `wait`; then abort
// the connection if one still waits. True once none is in flight.
bool DrainPushes(struct fuse_session* se, PushGate* gate, const std::string& abort_path,
                 std::chrono::milliseconds wait) {
  gate->Refuse();
  const auto deadline = std::chrono::steady_clock::now() + wait;
  struct fuse_buf buf;
  std::memset(&buf, 0, sizeof(buf));
  while (gate->InFlight() > 0 && std::chrono::steady_clock::now() < deadline) {
    struct pollfd p = {fuse_session_fd(se), POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    const int n = fuse_session_receive_buf(se, &buf);
    if (n > 0) {
      fuse_session_process_buf(se, &buf);
    } else if (n != -EINTR && n != -EAGAIN) {
      break;  // the connection is gone: its requests failed, the stores return
    }
  }
  std::free(buf.mem);
  if (gate->InFlight() == 0) return true;
  OPTSTATE_LOG_WARN("optstate-mount: a page-cache push still waits for the kernel; aborting the connection ({})",
                    abort_path.empty() ? "no fusectl: cannot" : abort_path);
  AbortConnection(abort_path.c_str());
  for (int i = 0; i < 100 && gate->InFlight() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return gate->InFlight() == 0;
}

void NoOpSignal(int) {}

// Ends the latest/ pins of processes that exited or went idle
// (StoreTree::SweepPins) once a second, so that a finished copier's
// generation goes back to the writer's GC without waiting for another lookup.
class PinSweeper {
 public:
  explicit PinSweeper(StoreTree* tree) : tree_(tree), thread_([this] { Run(); }) {}
  ~PinSweeper() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> l(mu_);
    while (!cv_.wait_for(l, std::chrono::seconds(1), [&] { return stop_; })) {
      l.unlock();
      tree_->SweepPins();
      l.lock();
    }
  }

  StoreTree* const tree_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;  // last: starts once the members above exist
};

// A process that outlives an unclean death of this daemon (SIGKILL, a crash)
// to abort its connection. Without it a push that waits in the kernel for the
// pages of a READ keeps the dead daemon a zombie that holds /dev/fuse open:
// no one answers that READ, so the mount hangs instead of failing with
// ENOTCONN, and it cannot be mounted again until someone aborts it by hand
// (seen: SIGTERM during a `cp -r` before exits drained, `kill -9` likewise).
// PR_SET_PDEATHSIG tells it when the thread that forked it (the main
// thread) is gone; a byte on the pipe (GuardianDone) means a clean exit.
struct Guardian {
  int fd = -1;  // the pipe's write end
  pid_t pid = -1;
};
Guardian StartGuardian(struct fuse_session* se, const std::string& abort_path) {
  if (abort_path.empty()) return {};
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return {};
  const pid_t parent = ::getpid();
  const pid_t g = ::fork();
  if (g < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return {};
  }
  if (g == 0) {
    // The child: async-signal-safe calls only. No descriptor but the pipe's
    // read end: a copy of /dev/fuse here would keep the connection alive.
    int keep = fds[0];
    ::close(fuse_session_fd(se));
    if (keep != 3) {
      ::dup2(keep, 3);
      keep = 3;
    }
    if (::close_range(4, ~0u, 0) != 0) {
      for (int fd = 4; fd < 65536; ++fd) ::close(fd);
    }
    // SIGUSR1 comes only as the parent-death signal (no SA_RESTART: the read
    // below returns EINTR). The stop signals are the daemon's business (a
    // service manager sends them to the whole group): ignored. getppid()
    // does not tell: the main thread's children go to another thread of the
    // same process, the one stuck in the kernel.
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = NoOpSignal;
    ::sigaction(SIGUSR1, &sa, nullptr);
    sa.sa_handler = SIG_IGN;
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGHUP, &sa, nullptr);
    ::prctl(PR_SET_PDEATHSIG, SIGUSR1);
    char b = 0;
    ssize_t n = -1;
    if (::getppid() == parent) {  // else it died before the prctl
      do {
        n = ::read(keep, &b, 1);
      } while (n < 0 && errno != EINTR);
    }
    if (n == 1) ::_exit(0);  // a clean exit: nothing to abort
    if (n < 0) {
      // The main thread is gone; a clean exit's byte may be there already.
      const int fl = ::fcntl(keep, F_GETFL);
      ::fcntl(keep, F_SETFL, fl | O_NONBLOCK);
      if (::read(keep, &b, 1) == 1) ::_exit(0);
    }
    AbortConnection(abort_path.c_str());
    ::_exit(0);
  }
  ::close(fds[0]);
  return {fds[1], g};
}

// Tells the guardian this exit is clean, and reaps it.
void GuardianDone(const Guardian& g) {
  if (g.fd < 0) return;
  (void)!::write(g.fd, "1", 1);
  ::close(g.fd);
  int st;
  (void)::waitpid(g.pid, &st, 0);
}

}  // namespace

Status CheckMountpoint(const std::string& mountpoint) {
  auto dead = [&] {
    return Busy(fmt::format(
        "mountpoint {} is a dead FUSE mount (its daemon exited); run `fusermount3 -u {}` and mount again",
        mountpoint, mountpoint));
  };
  struct stat st;
  if (::stat(mountpoint.c_str(), &st) != 0) {
    int e = errno;
    if (e == ENOTCONN) return dead();
    return ErrnoStatus("mountpoint " + mountpoint, e);
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument("mountpoint " + mountpoint + " is not a directory");
  char real[PATH_MAX];
  if (::realpath(mountpoint.c_str(), real) == nullptr) return ErrnoStatus("realpath " + mountpoint, errno);
  const std::optional<MountEntry> m = TopMountAt(real);
  if (!m) return Status();
  // A dead FUSE daemon's mount can still answer stat from the kernel's
  // attribute cache (the root's attributes are cached for a second); statfs
  // always goes to the daemon.
  struct statvfs sv;
  if (::statvfs(mountpoint.c_str(), &sv) != 0 && errno == ENOTCONN) return dead();
  return Busy(fmt::format(
      "mountpoint {} is busy: {} is mounted there (source {}); unmount it first (`fusermount3 -u {}`)",
      mountpoint, m->fstype, m->source, mountpoint));
}

Status CheckStoreRoot(const std::string& store_root) {
  struct stat rs;
  if (::stat(store_root.c_str(), &rs) != 0 || !S_ISDIR(rs.st_mode)) {
    return InvalidArgument(fmt::format("STORE_ROOT {} is not a directory", store_root));
  }
  struct stat id;
  if (::stat((store_root + "/IDENTITY").c_str(), &id) == 0 && S_ISREG(id.st_mode)) {
    const size_t slash = store_root.find_last_of('/');
    const std::string parent = slash == std::string::npos || slash == 0 ? "/" : store_root.substr(0, slash);
    return InvalidArgument(fmt::format(
        "{} is a store; mount its parent ({}), which serves every store in it as MOUNTPOINT/<store>/", store_root,
        parent));
  }
  return Status();
}

std::optional<std::string> HiddenByMountWarning(const std::string& mountpoint) {
  DIR* d = ::opendir(mountpoint.c_str());
  if (d == nullptr) return std::nullopt;
  size_t n = 0;
  std::string first;
  while (dirent* de = ::readdir(d)) {
    const std::string name = de->d_name;
    if (name == "." || name == "..") continue;
    if (n++ == 0) first = name;
  }
  ::closedir(d);
  if (n == 0) return std::nullopt;
  return fmt::format("mountpoint {} is not empty ({} entr{}, e.g. '{}'): hidden while the mount is up", mountpoint,
                     n, n == 1 ? "y" : "ies", first);
}

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
