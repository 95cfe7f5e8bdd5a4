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
namespace {

// The chunks of every field of a whole-tensor job (its unit's pieces).
uint64_t UnitChunks(const PlanUnit& j) {
  SliceLayout::Slice slice;
  uint64_t n = 0;
  for (uint64_t c = 0; c < j.layout->Slices(j.tensor->numel); ++c) {
    j.layout->SliceOf(j.tensor->numel, c, &slice);
    n += slice.n;
  }
  return n;
}

}  // namespace

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
  // A state mostly of whole-tensor units (Muon's matrices beside AdamW's
  // norms and biases): the budget's pages go to the units' windows (with 8
  // slots of AdamW's 3 chunks, a 256 MiB budget of 8 MiB pages kept 8 pages
  // for them), and two slots still overlap one slice's copies and kernel
  // with the next one's.
  if (state_ && state_->unit_bytes > state_->slice_bytes) slots = std::min<uint64_t>(slots, kUnitStateSlots);
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
  slot_count_ = arena_.pages / bufs_;
  started_ = true;
  OPTSTATE_RETURN_IF_ERROR(MapSlots());
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
    // 2b. Whole-tensor units: their reads and writes, then their kernels.
    OPTSTATE_RETURN_IF_ERROR(AdvanceUnits(&progressed));
    if (UnitGpuPending()) gpu_pending = true;
    // 3. Ready slices -> free device slots (none while their pages are lent
    //    to units' windows).
    for (size_t k = 0; k < slots_.size() && !ready_.empty() && !slots_lent_; ++k) {
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
                tail_busy_ == 0 && units_.empty();
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
  for (auto& l : lanes_) (void)dev_->SyncStream(l.stream);
  while (!units_.empty()) EndUnit(units_.size() - 1, /*dirty=*/true);
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
  // Units left are writing only: their device work and windows are done.
  for (auto& l : lanes_) {
    dev_->DestroyEvent(l.event);
    dev_->DestroyStream(l.stream);
  }
  lanes_.clear();
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
  while (!units_.empty()) EndUnit(units_.size() - 1, /*dirty=*/true);
  for (auto& l : lanes_) {
    dev_->DestroyEvent(l.event);
    dev_->DestroyStream(l.stream);
  }
  lanes_.clear();
  slots_lent_ = false;
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
      // A whole tensor: once its window fits (StartUnit).
      bool started = false;
      OPTSTATE_RETURN_IF_ERROR(Keep(StartUnit(front, &started)));
      if (!started) break;
      queue_.pop_front();
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
  if (oldest != nullptr) return dev_->SyncEvent(oldest->event);
  for (const Unit& u : units_) {
    if (u.phase == Unit::Phase::kKernel) return dev_->SyncEvent(lanes_[u.lane].event);
  }
  return Status::Ok();
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
  // A unit is computed once its last copy out of the window is done.
  for (const Unit& u : units_) {
    if (u.phase != Unit::Phase::kWriting) return false;
  }
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
  if ((c.tag & kUnitBit) != 0 && (c.tag >> 63) == 0) return OnUnitCompletion(c);
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

Status SlicePipeline::StartUnit(const Job& j, bool* started) {
  *started = false;
  uint64_t held_pages = 0;
  if (WindowsHeld(&held_pages) >= kMaxUnits) return Status::Ok();
  // A slice read while the slots' pages are lent computes only once they
  // are back: no unit starts until they are, whole (here, or as the windows
  // held go back: ReleaseWindow).
  if (slots_lent_ && !ready_.empty()) {
    OPTSTATE_RETURN_IF_ERROR(ReacquireSlots(/*wait=*/false));
    if (slots_lent_) return Status::Ok();
  }
  const TensorUnitSize size = TensorUnitOf(*j.rule, *j.layout, *j.tensor);
  const std::string what = "StreamedAdam: tensor '" + j.tensor->name + "' (whole-tensor update of " +
                           std::string(j.rule->name()) + ")";
  // Staging: free big sets (small ones when the step has no big sets), as
  // many as its gather keeps busy (a buffer per chunk, at most a read
  // queue's worth), at most half of them, so that the slices and the next
  // units keep some.
  const uint64_t chunks = UnitChunks(j);
  const uint64_t need_bufs = std::min<uint64_t>(chunks, std::max<uint32_t>(read_qd_, bufs_));
  const size_t need_sets = static_cast<size_t>((need_bufs + bufs_ - 1) / bufs_);
  std::vector<size_t> free_big, free_small;
  size_t big_total = 0;
  for (size_t i = 0; i < sets_.size(); ++i) {
    if (!sets_[i].small) ++big_total;
    if (sets_[i].stage != Stage::kFree) continue;
    (sets_[i].small ? free_small : free_big).push_back(i);
  }
  const bool use_big = big_total > 0;
  const std::vector<size_t>& from = use_big ? free_big : free_small;
  const size_t quota = std::min(need_sets, std::max<size_t>(1, (use_big ? big_total : sets_.size()) / 2));
  std::vector<size_t> sets(from.begin(), from.begin() + static_cast<long>(std::min(from.size(), quota)));
  if (sets.empty()) return Status::Ok();  // waits for a staging set
  // Its stream and event.
  size_t lane = 0;
  while (lane < lanes_.size() && lanes_[lane].busy) ++lane;
  if (lane == lanes_.size()) {
    Lane l;
    OPTSTATE_ASSIGN_OR_RETURN(l.stream, dev_->CreateStream());
    auto event = dev_->CreateEvent();
    if (!event.ok()) {
      dev_->DestroyStream(l.stream);
      return event.status().WithContext(what);
    }
    l.event = *event;
    lanes_.push_back(l);
  }
  // The window: from the budget's free pages, beside the slots' window and
  // the other units'. When they do not leave room, the slots' pages are
  // lent to the units while no slice computes on them or waits for them,
  // if the budget holds this window beside the other units' (ReleaseWindow
  // takes them back). With no other window held, the unit then waits only
  // for the trainer's pins, as a unit always has; beside one, it never
  // waits.
  auto window = mm_->AcquireArena(size.pages, size.pages, /*wait=*/false);
  if (!window.ok() && window.status().code() == StatusCode::kBusy) {
    const bool slot_busy = std::any_of(slots_.begin(), slots_.end(), [](const DevSlot& d) { return d.set >= 0; });
    if (slot_busy || !ready_.empty() || slots_lent_ || size.pages + held_pages > mm_->budget_pages()) {
      return Status::Ok();  // waits for them
    }
    for (auto& d : slots_) OPTSTATE_RETURN_IF_ERROR(dev_->SyncStream(d.stream));
    mm_->ReleaseArena(&arena_);
    slots_lent_ = true;
    const bool alone = held_pages == 0;
    window = mm_->AcquireArena(size.pages, size.pages, /*wait=*/alone);
    if (!window.ok()) {
      OPTSTATE_RETURN_IF_ERROR(ReacquireSlots(/*wait=*/alone));
      if (window.status().code() == StatusCode::kBusy) return Status::Ok();  // pins hold pages: waits
    }
  }
  if (!window.ok()) {
    return window.status().WithContext("StreamedAdam: the device window for tensor '" + j.tensor->name + "' (" +
                                       std::to_string(size.bytes) + " bytes)");
  }
  lanes_[lane].busy = true;
  Unit u;
  u.job = j;
  u.size = size;
  u.window = std::move(*window);
  u.id = next_unit_id_++;
  u.lane = lane;
  u.what = what;
  u.sets = std::move(sets);
  for (size_t i : u.sets) {
    Set& s = sets_[i];
    s.stage = Stage::kUnit;
    for (uint32_t f = 0; f < bufs_; ++f) u.free_bufs.emplace_back(s.io[f], s.small ? kSmallSliceBytes : chunk_bytes_);
  }
  // Every chunk of the tensor, where it lives in the window.
  const vfs::TensorInfo& t = *j.tensor;
  const SliceLayout& l = *j.layout;
  char* base = static_cast<char*>(u.window.ptr(0));
  SliceLayout::Slice slice;
  for (uint64_t c = 0; c < l.Slices(t.numel); ++c) {
    l.SliceOf(t.numel, c, &slice);
    for (uint32_t k = 0; k < slice.n; ++k) {
      const SliceLayout::Chunk& ch = slice.chunks[k];
      UnitPiece p;
      p.key = ChunkKey{j.tensor_id, j.tensor_fields[ch.rule_field], ch.index};
      p.len = ch.len;
      p.dst = base + size.field_offset[ch.rule_field] + ch.index * l.field_chunk_bytes(ch.rule_field);
      u.pieces.push_back(p);
    }
  }
  units_.push_back(std::move(u));
  peak_unit_windows = std::max<uint64_t>(peak_unit_windows, WindowsHeld(&held_pages));
  *started = true;
  bool progressed = false;
  return AdvanceUnitIo(units_.back(), &progressed);
}

Status SlicePipeline::AdvanceUnits(bool* progressed) {
  for (Unit& u : units_) OPTSTATE_RETURN_IF_ERROR(Keep(AdvanceUnitIo(u, progressed)));
  // Kernels in queue order (a unit gathered before the one ahead of it waits).
  // A host kernel runs here, on this thread: one per pass, so that the
  // computed unit's writes and the next reads go out before the next
  // kernel (back to back, the kernels of every gathered unit left the disk
  // idle for all of them).
  const bool host = dev_->backend() == Backend::kHost;
  for (Unit& u : units_) {
    if (u.phase != Unit::Phase::kGather) continue;
    if (u.next != u.pieces.size() || u.pending != 0) break;
    OPTSTATE_RETURN_IF_ERROR(Keep(LaunchUnit(u)));
    *progressed = true;
    if (host) break;
  }
  for (Unit& u : units_) OPTSTATE_RETURN_IF_ERROR(Keep(AdvanceUnitIo(u, progressed)));
  for (size_t k = 0; k < units_.size();) {
    Unit& u = units_[k];
    if (u.phase == Unit::Phase::kWriting && u.pending == 0) {
      EndUnit(k, /*dirty=*/true);
      ++slices;
      *progressed = true;
      continue;
    }
    ++k;
  }
  return Status::Ok();
}

Status SlicePipeline::RecycleCopies(Unit& u) {
  if (u.copying.empty()) return Status::Ok();
  OPTSTATE_RETURN_IF_ERROR(dev_->SyncStream(lanes_[u.lane].stream));
  for (const Unit::Copying& c : u.copying) {
    if (c.spare) {
      spare_.push_back(c.buf);  // becomes a staging set (SubmitReads)
    } else {
      u.free_bufs.emplace_back(c.buf, c.cap);
    }
  }
  u.copying.clear();
  return Status::Ok();
}

Status SlicePipeline::AdvanceUnitIo(Unit& u, bool* progressed) {
  // Writing: only completions move it on (its lane may be gone: ReleaseDevice).
  if (u.phase == Unit::Phase::kWriting) return Status::Ok();
  void* stream = lanes_[u.lane].stream;
  const bool host = dev_->backend() == Backend::kHost;
  // A free buffer for piece p (capacity >= its length); false when none.
  auto find_buf = [&](UnitPiece& p) {
    for (size_t i = 0; i < u.free_bufs.size(); ++i) {
      if (u.free_bufs[i].second < p.len) continue;
      p.buf = u.free_bufs[i].first;
      p.cap = u.free_bufs[i].second;
      u.free_bufs.erase(u.free_bufs.begin() + static_cast<long>(i));
      return true;
    }
    return false;
  };
  auto no_buf = [&](const UnitPiece& p) {
    return Internal(u.what + ": no staging buffer holds a chunk of " + std::to_string(p.len) + " bytes");
  };
  if (u.phase == Unit::Phase::kGather) {
    // Each chunk from the host cache tier, a prefetched buffer or the disk,
    // into its place in the window.
    while (u.next < u.pieces.size()) {
      UnitPiece& p = u.pieces[u.next];
      const auto key_what = [&] {
        return "chunk " + std::to_string(p.key.index) + " of tensor '" + u.job.tensor->name +
               "' (whole-tensor update)";
      };
      if (!ReadRoom(p.len)) break;
      if (p.entry == nullptr) {
        ChunkSource src;
        OPTSTATE_RETURN_IF_ERROR(SourceOf(p.key, p.len, key_what, &src));
        if (src.kind == ChunkSource::Kind::kEntry || src.kind == ChunkSource::Kind::kEntryToRead) p.entry = src.buf;
        if (src.kind == ChunkSource::Kind::kEntry) {
          OPTSTATE_RETURN_IF_ERROR(dev_->CopyH2D(p.dst, p.entry, p.len, stream));
          ++u.next;
          *progressed = true;
          continue;
        }
        if (src.kind == ChunkSource::Kind::kPrefetched) {
          OPTSTATE_RETURN_IF_ERROR(dev_->CopyH2D(p.dst, src.buf, p.len, stream));
          u.copying.push_back({src.buf, chunk_bytes_, /*spare=*/true});
          ++u.next;
          *progressed = true;
          continue;
        }
      }
      if (p.entry == nullptr && !find_buf(p)) {
        // Buffers come back once their copies into the window are done.
        OPTSTATE_RETURN_IF_ERROR(RecycleCopies(u));
        if (!find_buf(p)) {
          if (u.pending == 0) return no_buf(p);
          break;  // waits for a read to land
        }
      }
      void* into = p.entry != nullptr ? p.entry : p.buf;
      const uint64_t buf_bytes = p.entry != nullptr    ? HostCache::EntryBytes(p.len)
                                 : p.cap < chunk_bytes_ ? p.cap
                                                        : 0;  // 0: a whole chunk
      const double ts = NowS();
      Status rs = io_->SubmitRead(vfs::ChunkRef{p.key.tensor_id, p.key.field, p.key.index}, into,
                                  UnitTag(u.id, u.next), buf_bytes);
      submit_s_ += NowS() - ts;
      if (!rs.ok()) {
        // Not submitted: the buffer goes back (an entry is released with the unit).
        if (p.buf != nullptr) u.free_bufs.emplace_back(p.buf, p.cap);
        p.buf = nullptr;
        return rs.WithContext(u.what + ": read chunk " + std::to_string(p.key.index));
      }
      ++u.pending;
      ++reads_in_flight_;
      read_bytes_ += p.len;
      peak_read_bytes = std::max(peak_read_bytes, read_bytes_);
      ++u.next;
      *progressed = true;
    }
    return Status::Ok();
  }
  if (u.phase == Unit::Phase::kKernel) {
    auto done = dev_->QueryEvent(lanes_[u.lane].event);
    if (!done.ok()) return done.status().WithContext(u.what);
    if (!*done) return Status::Ok();
    // The kernel read every buffer copied in: they are all free again.
    OPTSTATE_RETURN_IF_ERROR(RecycleCopies(u));
    u.phase = Unit::Phase::kScatter;
    u.next = 0;
    *progressed = true;
  }
  if (u.phase != Unit::Phase::kScatter) return Status::Ok();
  // Each chunk back into its entry or a staging buffer, and written (or left
  // dirty in the tier when the step does not write): a round of copies out
  // of the window (as many as there are buffers and write room), one sync,
  // then their writes.
  const size_t first = u.next;
  uint64_t round_bytes = 0;
  while (u.next < u.pieces.size()) {
    UnitPiece& p = u.pieces[u.next];
    if (write_through() && !WriteRoom(round_bytes + p.len)) break;
    if (p.entry == nullptr && !find_buf(p)) {
      // Buffers come back as writes complete.
      if (u.pending == 0 && u.next == first) return no_buf(p);
      break;
    }
    round_bytes += p.len;
    void* to = p.entry != nullptr ? p.entry : p.buf;
    OPTSTATE_RETURN_IF_ERROR(dev_->CopyD2H(to, p.dst, p.len, stream));
    if (!host) d2h += p.len;
    ++u.next;
  }
  if (u.next == first) return Status::Ok();
  *progressed = true;
  OPTSTATE_RETURN_IF_ERROR(dev_->SyncStream(stream));
  if (u.next == u.pieces.size()) OPTSTATE_RETURN_IF_ERROR(ReleaseWindow(u));
  for (size_t i = first; i < u.next; ++i) {
    UnitPiece& p = u.pieces[i];
    if (!write_through()) {
      // The step lives in the tier only (cache mode): dirty, not written.
      mm_->cache()->Release(p.key, /*dirty=*/true);
      p.entry = nullptr;
      continue;
    }
    void* from = p.entry != nullptr ? p.entry : p.buf;
    if (p.entry == nullptr) mm_->cache()->Put(p.key, from, p.len);  // the new version
    const double ts = NowS();
    Status ws = io_->SubmitWrite(vfs::ChunkRef{p.key.tensor_id, p.key.field, p.key.index}, from, UnitTag(u.id, i));
    submit_s_ += NowS() - ts;
    if (!ws.ok()) return ws.WithContext(u.what + ": write chunk " + std::to_string(p.key.index));
    ++u.pending;
    ++writes_in_flight_;
    write_bytes_ += p.len;
    peak_write_bytes = std::max(peak_write_bytes, write_bytes_);
  }
  if (u.next == u.pieces.size()) u.phase = Unit::Phase::kWriting;
  return Status::Ok();
}

Status SlicePipeline::LaunchUnit(Unit& u) {
  const Job& j = u.job;
  const vfs::TensorInfo& t = *j.tensor;
  const SliceLayout& l = *j.layout;
  void* stream = lanes_[u.lane].stream;
  if (dev_->backend() != Backend::kHost) {
    for (const UnitPiece& p : u.pieces) h2d += p.len;
  }
  Status launch;
  OPTSTATE_TEST_SYNC_POINT_CALLBACK("streamed_adam.kernel_launch", &launch);
  if (!launch.ok()) return launch.WithContext(u.what + ": kernel launch");
  char* base = static_cast<char*>(u.window.ptr(0));
  SliceOperands o;
  for (uint32_t f = 0; f < l.fields(); ++f) o.fields[f] = base + u.size.field_offset[f];
  o.count = t.numel;
  o.first_elem = 0;
  o.grad = j.grad;
  o.grad_type = j.grad_type;
  o.param = j.param;
  if (j.param) o.param_type = j.param_type;
  o.found_inf = found_inf_;
  o.workspace = base + u.size.workspace_offset;
  o.shape = &t.shape;
  const double tc = NowS();
  Status st = dev_->RunRule(*j.rule, o, j.args, cpu_threads_, stream);
  if (st.ok()) st = dev_->RecordEvent(lanes_[u.lane].event, stream);  // host backend: complete already
  compute_s_ += NowS() - tc;
  if (!st.ok()) return st.WithContext(u.what);
  u.phase = Unit::Phase::kKernel;
  return Status::Ok();
}

Status SlicePipeline::OnUnitCompletion(const vfs::ChunkCompletion& c) {
  const uint64_t id = (c.tag & ~kUnitBit) >> 40;
  const size_t i = static_cast<size_t>(c.tag & kPieceMask);
  auto it = std::find_if(units_.begin(), units_.end(), [&](const Unit& u) { return (u.id & 0x3fffff) == id; });
  if (it == units_.end() || i >= it->pieces.size() || it->pending == 0) {
    return Internal("StreamedAdam: completion with unknown tag " + std::to_string(c.tag));
  }
  Unit& u = *it;
  UnitPiece& p = u.pieces[i];
  --u.pending;
  const bool reading = u.phase == Unit::Phase::kGather;
  if (reading) {
    --reads_in_flight_;
    read_bytes_ -= p.len;
  } else {
    --writes_in_flight_;
    write_bytes_ -= p.len;
  }
  if (!c.status.ok()) return c.status.WithContext(u.what);
  if (reading) {
    read_bytes += p.len;
    const void* src = p.entry != nullptr ? p.entry : p.buf;
    OPTSTATE_RETURN_IF_ERROR(dev_->CopyH2D(p.dst, src, p.len, lanes_[u.lane].stream));
    if (p.buf != nullptr) {
      u.copying.push_back({p.buf, p.cap, /*spare=*/false});
      p.buf = nullptr;
    }
    return Status::Ok();
  }
  write_bytes += p.len;
  if (on_written_) on_written_(p.len);
  if (p.entry != nullptr) {
    mm_->cache()->Release(p.key, /*dirty=*/true);
    mm_->cache()->MarkWritten(p.key);
    p.entry = nullptr;
  }
  if (p.buf != nullptr) {
    u.free_bufs.emplace_back(p.buf, p.cap);
    p.buf = nullptr;
  }
  return Status::Ok();
}

Status SlicePipeline::ReleaseWindow(Unit& u) {
  if (u.window.pages == 0) return Status::Ok();
  mm_->ReleaseArena(&u.window);
  lanes_[u.lane].busy = false;
  // Lent slots come back as soon as the budget has their pages; once no
  // unit holds a window, whatever that takes (only pins can hold pages then).
  uint64_t held_pages = 0;
  return slots_lent_ ? ReacquireSlots(/*wait=*/WindowsHeld(&held_pages) == 0) : Status::Ok();
}

size_t SlicePipeline::WindowsHeld(uint64_t* pages) const {
  size_t n = 0;
  *pages = 0;
  for (const Unit& u : units_) {
    if (u.window.pages == 0) continue;
    ++n;
    *pages += u.window.pages;
  }
  return n;
}

void SlicePipeline::EndUnit(size_t k, bool dirty) {
  Unit& u = units_[k];
  // A unit stopped early (Abort) still holds entries, copies and a window.
  for (UnitPiece& p : u.pieces) {
    if (p.entry != nullptr) mm_->cache()->Release(p.key, dirty);
    p.entry = nullptr;
  }
  for (const Unit::Copying& c : u.copying) {
    if (c.spare) spare_.push_back(c.buf);
  }
  if (u.window.pages != 0) {
    mm_->ReleaseArena(&u.window);
    lanes_[u.lane].busy = false;
  }
  for (size_t i : u.sets) sets_[i].stage = Stage::kFree;
  units_.erase(units_.begin() + static_cast<long>(k));
}

bool SlicePipeline::UnitGpuPending() const {
  return std::any_of(units_.begin(), units_.end(), [](const Unit& u) { return u.phase == Unit::Phase::kKernel; });
}

Status SlicePipeline::ReacquireSlots(bool wait) {
  // Whole (the slots Begin made), so that a lend never leaves fewer slots
  // behind; waiting (no window held: only the trainer's pins hold pages),
  // whatever the budget has free, at least one slot.
  const uint64_t whole = uint64_t{bufs_} * std::max<size_t>(slot_count_, 1);
  auto a = mm_->AcquireArena(wait ? bufs_ : whole, whole, wait);
  if (!a.ok() && !wait && a.status().code() == StatusCode::kBusy) return Status::Ok();  // still lent
  if (!a.ok()) return a.status().WithContext("StreamedAdam: the device slots' window");
  arena_ = std::move(*a);
  slots_lent_ = false;
  return MapSlots();
}

Status SlicePipeline::MapSlots() {
  const size_t n = arena_.pages / bufs_;
  while (slots_.size() > n) {
    dev_->DestroyEvent(slots_.back().event);
    dev_->DestroyStream(slots_.back().stream);
    slots_.pop_back();
  }
  while (slots_.size() < n) {
    DevSlot d;
    OPTSTATE_ASSIGN_OR_RETURN(d.stream, dev_->CreateStream());
    auto event = dev_->CreateEvent();
    if (!event.ok()) {
      dev_->DestroyStream(d.stream);
      return event.status().WithContext("StreamedAdam: a device slot's event");
    }
    d.event = *event;
    slots_.push_back(d);
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    for (uint32_t f = 0; f < bufs_; ++f) slots_[i].d[f] = arena_.ptr(bufs_ * i + f);
  }
  return Status::Ok();
}

}  // namespace optstate::memmgr::internal
