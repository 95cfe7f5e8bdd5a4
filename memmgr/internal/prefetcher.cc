#include "memmgr/internal/prefetcher.h"

#include <algorithm>
#include <utility>

#include "memmgr/internal/committer.h"
#include "memmgr/internal/engine_memory.h"
#include "base/log.h"

namespace optstate::memmgr::internal {

Prefetcher::~Prefetcher() {
  Stop();
  DropStaged();
}

void Prefetcher::Start(vfs::ChunkIo* io, bool after_commit, size_t stage_limit, std::vector<StepOrderEntry> order) {
  auto run = std::make_unique<Run>();
  Run* r = run.get();
  mem_->BeginBackgroundCommit();
  r->thread = std::thread([this, r, io, after_commit, stage_limit, order = std::move(order)] {
    Read(r, io, after_commit, stage_limit, order);
  });
  run_ = std::move(run);
}

void Prefetcher::Read(Run* r, vfs::ChunkIo* io, bool after_commit, size_t stage_limit,
                      const std::vector<StepOrderEntry>& order) {
  EngineMemory* impl = mem_;
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
    Status rs = io->Reap(&done, min);
    if (!rs.ok()) {
      OPTSTATE_LOG_WARN("StreamedAdam: prefetch of store {} stopped: {}", store_path_, rs.ToString());
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
        r->staged.push_back(StagedChunk{key, len, bufs[c.tag]});
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
  SliceLayout::Slice slice;
  for (const StepOrderEntry& e : order) {
    const SliceLayout& layout = *(*layouts_)[e.rule];
    for (uint64_t c = 0; ok && c < layout.Slices(e.numel) && !r->stop.load(); ++c) {
      layout.SliceOf(e.numel, c, &slice);
      for (uint32_t k = 0; k < slice.n && ok && !r->stop.load(); ++k) {
        const SliceLayout::Chunk& ch = slice.chunks[k];
        const uint64_t len = ch.len;
        const ChunkKey key{e.tensor_id, e.fields[ch.rule_field], ch.index};
        bool stage = false;
        if (!cache->WantsPrefetch(key, len)) {
          // Not for the tier: a chunk the step reads from disk, staged
          // while there is room (the tier serves the ones it holds).
          if (staged_reads >= stage_limit || cache->Contains(key, len)) continue;
          stage = true;
        }
        while (ok && free_bufs.empty() && io->in_flight() > 0) ok = reap(1);
        if (!ok || free_bufs.empty()) break;
        const size_t b = free_bufs.back();
        Status st = io->SubmitRead(vfs::ChunkRef{key.tensor_id, key.field, key.index}, bufs[b], b);
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
  while (io->in_flight() > 0) {
    if (!reap(io->in_flight())) {
      std::vector<vfs::ChunkCompletion> sink;
      while (io->in_flight() > 0 && io->Reap(&sink, io->in_flight()).ok()) {
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

void Prefetcher::Stop() {
  if (!run_) return;
  committer_->Wake(&run_->stop);
  run_->thread.join();
  read_bytes_ += run_->read_bytes;
  staged_ = std::move(run_->staged);
  staged_write_mark_ = run_->write_mark;
  if (run_->failed > 0) {
    OPTSTATE_LOG_INFO("StreamedAdam: prefetch of store {} could not read {} chunk(s); the step reads them",
                      store_path_, run_->failed);
  }
  run_.reset();
}

std::vector<StagedChunk> Prefetcher::TakeStaged() {
  if (!staged_.empty() && mem_->stats().nvme_write_bytes != staged_write_mark_) {
    DropStaged();  // a write-back through pins may have changed what they hold
  }
  return std::exchange(staged_, {});
}

void Prefetcher::DropStaged() {
  if (staged_.empty()) return;
  std::vector<void*> bufs;
  for (const StagedChunk& c : staged_) bufs.push_back(c.buf);
  mem_->ReleaseStaging(bufs);
  staged_.clear();
}

}  // namespace optstate::memmgr::internal
