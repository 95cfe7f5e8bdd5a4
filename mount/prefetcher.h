// Prefetcher: opens a generation's files ahead of a reader that walks them in
// tree order (`cp -r`, tar, rsync), so their first chunks are loading while
// the current file is copied.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "mount/chunk_reader.h"

namespace optstate::mount {

// Opens files before their reader does. `cp -r`, tar and rsync read a
// generation's files one after another in tree order (Generation::
// files_in_tree_order; cp through TreeInodeOf), and each new file used to cost
// its first chunk's disk latency on top of the FUSE round trips: on a
// realistic snapshot (hundreds of tensors, many of a few KiB) the disk idled
// through most of a `cp -r`. Once opens go through a generation in tree order (a
// file opened right after its predecessor with chunks, or one the Prefetcher
// had opened), the Prefetcher's thread opens ChunkReaders for the next
// opts.prefetch_files files with chunks, so their first chunks are loading
// while the current one is copied, and OpOpen takes such a parked reader
// instead of opening its own. A process that opens files in any other order
// (one tensor here, one there) costs no extra I/O. A file whose pages the
// kernel still holds (HeldFn: a second copy) is parked without loading.
// Parked readers are bounded (twice prefetch_files; their chunk buffers come
// from the shared pool like any reader's) and closed after kIdle unused.
// Thread-safe.
class Prefetcher {
 public:
  static constexpr std::chrono::milliseconds kIdle{2000};

  // Whether the kernel's page cache holds a file of a generation (its first
  // and last pages): its reader is opened without loading, since cp will
  // read it from there (a second copy of a snapshot used to read every
  // file's first chunks off the disk again). Called on the Prefetcher's
  // thread, without its lock.
  using HeldFn = std::function<bool(const Generation&, const vfs::CheckpointFile&)>;

  // opts (prefetch_files > 0), pool and stats as for ChunkReader::Open; pool
  // and stats must outlive this. `held` may be null (every reader loads).
  Prefetcher(const MountOptions& opts, ChunkBufferPool* pool, ReadStats* stats, HeldFn held = nullptr);
  ~Prefetcher();  // closes every parked reader
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The parked reader of `file` in `gen` (the same Generation object), removed
  // from the parked set, or null. Waits while the thread is opening it.
  std::unique_ptr<ChunkReader> Take(const Generation* gen, const vfs::CheckpointFile* file) EXCLUDES(mu_);
  // `file` of gen was just opened (`taken`: its reader came from Take): when
  // that continues a tree-order walk, park readers for the files after it.
  void Opened(std::shared_ptr<const Generation> gen, const vfs::CheckpointFile* file, bool taken) EXCLUDES(mu_);
  // Readers parked now (for tests).
  size_t parked() const EXCLUDES(mu_);

 private:
  struct Parked {
    std::shared_ptr<const Generation> gen;
    const vfs::CheckpointFile* file = nullptr;
    std::unique_ptr<ChunkReader> reader;
    std::chrono::steady_clock::time_point at;
  };
  void Loop() EXCLUDES(mu_);

  const MountOptions opts_;
  ChunkBufferPool* const pool_;
  ReadStats* const stats_;
  const HeldFn held_;
  mutable Mutex mu_;
  CondVar cv_;  // with mu_: stop_, want_ or opening_ changed
  bool stop_ GUARDED_BY(mu_) = false;
  std::deque<Parked> parked_ GUARDED_BY(mu_);  // oldest first
  // The previous Opened (what a tree-order walk continues from).
  const Generation* last_gen_ GUARDED_BY(mu_) = nullptr;
  uint32_t last_pos_ GUARDED_BY(mu_) = 0;
  // The latest Opened of a walk: the thread parks the files after it.
  std::shared_ptr<const Generation> want_gen_ GUARDED_BY(mu_);
  uint32_t want_after_ GUARDED_BY(mu_) = 0;
  bool want_ GUARDED_BY(mu_) = false;
  // Being opened by the thread right now (Take waits for it).
  const vfs::CheckpointFile* opening_ GUARDED_BY(mu_) = nullptr;
  std::thread thread_;
};

}  // namespace optstate::mount
