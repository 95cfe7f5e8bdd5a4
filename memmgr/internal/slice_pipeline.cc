#include "memmgr/internal/slice_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

#include "memmgr/internal/streamed_adam_util.h"
#include "base/sync_point.h"

namespace optstate::memmgr::internal {

Status SlicePipeline::Begin() {
  const MemoryManagerOptions& o = mm_->options();
  if (mm_->budget_pages() < bufs_) {
    return ResourceExhausted("StreamedAdam: device budget " + std::to_string(o.device_budget_bytes) +
                             " bytes is smaller than one slice in flight (" + std::to_string(bufs_) + " x " +
                             std::to_string(mm_->page_bytes()) + " bytes)");
  }
  // Device slots: enough streams that H2D, kernels and D2H of consecutive
  // slices overlap on both copy engines (8; docs/BENCHMARKS.md "Defaults"),
  // within the budget.
  uint64_t slots = std::min<uint64_t>(mm_->budget_pages() / bufs_, 8);
  const size_t total = mm_->staging_count();
  // Every slice of the state is small: one buffer (cut into pieces) will do.
  const bool all_small = state_ && state_->big == 0;
  const size_t min_bufs = all_small ? 1 : bufs_;
  const size_t want = StepPipelineBuffers(total, o, size_, min_bufs);
  if (want < min_bufs) {
    return ResourceExhausted("StreamedAdam: " + std::to_string(total) + " staging buffers; need at least " +
                             std::to_string(min_bufs) + " (one per chunk of a slice)");
  }
  read_qd_ = std::max<uint32_t>(o.queue_depth, 3);
  write_qd_ = o.write_queue_depth == 0 ? 0 : std::max<uint32_t>(o.write_queue_depth, 3);
  if (write_qd_ == 0) read_qd_ = std::max<uint32_t>(read_qd_, 6);
  ring_requests_ = RingRequests(o);
  // Adopted prefetch buffers count against the pipeline's own staging.
  staging_ = mm_->AcquireStaging(
      min_bufs, want > extra_staging_.size() + min_bufs ? want - extra_staging_.size() : min_bufs);
  chunk_bytes_ = mm_->page_bytes();
  size_t big_sets = staging_.size() / bufs_;
  // Small sets: the buffers of two big sets cut into kSmallSliceBytes
  // pieces, for slices of small tensors (norms, biases). A trainer's mix
  // has about one such slice per big one; in big sets they took half the
  // staging and half the read-ahead while moving KiB (README, "Defaults").
  // A state with fewer big slices than big sets (a pool sized to the
  // state: StateStaging) keeps a set per big slice and cuts the rest.
  const uint64_t pieces_per_buffer = chunk_bytes_ / kSmallSliceBytes;
  size_t carve = 0;  // buffers cut into pieces
  if (state_ && state_->small > 0 && (state_->big == 0 || state_->big < big_sets) && pieces_per_buffer >= 2) {
    big_sets = static_cast<size_t>(state_->big);
    carve = staging_.size() - bufs_ * big_sets;
  } else if (big_sets >= 6 && pieces_per_buffer >= 2) {
    big_sets -= 2;
    carve = 2 * bufs_;
  }
  sets_.resize(big_sets);
  for (size_t i = 0; i < big_sets; ++i) {
    for (uint32_t f = 0; f < bufs_; ++f) sets_[i].io[f] = staging_[bufs_ * i + f];
  }
  std::vector<void*> pieces;
  for (size_t b = bufs_ * big_sets; b < bufs_ * big_sets + carve; ++b) {
    for (uint64_t k = 0; k < pieces_per_buffer; ++k) {
      pieces.push_back(static_cast<char*>(staging_[b]) + k * kSmallSliceBytes);
    }
  }
  for (size_t k = 0; k + bufs_ <= pieces.size(); k += bufs_) {
    Set small;
    small.small = true;
    for (uint32_t f = 0; f < bufs_; ++f) small.io[f] = pieces[k + f];
    sets_.push_back(small);
  }
  small_sets_ = sets_.size() - big_sets;
  if (sets_.empty()) {
    return Internal("StreamedAdam: " + std::to_string(staging_.size()) + " staging buffers make no staging set");
  }
  OPTSTATE_ASSIGN_OR_RETURN(arena_, mm_->AcquireArena(bufs_, bufs_ * slots));
  slots_.resize(arena_.pages / bufs_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    for (uint32_t f = 0; f < bufs_; ++f) slots_[i].d[f] = arena_.ptr(bufs_ * i + f);
    OPTSTATE_ASSIGN_OR_RETURN(slots_[i].stream, dev_->CreateStream());
    OPTSTATE_ASSIGN_OR_RETURN(slots_[i].event, dev_->CreateEvent());
  }
  started_ = true;
  return Status::Ok();
}

void SlicePipeline::SetMode(StepMode mode) {
  mode_ = mode;
  read_tier_ = cache_mode() || mm_->cache()->enabled();
}

void SlicePipeline::Adopt(std::vector<Staged> staged) {
  for (const Staged& st : staged) {
    extra_staging_.push_back(st.buf);
    staged_[st.key] = st;
  }
}

Status SlicePipeline::Pump(bool drain, bool until_computed) {
  if (!error_.ok()) return error_;
  if (reap_ == ReapPolicy::kHoldUntilDrain && !drain) {
    bool progressed = false;
    return SubmitReads(&progressed);
  }
  for (;;) {
    bool progressed = false;
    // 0. Collect whatever has completed (never blocks), so finished reads
    //    become computable and finished writes free their staging sets
    //    before anything new is queued.
    OPTSTATE_RETURN_IF_ERROR(ReapReady(&progressed));
    // 1. Finished device work -> writes. Writes go first: they free staging
    //    sets for read-ahead, and a write queued now keeps the disk busy in
    //    both directions (no phase with only reads in flight).
    bool gpu_pending = false;
    for (size_t k = 0; k < slots_.size(); ++k) {
      DevSlot& d = slots_[k];
      if (d.set < 0) continue;
      auto done = dev_->QueryEvent(d.event);
      if (!done.ok()) return Keep(done.status().WithContext("StreamedAdam: slice compute"));
      if (!*done) {
        gpu_pending = true;
        continue;
      }
      size_t set = static_cast<size_t>(d.set);
      d.set = -1;
      OnComputed(set);
      progressed = true;
    }
    // 1b. Computed slices -> writes, while the write queue has room.
    OPTSTATE_RETURN_IF_ERROR(SubmitComputed(&progressed));
    // 2. Reads into free staging sets before any compute: on the host
    //    backend a slice's kernel runs here, synchronously, and reads held
    //    back behind a few of them would miss the disk's next round.
    OPTSTATE_RETURN_IF_ERROR(SubmitReads(&progressed));
    // 3. Ready slices -> free device slots.
    for (size_t k = 0; k < slots_.size() && !ready_.empty(); ++k) {
      if (slots_[k].set >= 0) continue;
      size_t set = ready_.front();
      ready_.pop_front();
      double tc = NowS();
      Status cs = StartCompute(set, k);
      compute_s_ += NowS() - tc;
      OPTSTATE_RETURN_IF_ERROR(Keep(cs));
      progressed = true;
      if (dev_->backend() == Backend::kHost) {
        // Host: the kernel ran synchronously; write back as soon as there is room.
        slots_[k].set = -1;
        OnComputed(set);
        OPTSTATE_RETURN_IF_ERROR(SubmitComputed(&progressed));
        OPTSTATE_RETURN_IF_ERROR(ReapReady(&progressed));
        OPTSTATE_RETURN_IF_ERROR(SubmitReads(&progressed));
      } else {
        gpu_pending = true;
      }
    }
    if (until_computed && !gpu_pending && AllComputed()) return Status::Ok();
    bool idle = io_->in_flight() == 0 && !gpu_pending && queue_.empty() && ready_.empty() && computed_.empty() &&
                tail_busy_ == 0;
    if (idle && std::all_of(sets_.begin(), sets_.end(), [](const Set& s) { return s.stage == Stage::kFree; })) {
      return Status::Ok();
    }
    // 4. I/O completions.
    size_t min = 0;
    if (drain && !progressed && io_->in_flight() > 0 && !gpu_pending) min = 1;
    if (reap_ == ReapPolicy::kOnlyWhenBlocked && min == 0) {
      if (!drain && !progressed) return Status::Ok();
      if (!progressed && gpu_pending && io_->in_flight() == 0) {
        OPTSTATE_RETURN_IF_ERROR(Keep(SyncOldestSlot()));
      }
      continue;
    }
    done_.clear();
    double t0 = NowS();
    Status rs = io_->Reap(&done_, min);
    if (min > 0) stall_s_ += NowS() - t0;
    if (!rs.ok()) return Keep(rs.WithContext("StreamedAdam: reaping chunk I/O"));
    for (const auto& c : done_) {
      OPTSTATE_RETURN_IF_ERROR(Keep(OnCompletion(c)));
      progressed = true;
    }
    if (!drain && !progressed) return Status::Ok();
    if (drain && !progressed && gpu_pending) {
      if (io_->in_flight() == 0) {
        // Only the GPU can make progress: wait for the oldest slice on it.
        OPTSTATE_RETURN_IF_ERROR(Keep(SyncOldestSlot()));
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }
}

void SlicePipeline::Abort() {
  if (started_) {
    std::vector<vfs::ChunkCompletion> sink;
    while (io_->in_flight() > 0) {
      if (!io_->Reap(&sink, io_->in_flight()).ok()) break;
    }
  }
  for (auto& d : slots_) (void)dev_->SyncStream(d.stream);
  for (Set& st : sets_) ReleaseCached(st, /*dirty=*/true);
  for (Set& st : tail_) ReleaseCached(st, /*dirty=*/true);
  Release();
}

Status SlicePipeline::ReleaseDevice() {
  Status st;
  for (auto& d : slots_) {
    Status ss = dev_->SyncStream(d.stream);
    if (st.ok() && !ss.ok()) st = ss;
    dev_->DestroyEvent(d.event);
    dev_->DestroyStream(d.stream);
  }
  slots_.clear();
  mm_->ReleaseArena(&arena_);
  return st;
}

void SlicePipeline::Release() {
  // StartReads moves buffers between sets, staged_ and spare_, never
  // loses or duplicates one: staging_ and extra_staging_ stay the buffers
  // owned.
  if (!extra_staging_.empty()) mm_->ReleaseStaging(extra_staging_);
  extra_staging_.clear();
  staged_.clear();
  spare_.clear();
  if (!started_) return;
  started_ = false;
  for (auto& d : slots_) {
    dev_->DestroyEvent(d.event);
    dev_->DestroyStream(d.stream);
  }
  slots_.clear();
  mm_->ReleaseArena(&arena_);
  if (!staging_.empty()) mm_->ReleaseStaging(staging_);
  staging_.clear();
  sets_.clear();
  tail_.clear();
  free_tail_.clear();
  tail_busy_ = 0;
  queue_.clear();
  ready_.clear();
  computed_.clear();
}

void SlicePipeline::ReleaseCached(Set& s, bool dirty) {
  for (uint32_t f = 0; f < kMaxSliceChunks; ++f) {
    if (!s.acquired[f]) continue;
    mm_->cache()->Release(Key(s.job, f), dirty);
    s.acquired[f] = false;
  }
}

Status SlicePipeline::SubmitReads(bool* progressed) {
  while (spare_.size() >= bufs_) {
    Set grown;
    for (uint32_t f = 0; f < bufs_; ++f) {
      grown.io[f] = spare_.back();
      spare_.pop_back();
    }
    sets_.push_back(grown);
  }
  while (!queue_.empty()) {
    const Job& front = queue_.front();
    if (front.tensor != nullptr) {
      // A whole tensor: once everything before it is written.
      if (!Idle()) break;
      const Job j = front;
      queue_.pop_front();
      OPTSTATE_RETURN_IF_ERROR(Keep(RunTensorUnit(j)));
      *progressed = true;
      continue;
    }
    if (!ReadRoom(front.bytes())) break;
    const size_t i = FreeSetFor(front);
    if (i == kNoSet) {
      if (small_sets_ == sets_.size() && front.max_len() > kSmallSliceBytes) {
        return Keep(Internal("StreamedAdam: a slice of tensor id " + std::to_string(front.tensor_id) +
                             " needs whole-chunk buffers, but the step planned for small slices only"));
      }
      break;
    }
    Job j = front;
    queue_.pop_front();
    double ts = NowS();
    Status rs = StartReads(i, j);
    submit_s_ += NowS() - ts;
    OPTSTATE_RETURN_IF_ERROR(Keep(rs));
    *progressed = true;
  }
  return Status::Ok();
}

Status SlicePipeline::SubmitComputed(bool* progressed) {
  while (!computed_.empty() && WriteRoom(SetAt(computed_.front()).job.bytes())) {
    size_t set = computed_.front();
    computed_.pop_front();
    double ts = NowS();
    Status ws = StartWrites(set);
    submit_s_ += NowS() - ts;
    OPTSTATE_RETURN_IF_ERROR(Keep(ws));
    *progressed = true;
  }
  return Status::Ok();
}

void SlicePipeline::OnComputed(size_t i) {
  Set& s = sets_[i];
  if (!write_through()) {
    ReleaseCached(s, /*dirty=*/true);
    s.stage = Stage::kFree;
    ++slices;
    return;
  }
  if (std::all_of(s.acquired, s.acquired + s.job.n_bufs(), [](bool a) { return a; })) {
    // The slice lives in cache entries: its writes go out from them, and
    // the staging set is free for the next read at once.
    size_t t;
    if (free_tail_.empty()) {
      t = tail_.size();
      tail_.emplace_back();
    } else {
      t = free_tail_.back();
      free_tail_.pop_back();
    }
    Set& w = tail_[t];
    w = s;
    w.stage = Stage::kComputed;
    ++tail_busy_;
    for (uint32_t f = 0; f < kMaxSliceChunks; ++f) s.acquired[f] = false;
    s.stage = Stage::kFree;
    computed_.push_back(kTailBit | t);
    return;
  }
  s.stage = Stage::kComputed;
  computed_.push_back(i);
}

Status SlicePipeline::SyncOldestSlot() {
  DevSlot* oldest = nullptr;
  for (auto& d : slots_) {
    if (d.set >= 0 && (oldest == nullptr || d.seq < oldest->seq)) oldest = &d;
  }
  return oldest == nullptr ? Status::Ok() : dev_->SyncEvent(oldest->event);
}

size_t SlicePipeline::FreeSetFor(const Job& j) const {
  const bool fits_small = j.max_len() <= kSmallSliceBytes;
  size_t big = kNoSet;
  for (size_t i = 0; i < sets_.size(); ++i) {
    if (sets_[i].stage != Stage::kFree) continue;
    if (sets_[i].small == fits_small) return i;
    if (!sets_[i].small && big == kNoSet) big = i;
  }
  return big;
}

bool SlicePipeline::ReadRoom(uint64_t bytes) const {
  if (reads_in_flight_ == 0 && writes_in_flight_ == 0) return true;
  if (reads_in_flight_ + writes_in_flight_ + bufs_ > ring_requests_) return false;
  if (write_qd_ == 0) return read_bytes_ + write_bytes_ + bytes + bufs_ * chunk_bytes_ <= read_qd_ * chunk_bytes_;
  return read_bytes_ + bytes <= read_qd_ * chunk_bytes_;
}

bool SlicePipeline::WriteRoom(uint64_t bytes) const {
  if (writes_in_flight_ == 0) return true;
  if (reads_in_flight_ + writes_in_flight_ + bufs_ > ring_requests_) return false;
  if (write_qd_ == 0) return read_bytes_ + write_bytes_ + bytes <= read_qd_ * chunk_bytes_;
  return write_bytes_ + bytes <= write_qd_ * chunk_bytes_;
}

Status SlicePipeline::Keep(Status s) {
  if (!s.ok() && error_.ok()) error_ = s;
  return s;
}

Status SlicePipeline::ReapReady(bool* progressed) {
  if (io_->in_flight() == 0 || reap_ == ReapPolicy::kOnlyWhenBlocked) return Status::Ok();
  reap_buf_.clear();
  Status rs = io_->Reap(&reap_buf_, 0);
  if (!rs.ok()) return Keep(rs.WithContext("StreamedAdam: reaping chunk I/O"));
  for (const auto& c : reap_buf_) {
    OPTSTATE_RETURN_IF_ERROR(Keep(OnCompletion(c)));
    *progressed = true;
  }
  return Status::Ok();
}

bool SlicePipeline::AllComputed() const {
  if (!queue_.empty() || !ready_.empty()) return false;
  for (const DevSlot& d : slots_) {
    if (d.set >= 0) return false;
  }
  return std::none_of(sets_.begin(), sets_.end(), [](const Set& s) {
    return s.stage == Stage::kReading || s.stage == Stage::kReady || s.stage == Stage::kComputing;
  });
}

Status SlicePipeline::StartReads(size_t i, const Job& j) {
  Set& s = sets_[i];
  if (s.small) ++small_slices;
  s.job = j;
  s.stage = Stage::kReading;
  s.pending = 0;
  for (uint32_t f = 0; f < j.n_bufs(); ++f) {
    const uint64_t len = j.len(f);
    const ChunkKey key = Key(j, f);
    s.buf[f] = s.io[f];
    ChunkSource src;
    OPTSTATE_RETURN_IF_ERROR(SourceOf(
        key, len, [&j] { return "tensor id " + std::to_string(j.tensor_id) + " chunk " + std::to_string(j.chunk); },
        &src));
    if (src.kind == ChunkSource::Kind::kEntry || src.kind == ChunkSource::Kind::kEntryToRead) {
      s.buf[f] = src.buf;
      s.acquired[f] = true;
      if (src.kind == ChunkSource::Kind::kEntry) continue;
    }
    if (src.kind == ChunkSource::Kind::kPrefetched) {
      if (s.small) {
        std::memcpy(s.io[f], src.buf, len);
      } else {
        // The set takes the prefetched buffer; its own joins spare_,
        // which makes new sets (SubmitReads), so the pipeline grows
        // back to the depth it has without prefetch.
        spare_.push_back(s.io[f]);
        s.io[f] = src.buf;
        s.buf[f] = s.io[f];
      }
      continue;
    }
    vfs::ChunkRef ref{key.tensor_id, key.field, key.index};
    // 0: a whole chunk.
    const uint64_t buf_bytes = s.acquired[f] ? HostCache::EntryBytes(len) : s.small ? kSmallSliceBytes : 0;
    Status st = io_->SubmitRead(ref, s.buf[f], IoTag::Of(i, f).Pack(), buf_bytes);
    if (!st.ok()) {
      return st.WithContext("StreamedAdam: read tensor id " + std::to_string(j.tensor_id) + " chunk " +
                            std::to_string(j.chunk));
    }
    ++s.pending;
    ++reads_in_flight_;
    read_bytes_ += len;
    peak_read_bytes = std::max(peak_read_bytes, read_bytes_);
  }
  if (s.pending == 0) {
    s.stage = Stage::kReady;
    ready_.push_back(i);
  }
  return Status::Ok();
}

Status SlicePipeline::SourceOf(const ChunkKey& key, uint64_t len, const std::function<std::string()>& what,
                               ChunkSource* src) {
  *src = ChunkSource{};
  if (read_tier_) {
    bool valid = false;
    void* entry = mm_->cache()->Acquire(key, len, /*may_evict=*/cache_mode(), &valid);
    if (entry == nullptr && !write_through()) {
      return ResourceExhausted("StreamedAdam: host cache tier (" + std::to_string(mm_->cache()->capacity_bytes()) +
                               " bytes) has no clean entry left for " + what());
    }
    if (entry != nullptr) {
      src->buf = entry;
      if (!valid) {
        src->kind = ChunkSource::Kind::kEntryToRead;
        return Status::Ok();
      }
      src->kind = ChunkSource::Kind::kEntry;
      cache_hits += len;
      if (mm_->cache()->TakePrefetched(key)) prefetch_hits += len;
      return Status::Ok();
    }
  }
  if (staged_.empty()) return Status::Ok();
  auto sc = staged_.find(key);
  if (sc == staged_.end() || sc->second.len != len) return Status::Ok();
  src->kind = ChunkSource::Kind::kPrefetched;
  src->buf = sc->second.buf;
  staged_.erase(sc);
  prefetch_hits += len;
  return Status::Ok();
}

Status SlicePipeline::OnCompletion(const vfs::ChunkCompletion& c) {
  const IoTag tag = IoTag::Unpack(c.tag);
  const size_t i = tag.Index();
  const uint32_t f = tag.chunk;
  if ((i & kTailBit) ? (i & ~kTailBit) >= tail_.size() : i >= sets_.size()) {
    return Internal("StreamedAdam: completion with unknown tag " + std::to_string(c.tag));
  }
  Set& s = SetAt(i);
  const uint64_t len = s.job.len(f);
  if (s.stage == Stage::kReading) {
    --reads_in_flight_;
    read_bytes_ -= len;
  }
  if (s.stage == Stage::kWriting) {
    --writes_in_flight_;
    write_bytes_ -= len;
  }
  if (!c.status.ok()) return c.status;
  if (s.stage == Stage::kReading) {
    read_bytes += len;
    if (--s.pending == 0) {
      s.stage = Stage::kReady;
      ready_.push_back(i);
    }
  } else if (s.stage == Stage::kWriting) {
    write_bytes += len;
    if (on_written_) on_written_(len);
    if (s.acquired[f]) {
      mm_->cache()->Release(Key(s.job, f), /*dirty=*/true);
      mm_->cache()->MarkWritten(Key(s.job, f));
      s.acquired[f] = false;
    }
    if (--s.pending == 0) {
      s.stage = Stage::kFree;
      ++slices;
      if (i & kTailBit) {
        free_tail_.push_back(i & ~kTailBit);
        --tail_busy_;
      }
    }
  } else {
    return Internal("StreamedAdam: I/O completion for a slice that is not reading or writing");
  }
  return Status::Ok();
}

Status SlicePipeline::StartCompute(size_t i, size_t k) {
  Set& s = sets_[i];
  DevSlot& d = slots_[k];
  const Job& j = s.job;
  s.stage = Stage::kComputing;
  d.set = static_cast<long>(i);
  d.seq = next_seq_++;
  // Host backend: "device" memory is host memory, so the kernel runs in
  // place on the staging buffers (no staging -> page -> staging memcpys).
  const bool in_place = dev_->backend() == Backend::kHost;
  void* const* bufs = in_place ? s.buf : d.d;
  if (!in_place) {
    for (uint32_t f = 0; f < j.n_bufs(); ++f) {
      OPTSTATE_RETURN_IF_ERROR(dev_->CopyH2D(d.d[f], s.buf[f], j.len(f), d.stream));
    }
    h2d += j.bytes();
  }
  // Tests fail a launch here as a device error would (the callback sets the
  // Status); nothing in the product arms it (base/sync_point.h).
  Status launch;
  OPTSTATE_TEST_SYNC_POINT_CALLBACK("streamed_adam.kernel_launch", &launch);
  if (!launch.ok()) {
    return launch.WithContext("StreamedAdam: kernel launch at tensor id " + std::to_string(j.tensor_id) + " chunk " +
                              std::to_string(j.chunk));
  }
  // One kernel call per piece of the slice that is contiguous in every field.
  SliceOperands o;
  o.grad_type = j.grad_type;
  if (j.param) o.param_type = j.param_type;
  o.found_inf = found_inf_;
  for (uint64_t off = 0; off < j.slice.elems; off += o.count) {
    o.count = j.layout->Piece(j.slice, bufs, off, o.fields);
    o.first_elem = j.slice.first_elem + off;
    o.grad = static_cast<const char*>(j.grad) + o.first_elem * DTypeSize(j.grad_type);
    o.param = j.param ? static_cast<char*>(j.param) + o.first_elem * DTypeSize(j.param_type) : nullptr;
    OPTSTATE_RETURN_IF_ERROR(dev_->RunRule(*j.rule, o, j.args, cpu_threads_, d.stream));
  }
  if (!in_place) {
    for (uint32_t f = 0; f < j.n_bufs(); ++f) {
      OPTSTATE_RETURN_IF_ERROR(dev_->CopyD2H(s.buf[f], d.d[f], j.len(f), d.stream));
    }
    d2h += j.bytes();
  }
  return dev_->RecordEvent(d.event, d.stream);  // host backend: complete already
}

Status SlicePipeline::StartWrites(size_t i) {
  Set& s = SetAt(i);
  const Job& j = s.job;
  s.stage = Stage::kWriting;
  s.pending = 0;
  for (uint32_t f = 0; f < j.n_bufs(); ++f) {
    const uint64_t len = j.len(f);
    const ChunkKey key = Key(j, f);
    // The new version; cleared on abort (EngineMemory::OnAbortPending).
    if (!s.acquired[f]) mm_->cache()->Put(key, s.buf[f], len);
    vfs::ChunkRef ref{key.tensor_id, key.field, key.index};
    Status st = io_->SubmitWrite(ref, s.buf[f], IoTag::Of(i, f).Pack());
    if (!st.ok()) {
      return st.WithContext("StreamedAdam: write tensor id " + std::to_string(j.tensor_id) + " chunk " +
                            std::to_string(j.chunk));
    }
    ++s.pending;
    ++writes_in_flight_;
    write_bytes_ += len;
    peak_write_bytes = std::max(peak_write_bytes, write_bytes_);
  }
  return Status::Ok();
}

bool SlicePipeline::Idle() const {
  if (io_->in_flight() != 0 || !ready_.empty() || !computed_.empty() || tail_busy_ != 0) return false;
  for (const DevSlot& d : slots_) {
    if (d.set >= 0) return false;
  }
  return std::all_of(sets_.begin(), sets_.end(), [](const Set& s) { return s.stage == Stage::kFree; });
}

Status SlicePipeline::RunTensorUnit(const Job& j) {
  const TensorUnitSize u = TensorUnitOf(*j.rule, *j.layout, *j.tensor);
  // The unit holds the whole window: the slots' pages go back meanwhile.
  for (auto& d : slots_) OPTSTATE_RETURN_IF_ERROR(dev_->SyncStream(d.stream));
  mm_->ReleaseArena(&arena_);
  auto unit = mm_->AcquireArena(u.pages, u.pages);
  Status st;
  if (unit.ok()) {
    st = GatherScatterUnit(j, static_cast<char*>(unit->ptr(0)));
    mm_->ReleaseArena(&*unit);
  } else {
    st = unit.status().WithContext("StreamedAdam: the device window for tensor '" + j.tensor->name + "' (" +
                                   std::to_string(u.bytes) + " bytes)");
  }
  Status rs = ReacquireSlots();
  return st.ok() ? rs : st;
}

Status SlicePipeline::ReacquireSlots() {
  OPTSTATE_ASSIGN_OR_RETURN(arena_, mm_->AcquireArena(bufs_, bufs_ * std::max<size_t>(slots_.size(), 1)));
  const size_t n = arena_.pages / bufs_;
  while (slots_.size() > n) {
    dev_->DestroyEvent(slots_.back().event);
    dev_->DestroyStream(slots_.back().stream);
    slots_.pop_back();
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    for (uint32_t f = 0; f < bufs_; ++f) slots_[i].d[f] = arena_.ptr(bufs_ * i + f);
  }
  return Status::Ok();
}

Status SlicePipeline::GatherScatterUnit(const Job& j, char* base) {
  const vfs::TensorInfo& t = *j.tensor;
  const SliceLayout& l = *j.layout;
  const TensorUnitSize u = TensorUnitOf(*j.rule, l, t);
  void* stream = slots_.empty() ? nullptr : slots_.front().stream;
  const std::string what = "StreamedAdam: tensor '" + t.name + "' (whole-tensor update of " +
                           std::string(j.rule->name()) + ")";
  // Every chunk of the tensor, where it lives in the window.
  struct Piece {
    ChunkKey key;
    uint64_t len = 0;
    char* dst = nullptr;  // in the window
    void* entry = nullptr;  // an acquired host cache entry, else null
    void* buf = nullptr;    // the staging buffer in use, else null
  };
  std::vector<Piece> pieces;
  SliceLayout::Slice slice;
  for (uint64_t c = 0; c < l.Slices(t.numel); ++c) {
    l.SliceOf(t.numel, c, &slice);
    for (uint32_t k = 0; k < slice.n; ++k) {
      const SliceLayout::Chunk& ch = slice.chunks[k];
      Piece p;
      p.key = ChunkKey{j.tensor_id, j.tensor_fields[ch.rule_field], ch.index};
      p.len = ch.len;
      p.dst = base + u.field_offset[ch.rule_field] + ch.index * l.field_chunk_bytes(ch.rule_field);
      pieces.push_back(p);
    }
  }
  // Staging buffers to read into and write from: the free sets' (the
  // pipeline is idle), each with its capacity.
  std::vector<std::pair<void*, uint64_t>> free_bufs;
  for (const Set& s : sets_) {
    for (uint32_t f = 0; f < bufs_; ++f) free_bufs.emplace_back(s.io[f], s.small ? kSmallSliceBytes : chunk_bytes_);
  }
  auto take_buf = [&](uint64_t len) -> std::pair<void*, uint64_t> {
    for (size_t i = 0; i < free_bufs.size(); ++i) {
      if (free_bufs[i].second >= len) {
        auto b = free_bufs[i];
        free_bufs.erase(free_bufs.begin() + static_cast<long>(i));
        return b;
      }
    }
    return {nullptr, 0};
  };
  std::vector<uint64_t> buf_cap(pieces.size(), 0);
  // One chunk into the window, complete when it returns.
  auto copy_in = [&](char* dst, const void* src, uint64_t len) {
    Status cs = dev_->CopyH2D(dst, src, len, stream);
    return cs.ok() ? dev_->SyncStream(stream) : cs;
  };
  Status st;
  // Reaps at least min_done; on_done(piece index) for each success.
  auto reap = [&](size_t min_done, const std::function<Status(size_t)>& on_done) {
    done_.clear();
    double t0 = NowS();
    Status rs = io_->Reap(&done_, min_done);
    stall_s_ += NowS() - t0;
    if (!rs.ok() && st.ok()) st = rs.WithContext(what + ": reaping chunk I/O");
    for (const auto& c : done_) {
      if (!c.status.ok()) {
        if (st.ok()) st = c.status.WithContext(what);
        continue;
      }
      Status ds = on_done(c.tag);
      if (!ds.ok() && st.ok()) st = ds;
    }
  };
  auto drain = [&](const std::function<Status(size_t)>& on_done) {
    while (io_->in_flight() > 0) {
      const size_t before = io_->in_flight();
      reap(before, on_done);
      if (io_->in_flight() == before && !st.ok()) break;
    }
  };
  auto release_entries = [&](bool dirty) {
    for (Piece& p : pieces) {
      if (p.entry != nullptr) mm_->cache()->Release(p.key, dirty);
      p.entry = nullptr;
    }
  };
  const uint32_t max_in_flight = std::max<uint32_t>(1, std::min<uint32_t>(ring_requests_, read_qd_));
  // Reaps until piece p can be submitted (ring room, and a staging buffer
  // when it has no entry), then takes its buffer: where it goes.
  auto make_room = [&](size_t i, const std::function<Status(size_t)>& on_done) -> void* {
    Piece& p = pieces[i];
    while (st.ok() && (io_->in_flight() >= max_in_flight || (p.entry == nullptr && free_bufs.empty()))) {
      if (io_->in_flight() == 0) break;
      reap(1, on_done);
    }
    if (!st.ok() || p.entry != nullptr) return p.entry;
    auto b = take_buf(p.len);
    if (b.first == nullptr) {
      st = Internal(what + ": no staging buffer holds a chunk of " + std::to_string(p.len) + " bytes");
      return nullptr;
    }
    p.buf = b.first;
    buf_cap[i] = b.second;
    return p.buf;
  };
  // 1. Gather: each chunk from the host cache tier, a prefetched buffer or
  //    the disk, into its place in the window.
  auto landed = [&](size_t i) -> Status {
    Piece& p = pieces[i];
    const void* src = p.entry != nullptr ? p.entry : p.buf;
    read_bytes += p.len;
    Status cs = copy_in(p.dst, src, p.len);
    if (p.buf != nullptr) {
      free_bufs.emplace_back(p.buf, buf_cap[i]);
      p.buf = nullptr;
    }
    return cs;
  };
  for (size_t i = 0; i < pieces.size() && st.ok(); ++i) {
    Piece& p = pieces[i];
    ChunkSource src;
    st = SourceOf(
        p.key, p.len,
        [&] { return "chunk " + std::to_string(p.key.index) + " of tensor '" + t.name + "' (whole-tensor update)"; },
        &src);
    if (!st.ok()) break;
    if (src.kind == ChunkSource::Kind::kEntry || src.kind == ChunkSource::Kind::kEntryToRead) p.entry = src.buf;
    if (src.kind == ChunkSource::Kind::kEntry) {
      st = copy_in(p.dst, p.entry, p.len);
      continue;
    }
    if (src.kind == ChunkSource::Kind::kPrefetched) {
      st = copy_in(p.dst, src.buf, p.len);
      spare_.push_back(src.buf);  // becomes a staging set (SubmitReads)
      continue;
    }
    void* into = make_room(i, landed);
    if (!st.ok()) break;
    const uint64_t buf_bytes = p.entry != nullptr        ? HostCache::EntryBytes(p.len)
                               : buf_cap[i] < chunk_bytes_ ? buf_cap[i]
                                                           : 0;  // 0: a whole chunk
    const double ts = NowS();
    Status rs = io_->SubmitRead(vfs::ChunkRef{p.key.tensor_id, p.key.field, p.key.index}, into, i, buf_bytes);
    submit_s_ += NowS() - ts;
    if (!rs.ok()) st = rs.WithContext(what + ": read chunk " + std::to_string(p.key.index));
  }
  drain(landed);
  // 2. The kernel, once, on the whole tensor.
  if (st.ok()) {
    Status launch;
    OPTSTATE_TEST_SYNC_POINT_CALLBACK("streamed_adam.kernel_launch", &launch);
    if (!launch.ok()) st = launch.WithContext(what + ": kernel launch");
  }
  if (st.ok()) {
    SliceOperands o;
    for (uint32_t f = 0; f < l.fields(); ++f) o.fields[f] = base + u.field_offset[f];
    o.count = t.numel;
    o.first_elem = 0;
    o.grad = j.grad;
    o.grad_type = j.grad_type;
    o.param = j.param;
    if (j.param) o.param_type = j.param_type;
    o.found_inf = found_inf_;
    o.workspace = base + u.workspace_offset;
    o.shape = &t.shape;
    const double tc = NowS();
    st = dev_->RunRule(*j.rule, o, j.args, cpu_threads_, stream);
    if (st.ok()) st = dev_->SyncStream(stream);
    compute_s_ += NowS() - tc;
    if (!st.ok()) st = st.WithContext(what);
  }
  if (dev_->backend() != Backend::kHost) {
    for (const Piece& p : pieces) h2d += p.len;
  }
  // 3. Scatter: each chunk back into its entry or a staging buffer, and
  //    written (or left dirty in the tier when the step does not write).
  auto written = [&](size_t i) -> Status {
    Piece& p = pieces[i];
    write_bytes += p.len;
    if (on_written_) on_written_(p.len);
    if (p.entry != nullptr) {
      mm_->cache()->Release(p.key, /*dirty=*/true);
      mm_->cache()->MarkWritten(p.key);
      p.entry = nullptr;
    }
    if (p.buf != nullptr) {
      free_bufs.emplace_back(p.buf, buf_cap[i]);
      p.buf = nullptr;
    }
    return Status::Ok();
  };
  for (size_t i = 0; i < pieces.size() && st.ok(); ++i) {
    Piece& p = pieces[i];
    void* from = make_room(i, written);
    if (!st.ok()) break;
    st = dev_->CopyD2H(from, p.dst, p.len, stream);
    if (st.ok()) st = dev_->SyncStream(stream);
    if (!st.ok()) break;
    if (dev_->backend() != Backend::kHost) d2h += p.len;
    if (!write_through()) {
      // The step lives in the tier only (cache mode): dirty, not written.
      mm_->cache()->Release(p.key, /*dirty=*/true);
      p.entry = nullptr;
      continue;
    }
    if (p.entry == nullptr) mm_->cache()->Put(p.key, from, p.len);  // the new version
    const double ts = NowS();
    Status ws = io_->SubmitWrite(vfs::ChunkRef{p.key.tensor_id, p.key.field, p.key.index}, from, i);
    submit_s_ += NowS() - ts;
    if (!ws.ok()) st = ws.WithContext(what + ": write chunk " + std::to_string(p.key.index));
  }
  drain(written);
  // On an error the entries still held go back dirty (the caller drops the
  // tier with the pending generation).
  release_entries(/*dirty=*/true);
  if (st.ok()) ++slices;
  return st;
}

}  // namespace optstate::memmgr::internal
