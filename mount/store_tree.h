// StoreTree: the namespace optstate-mount serves, without FUSE in it.
//
//   /                                   every store under STORE_ROOT (a directory
//                                       holding an IDENTITY file), sorted
//   /<store>/latest/...                 the newest committed generation, as the
//                                       calling process first saw it (below)
//   /<store>/generations/<g>/...        each generation the store retains
//   /<store>/snapshots/<snapshot>/...   each snapshot (name escaped, vfs/checkpoint.h)
// and under each generation directory the files of a CheckpointLayout.
//
// Stores are opened with Store::OpenReadOnly (never the store's lock) when first
// looked up and dropped when their IDENTITY disappears. Resolving a path at or
// above a generation directory catches the store up with its writer (at most
// once per catchup_interval_ms) and, if latest moved, builds a new Generation
// for it; a Generation (view + layout) is shared by every open file that uses
// it, so a file opened under latest/ keeps reading the generation it was opened
// on (the view's lease keeps its extents from the writer's GC).
//
// latest/ is per process. The first resolution of latest/ by a process (the
// caller's thread id, mapped to its thread group) pins the newest generation
// for that process (a LatestPin holds its Generation, and so its lease); every
// later resolution by the same process gets that generation again, so a
// copier that walks latest/ by path for each file (cp -r, cp -a,
// shutil.copytree) copies one generation. A pin ends when its process exits
// (pid and start time, so a reused pid is another process) or when it has no
// open file or directory under it and no request for
// MountOptions::latest_pin_idle_ms; the process's next resolution then pins
// the newest generation again. Callers that are not a process we can see
// (thread id 0) get the newest generation, unpinned.
//
// Thread-safety: all methods are thread-safe. Lock order: tree mu_ before a
// StoreEntry's mu before its pins_mu; ids_mu_ is taken alone.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "vfs/checkpoint.h"
#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "vfs/store.h"

namespace optstate::mount {

struct MountOptions {
  std::string store_root;             // absolute path of STORE_ROOT
  // Read-ahead per open file, in whole chunks' worth of bytes (the queue depth
  // of its ChunkIo). Default 8: 64 MiB in flight at 8 MiB chunks, at least the
  // 32 MiB of the fio reference (1 MiB x QD 32); the window ramps up from one
  // chunk, so random readers do not pay for the depth.
  uint32_t readahead_chunks = 8;
  // Most bytes of chunk buffers (read-ahead) over all open files. Default
  // 1 GiB: 14 files read at full depth at once.
  uint64_t buffer_pool_bytes = 1ull << 30;
  // Each chunk read goes out as parallel SQEs of at most this many bytes
  // (vfs::ChunkIoOptions::max_sqe_bytes); 0 = one SQE per chunk (default).
  uint64_t max_sqe_bytes = 0;
  // Files opened ahead of the reader, in tree order (mount/prefetcher.h): at
  // most prefetch_files of them, and no more once the files opened ahead load
  // prefetch_bytes (each loads its first two chunks at most); prefetch_files
  // 0 = none. Defaults 32 files, 32 MiB. Why bytes: a trainer's snapshot puts
  // runs of a dozen files of a few KiB (norms, biases) between tensors of
  // several chunks, so a count of files alone either holds only KiB ahead or
  // loads far more than the copy needs (docs/BENCHMARKS.md, "Defaults").
  uint32_t prefetch_files = 32;
  uint64_t prefetch_bytes = 32ull << 20;
  // st_blksize of the generation files, the size cp and other readers buffer
  // by; 0 = the store's chunk size. Default 1 MiB: GNU cp allocates a buffer
  // of st_blksize for every file it copies, and at 8 MiB that is a fresh mmap,
  // 2048 page faults and a munmap per file (docs/BENCHMARKS.md, "Defaults").
  uint64_t st_blksize_bytes = 1ull << 20;
  // Which files are read through the kernel's page cache (kept across opens,
  // since a node's bytes never change) instead of direct_io. Cached files can
  // be mmap'd (direct_io ones fail with ENODEV), which is how the safetensors
  // library, numpy.memmap and Python's mmap open a file, and a CachePusher
  // fills a big cached file's pages ahead of a sequential reader, which makes
  // cached faster than direct_io for copies too. Small files are cached in
  // every mode but `none`: a direct_io read(2) pins the whole buffer the
  // reader passes and the kernel sends one more READ at EOF. Default kAll
  // (--page-cache none|small|mappable|all); `small` suits a VM where every
  // fresh page costs a hypervisor fault (docs/BENCHMARKS.md, "Defaults").
  enum class PageCache : uint8_t {
    kNone,      // every file direct_io
    kSmall,     // files of at most kSmallFileBytes cached (mmap-able), the others direct_io
    kMappable,  // ... and state.safetensors and manifest.json
    kAll,       // every file cached
  };
  // One request of the kernel's default read-ahead (128 KiB) reads such a
  // file whole.
  static constexpr uint64_t kSmallFileBytes = 128ull << 10;
  PageCache page_cache = PageCache::kAll;
  // The kernel's read-ahead for the mount when big files are cached (its
  // bdi's read_ahead_kb, set after mounting; needs root); 0 = the kernel's
  // own (128 KiB). Default 0: the CachePusher fills the page cache ahead of a
  // sequential reader, and a wider kernel read-ahead only sends READs for
  // pages the push is about to store.
  uint64_t kernel_readahead_bytes = 0;
  // Fill state.safetensors' page cache from the field files' bytes as the
  // kernel gets them (mount/safetensors_fill.cc), so that a copy of a
  // generation directory reads each chunk off the disk once: tensors/ comes
  // before state.safetensors in its listing, and state.safetensors is then
  // read from memory. Costs a second copy into the page cache (memory, not
  // disk) of what the field files' readers get, also when nobody reads
  // state.safetensors afterwards, and only once the kernel holds its node (a
  // listing of the generation directory). Default kAuto: on with 8 or more
  // cores, off on fewer, where the second copy competes with the reader for
  // the cores (FillsSafetensors; --fill-safetensors, --no-fill-safetensors;
  // docs/BENCHMARKS.md, "Defaults").
  enum class Fill : uint8_t { kAuto, kOn, kOff };
  Fill fill_safetensors = Fill::kAuto;
  // Resolving a path CatchUp()s a store at most this often. Default 20 ms.
  uint32_t catchup_interval_ms = 20;
  // A path inside a snapshot already held (immutable while it exists) is
  // resolved without a catch-up when the last one is at most this old, so a
  // released snapshot's paths go at most this long after its release.
  // Default 1000 ms: a catch-up under the store's lock was most of what
  // `stat` and `open` cost during a `cp -r` of a snapshot.
  uint32_t snapshot_recheck_ms = 1000;
  // A process's pin of latest/ (StoreTree) ends once it has no file or
  // directory open under it and has sent no request under it for this long.
  // Default 60000 ms (--latest-pin-s). Why: long enough that a copier that
  // stalls between two files (a slow destination, rsync's sender waiting for
  // its receiver) still finishes on one generation; short enough that a
  // long-running process that looks at latest/ now and then moves on.
  uint32_t latest_pin_idle_ms = 60000;
};

// One generation as files. Immutable; shared by open file handles.
struct Generation {
  // Keeps the store (and its index) open while this generation is in use, even
  // after the store vanished from the tree. Declared first: destroyed last.
  std::shared_ptr<void> store_keepalive;
  std::string store_name;
  std::string dir_label;              // "latest", "generations/<g>" or "snapshots/<name>"
  std::unique_ptr<vfs::GenerationView> view;
  std::unique_ptr<vfs::CheckpointLayout> layout;  // refers to *view
  // Tree order (IndexTree): every path inside the generation directory, dirs
  // and files, depth first in listing order (GenerationDirNames): the order
  // in which `ls -R`, tar and (through TreeInodeOf) `cp -r` visit it.
  std::unordered_map<std::string, uint32_t> tree_rank;  // rel path -> 0, 1, ...
  std::vector<const vfs::CheckpointFile*> files_in_tree_order;
  std::unordered_map<const vfs::CheckpointFile*, uint32_t> file_position;  // in files_in_tree_order
  uint64_t inode_base = 0;  // TreeInodeOf: from the generation directory's path
  uint64_t generation() const { return view->info().generation; }
};

// Fills the tree-order fields of g from g->layout (store_name, dir_label set).
Status IndexTree(Generation* g);

enum class NodeKind : uint8_t {
  kRoot,          // /
  kStore,         // /<store>
  kSnapshotsDir,  // /<store>/snapshots
  kGenerationsDir,  // /<store>/generations
  kGenDir,        // a directory inside a generation (rel "" = the generation dir)
  kGenFile,       // a file inside a generation
};

struct Node {
  NodeKind kind = NodeKind::kRoot;
  std::string store;
  std::shared_ptr<const Generation> gen;     // kGenDir, kGenFile
  std::string rel;                           // path inside the generation
  const vfs::CheckpointFile* file = nullptr; // kGenFile (owned by gen->layout)
  int64_t mtime_unix_ms = 0;
};

// A process's hold on the generation latest/ showed it first (StoreTree).
// Shared with the file and directory handles it opens under that generation
// (PinUse), which keep it from idling out and mark it used.
struct LatestPin {
  std::shared_ptr<const Generation> gen;
  std::atomic<int64_t> last_use_ms{0};  // steady clock
  std::atomic<int32_t> open_handles{0};
  void Touch();
};

// An open handle's use of a pin: counted while it lives.
class PinUse {
 public:
  explicit PinUse(std::shared_ptr<LatestPin> pin);
  ~PinUse();
  PinUse(const PinUse&) = delete;
  PinUse& operator=(const PinUse&) = delete;
  void Touch() { pin_->Touch(); }

 private:
  const std::shared_ptr<LatestPin> pin_;
};

class StoreTree {
 public:
  explicit StoreTree(MountOptions opts);
  ~StoreTree();

  // Resolves an absolute path ("/", "/s", "/s/latest/tensors/x/main") for the
  // thread caller_tid (a FUSE request's pid; 0 = unknown: latest/ is then the
  // newest generation, unpinned). NotFound for anything that does not exist.
  Result<Node> Resolve(std::string_view path, uint32_t caller_tid = 0);
  // The pin of caller_tid's process on `gen`, if latest/ is pinned to gen for
  // it (a file or directory it opens there then counts as a use), else null.
  std::shared_ptr<LatestPin> PinOf(const Generation& gen, uint32_t caller_tid);
  // Ends the pins whose process exited or that idled out, and drops the
  // generations/<g> directories unused for as long (their generations go once
  // no open file uses them). Returns how many pins are left.
  size_t SweepPins();
  // The node at `rel` inside generation `gen` (rel "" = its directory), from
  // the generation's layout alone: no store lock, no catch-up. `path` (the
  // path the user asked for) names it in errors. NotFound if there is none.
  static Result<Node> ResolveIn(std::shared_ptr<const Generation> gen, std::string_view rel,
                                std::string_view path);
  // Sorted child names of a directory node (generations/: by number).
  Result<std::vector<std::string>> List(const Node& dir);

  const MountOptions& options() const { return opts_; }

  struct StoreEntry;  // defined in store_tree.cc

 private:
  Result<std::shared_ptr<StoreEntry>> GetStore(const std::string& name);
  Status Refresh(StoreEntry* e, bool force);
  Result<std::shared_ptr<const Generation>> Latest(StoreEntry* e, uint32_t caller_tid);
  Result<std::shared_ptr<const Generation>> Snapshot(StoreEntry* e, const std::string& name);
  Result<std::shared_ptr<const Generation>> Retained(StoreEntry* e, const std::string& name);

  // A process as pins know it: its thread group id and start time (so that a
  // reused pid is another process).
  struct ProcessKey {
    uint32_t tgid = 0;
    uint64_t start_ticks = 0;
    auto operator<=>(const ProcessKey&) const = default;
  };
  // caller_tid's process, from /proc (cached for a second), or none.
  std::optional<ProcessKey> Identify(uint32_t caller_tid);
  bool PinExpired(const ProcessKey& who, const LatestPin& pin, int64_t now_ms) const;

  const MountOptions opts_;
  Mutex mu_;  // taken before a StoreEntry's locks
  std::map<std::string, std::shared_ptr<StoreEntry>> stores_ GUARDED_BY(mu_);
  struct KnownThread {
    ProcessKey process;
    int64_t checked_ms = 0;
  };
  Mutex ids_mu_;
  std::unordered_map<uint32_t, KnownThread> threads_ GUARDED_BY(ids_mu_);  // tid -> its process
};

// Milliseconds of the steady clock (LatestPin's times).
int64_t SteadyNowMs();

// Whether the mount fills state.safetensors' page cache from the field files'
// reads (MountOptions::fill_safetensors, kAuto resolved by core count).
bool FillsSafetensors(const MountOptions& o);

// The names in directory `rel` of a generation, in listing (and tree) order:
// siblings by name, except that state.safetensors comes last in the
// generation directory, after tensors/. A copy of the directory then reads
// every field file before state.safetensors, whose pages the mount fills from
// the field files' bytes as they are read (MountOptions::fill_safetensors), so
// its bytes come off the disk once, not twice.
Result<std::vector<std::string>> GenerationDirNames(const vfs::CheckpointLayout& layout, std::string_view rel);

// Stable inode number of a path (XXH3, never 0 or 1).
uint64_t InodeOf(std::string_view path);

// st_ino of `path`, which is `rel` (non-empty) inside generation g: the
// generation directory's hash in the high 40 bits, the tree rank + 1 in the
// low 24, so that a directory's entries sorted by inode number are in
// listing order (GenerationDirNames). GNU cp -r copies a directory's entries
// sorted by inode number; with path hashes it visited files in an order no
// read-ahead could predict, with these it visits them in tree order, which the
// mount's Prefetcher follows.
// InodeOf(path) when rel is empty or not in the tree.
uint64_t TreeInodeOf(const Generation& g, std::string_view rel, std::string_view path);

}  // namespace optstate::mount
