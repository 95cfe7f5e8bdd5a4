// StreamedAdam: commits: the commit info, deferred durability in the host
// cache tier (MakeDurable), and the pipelined commit that runs on a thread
// of the optimizer (StartBackgroundCommit, FinishCommit).
#include "memmgr/internal/streamed_engine.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "memmgr/internal/committer.h"
#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_pipeline.h"
#include "memmgr/internal/prefetcher.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr::internal {


vfs::CommitInfo StreamedEngine::MakeCommitInfo(bool advance) const {
  vfs::CommitInfo ci;
  for (const auto& [id, g] : groups_) {
    vfs::GroupInfo gi;
    gi.id = id;
    const Hyperparams h = GroupMap(g);
    gi.hyper.insert(h.begin(), h.end());
    ci.groups.push_back(std::move(gi));
  }
  counts_.Fill(advance, step_.groups, step_.tensors, &ci);
  return ci;
}

bool StreamedEngine::CacheHoldsState() const {
  const HostCache* c = mem_->cache();
  if (!c->enabled()) return false;
  return StateCacheBytes() <= c->capacity_bytes();
}

uint64_t StreamedEngine::StateCacheBytes() const {
  const uint64_t chunk = mem_->page_bytes();
  uint64_t need = 0;
  for (const auto& [name, p] : params_.all()) {
    for (uint32_t f = 0; f < p.info.fields.size(); ++f) {
      const uint64_t stride = p.info.field_chunk_bytes(f, chunk);
      const uint64_t bytes = p.info.field_bytes(f);
      const uint64_t tail = bytes % stride ? HostCache::EntryBytes(bytes % stride) : 0;
      need += (bytes / stride) * HostCache::EntryBytes(stride) + tail;
    }
  }
  return need;
}

void StreamedEngine::NoteCommitted(uint64_t gen) {
  mem_->cache()->MarkAllClean();
  counts_.Committed(gen);
  params_.MarkCommitted();
}

Status StreamedEngine::WriteDirtyCache() {
  HostCache* cache = mem_->cache();
  auto dirty = cache->DirtyUnwritten();
  if (dirty.empty()) return Status::Ok();
  OPTSTATE_RETURN_IF_ERROR(EnsureIo());
  const size_t depth = std::max<uint32_t>(mm_->options().queue_depth + mm_->options().write_queue_depth, 1);
  std::vector<vfs::ChunkCompletion> done;
  Status st;
  size_t next = 0;
  while ((next < dirty.size() || io_->in_flight() > 0)) {
    while (st.ok() && next < dirty.size() && io_->in_flight() < depth) {
      const ChunkKey& k = dirty[next].first;
      st = io_->SubmitWrite(vfs::ChunkRef{k.tensor_id, k.field, k.index}, dirty[next].second, next);
      if (!st.ok()) {
        st = st.WithContext("StreamedAdam: writing cached tensor id " + std::to_string(k.tensor_id) + " field " +
                            std::to_string(k.field) + " chunk " + std::to_string(k.index));
        break;
      }
      ++next;
    }
    if (io_->in_flight() == 0) break;
    done.clear();
    Status rs = io_->Reap(&done, 1);
    if (!rs.ok() && st.ok()) st = rs;
    for (const auto& c : done) {
      if (!c.status.ok()) {
        if (st.ok()) st = c.status;
        continue;
      }
      cache->MarkWritten(dirty[c.tag].first);
    }
    if (!rs.ok()) break;
  }
  return st;
}

Result<uint64_t> StreamedEngine::MakeDurable() {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (step_.in_step()) return FailedPrecondition("StreamedAdam::MakeDurable: a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  if (counts_.uncommitted_steps() == 0 && !params_.pending()) return counts_.last_generation();
  const uint64_t n = counts_.uncommitted_steps();
  Status s = WriteDirtyCache();
  if (s.ok()) s = mm_->Flush();
  Result<uint64_t> gen = s.ok() ? store_->Commit(MakeCommitInfo(false)) : Result<uint64_t>(s);
  if (!gen.ok()) {
    Status a = store_->AbortPending();
    if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed MakeDurable: {}", a.ToString());
    // The cache still holds the steps: keep them (dirty) and let the caller
    // retry. Their chunks written before the failure went with the dropped
    // generation, so every dirty entry must be written again by the retry.
    // Registrations and loaded mains were only in the pending generation:
    // they are gone, and the error says so.
    mem_->OnAbortPending(/*keep_dirty_cache=*/true);
    const std::string dropped = DropUncommittedRegistrations();
    Status err = gen.status().WithContext("StreamedAdam::MakeDurable of " + std::to_string(n) +
                                          " cached step(s) of store " + store_->path());
    if (n > 0) {
      err = WithNote(err, "the " + std::to_string(n) + " step(s) stay in the host cache (generation " +
                              std::to_string(counts_.last_generation()) + " is the last commit): call MakeDurable again");
    }
    return WithNote(err, dropped);
  }
  NoteCommitted(*gen);
  return *gen;
}

void StreamedEngine::StartBackgroundCommit() {
  internal::Committer::Work w;
  w.info = MakeCommitInfo(true);
  w.write_dirty_cache = step_.cache_mode();
  w.generation = store_->LatestGeneration().generation + 1;
  w.steps = counts_.uncommitted_steps() + 1;
  pipeline_->HandOffTail();
  w.pipeline = std::move(pipeline_);
  counts_.HandOffCached();  // the cached steps are written with this one
  committer_->Start(std::move(w));
}

Status StreamedEngine::FinishCommit(double* wait_s, bool keep_staged) {
  if (wait_s != nullptr) *wait_s = 0;
  prefetcher_->Stop();
  if (!keep_staged) prefetcher_->DropStaged();
  std::optional<internal::Committer::Outcome> c = committer_->Wait(wait_s);
  if (!c) return Status::Ok();
  last_stats_.slices = c->slices;
  last_stats_.write_bytes = c->write_bytes;
  last_stats_.peak_write_bytes_in_flight = c->peak_write_bytes;
  last_stats_.io_wait_seconds = c->io_wait_seconds;
  last_stats_.commit_seconds = c->commit_seconds;
  last_stats_.write_tail_bytes = c->write_bytes - std::min(c->write_bytes, c->write_bytes_at_start);
  if (c->status.ok()) {
    mem_->cache()->MarkAllClean();
    // The counts the generation holds (set_global_step may have moved on).
    counts_.CommittedAs(c->committed, c->info);
    params_.MarkCommitted();
    return Status::Ok();
  }
  // The commit's thread dropped the pending generation (and the host cache
  // with it): back to the last commit, as after an aborted step.
  counts_.RevertAll();
  Status err = c->status.WithContext(
      "StreamedAdam: the background commit of step " + std::to_string(c->info.step) + " as generation " +
      std::to_string(c->generation) + " of store " + store_->path() + " failed");
  err = WithNote(err, "nothing of it was committed" +
                          (c->steps > 1 ? " (" + std::to_string(c->steps) + " steps, cached ones included)"
                                        : std::string()) +
                          "; the optimizer and the store are at generation " +
                          std::to_string(counts_.last_generation()) + " (step " +
                          std::to_string(counts_.committed_global_step()) +
                          "); the params that step updated are ahead of the store: copy the store's mains into "
                          "them, or resume from the store");
  err = WithNote(err, DropUncommittedRegistrations());
  OPTSTATE_LOG_DEBUG("{}", err.ToString());  // returned to the caller, who reports it
  return err;
}

Status StreamedEngine::WaitForCommit() { return FinishCommit(); }

}  // namespace optstate::memmgr::internal
