// CachePusher: fills the kernel's page cache of one open file ahead of a
// sequential reader (FUSE_NOTIFY_STORE), from the file's ChunkReader.
//
// Through the page cache the kernel asks for a file's bytes by its own
// read-ahead, in requests of 128 KiB that run in the reader's context: the
// reader allocates every page-cache page and waits for each request's round
// trip to the daemon. With the pusher the daemon reads the file's chunks at
// the disk's pace (its ChunkReader's window) and stores each verified range
// into the page cache from its own thread, so a sequential reader mostly
// finds its pages there and the kernel sends READs only where the reader
// caught up with the push (faster than the kernel's read-ahead alone and than
// direct_io: docs/BENCHMARKS.md, "Defaults").
//
// When: the push starts at the file's first READ at offset 0 (cp, cat, tar,
// rsync, a Python read() all start there) and goes from the end of that READ
// to the end of the file, as fast as the chunks load, until the file is
// closed. A READ far from the push front (more than kFarBytes either way: a
// seek, or pages the kernel dropped before the reader got to them) ends it:
// a reader that jumps around gets what it asks for and nothing more, one
// that reads a header and seeks costs at most kFarBytes of pushing.
//
// Pushes are page-aligned and one notification each: the kernel marks a page
// up to date only when one notification fills it whole, and a page left
// partly filled is read again by the reader's own READ (far behind the push,
// which moved the ChunkReader's window back and reloaded chunks).
//
// Thread-safety: OnRead may be called from several threads at once; the
// destructor stops the thread and waits for it (it must not race OnRead).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <thread>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "mount/chunk_reader.h"

namespace optstate::mount {

class CachePusher {
 public:
  // A READ more than this far from the push front (either way) ends the push.
  static constexpr uint64_t kFarBytes = 64ull << 20;
  static constexpr uint64_t kPageBytes = 4096;

  // Stores the bytes of `iov` at `offset` of the file into the page cache:
  // 0, or a negative errno (the push ends; the reader's READs still work).
  using StoreFn = std::function<int(uint64_t offset, std::span<const iovec> iov)>;

  // `stats` (may be null) must outlive this. `far_bytes`: kFarBytes (tests
  // pass less).
  CachePusher(std::shared_ptr<ChunkReader> reader, StoreFn store, ReadStats* stats,
              uint64_t far_bytes = kFarBytes);
  ~CachePusher();
  CachePusher(const CachePusher&) = delete;
  CachePusher& operator=(const CachePusher&) = delete;

  // The kernel READs [offset, offset + bytes): may start or end the push.
  void OnRead(uint64_t offset, uint64_t bytes) EXCLUDES(mu_);
  // Waits until the push thread has ended (tests: the push ran to the end).
  void Join() EXCLUDES(mu_);
  // Bytes stored into the page cache so far.
  uint64_t pushed_bytes() const { return pushed_bytes_.load(std::memory_order_relaxed); }

 private:
  void Loop(uint64_t from);
  bool Stopped() const { return stop_.load(std::memory_order_relaxed); }

  const std::shared_ptr<ChunkReader> reader_;
  const StoreFn store_;
  ReadStats* const stats_;
  const uint64_t far_bytes_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> front_{0};       // the push has stored everything before this
  std::atomic<uint64_t> read_end_{0};    // the highest end of a READ
  std::atomic<uint64_t> pushed_bytes_{0};
  Mutex mu_;
  bool started_ GUARDED_BY(mu_) = false;
  std::thread thread_ GUARDED_BY(mu_);
};

}  // namespace optstate::mount
