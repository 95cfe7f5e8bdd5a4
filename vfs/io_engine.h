// IoEngine: asynchronous positional reads and writes of chunk extents.
//
// Two implementations behind one interface:
//  - UringIoEngine: io_uring, O_DIRECT files, registered (fixed) buffers and
//    files, batched submission, a configurable queue depth. Short transfers,
//    -EAGAIN and -EINTR are resubmitted for the remainder (rocksdb
//    env/io_posix.h UpdateResult, liburing examples/io_uring-cp.c); every other
//    failure completes the request with a Status naming file, offset and errno.
//  - SyncIoEngine: pread/pwrite through one pinned staging buffer, one request
//    at a time, in the caller's thread. This is how miles' NVMe streaming reads and writes, and
//    the benchmark baseline; it is also the fallback where io_uring is absent.
//
// Ownership: the engine does not own files or buffers. The caller keeps each
// buffer and File alive until its request completes.
// Thread-safety: one engine per thread; an engine is not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "vfs/file_system.h"
#include "base/status.h"

namespace optstate::vfs {

struct IoRequest {
  enum class Op : uint8_t { kRead, kWrite };
  Op op = Op::kRead;
  File* file = nullptr;     // must stay alive until completion
  uint64_t offset = 0;      // multiple of 4096 for O_DIRECT files
  uint64_t length = 0;      // multiple of 4096 for O_DIRECT files
  void* buf = nullptr;      // 4096-aligned for O_DIRECT files
  uint64_t tag = 0;         // returned in the completion
};

struct IoCompletion {
  uint64_t tag = 0;
  Status status;            // OK: all `length` bytes transferred
};

struct IoEngineOptions {
  uint32_t queue_depth = 32;  // requests in flight at most (io_uring SQ/CQ size)
  // Buffers to register with io_uring (IORING_REGISTER_BUFFERS); requests
  // whose buf lies inside one use the fixed-buffer opcodes. May be empty.
  std::vector<std::span<std::byte>> registered_buffers;
  bool sqpoll = false;        // IORING_SETUP_SQPOLL (off: costs a core)
  // io_uring: a request longer than this goes to the kernel as parallel SQEs
  // of at most this many bytes (a multiple of 4096; at most 16 per request,
  // larger when needed), completed as one. 0 = one SQE per request (default).
  // Why: what request size a disk serves best varies; the block layer only
  // caps requests at max_sectors_kb, and memory in huge pages reaches it.
  // Parts go to the kernel at most two per io_uring_enter: a larger batch is
  // plugged, and the plug merges adjacent parts back into one request.
  uint64_t max_sqe_bytes = 0;
  // io_uring: Wake() may be called (an eventfd polled in the ring). Off by
  // default: it costs one SQ entry and a descriptor.
  bool wakeable = false;
  // io_uring: Submit only queues SQEs; the next Reap (or a Submit that must
  // wait for room) sends all queued ones in one io_uring_enter. A batch of
  // more than two SQEs is plugged, and the plug merges adjacent requests into
  // one (up to max_sectors_kb): a step's writes of a small tensor's three
  // fields, carved side by side from one slot, reach the disk as one request,
  // and so do the next step's reads of them. The caller must Reap to make
  // progress. Off by default.
  bool defer_submit = false;
  // Registered-file table size (IORING_REGISTER_FILES, sparse); files beyond
  // it evict the oldest slot. 0 disables registered files. Default 1024 slots.
  uint32_t registered_file_slots = 1024;
  // Test-only: sees every io_uring completion before the engine interprets it
  // and returns the result to use instead of `res` (a short count, 0, -EAGAIN,
  // -EINTR, -EIO, ...) to fake what a device could report. `offset`/`len` are
  // those of the SQE (a resubmission covers only the remainder). Empty (the
  // default): completions are used as the kernel reports them. Ignored by the
  // sync engine.
  using CompletionFault =
      std::function<int32_t(const IoRequest& request, uint64_t offset, uint32_t len, int32_t res)>;
  CompletionFault completion_fault;
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // io_uring engine; falls back to nothing: returns an error naming why
  // io_uring is unavailable (the caller may then choose NewSyncIoEngine).
  static Result<std::unique_ptr<IoEngine>> NewUring(const IoEngineOptions& opts);
  // Synchronous baseline: one staging buffer of staging_bytes (pinned with
  // mlock when allowed), data copied through it, pread/pwrite per request.
  static Result<std::unique_ptr<IoEngine>> NewSync(uint64_t staging_bytes);

  // Queues requests; may block reaping completions when the queue is full
  // (reaped completions are kept and returned by the next Reap). Invalid
  // requests (misaligned for O_DIRECT, null file) fail at once.
  virtual Status Submit(std::span<const IoRequest> requests) = 0;
  // Appends at least min_complete completions (fewer only when fewer are in
  // flight) to *out. min_complete 0 only collects what is ready.
  virtual Status Reap(std::vector<IoCompletion>* out, size_t min_complete) = 0;
  virtual size_t in_flight() const = 0;
  virtual const char* name() const = 0;  // "io_uring" or "sync"
  // Thread-safe, unlike every other member: a Reap blocked waiting for
  // completions (or the next one, if none is) returns, with fewer than
  // min_complete if that is what there is. For an owner thread that sleeps in
  // Reap while other threads make new work for it. Needs
  // IoEngineOptions::wakeable on io_uring; the sync engine never blocks in Reap
  // (its I/O happens in Submit), so there it does nothing.
  virtual void Wake() {}
};

}  // namespace optstate::vfs
