// ChunkReader: the read path of one open file of the mount.
//
// One synchronous 1 MiB O_DIRECT pread per FUSE request is latency-bound
// (a fraction of the disk's rate), so each reader has its own I/O thread that keeps whole
// chunks of the file's chunk sequence in flight on its own ChunkIo (io_uring,
// from the generation's GenerationView) and reaps them, and a verify thread
// checks each loaded chunk's XXH3 (ChunkIoOptions::verify_reads = false; a
// file of one chunk has neither ring nor verify thread: its I/O thread reads
// and verifies that chunk synchronously):
// hashing on the I/O thread held back its next submissions and left the disk
// idle for part of a sequential read. The verify thread hashes a
// chunk shortly before the reader reaches it (kVerifyAhead), so that the
// reader's copies can find it in cache. A FUSE request only waits for a chunk that is
// already verified and copies (or hands) its bytes out: no disk wait, no
// checksum and no io_uring call on the request path, and the disk sees a queue
// of whole chunks while `cp` is busy with the previous megabyte.
//
// The read-ahead window starts at open (chunks 0 and 1 are submitted at once)
// and doubles with every sequential chunk step up to `readahead_chunks` whole
// chunks' worth of bytes ahead of the chunk being read; a jump (seek) shrinks
// it back to one chunk. A random reader therefore pays at most one extra chunk
// per seek, a sequential one gets the full queue after a few chunks. The
// window is counted in bytes of chunk buffers, not in chunks: state.safetensors
// interleaves runs of a dozen one-chunk fields of a few KiB (norms, biases)
// with fields of whole chunks, and a window of 8 chunks shrank there to a few
// KiB ahead, so the next big field's chunks were asked for only when the
// reader got there. Such a file's reader has more slots
// (kSmallChunkSlots per chunk of the window) and buffers sized to its chunks;
// its buffer bytes stay within (readahead_chunks + 1 + the trail, below) of
// its longest chunk.
// The window follows the reader that moved last; a chunk some other reader of
// the file waits for is loaded first, wherever the window is (concurrent
// preads or AIO on one descriptor). Requests of one stream served at once
// (the kernel's read-ahead through the page cache, concurrent preads) reach
// the reader slightly out of order: one that lands in the trail, a few
// chunks behind the window start, neither moves the window back nor shrinks
// it, and read-ahead keeps a trail chunk until all its bytes went out
// (kTrailChunks, chunk_reader.cc).
//
// Bytes handed out always come from a chunk whose checksum matched: a chunk
// that fails (I/O error or checksum mismatch) fails the read with its Status
// (kCorruption for a mismatch) and one log line naming store, generation,
// tensor, field and chunk; the next read of it retries.
//
// Chunk buffers come from a ChunkBufferPool shared by all readers: memory for
// read-ahead is bounded by the pool's budget (each reader may exceed it by one
// chunk so that it can always make progress, and by one more per chunk it has
// lent: ReadWith's `lend`).
//
// Ownership: holds a reference on its Generation (so the file reads that
// generation until closed). Thread-safety: Read/ReadWith may be called from
// several threads at once; the destructor must not race with them. FUSE sends
// release once the kernel has the reply to the last read, which can be before
// that read's ReadWith returns (it unpins after `consume`): the mount keeps a
// shared reference per request (mount/internal/open_handles.h NewHandle/HandleOf).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mount/chunk_buffer_pool.h"
#include "mount/store_tree.h"
#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"

namespace optstate::mount {


// What the readers of a mount did, summed over all open files; the daemon logs
// it at unmount (the first thing to look at when a copy is slow: did reads wait
// for the disk, or for something else?). Thread-safe.
struct ReadStats {
  std::atomic<uint64_t> requests{0};       // Read/ReadWith calls
  std::atomic<uint64_t> bytes{0};          // bytes they returned
  std::atomic<uint64_t> waited{0};         // requests that waited for a chunk to load
  std::atomic<uint64_t> wait_ns{0};        // time they waited
  std::atomic<uint64_t> serve_ns{0};       // time FUSE READs spent in the daemon, reply included
  std::atomic<uint64_t> chunks_loaded{0};  // chunk reads completed (hashed afterwards)
  std::atomic<uint64_t> bounced{0};        // requests copied: across into a chunk not yet verified
  std::atomic<uint64_t> opens{0};          // files opened (with chunks to read)
  std::atomic<uint64_t> prefetched{0};     // ... that found a reader the Prefetcher had opened
  std::atomic<uint64_t> held{0};           // readers the Prefetcher opened without loading (the kernel held the file)
  std::atomic<uint64_t> lookups{0};        // FUSE LOOKUPs (path components the kernel did not cache)
  std::atomic<uint64_t> listed{0};         // names READDIRPLUS gave the kernel as nodes (no LOOKUP follows)
  std::atomic<uint64_t> getattrs{0};       // FUSE GETATTRs
  std::atomic<uint64_t> pushes{0};         // files a CachePusher filled the page cache of
  std::atomic<uint64_t> pushed_bytes{0};   // ... bytes it stored there
  std::atomic<uint64_t> filled_bytes{0};   // bytes stored into state.safetensors from field files' reads

  // "N reads (X GiB), W waited for a chunk (T s in all), S us per read in the
  // daemon, C chunks loaded, B copied across a chunk boundary, O opens (P
  // prefetched, H of the files held by the kernel), L lookups, D names listed
  // as nodes, G getattrs, F files pushed into the page cache (Y GiB), Z GiB
  // filled into state.safetensors"
  std::string Summary() const;
};

class ChunkReader {
 public:
  // Starts the reader's I/O thread (none for a file without chunks). Uses
  // opts.readahead_chunks and opts.max_sqe_bytes. `stats` (may be null) must
  // outlive the reader. `start`: the first chunks load at once; else nothing
  // loads until the first read or Start().
  static Result<std::unique_ptr<ChunkReader>> Open(std::shared_ptr<const Generation> gen,
                                                   const vfs::CheckpointFile* file,
                                                   const MountOptions& opts, ChunkBufferPool* pool,
                                                   ReadStats* stats = nullptr, bool start = true);
  // The read-ahead window starts loading (a no-op once it has).
  void Start() EXCLUDES(mu_);
  ~ChunkReader();
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  // Copies up to len bytes at offset into out; short only at EOF.
  Result<uint64_t> Read(uint64_t offset, uint64_t len, char* out) EXCLUDES(mu_);

  // Hands `consume` the bytes of [offset, offset + len) (clipped at EOF) as
  // iovecs valid only during the call: into the verified chunk buffers (pinned
  // meanwhile) and layout memory, or into a per-thread copy when the range
  // crosses into a chunk that is not verified yet. Returns the byte count, or
  // consume's error. Lets the FUSE reply go straight from the chunk buffers.
  // `count`: counted in ReadStats::requests/bytes (a CachePusher's are not).
  // `lend`: for a consume that may wait on something a READ of this file has
  // to do first (a store into the kernel's page cache waits for pages whose
  // READ is in flight): the chunks are not pinned while consume runs but
  // their buffers lent, so the read-ahead may still reuse those slots (with
  // new buffers, past the pool's budget if need be: at most one per lent
  // chunk); a lent buffer goes back to the pool when consume has returned.
  Result<uint64_t> ReadWith(uint64_t offset, uint64_t len,
                            const std::function<Status(std::span<const iovec>)>& consume, bool count = true,
                            bool lend = false) EXCLUDES(mu_);

  const Generation& generation() const { return *gen_; }
  const std::shared_ptr<const Generation>& shared_generation() const { return gen_; }
  const vfs::CheckpointFile& file() const { return *file_; }

 private:
  // kEmpty -> kInFlight (I/O thread) -> kLoaded (read, checksum not yet
  // checked) -> kVerifying (verify thread) -> kReady | kFailed.
  enum class SlotState : uint8_t { kEmpty, kInFlight, kLoaded, kVerifying, kReady, kFailed };
  struct Slot {
    char* buf = nullptr;   // from pool_, BufBytesFor its chunk; null until first use
    uint64_t buf_bytes = 0;  // of buf
    uint64_t seq = 0;
    SlotState state = SlotState::kEmpty;
    uint32_t pins = 0;     // readers copying out of buf: not evictable while > 0
    uint32_t lends = 0;    // lent to a ReadWith(lend): buf goes to detached_ if the slot is reused
    uint64_t served_bytes = 0;  // handed out since seq was loaded (a trail chunk is done once all are)
    Status status;         // kFailed: why
    vfs::ChunkCompletion loaded;  // kLoaded/kVerifying: what VerifyChunkRead needs
  };

  ChunkReader(std::shared_ptr<const Generation> gen, const vfs::CheckpointFile* file,
              const MountOptions& opts, ChunkBufferPool* pool, ReadStats* stats);
  void IoLoop() EXCLUDES(mu_);
  void VerifyLoop() EXCLUDES(mu_);
  // The kLoaded slot to verify next, or null: a chunk a reader waits for,
  // else the first from the window start up to kVerifyAhead chunks ahead of it.
  Slot* NextToVerify() REQUIRES(mu_);
  // The slot to load the next chunk of the window into (seq set, state
  // kInFlight, buffer present), or null when the window is full or no slot
  // is free.
  Slot* NextSubmission() REQUIRES(mu_);
  // A slot for chunk seq (set kInFlight), or null when none can be had now.
  // `demand`: a reader waits for seq (see .cc).
  Slot* Claim(uint64_t seq, uint64_t hi, bool demand) REQUIRES(mu_);
  // Every slot with a buffer is pinned.
  bool AllBuffersPinned() const REQUIRES(mu_);
  // Moves the window to `seq` (the chunk a reader needs).
  void MoveTo(uint64_t seq) REQUIRES(mu_);
  // The last chunk of the window that holds at most `bytes` of chunk buffers
  // after pos_'s: at least pos_ + 1 (while there is one), at most as far as
  // the slots reach.
  uint64_t WindowEnd(uint64_t bytes) const REQUIRES(mu_);
  // The bytes of the buffer chunk seq is read into (from buf_ends_; sizes:
  // see the constructor).
  uint64_t BufBytesFor(uint64_t seq) const;
  // Gives s's buffer back to the pool, or to detached_ while it is lent (s
  // becomes kEmpty).
  void DropBuffer(Slot* s) REQUIRES(mu_);
  // A lend of buf (ReadWith) has ended.
  void Return(char* buf) REQUIRES(mu_);
  // Waits until chunk seq is verified (mu_ released while waiting), pins it.
  Result<Slot*> PinChunk(uint64_t seq) REQUIRES(mu_);
  // `bytes` of s went out to the reader.
  void Unpin(Slot* s, uint64_t bytes) REQUIRES(mu_);
  // seq is behind the window start by at most kTrailChunks chunks' worth of
  // buffer bytes (see .cc).
  bool InTrail(uint64_t seq) const REQUIRES(mu_);
  // Tells the I/O thread there may be a chunk to submit, whether it waits on
  // io_cv_ or for completions in Reap (ChunkIo::Wake).
  void Kick() REQUIRES(mu_);
  Slot* Find(uint64_t seq) REQUIRES(mu_);
  void Count(uint64_t bytes);  // one request that returned `bytes`
  // Read; `count`: as for ReadWith.
  Result<uint64_t> CopyOut(uint64_t offset, uint64_t len, char* out, bool count) EXCLUDES(mu_);
  Status SlotError(const Slot& s) const;

  const std::shared_ptr<const Generation> gen_;
  const vfs::CheckpointFile* const file_;
  const uint32_t readahead_;
  const uint64_t max_sqe_bytes_;  // vfs::ChunkIoOptions::max_sqe_bytes of io_
  const uint64_t chunk_size_;
  const uint64_t max_buf_bytes_;  // the file's longest chunk, rounded to 4096
  const uint64_t seq_len_;
  std::vector<uint64_t> buf_ends_;  // [i]: the buffer bytes of chunks 0..i (set at construction)
  std::vector<uint64_t> chunk_bytes_;  // [i]: chunk i's bytes in the file (set at construction)
  uint64_t cap_bytes_ = 0;         // most buffer bytes held: (readahead_ + 1 + kTrailChunks) * max_buf_bytes_
  ChunkBufferPool* const pool_;
  ReadStats* const stats_;             // null: not counted

  Mutex mu_;           // guards what is marked GUARDED_BY(mu_) below
  CondVar io_cv_;      // with mu_: the I/O thread waits for work here
  CondVar ready_cv_;   // with mu_: readers wait for a chunk here
  CondVar verify_cv_;  // with mu_: the verify thread waits for a loaded chunk here
  // readahead + 1 (the chunk being read) + the trail; more for small chunks.
  // A Slot is reached only through slots_, so mu_ guards its fields too.
  std::vector<Slot> slots_ GUARDED_BY(mu_);
  uint64_t held_bytes_ GUARDED_BY(mu_) = 0;    // of the slots' buffers
  uint64_t pos_ GUARDED_BY(mu_) = 0;           // chunk a reader needs now: window start
  uint64_t window_bytes_ GUARDED_BY(mu_) = 0;  // buffer bytes kept loaded after pos_ (ramps up)
  std::map<uint64_t, uint32_t> waiting_ GUARDED_BY(mu_);  // chunk -> readers waiting for it to load
  struct Detached {
    char* buf;
    uint64_t bytes;
    uint32_t lends;
  };
  // Lent buffers no slot holds any more (not in held_bytes_).
  std::vector<Detached> detached_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  bool started_ GUARDED_BY(mu_) = true;     // read-ahead may load (Open's `start`, Start, or a read)
  bool reaping_ GUARDED_BY(mu_) = false;    // the I/O thread is in io_->Reap (io_ is set)
  bool wake_sent_ GUARDED_BY(mu_) = false;  // Kick() woke that Reap already
  Status io_error_ GUARDED_BY(mu_);         // the ChunkIo itself failed: reads fail with it
  // The I/O thread's only (ChunkIo: one thread); set by it before it takes
  // mu_ and reset after, used by Kick (mu_ held) only while reaping_.
  std::unique_ptr<vfs::ChunkIo> io_;
  // One chunk, or NewChunkIo failed: ReadChunk per chunk. The I/O thread's
  // own (set before its loop, read only by it).
  bool sync_fallback_ = false;
  std::thread thread_;
  std::thread verify_thread_;          // started with thread_
};

}  // namespace optstate::mount
