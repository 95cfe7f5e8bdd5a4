// Prefetcher: reads the next step's state while the trainer runs forward
// and backward, on a thread of the engine: chunks the host cache tier
// admits go into the tier; up to a limit of the others go into staging
// buffers that the next step's pipeline adopts (SlicePipeline::Adopt).
// Internal to memmgr.
// Contract: Start runs one prefetch; Stop joins it and keeps what it
// staged until TakeStaged (the step that begins) or DropStaged gives the
// buffers away. A write-back through pins since the prefetch began reading
// may have changed what staged chunks hold: TakeStaged then drops them.
// Thread-safety: Start, Stop, TakeStaged and DropStaged on the trainer's
// thread; the prefetch's thread owns the ChunkIo it was given until Stop
// joins it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "memmgr/internal/slice_layout.h"
#include "memmgr/internal/step_plan.h"
#include "memmgr/internal/step_state.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

class Committer;
class EngineMemory;

class Prefetcher {
 public:
  // layouts: each rule's slice geometry (outlives this).
  Prefetcher(EngineMemory* mem, Committer* committer, const std::vector<std::unique_ptr<SliceLayout>>* layouts,
             std::string store_path)
      : mem_(mem), committer_(committer), layouts_(layouts), store_path_(std::move(store_path)) {}
  ~Prefetcher();

  bool running() const { return run_ != nullptr; }
  bool has_staged() const { return !staged_.empty(); }

  // Starts reading order's slices through io (owned by the thread until
  // Stop): into the tier, and up to stage_limit chunks outside it into
  // staging buffers. after_commit: first waits until the commit in flight
  // has published its generation. REQUIRES: !running().
  void Start(vfs::ChunkIo* io, bool after_commit, size_t stage_limit, std::vector<StepOrderEntry> order);
  // Stops the prefetch, if any, joins it and keeps what it staged.
  void Stop();
  // Bytes the prefetches read since the last call.
  uint64_t TakeReadBytes() {
    const uint64_t b = read_bytes_;
    read_bytes_ = 0;
    return b;
  }
  // The staged chunks for the step's pipeline (which owns their buffers
  // from now on); none when a write-back since may have changed them.
  std::vector<StagedChunk> TakeStaged();
  // Gives the staged chunks' buffers back to the manager.
  void DropStaged();

 private:
  struct Run {
    std::thread thread;
    std::atomic<bool> stop{false};  // set by Stop (Committer::Wake)
    // Written by the thread, read after join.
    uint64_t read_bytes = 0;  // chunk bytes read into the host cache tier
    uint64_t disk_bytes = 0;  // chunk bytes read from the store (some may have found an entry by then)
    uint64_t failed = 0;      // chunks not read (a read error; the step reads them again)
    std::vector<StagedChunk> staged;  // read into staging buffers for the next step
    uint64_t write_mark = 0;                   // the manager's nvme_write_bytes when reading started
  };
  // The prefetch's thread.
  void Read(Run* r, vfs::ChunkIo* io, bool after_commit, size_t stage_limit, const std::vector<StepOrderEntry>& order);

  EngineMemory* const mem_;
  Committer* const committer_;
  const std::vector<std::unique_ptr<SliceLayout>>* const layouts_;
  const std::string store_path_;
  std::unique_ptr<Run> run_;
  uint64_t read_bytes_ = 0;  // by the prefetches since TakeReadBytes
  // Chunks a finished prefetch read into staging buffers for the next step;
  // staged_write_mark_: the manager's nvme_write_bytes when it started
  // reading (a write-back since then drops them).
  std::vector<StagedChunk> staged_;
  uint64_t staged_write_mark_ = 0;
};

}  // namespace optstate::memmgr::internal
