// Prefetcher: opens files before their reader does. `cp -r`, tar and rsync read a
// generation's files one after another in tree order (Generation::
// files_in_tree_order; cp through TreeInodeOf), and each new file used to cost
// its first chunk's disk latency on top of the FUSE round trips: on a
// realistic snapshot (hundreds of tensors, many of a few KiB) the disk was
// busy 7% of a `cp -r`. Once opens go through a generation in tree order (a
// file opened right after its predecessor with chunks, or one the Prefetcher
// had opened), the Prefetcher's thread opens ChunkReaders for the next
// opts.prefetch_files files with chunks, so their first chunks are loading
// while the current one is copied, and OpOpen takes such a parked reader
// instead of opening its own. A process that opens files in any other order
// (one tensor here, one there) costs no extra I/O. A file whose pages the
// kernel still holds (HeldFn: a second copy) is parked without loading; one
// that loads is also pushed into the kernel's page cache as its chunks load
// (PushFn, CachePusher::StartAhead: the bytes its open loads, its first two
// chunks), so the walk reads it from memory instead of waiting for its first
// READ; OpOpen takes the pusher with the reader.
// Parked readers are bounded (twice prefetch_files; their chunk buffers come
// from the shared pool like any reader's) and closed after kIdle unused.
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "mount/cache_pusher.h"
#include "mount/chunk_reader.h"
#include "mount/store_tree.h"

namespace optstate::mount {

class Prefetcher {
 public:
  static constexpr std::chrono::milliseconds kIdle{2000};

  // Whether the kernel's page cache holds a file of a generation (its first
  // and last pages): its reader is opened without loading, since cp will
  // read it from there (a second copy of a snapshot used to read every
  // file's first chunks off the disk again). Called on the Prefetcher's
  // thread, without its lock.
  using HeldFn = std::function<bool(const Generation&, const vfs::CheckpointFile&)>;
  // A pusher into the kernel's page cache for a file opened ahead (not yet
  // started: the Prefetcher calls StartAhead), or null where the kernel
  // cannot take the file's pages. Called on the Prefetcher's thread, without
  // its lock.
  using PushFn = std::function<std::unique_ptr<CachePusher>(const Generation&, const vfs::CheckpointFile&,
                                                            std::shared_ptr<ChunkReader>)>;
  // What Take hands OpOpen: a parked reader and its pusher (null: none).
  struct Taken {
    std::shared_ptr<ChunkReader> reader;
    std::unique_ptr<CachePusher> pusher;
  };

  // opts (prefetch_files > 0), pool and stats as for ChunkReader::Open; pool
  // and stats must outlive this. `held` may be null (every reader loads),
  // `push` too (nothing is pushed before its open).
  Prefetcher(const MountOptions& opts, ChunkBufferPool* pool, ReadStats* stats, HeldFn held = nullptr,
             PushFn push = nullptr);
  ~Prefetcher();  // closes every parked reader
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The parked reader of `file` in `gen` (the same Generation object) and its
  // pusher, removed from the parked set; a null reader if there is none.
  // Waits while the thread is opening it.
  Taken Take(const Generation* gen, const vfs::CheckpointFile* file);
  // `file` of gen was just opened (`taken`: its reader came from Take): when
  // that continues a tree-order walk, park readers for the files after it.
  void Opened(std::shared_ptr<const Generation> gen, const vfs::CheckpointFile* file, bool taken);
  // Readers parked now (for tests).
  size_t parked() const;

 private:
  struct Parked {
    std::shared_ptr<const Generation> gen;
    const vfs::CheckpointFile* file = nullptr;
    std::shared_ptr<ChunkReader> reader;
    std::unique_ptr<CachePusher> pusher;  // declared after reader: stopped first
    std::chrono::steady_clock::time_point at;
  };
  void Loop();

  const MountOptions opts_;
  ChunkBufferPool* const pool_;
  ReadStats* const stats_;
  const HeldFn held_;
  const PushFn push_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<Parked> parked_;  // oldest first
  // The previous Opened (what a tree-order walk continues from).
  const Generation* last_gen_ = nullptr;
  uint32_t last_pos_ = 0;
  // The latest Opened of a walk: the thread parks the files after it.
  std::shared_ptr<const Generation> want_gen_;
  uint32_t want_after_ = 0;
  bool want_ = false;
  // Being opened by the thread right now (Take waits for it).
  const vfs::CheckpointFile* opening_ = nullptr;
  std::thread thread_;
};

}  // namespace optstate::mount
