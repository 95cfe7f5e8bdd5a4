// StreamedAdam: Prefetch, which reads the next step's state into the host
// cache tier or staging buffers while the trainer runs forward/backward.
#include "memmgr/internal/streamed_engine.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_layout.h"
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/internal/streamed_adam_impl.h"
#include "memmgr/internal/streamed_adam_util.h"
#include "base/log.h"

namespace optstate::memmgr::internal {


Status StreamedEngine::Prefetch() {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  // During a step the step itself is reading; a prefetch already runs.
  if (in_step_ || prefetch_) return Status::Ok();
  internal::EngineMemory* impl = mem_;
  const MemoryManagerOptions& mo = impl->options();
  // Chunks outside the tier go into staging buffers for the step's pipeline
  // to adopt: at most its own staging less one slice (StepPipeline::Begin).
  size_t stage_limit = 0;
  if (!CacheHoldsState() && staged_.empty()) {
    const size_t slice_bufs = MaxSliceSize().chunks;
    const size_t want = internal::StepPipelineBuffers(impl->staging_count(), mo, MaxSliceSize());
    stage_limit = want > slice_bufs ? want - slice_bufs : 0;
  }
  if (!impl->cache()->enabled() && stage_limit == 0) return Status::Ok();
  if (!committer_->running()) OPTSTATE_RETURN_IF_ERROR(EnsureIo());  // else the commit's thread owns io_ (it exists)
  std::vector<StepOrderEntry> order = step_order_;
  if (order.empty()) {
    for (const auto& [name, p] : params_) {
      if (!retired_.count(name)) {
        order.push_back(StepOrderEntry{p.info.id, p.rule, p.fields, p.info.numel});
      }
    }
  }
  auto run = std::make_unique<PrefetchRun>();
  PrefetchRun* r = run.get();
  const bool after_commit = committer_->running();
  mem_->BeginBackgroundCommit();
  r->thread = std::thread([this, r, after_commit, stage_limit, order = std::move(order)] {
    ReadPrefetch(r, after_commit, stage_limit, order);
  });
  prefetch_ = std::move(run);
  return Status::Ok();
}

void StreamedEngine::ReadPrefetch(PrefetchRun* r, bool after_commit, size_t stage_limit,
                                const std::vector<StepOrderEntry>& order) {
  internal::EngineMemory* impl = mem_;
  // The store shows the step's generation once its commit is done; a
  // failed commit dropped the tier, and its error comes at the next wait.
  if (after_commit && !committer_->WaitPublished(r->stop)) {
    impl->EndBackgroundCommit();
    return;
  }
  HostCache* cache = impl->cache();
  // The step's slices (SliceLayout), their chunks read in their order.
  // Staging for the reads (the tier's entries are filled by a copy, so a
  // concurrent reader of the tier never sees a half-read entry): up to a
  // read queue's worth, leaving two for concurrent pins.
  const size_t total = impl->staging_count();
  const size_t want = std::max<size_t>(1, std::min<size_t>(total >= 5 ? total - 2 : 1, impl->options().queue_depth));
  r->write_mark = impl->stats().nvme_write_bytes;
  std::vector<void*> bufs = impl->AcquireStaging(1, std::max(want, stage_limit));
  std::vector<std::pair<ChunkKey, uint64_t>> reading(bufs.size());
  std::vector<bool> keep(bufs.size(), false);  // holds a staged chunk
  size_t staged_reads = 0;                     // submitted to be staged
  std::vector<size_t> free_bufs;
  for (size_t b = bufs.size(); b-- > 0;) free_bufs.push_back(b);
  std::vector<vfs::ChunkCompletion> done;
  auto reap = [&](size_t min) {
    done.clear();
    Status rs = io_->Reap(&done, min);
    if (!rs.ok()) {
      OPTSTATE_LOG_WARN("StreamedAdam: prefetch of store {} stopped: {}", store_->path(), rs.ToString());
      return false;
    }
    for (const auto& c : done) {
      const auto& [key, len] = reading[c.tag];
      if (c.status.ok()) r->disk_bytes += len;
      if (!c.status.ok()) {
        ++r->failed;
        if (keep[c.tag]) --staged_reads;
        keep[c.tag] = false;
      } else if (keep[c.tag]) {
        r->staged.push_back(StagedChunk{key.tensor_id, key.field, key.index, len, bufs[c.tag]});
        r->read_bytes += len;
        continue;  // the buffer stays with the chunk
      } else if (cache->PutPrefetched(key, bufs[c.tag], len)) {
        r->read_bytes += len;
      }
      free_bufs.push_back(c.tag);
    }
    return true;
  };
  bool ok = true;
  internal::SliceLayout::Slice slice;
  for (const StepOrderEntry& e : order) {
    const internal::SliceLayout& layout = *layouts_[e.rule];
    for (uint64_t c = 0; ok && c < layout.Slices(e.numel) && !r->stop.load(); ++c) {
      layout.SliceOf(e.numel, c, &slice);
      for (uint32_t k = 0; k < slice.n && ok && !r->stop.load(); ++k) {
        const internal::SliceLayout::Chunk& ch = slice.chunks[k];
        const uint64_t len = ch.len;
        const ChunkKey key{e.tensor_id, e.fields[ch.rule_field], ch.index};
        bool stage = false;
        if (!cache->WantsPrefetch(key, len)) {
          // Not for the tier: a chunk the step reads from disk, staged
          // while there is room (the tier serves the ones it holds).
          if (staged_reads >= stage_limit || cache->Contains(key, len)) continue;
          stage = true;
        }
        while (ok && free_bufs.empty() && io_->in_flight() > 0) ok = reap(1);
        if (!ok || free_bufs.empty()) break;
        const size_t b = free_bufs.back();
        Status st = io_->SubmitRead(vfs::ChunkRef{key.tensor_id, key.field, key.index}, bufs[b], b);
        if (!st.ok()) {
          ++r->failed;
          continue;
        }
        free_bufs.pop_back();
        reading[b] = {key, len};
        keep[b] = stage;
        if (stage) ++staged_reads;
      }
    }
  }
  while (io_->in_flight() > 0) {
    if (!reap(io_->in_flight())) {
      std::vector<vfs::ChunkCompletion> sink;
      while (io_->in_flight() > 0 && io_->Reap(&sink, io_->in_flight()).ok()) {
      }
      break;
    }
  }
  impl->AddStats(r->disk_bytes, 0, 0, 0, 0, 0);
  std::vector<void*> unused;
  for (size_t b = 0; b < bufs.size(); ++b) {
    if (!keep[b]) unused.push_back(bufs[b]);
  }
  impl->ReleaseStaging(unused);
  impl->EndBackgroundCommit();
}

void StreamedEngine::DropStaged() {
  if (staged_.empty()) return;
  std::vector<void*> bufs;
  for (const StagedChunk& c : staged_) bufs.push_back(c.buf);
  mem_->ReleaseStaging(bufs);
  staged_.clear();
}

void StreamedEngine::StopPrefetch() {
  if (!prefetch_) return;
  committer_->Wake(&prefetch_->stop);
  prefetch_->thread.join();
  prefetch_read_bytes_ += prefetch_->read_bytes;
  staged_ = std::move(prefetch_->staged);
  staged_write_mark_ = prefetch_->write_mark;
  if (prefetch_->failed > 0) {
    OPTSTATE_LOG_INFO("StreamedAdam: prefetch of store {} could not read {} chunk(s); the step reads them",
                      store_->path(), prefetch_->failed);
  }
  prefetch_.reset();
}

}  // namespace optstate::memmgr::internal
