// Committer: the end of a step's generation, behind one Wait() (internal to
// memmgr). It owns:
//  - the data syncs: during a step, the data files are fdatasync'ed in the
//    background every sync_every_bytes of completed writes (the pipeline
//    reports them: OnWritten), so part of the device's flush overlaps the
//    step instead of landing in the commit;
//  - the write tail: the writes of a step's pipeline still in flight or
//    queued when Step returned (a pipelined commit drains them);
//  - the commit: the host cache's dirty entries of earlier cached steps, the
//    manager's write-backs (EngineMemory::Flush) and Store::Commit.
// A commit runs inline (Run: commit_lag_steps 0) or on a thread of the
// optimizer (Start: commit_lag_steps 1), which Wait() joins; only one runs
// at a time. A background commit that fails drops the pending generation
// (Store::AbortPending, EngineMemory::OnAbortPending) on its thread, before
// anyone waiting in the manager reads the store; an inline one leaves that
// to its caller (which aborts the step).
//
// Thread-safety: Start, Wait, Run, OnWritten and FinishSync are called by
// one thread at a time (the trainer's, or the commit's thread while it
// runs: it owns the pipeline, the data sync and the store's pending
// generation until joined). WaitPublished and Wake may be called from any
// thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_pipeline.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

class Committer {
 public:
  // write_dirty_cache: writes the host cache's dirty entries not yet in the
  // pending generation (the commit's caller's ChunkIo). sync_every_bytes: 0
  // = only Store::Commit syncs.
  Committer(vfs::Store* store, EngineMemory* mem, uint64_t sync_every_bytes,
            std::function<Status()> write_dirty_cache);
  // Joins a running commit (its outcome is dropped) and the data sync.
  ~Committer();

  // A step begins: its completed writes count towards the next data sync.
  // REQUIRES: no commit running.
  void BeginStep() { unsynced_bytes_ = 0; }
  // bytes of the step's writes completed (the pipeline's driving thread).
  void OnWritten(uint64_t bytes);
  // Joins the data sync, if any; its error, if it failed (then no later
  // sync of this step runs: the commit's own sync reports the disk).
  Status FinishSync();

  struct Work {
    std::unique_ptr<SlicePipeline> pipeline;  // its write tail; null: every write done
    vfs::CommitInfo info;                    // the generation's step counts and hyperparameters
    bool write_dirty_cache = false;          // earlier cached steps to write with it
    uint64_t generation = 0;                 // the generation it publishes (messages)
    uint64_t steps = 1;                      // steps it makes durable (cached ones too)
  };
  struct Outcome {
    Status status;
    uint64_t committed = 0;  // the generation Store::Commit returned
    vfs::CommitInfo info;
    uint64_t generation = 0, steps = 1;
    // Of the write tail (0 without a pipeline); write_bytes_at_start: of the
    // pipeline's writes, complete when the commit started.
    uint64_t slices = 0, write_bytes = 0, peak_write_bytes = 0, write_bytes_at_start = 0;
    double io_wait_seconds = 0, commit_seconds = 0;
  };
  // Commits inline. On failure nothing is aborted (the caller does).
  Outcome Run(Work w);
  // Commits on a thread. REQUIRES: no commit running.
  void Start(Work w);
  bool running() const { return thread_.joinable(); }
  // Joins the running commit; its outcome (nullopt when none ran). *wait_s:
  // seconds spent waiting (may be null).
  std::optional<Outcome> Wait(double* wait_s = nullptr);

  // For a thread that must read the store only after the running commit
  // published: waits until it did (true), or it failed or *stop was set
  // (false).
  bool WaitPublished(const std::atomic<bool>& stop);
  // Sets *stop and wakes WaitPublished.
  void Wake(std::atomic<bool>* stop);

 private:
  // The commit's steps; on a thread when background (then a failure drops
  // the pending generation).
  void Commit(Work* w, Outcome* out, bool background);

  vfs::Store* const store_;
  EngineMemory* const mem_;
  const uint64_t sync_every_bytes_;
  const std::function<Status()> write_dirty_cache_;

  // The data sync: at most one Store::SyncData at a time.
  std::thread sync_thread_;
  std::atomic<bool> sync_running_{false};
  Status sync_status_;  // written by sync_thread_, read after join
  uint64_t unsynced_bytes_ = 0;

  // The background commit.
  std::thread thread_;
  Work work_;        // owned by thread_ while it runs
  Outcome outcome_;  // written by thread_, read after join
  Mutex mu_;
  CondVar cv_;
  bool done_ GUARDED_BY(mu_) = true;  // the running commit finished (outcome_.status final)
};

}  // namespace optstate::memmgr::internal
