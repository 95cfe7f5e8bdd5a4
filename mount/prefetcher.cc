#include "mount/prefetcher.h"

#include <algorithm>

#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::mount {

Prefetcher::Prefetcher(const MountOptions& opts, ChunkBufferPool* pool, ReadStats* stats, HeldFn held)
    : opts_(opts), pool_(pool), stats_(stats), held_(std::move(held)) {
  thread_ = std::thread([this] { Loop(); });
}

Prefetcher::~Prefetcher() {
  {
    MutexLock l(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
  parked_.clear();  // closes the readers (joins their threads)
}

size_t Prefetcher::parked() const {
  MutexLock l(&mu_);
  return parked_.size();
}

std::unique_ptr<ChunkReader> Prefetcher::Take(const Generation* gen, const vfs::CheckpointFile* file) {
  MutexLock l(&mu_);
  while (opening_ == file && !stop_) cv_.Wait(&mu_);
  for (auto it = parked_.begin(); it != parked_.end(); ++it) {
    if (it->gen.get() != gen || it->file != file) continue;
    std::unique_ptr<ChunkReader> r = std::move(it->reader);
    parked_.erase(it);
    if (stats_ != nullptr) stats_->prefetched.fetch_add(1, std::memory_order_relaxed);
    return r;
  }
  return nullptr;
}

void Prefetcher::Opened(std::shared_ptr<const Generation> gen, const vfs::CheckpointFile* file, bool taken) {
  auto pos = gen->file_position.find(file);
  if (pos == gen->file_position.end()) return;
  {
    MutexLock l(&mu_);
    bool walk = taken;
    if (!walk && last_gen_ == gen.get() && last_pos_ < pos->second) {
      // The next file with chunks after the previous open?
      uint32_t i = last_pos_ + 1;
      while (i < pos->second && gen->layout->ChunkSequenceLength(*gen->files_in_tree_order[i]) == 0) ++i;
      walk = i == pos->second;
    }
    last_gen_ = gen.get();
    last_pos_ = pos->second;
    if (!walk) return;
    want_gen_ = std::move(gen);
    want_after_ = pos->second;
    want_ = true;
  }
  cv_.SignalAll();
}

void Prefetcher::Loop() {
  MutexLock l(&mu_);
  while (!stop_) {
    // Close readers parked too long or beyond the bound (outside the lock:
    // closing joins their threads).
    std::vector<std::unique_ptr<ChunkReader>> closing;
    const auto now = std::chrono::steady_clock::now();
    const size_t max_parked = 2 * size_t{opts_.prefetch_files};
    while (!parked_.empty() && (parked_.size() > max_parked || now - parked_.front().at > kIdle)) {
      closing.push_back(std::move(parked_.front().reader));
      parked_.pop_front();
    }
    if (!closing.empty()) {
      l.Unlock();
      closing.clear();
      l.Lock();
      continue;
    }
    if (!want_) {
      // No round asked for since the last one ended (with the prefetcher's
      // lock held: a callback must not take it).
      OPTSTATE_TEST_SYNC_POINT("prefetcher.idle");
      cv_.WaitFor(&mu_, kIdle / 2);
      continue;
    }
    want_ = false;
    std::shared_ptr<const Generation> gen = std::move(want_gen_);  // held no longer than this round
    const uint32_t after = want_after_;
    // The next files with chunks to read, opened in order, up to
    // prefetch_files of them or until they load prefetch_bytes (a parked
    // reader loads its first two chunks: ChunkReader's window at open); a
    // newer Opened (the reader moved on) replaces this round.
    const uint64_t chunk = gen->view->identity().chunk_size_bytes;
    uint32_t found = 0;
    uint64_t ahead_bytes = 0;
    for (uint32_t i = after + 1; i < gen->files_in_tree_order.size() && found < opts_.prefetch_files &&
                                 ahead_bytes < opts_.prefetch_bytes && !want_ && !stop_;
         ++i) {
      const vfs::CheckpointFile* f = gen->files_in_tree_order[i];
      if (gen->layout->ChunkSequenceLength(*f) == 0) continue;
      ++found;
      ahead_bytes += std::min(f->size_bytes, 2 * chunk);
      bool have = false;
      for (const Parked& p : parked_) have = have || (p.gen == gen && p.file == f);
      if (have) continue;
      opening_ = f;
      l.Unlock();
      auto r = ChunkReader::Open(gen, f, opts_, pool_, stats_, /*start=*/held_ == nullptr);
      if (r.ok() && held_ != nullptr) {
        if (held_(*gen, *f)) {
          if (stats_ != nullptr) ++stats_->held;
        } else {
          (*r)->Start();
        }
      }
      l.Lock();
      opening_ = nullptr;
      cv_.SignalAll();
      if (!r.ok()) break;  // out of threads: the reader's own open reports it
      parked_.push_back(Parked{gen, f, std::move(r).value(), std::chrono::steady_clock::now()});
    }
    // Argument: the tree position the round opened files after. With the
    // prefetcher's lock held: a callback must not take it.
    OPTSTATE_TEST_SYNC_POINT_CALLBACK("prefetcher.round_done", const_cast<uint32_t*>(&after));
  }
}

}  // namespace optstate::mount
