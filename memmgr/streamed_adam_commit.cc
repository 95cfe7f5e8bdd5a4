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
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/internal/streamed_adam_impl.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr::internal {


vfs::CommitInfo StreamedEngine::MakeCommitInfo(bool advance) const {
  vfs::CommitInfo ci;
  ci.step = advance ? global_step_ + 1 : global_step_;
  for (const auto& [id, g] : groups_) {
    vfs::GroupInfo gi;
    gi.id = id;
    auto sc = step_counts_.find(id);
    gi.step_count = sc == step_counts_.end() ? 0 : sc->second;
    if (advance && groups_stepped_.count(id)) gi.step_count += 1;
    const Hyperparams h = GroupMap(g);
    gi.hyper.insert(h.begin(), h.end());
    ci.groups.push_back(std::move(gi));
  }
  // Every tensor's count (Store::Commit keeps those that differ from their
  // group's).
  std::set<uint32_t> stepped;
  if (advance) {
    for (const std::string& n : stepped_) stepped.insert(params_.at(n).info.id);
  }
  for (const auto& [id, c] : tensor_counts_) ci.tensor_steps[id] = c.now + (stepped.count(id) ? 1 : 0);
  return ci;
}

void StreamedEngine::AdvanceCounts() {
  for (const auto& [id, stepped] : groups_stepped_) step_counts_[id] += 1;
  for (const std::string& n : stepped_) tensor_counts_[params_.at(n).info.id].now += 1;
}

bool StreamedEngine::CacheHoldsState() const {
  const HostCache* c = mem_->cache();
  if (!c->enabled()) return false;
  return StateCacheBytes() <= c->capacity_bytes();
}

uint64_t StreamedEngine::StateCacheBytes() const {
  const uint64_t chunk = mem_->page_bytes();
  uint64_t need = 0;
  for (const auto& [name, p] : params_) {
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
  last_generation_ = gen;
  mem_->cache()->MarkAllClean();
  uncommitted_steps_ = 0;
  committed_step_counts_ = step_counts_;
  for (auto& [id, c] : tensor_counts_) c.committed = c.now;
  committed_global_step_ = global_step_;
  for (auto& [name, p] : params_) {
    p.committed = true;
    p.main_pending = false;
  }
  registrations_pending_ = false;
  dropped_.clear();
}

std::string StreamedEngine::RevertUncommitted() {
  if (uncommitted_steps_ == 0) return "";
  std::string msg = std::to_string(uncommitted_steps_) +
                    " step(s) held only in the host cache were lost; the optimizer is back at generation " +
                    std::to_string(last_generation_) + " (step " + std::to_string(committed_global_step_) + ")";
  for (auto& [id, n] : step_counts_) {
    auto it = committed_step_counts_.find(id);
    n = it == committed_step_counts_.end() ? 0 : it->second;
  }
  for (auto& [id, c] : tensor_counts_) c.now = c.committed;
  global_step_ = committed_global_step_;
  uncommitted_steps_ = 0;
  return msg;
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
  if (in_step_) return FailedPrecondition("StreamedAdam::MakeDurable: a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  if (uncommitted_steps_ == 0 && !registrations_pending_) return last_generation_;
  const uint64_t n = uncommitted_steps_;
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
                              std::to_string(last_generation_) + " is the last commit): call MakeDurable again");
    }
    return WithNote(err, dropped);
  }
  NoteCommitted(*gen);
  return *gen;
}

void StreamedEngine::StartBackgroundCommit() {
  internal::Committer::Work w;
  w.info = MakeCommitInfo(true);
  w.write_dirty_cache = step_cache_mode_;
  w.generation = store_->LatestGeneration().generation + 1;
  w.steps = uncommitted_steps_ + 1;
  pipeline_->SetReapOnlyWhenBlocked(false);
  w.pipeline = std::move(pipeline_);
  uncommitted_steps_ = 0;  // the cached steps are written with this one
  committer_->Start(std::move(w));
}

Status StreamedEngine::FinishCommit(double* wait_s, bool keep_staged) {
  if (wait_s != nullptr) *wait_s = 0;
  StopPrefetch();
  if (!keep_staged) DropStaged();
  std::optional<internal::Committer::Outcome> c = committer_->Wait(wait_s);
  if (!c) return Status::Ok();
  last_stats_.slices = c->slices;
  last_stats_.write_bytes = c->write_bytes;
  last_stats_.peak_write_bytes_in_flight = c->peak_write_bytes;
  last_stats_.io_wait_seconds = c->io_wait_seconds;
  last_stats_.commit_seconds = c->commit_seconds;
  last_stats_.write_tail_bytes = c->write_bytes - std::min(c->write_bytes, c->write_bytes_at_start);
  if (c->status.ok()) {
    NoteCommitted(c->committed);
    // The counts the generation holds (set_global_step may have moved on).
    committed_global_step_ = c->info.step;
    committed_step_counts_.clear();
    for (const vfs::GroupInfo& g : c->info.groups) committed_step_counts_[g.id] = g.step_count;
    for (auto& [id, tc] : tensor_counts_) {
      auto it = c->info.tensor_steps.find(id);
      if (it != c->info.tensor_steps.end()) tc.committed = it->second;
    }
    return Status::Ok();
  }
  // The commit's thread dropped the pending generation (and the host cache
  // with it): back to the last commit, as after an aborted step.
  for (auto& [id, n] : step_counts_) {
    auto it = committed_step_counts_.find(id);
    n = it == committed_step_counts_.end() ? 0 : it->second;
  }
  for (auto& [id, tc] : tensor_counts_) tc.now = tc.committed;
  global_step_ = committed_global_step_;
  uncommitted_steps_ = 0;
  Status err = c->status.WithContext(
      "StreamedAdam: the background commit of step " + std::to_string(c->info.step) + " as generation " +
      std::to_string(c->generation) + " of store " + store_->path() + " failed");
  err = WithNote(err, "nothing of it was committed" +
                          (c->steps > 1 ? " (" + std::to_string(c->steps) + " steps, cached ones included)"
                                        : std::string()) +
                          "; the optimizer and the store are at generation " + std::to_string(last_generation_) +
                          " (step " + std::to_string(committed_global_step_) +
                          "); the params that step updated are ahead of the store: copy the store's mains into "
                          "them, or resume from the store");
  err = WithNote(err, DropUncommittedRegistrations());
  OPTSTATE_LOG_DEBUG("{}", err.ToString());  // returned to the caller, who reports it
  return err;
}

Status StreamedEngine::WaitForCommit() { return FinishCommit(); }

}  // namespace optstate::memmgr::internal
