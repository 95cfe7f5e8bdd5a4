#include "memmgr/internal/committer.h"

#include <utility>

#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr::internal {

Committer::Committer(vfs::Store* store, EngineMemory* mem, uint64_t sync_every_bytes,
                     std::function<Status()> write_dirty_cache)
    : store_(store), mem_(mem), sync_every_bytes_(sync_every_bytes), write_dirty_cache_(std::move(write_dirty_cache)) {}

Committer::~Committer() {
  (void)Wait();
  (void)FinishSync();
}

void Committer::OnWritten(uint64_t bytes) {
  unsynced_bytes_ += bytes;
  if (sync_every_bytes_ == 0 || unsynced_bytes_ < sync_every_bytes_ || sync_running_.load()) return;
  if (sync_thread_.joinable()) sync_thread_.join();
  if (!sync_status_.ok()) return;
  unsynced_bytes_ = 0;
  sync_running_ = true;
  sync_thread_ = std::thread([this] {
    Status st = store_->SyncData();
    if (!st.ok()) sync_status_ = st.WithContext("StreamedAdam: background data sync");
    sync_running_ = false;
  });
}

Status Committer::FinishSync() {
  if (sync_thread_.joinable()) sync_thread_.join();
  Status s = sync_status_;
  sync_status_ = Status::Ok();
  return s;
}

void Committer::Commit(Work* w, Outcome* out, bool background) {
  out->info = w->info;
  out->generation = w->generation;
  out->steps = w->steps;
  Status s;
  if (w->pipeline) {
    SlicePipeline& pl = *w->pipeline;
    out->write_bytes_at_start = pl.write_bytes;
    s = pl.Pump(true);
    Status ss = FinishSync();
    if (s.ok()) s = ss;
    out->slices = pl.slices;
    out->write_bytes = pl.write_bytes;
    out->peak_write_bytes = pl.peak_write_bytes;
    out->io_wait_seconds = pl.stall_s_;
    if (s.ok()) {
      mem_->AddStats(pl.read_bytes, pl.write_bytes, pl.cache_hits, pl.h2d, pl.d2h, pl.stall_s_);
      pl.Release();
    } else {
      pl.Abort();
    }
    w->pipeline.reset();
  }
  // Params not stepped now may hold earlier uncommitted steps in the cache.
  if (s.ok() && w->write_dirty_cache) s = write_dirty_cache_();
  // EngineMemory::Flush, not MemoryManager::Flush: that waits for this thread.
  if (s.ok()) s = mem_->Flush();
  if (s.ok()) {
    const double t0 = NowS();
    auto gen = store_->Commit(w->info);
    out->commit_seconds = NowS() - t0;
    if (gen.ok()) {
      out->committed = *gen;
    } else {
      s = gen.status();
    }
  }
  if (!s.ok() && background) {
    // Drop the step before anyone waiting in the manager reads the store.
    Status a = store_->AbortPending();
    if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed background commit: {}", a.ToString());
    mem_->OnAbortPending();
  }
  out->status = s;
}

Committer::Outcome Committer::Run(Work w) {
  Outcome out;
  Commit(&w, &out, /*background=*/false);
  return out;
}

void Committer::Start(Work w) {
  work_ = std::move(w);
  outcome_ = Outcome{};
  {
    MutexLock l(&mu_);
    done_ = false;
  }
  mem_->BeginBackgroundCommit();
  thread_ = std::thread([this] {
    Commit(&work_, &outcome_, /*background=*/true);
    mem_->EndBackgroundCommit();
    {
      MutexLock l(&mu_);
      done_ = true;
    }
    cv_.SignalAll();
  });
}

std::optional<Committer::Outcome> Committer::Wait(double* wait_s) {
  if (wait_s != nullptr) *wait_s = 0;
  if (!thread_.joinable()) return std::nullopt;
  const double t0 = NowS();
  thread_.join();
  if (wait_s != nullptr) *wait_s = NowS() - t0;
  return std::move(outcome_);
}

bool Committer::WaitPublished(const std::atomic<bool>& stop) {
  MutexLock l(&mu_);
  while (!done_ && !stop.load()) cv_.Wait(&mu_);
  return done_ && outcome_.status.ok();
}

void Committer::Wake(std::atomic<bool>* stop) {
  {
    MutexLock l(&mu_);
    *stop = true;
  }
  cv_.SignalAll();
}

}  // namespace optstate::memmgr::internal
