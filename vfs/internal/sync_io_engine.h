// SyncIoEngine: the synchronous IoEngine (vfs/io_engine.h), the first
// version's method kept as the benchmark baseline and the fallback where
// io_uring is unavailable.
//
// Each request is done in Submit, in the caller's thread: data is copied
// through one staging buffer (4096-aligned, mlock'ed when RLIMIT_MEMLOCK
// allows) with pread/pwrite, one staging-sized piece at a time. Completions are
// queued and handed out by Reap.
//
// Ownership: owns the staging buffer; files and request buffers belong to the
// caller. Thread-safety: none; one engine per thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "vfs/io_engine.h"
#include "base/status.h"

namespace optstate::vfs::internal {

class SyncIoEngine final : public IoEngine {
 public:
  static Result<std::unique_ptr<IoEngine>> Create(uint64_t staging_bytes);
  ~SyncIoEngine() override;
  SyncIoEngine(const SyncIoEngine&) = delete;
  SyncIoEngine& operator=(const SyncIoEngine&) = delete;

  Status Submit(std::span<const IoRequest> requests) override;
  Status Reap(std::vector<IoCompletion>* out, size_t min_complete) override;
  size_t in_flight() const override { return ready_.size(); }
  const char* name() const override { return "sync"; }

  // Whether the staging buffer is locked in memory (mlock succeeded).
  bool staging_locked() const { return locked_; }

 private:
  SyncIoEngine() = default;
  Status DoRequest(const IoRequest& r, uint64_t first_len);
  // Moves [offset, offset+len) between the file and the staging buffer.
  Status Transfer(const IoRequest& r, bool read, uint64_t offset, uint64_t len);

  std::byte* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
  bool locked_ = false;
  std::deque<IoCompletion> ready_;
};

}  // namespace optstate::vfs::internal
