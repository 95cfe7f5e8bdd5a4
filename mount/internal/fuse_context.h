// The state a mount's FUSE operations share (Context), the node ids the
// kernel holds and the files it has open: the pieces of mount/fuse_mount.cc's
// daemon, each defined in the file of its idea. Internal to mount/.
#pragma once

#define FUSE_USE_VERSION 312
#include <fuse3/fuse_lowlevel.h>

#include <sys/stat.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "mount/cache_pusher.h"
#include "mount/chunk_reader.h"
#include "mount/prefetcher.h"
#include "mount/store_tree.h"
#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"

namespace optstate::mount::internal {

inline constexpr uint32_t kMaxReadBytes = 1u << 20;

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

class PushGate;
class SafetensorsFill;

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
  Mutex mu;
  std::unordered_map<fuse_ino_t, NodeRef> nodes GUARDED_BY(mu);
  // What the fills of each state.safetensors node the kernel holds share (an
  // entry goes when the node does).
  std::unordered_map<fuse_ino_t, std::shared_ptr<struct SafetensorsPages>> safetensors_pages GUARDED_BY(mu);
  std::shared_ptr<PushGate> push_gate;
};

struct FileHandle {
  std::unique_ptr<PinUse> pin_use;  // under latest/ pinned for the opener's process: keeps the pin
  std::shared_ptr<ChunkReader> reader;
  std::shared_ptr<SafetensorsFill> fill;  // a field file's, or null
  std::unique_ptr<CachePusher> pusher;
};

// --- node ids, attributes, what the kernel may cache (fuse_nodes.cc) -------

// Node ids are stable across remounts: a path's hash, with the generation's
// number for nodes pinned to one. Outside generations they equal the st_ino
// that stat shows; inside, st_ino is TreeInodeOf (by tree rank, not pinned).
fuse_ino_t NodeIdOf(const std::string& path, uint64_t generation);

Status StaleNode(const std::string& what);

// The thread that sent req (0 when it is not in our pid namespace), which
// latest/ is resolved for (StoreTree).
uint32_t CallerTid(fuse_req_t req);

// A copy of the kernel-held node ino (the root: path "/"), or ESTALE.
Result<NodeRef> RefOf(Context* c, fuse_ino_t ino);

// The node a NodeRef names. Inside a generation it comes from that
// generation's layout (no store lock, no catch-up) while the tree still serves
// that Generation; else through the tree, and only while the path's generation
// directory still shows that generation: ESTALE once it does not (a shell
// whose working directory was latest/ before the commits that retired its
// generation).
Result<Node> NodeFromRef(Context* c, const NodeRef& ref, uint32_t caller_tid);

// The node of a node id the kernel holds, and its path.
Result<Node> NodeOf(Context* c, fuse_ino_t ino, std::string* path, uint32_t caller_tid);

// Timeouts for a node the kernel gets from a lookup (see kInGenerationTimeoutS).
double EntryTimeoutS(const Context& c, const Node& n);

double AttrTimeoutS(const Node& n);

// blksize: st_blksize of files; 0 = the chunk size (MountOptions::st_blksize_bytes).
void FillStat(const std::string& path, const Node& n, uint64_t blksize, struct stat* st);

std::string JoinPath(const std::string& dir, const char* name);

// Whether files bigger than one read-ahead request go through the page cache
// (then the kernel's read-ahead is widened for them).
bool BigFilesCached(const MountOptions& o);

// The entry (node id, attributes, timeouts) of node n at path.
void EntryOf(const Context& c, const std::string& path, const Node& n, struct fuse_entry_param* e);

// Counts one more kernel lookup of node id ino (n at path), as a LOOKUP reply
// or a READDIRPLUS entry gives the kernel. False (and nothing counted) if ino
// already names another path.
bool Hold(Context* c, fuse_ino_t ino, const std::string& path, const Node& n);

void Forget(Context* c, fuse_ino_t ino, uint64_t nlookup);

// Whether reads of `f` go through the page cache (MountOptions::page_cache).
bool CachedFile(const MountOptions& o, const vfs::CheckpointFile& f);

// Whether the kernel holds the first and last pages of file f of g in its
// page cache (Prefetcher::HeldFn), asked through the node a path walk into g
// gives it.
bool KernelHolds(Context* c, const Generation& g, const vfs::CheckpointFile& f);

// The FUSE operations of the mount (fuse_ops.cc): read-only, low-level API.
struct fuse_lowlevel_ops MakeOps();

}  // namespace optstate::mount::internal
