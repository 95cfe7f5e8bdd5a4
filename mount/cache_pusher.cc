#include "mount/cache_pusher.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "base/log.h"

namespace optstate::mount {

CachePusher::CachePusher(std::shared_ptr<ChunkReader> reader, StoreFn store, ReadStats* stats,
                         uint64_t far_bytes)
    : reader_(std::move(reader)), store_(std::move(store)), stats_(stats), far_bytes_(far_bytes) {}

CachePusher::~CachePusher() {
  stop_.store(true, std::memory_order_relaxed);
  Join();
}

void CachePusher::Join() {
  MutexLock l(&mu_);
  if (thread_.joinable()) thread_.join();
}

void CachePusher::OnRead(uint64_t offset, uint64_t bytes) {
  const uint64_t end = offset + bytes;
  uint64_t cur = read_end_.load(std::memory_order_relaxed);
  while (cur < end && !read_end_.compare_exchange_weak(cur, end, std::memory_order_relaxed)) {
  }
  if (Stopped()) return;
  MutexLock l(&mu_);
  if (!started_) {
    started_ = true;
    if (offset != 0) {
      stop_.store(true, std::memory_order_relaxed);  // not a reader from the start: never push
      return;
    }
    if (stats_ != nullptr) stats_->pushes.fetch_add(1, std::memory_order_relaxed);
    thread_ = std::thread([this, end] { Loop(end); });
    return;
  }
  const uint64_t front = front_.load(std::memory_order_relaxed);
  if (offset + far_bytes_ < front || offset > front + far_bytes_) stop_.store(true, std::memory_order_relaxed);
}

void CachePusher::Loop(uint64_t from) {
  const vfs::CheckpointFile& f = reader_->file();
  const vfs::CheckpointLayout& layout = *reader_->generation().layout;
  const uint64_t chunk_bytes = reader_->generation().view->identity().chunk_size_bytes;
  uint64_t off = from / kPageBytes * kPageBytes;
  while (!Stopped()) {
    // A reader ahead of the push has its pages (or they are on their way).
    off = std::max(off, read_end_.load(std::memory_order_relaxed) / kPageBytes * kPageBytes);
    if (off >= f.size_bytes) break;
    front_.store(off, std::memory_order_relaxed);
    // Up to the last whole page of the segment at `off` (one chunk, no copy);
    // a page that spans segments goes by itself.
    const std::vector<vfs::CheckpointSegment> segs = layout.MapRange(f, off, chunk_bytes);
    if (segs.empty()) break;
    const uint64_t seg_end = off + segs.front().length_bytes;
    uint64_t end = seg_end == f.size_bytes ? seg_end : seg_end / kPageBytes * kPageBytes;
    if (end <= off) end = std::min(f.size_bytes, off + kPageBytes);
    // Lent, not pinned: the store may wait in the kernel for pages whose READ
    // waits for a chunk of this file, and a pin held across that wait kept its
    // buffer from the READ's chunk (4 cp -r on a 2 MiB pool hung so, rarely).
    int err = 0;
    Result<uint64_t> n = reader_->ReadWith(off, end - off, [&](std::span<const iovec> iov) {
      if (!iov.empty()) err = store_(off, iov);
      return Status();
    }, /*count=*/false, /*lend=*/true);
    if (!n.ok()) {
      // The reader's own READ of that range fails with it (and logs it).
      OPTSTATE_LOG_DEBUG("optstate-mount: {}/{}: push stops at byte {}: {}", reader_->generation().dir_label,
                         f.path, off, n.status().ToString());
      break;
    }
    if (err == -ESHUTDOWN) break;  // the daemon is exiting
    if (err != 0) {
      OPTSTATE_LOG_WARN("optstate-mount: {}/{}: cannot store bytes {}..{} into the page cache ({}); the "
                        "reader's own reads go on", reader_->generation().dir_label, f.path, off, off + *n,
                        std::strerror(-err));
      break;
    }
    if (*n == 0) break;
    off += *n;
    pushed_bytes_.fetch_add(*n, std::memory_order_relaxed);
    if (stats_ != nullptr) stats_->pushed_bytes.fetch_add(*n, std::memory_order_relaxed);
  }
  front_.store(f.size_bytes, std::memory_order_relaxed);
}

}  // namespace optstate::mount
