// UringIoEngine: the io_uring implementation of IoEngine (vfs/io_engine.h).
//
// One ring per engine. Requests become one SQE each (split at 1 GiB), or with
// max_sqe_bytes several parallel SQEs completed as one request; a short
// transfer, -EAGAIN or -EINTR is resubmitted for the remainder, and a read that
// keeps returning 0 bytes is failed after a few tries instead of looping.
// Buffers given in IoEngineOptions are registered and used with READ_FIXED /
// WRITE_FIXED; files are registered in a sparse table the first time their fd
// is seen (plain fds where the kernel lacks sparse tables).
//
// Ownership: the engine owns its ring and nothing else; files and buffers of a
// request must outlive its completion. The destructor waits for every request
// still in the kernel.
// Thread-safety: none; one engine per thread.
#pragma once

#include <liburing.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "vfs/io_engine.h"
#include "base/status.h"

namespace optstate::vfs::internal {

class UringIoEngine final : public IoEngine {
 public:
  static Result<std::unique_ptr<IoEngine>> Create(const IoEngineOptions& opts);
  ~UringIoEngine() override;
  UringIoEngine(const UringIoEngine&) = delete;
  UringIoEngine& operator=(const UringIoEngine&) = delete;

  Status Submit(std::span<const IoRequest> requests) override;
  Status Reap(std::vector<IoCompletion>* out, size_t min_complete) override;
  size_t in_flight() const override { return accepted_ - delivered_; }
  const char* name() const override { return "io_uring"; }
  void Wake() override;

  // For tests and the benchmark: whether fixed files are in use.
  bool registered_files_active() const { return file_slots_ > 0; }
  // Counters since construction (for tests and the benchmark).
  struct Stats {
    uint64_t requests = 0;       // accepted requests
    uint64_t sqes = 0;           // SQEs prepared (first submissions + resubmissions)
    uint64_t resubmissions = 0;  // SQEs for a remainder or a retry
    uint64_t fixed_buffer_sqes = 0;
    uint64_t fixed_file_sqes = 0;
  };
  const Stats& stats() const { return stats_; }

 private:
  // One accepted request until its completion is queued in ready_.
  struct Op {
    IoRequest req;
    uint64_t done = 0;         // bytes transferred so far
    uint64_t first_len = 0;    // length of the first SQE (short when a hook asked)
    uint32_t sqe_len = 0;      // length of the SQE in the kernel now
    int buf_index = -1;        // registered buffer holding req.buf, or -1
    int file_slot = -1;        // registered file slot, or -1 for the plain fd
    uint32_t zero_results = 0; // consecutive completions that moved no byte
    uint32_t retries = 0;      // consecutive -EAGAIN/-EINTR
    bool direct = false;
    uint32_t request = 0;      // index in requests_ of the request this op is a part of
  };
  // An accepted request: done when its last part (op) finishes.
  struct Request {
    uint64_t tag = 0;
    uint32_t parts_left = 0;
    Status status;  // the first failed part's
  };
  // A registered-file slot and what it holds, to notice fd reuse.
  struct FileSlot {
    int fd = -1;
    uint64_t dev = 0;
    uint64_t ino = 0;
    int flags = 0;
  };

  explicit UringIoEngine(const IoEngineOptions& opts);
  Status Init();
  Status Validate(const IoRequest& r) const;
  // Registered slot for the file of r, or -1 (plain fd). May register it.
  int FileSlotFor(const IoRequest& r, std::unordered_map<int, int>* checked);
  int BufIndexFor(const IoRequest& r) const;
  // Prepares the SQE for op's remainder. REQUIRES: active_ <= ring_entries_.
  void Prepare(uint32_t op_index);
  void Finish(uint32_t op_index, Status status);
  // Handles one CQE: completes the op or resubmits its remainder.
  void Process(const io_uring_cqe* cqe);
  // Submits prepared SQEs and waits for at least one completion.
  Status WaitOne();
  // Handles every CQE already in the ring, without waiting.
  void DrainReady();
  Status SubmitPrepared();
  // Queues the multishot poll of wake_fd_ (IoEngineOptions::wakeable).
  void ArmWake();

  IoEngineOptions opts_;
  io_uring ring_{};
  bool ring_ok_ = false;
  uint32_t queue_depth_ = 0;
  std::vector<std::span<std::byte>> buffers_;  // registered, in index order
  uint32_t file_slots_ = 0;                    // 0: plain fds
  std::vector<FileSlot> slots_;
  std::unordered_map<int, int> fd_to_slot_;
  uint32_t next_evict_ = 0;

  std::vector<Op> ops_;            // indexed by SQE user_data; ring_entries_ of them
  std::vector<uint32_t> free_ops_;
  std::vector<Request> requests_;  // queue_depth_ of them
  std::vector<uint32_t> free_requests_;
  uint32_t ring_entries_ = 0;      // SQ entries: queue_depth_ x the most parts per request
  uint32_t active_ = 0;            // ops with an SQE prepared or in the kernel
  uint32_t requests_active_ = 0;   // requests with an op in flight
  uint32_t prepared_ = 0;          // SQEs prepared, not yet submitted
  std::deque<IoCompletion> ready_;
  Stats stats_;
  uint64_t accepted_ = 0;
  uint64_t delivered_ = 0;
  int wake_fd_ = -1;     // eventfd (wakeable); its poll holds one SQ entry beyond ring_entries_
  bool woken_ = false;   // a wake CQE arrived since the last Reap returned
};

}  // namespace optstate::vfs::internal
