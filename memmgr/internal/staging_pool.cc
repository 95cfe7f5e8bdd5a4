// The staging pool (pinned, chunk-sized host buffers) and the chunk
// transfers between device pages and the store that go through it.
#include <algorithm>
#include <chrono>
#include <utility>

#include "memmgr/internal/manager_impl.h"
#include "memmgr/internal/step_pipeline.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::memmgr::internal {

namespace {
uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
}  // namespace

Status ManagerImpl::LoadChunks(const std::vector<IoItem>& items) {
  if (items.empty()) return Status::Ok();
  GrowStaging(std::min<size_t>(items.size() + 2, StepPipelineStaging(opts_, SliceSize{})));
  MutexLock io_lock(&io_mu_);
  size_t pos = 0;
  while (pos < items.size()) {
    std::vector<void*> bufs = AcquireStaging(1, std::min<size_t>(items.size() - pos, staging_count()));
    std::vector<std::pair<size_t, void*>> submitted;  // item index, staging
    Status st;
    size_t b = 0;
    for (; pos < items.size() && b < bufs.size(); ++pos) {
      const IoItem& it = items[pos];
      if (cache_->Get(it.key, it.d_page, it.len, true, copy_stream_)) {
        cache_hit_ += it.len;
        continue;
      }
      vfs::ChunkRef ref{it.key.tensor_id, it.key.field, it.key.index};
      st = io_->SubmitRead(ref, bufs[b], submitted.size());
      if (!st.ok()) break;
      submitted.emplace_back(pos, bufs[b]);
      ++b;
    }
    std::vector<vfs::ChunkCompletion> done;
    uint64_t t0 = NowNs();
    while (io_->in_flight() > 0) {
      Status rs = io_->Reap(&done, io_->in_flight());
      if (!rs.ok() && st.ok()) st = rs;
      if (!rs.ok()) break;
    }
    stall_ns_ += NowNs() - t0;
    for (const auto& c : done) {
      if (!c.status.ok()) {
        if (st.ok()) st = c.status;
        continue;
      }
      const auto& [idx, buf] = submitted[c.tag];
      const IoItem& it = items[idx];
      nvme_read_ += it.len;
      Status cs = dev_->CopyH2D(it.d_page, buf, it.len, copy_stream_);
      if (!cs.ok() && st.ok()) st = cs;
      h2d_ += it.len;
      cache_->Put(it.key, buf, it.len);
    }
    Status ss = dev_->SyncStream(copy_stream_);
    if (!ss.ok() && st.ok()) st = ss;
    ReleaseStaging(bufs);
    OPTSTATE_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

Status ManagerImpl::StoreChunks(const std::vector<IoItem>& items) {
  if (items.empty()) return Status::Ok();
  GrowStaging(std::min<size_t>(items.size() + 2, StepPipelineStaging(opts_, SliceSize{})));
  MutexLock io_lock(&io_mu_);
  size_t pos = 0;
  while (pos < items.size()) {
    std::vector<void*> bufs = AcquireStaging(1, std::min<size_t>(items.size() - pos, staging_count()));
    size_t n = std::min(bufs.size(), items.size() - pos);
    Status st;
    for (size_t i = 0; i < n; ++i) {
      const IoItem& it = items[pos + i];
      st = dev_->CopyD2H(bufs[i], it.d_page, it.len, copy_stream_);
      if (!st.ok()) break;
      d2h_ += it.len;
    }
    if (st.ok()) st = dev_->SyncStream(copy_stream_);
    size_t submitted = 0;
    for (size_t i = 0; st.ok() && i < n; ++i) {
      const IoItem& it = items[pos + i];
      vfs::ChunkRef ref{it.key.tensor_id, it.key.field, it.key.index};
      st = io_->SubmitWrite(ref, bufs[i], i);
      if (st.ok()) ++submitted;
    }
    std::vector<vfs::ChunkCompletion> done;
    uint64_t t0 = NowNs();
    while (io_->in_flight() > 0) {
      Status rs = io_->Reap(&done, io_->in_flight());
      if (!rs.ok()) {
        if (st.ok()) st = rs;
        break;
      }
    }
    stall_ns_ += NowNs() - t0;
    for (const auto& c : done) {
      const IoItem& it = items[pos + c.tag];
      if (!c.status.ok()) {
        if (st.ok()) st = c.status;
        cache_->Erase(it.key);
        continue;
      }
      nvme_write_ += it.len;
      cache_->Put(it.key, bufs[c.tag], it.len);
    }
    ReleaseStaging(bufs);
    pos += n;
    OPTSTATE_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

size_t ManagerImpl::staging_count() const {
  MutexLock l(&staging_mu_);
  return staging_.size();
}

void ManagerImpl::GrowStaging(size_t total) {
  if (opts_.staging_buffers != 0) return;
  size_t have = staging_count();
  if (have >= total) return;
  std::vector<void*> added;
  for (size_t i = have; i < total; ++i) {
    auto r = dev_->AllocPinnedHost(page_bytes_);
    if (!r.ok()) {
      OPTSTATE_LOG_WARN("memmgr: growing the staging pool of store {} to {} buffers stopped at {}: {} (check "
                        "RLIMIT_MEMLOCK / pinned memory); steps run fewer slices at once",
                        store_->path(), total, i, r.status().ToString());
      break;
    }
    added.push_back(*r);
  }
  OPTSTATE_TEST_SYNC_POINT("memmgr.grow_staging.allocated");
  // The allocations ran without the lock (AcquireStaging goes on meanwhile),
  // so another thread may have grown the pool since `have` was counted: add
  // only what is still missing, and free the rest.
  std::vector<void*> spare;
  size_t now = 0;
  {
    MutexLock l(&staging_mu_);
    const size_t missing = total > staging_.size() ? total - staging_.size() : 0;
    const size_t keep = std::min(missing, added.size());
    spare.assign(added.begin() + static_cast<long>(keep), added.end());
    added.resize(keep);
    staging_.insert(staging_.end(), added.begin(), added.end());
    staging_free_.insert(staging_free_.end(), added.begin(), added.end());
    now = staging_.size();
  }
  for (void* b : spare) dev_->FreePinnedHost(b, page_bytes_);
  if (added.empty()) return;
  staging_cv_.SignalAll();
  OPTSTATE_LOG_INFO("memmgr: staging pool of store {} grown to {} buffers of {}", store_->path(), now,
                    Mib(page_bytes_));
}

std::vector<void*> ManagerImpl::AcquireStaging(size_t min, size_t max) {
  MutexLock l(&staging_mu_);
  min = std::min(std::max<size_t>(min, 1), staging_.size());
  while (staging_free_.size() < min) staging_cv_.Wait(&staging_mu_);
  size_t n = std::min(max, staging_free_.size());
  std::vector<void*> out(staging_free_.end() - static_cast<long>(n), staging_free_.end());
  staging_free_.resize(staging_free_.size() - n);
  return out;
}

void ManagerImpl::ReleaseStaging(const std::vector<void*>& bufs) {
  {
    MutexLock l(&staging_mu_);
    staging_free_.insert(staging_free_.end(), bufs.begin(), bufs.end());
  }
  staging_cv_.SignalAll();
}

}  // namespace optstate::memmgr::internal
