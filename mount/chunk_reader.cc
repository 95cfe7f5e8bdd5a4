#include "mount/chunk_reader.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include <fmt/format.h>

#include "vfs/io_buffer.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::mount {

// ---- ReadStats --------------------------------------------------------------

std::string ReadStats::Summary() const {
  const uint64_t n = requests.load();
  return fmt::format("{} reads ({:.2f} GiB), {} waited for a chunk to load ({:.3f} s in all), "
                     "{:.0f} us per read in the daemon, "
                     "{} chunks loaded, {} copied across a chunk boundary, {} opens ({} prefetched, {} of the files held "
                     "by the kernel), "
                     "{} lookups, {} names listed as nodes, {} getattrs, "
                     "{} files pushed into the page cache ({:.2f} GiB), "
                     "{:.2f} GiB filled into state.safetensors",
                     n, static_cast<double>(bytes.load()) / (1ull << 30), waited.load(),
                     static_cast<double>(wait_ns.load()) * 1e-9,
                     n == 0 ? 0.0 : static_cast<double>(serve_ns.load()) * 1e-3 / static_cast<double>(n),
                     chunks_loaded.load(), bounced.load(),
                     opens.load(), prefetched.load(), held.load(), lookups.load(), listed.load(), getattrs.load(),
                     pushes.load(),
                     static_cast<double>(pushed_bytes.load()) / (1ull << 30),
                     static_cast<double>(filled_bytes.load()) / (1ull << 30));
}

// ---- ChunkReader ------------------------------------------------------------

namespace {
// Slots per chunk of the window for a file whose chunks are not all of one
// size (state.safetensors): a window of 8 chunks' bytes may span a run of a
// dozen one-chunk fields of a few KiB as well as the big fields around it.
constexpr uint64_t kSmallChunkSlots = 4;

// Chunks' worth of bytes behind the window start that still belong to the
// stream that moved it (the trail): several requests of one sequential
// stream are served at once when the kernel reads ahead through the page
// cache (up to 16 worker threads, each on 1 MiB of a 16 MiB read-ahead) or a
// reader issues concurrent preads, and they reach the reader slightly out of
// order. A request that lands in the trail neither moves the window back
// nor shrinks it, and read-ahead does not evict a trail chunk whose bytes
// have not all been handed out yet. Without it a late request is a backward
// jump: the window snaps back to one chunk, and read-ahead evicts the chunks
// those late requests come for, loading many chunks twice.
constexpr uint64_t kTrailChunks = 3;

uint64_t RoundUp4096(uint64_t n) { return (n + 4095) / 4096 * 4096; }
}  // namespace

ChunkReader::ChunkReader(std::shared_ptr<const Generation> gen, const vfs::CheckpointFile* file,
                         const MountOptions& opts, ChunkBufferPool* pool, ReadStats* stats)
    : gen_(std::move(gen)),
      file_(file),
      readahead_(std::max<uint32_t>(1, opts.readahead_chunks)),
      max_sqe_bytes_(opts.max_sqe_bytes),
      chunk_size_(gen_->view->identity().chunk_size_bytes),
      // A field's chunks are no longer than the field: a reader of a norm's
      // 4 KiB field takes a 4 KiB buffer, not a whole chunk's (a burst of
      // opens of a trainer's snapshot, each loading its first chunks, took
      // 8 MiB each from the pool and past it: 400 readers, 3 GiB).
      max_buf_bytes_(RoundUp4096(
          std::min(chunk_size_, file->kind == vfs::CheckpointFileKind::kField ? file->size_bytes : chunk_size_))),
      seq_len_(gen_->layout->ChunkSequenceLength(*file)),
      pool_(pool),
      stats_(stats) {
  // A field's longest chunk for every chunk of a field file (one size,
  // reused), else the chunk's length rounded up to a power of two of at
  // least 4096 (a few sizes, reused through the pool).
  const bool field = file_->kind == vfs::CheckpointFileKind::kField;
  buf_ends_.resize(seq_len_);
  chunk_bytes_.resize(seq_len_);
  for (uint64_t i = 0, sum = 0; i < seq_len_; ++i) {
    chunk_bytes_[i] = gen_->layout->ChunkLengthAt(*file_, i);
    sum += field ? max_buf_bytes_ : std::min(max_buf_bytes_, std::bit_ceil(RoundUp4096(chunk_bytes_[i])));
    buf_ends_[i] = sum;
  }
  // readahead_ ahead of the chunk being read, plus that chunk and the trail;
  // in bytes for chunks of several sizes.
  slots_.resize(std::min<uint64_t>((readahead_ + 1 + kTrailChunks) * (field ? 1 : kSmallChunkSlots), seq_len_));
  cap_bytes_ = (readahead_ + 1 + kTrailChunks) * max_buf_bytes_;
  window_bytes_ = chunk_size_;
}

uint64_t ChunkReader::BufBytesFor(uint64_t seq) const {
  return buf_ends_[seq] - (seq > 0 ? buf_ends_[seq - 1] : 0);
}

uint64_t ChunkReader::WindowEnd(uint64_t bytes) const {
  if (pos_ + 1 >= seq_len_) return seq_len_ - 1;
  // The last chunk whose buffer ends within `bytes` after pos_'s.
  auto it = std::upper_bound(buf_ends_.begin() + static_cast<std::ptrdiff_t>(pos_ + 1), buf_ends_.end(),
                             buf_ends_[pos_] + bytes);
  const uint64_t last = static_cast<uint64_t>(it - buf_ends_.begin()) - 1;
  return std::min({std::max(last, pos_ + 1), seq_len_ - 1, pos_ + slots_.size() - 1});
}

void ChunkReader::DropBuffer(Slot* s) {
  if (s->lends > 0) {
    detached_.push_back({s->buf, s->buf_bytes, s->lends});
  } else {
    pool_->Give(s->buf, s->buf_bytes);
  }
  held_bytes_ -= s->buf_bytes;
  s->buf = nullptr;
  s->buf_bytes = 0;
  s->lends = 0;
  s->state = SlotState::kEmpty;
}

void ChunkReader::Return(char* buf) {
  for (Slot& s : slots_) {
    if (s.buf == buf && s.lends > 0) {
      --s.lends;
      return;
    }
  }
  for (auto it = detached_.begin(); it != detached_.end(); ++it) {
    if (it->buf != buf) continue;
    if (--it->lends == 0) {
      pool_->Give(it->buf, it->bytes);
      detached_.erase(it);
      if (!waiting_.empty()) Kick();  // the pool has room again
    }
    return;
  }
}

Result<std::unique_ptr<ChunkReader>> ChunkReader::Open(std::shared_ptr<const Generation> gen,
                                                       const vfs::CheckpointFile* file,
                                                       const MountOptions& opts,
                                                       ChunkBufferPool* pool, ReadStats* stats, bool start) {
  std::unique_ptr<ChunkReader> r(new ChunkReader(std::move(gen), file, opts, pool, stats));
  if (r->seq_len_ == 0) return r;  // manifest.json: bytes held by the layout
  {
    MutexLock l(&r->mu_);  // before the I/O thread exists: for the analysis
    r->started_ = start;
  }
  try {
    r->thread_ = std::thread([p = r.get()] { p->IoLoop(); });
    // A file of one chunk (most of a trainer's files: norms, biases, small
    // tensors) has nothing to submit behind that chunk: its I/O thread reads
    // and verifies it synchronously (ReadChunk), without a ring or a verify
    // thread, whose setup would dominate the open of each small file that a
    // `cp -r` of a snapshot makes.
    if (r->seq_len_ > 1) r->verify_thread_ = std::thread([p = r.get()] { p->VerifyLoop(); });
  } catch (const std::system_error& e) {
    return ResourceExhausted(fmt::format("optstate-mount: store {} ({}/{}): cannot start a read-ahead thread: {}",
                                         r->gen_->store_name, r->gen_->dir_label, file->path, e.what()));
  }
  return r;
}

ChunkReader::~ChunkReader() {
  {
    MutexLock l(&mu_);
    stop_ = true;
    Kick();
    verify_cv_.SignalAll();
  }
  if (verify_thread_.joinable()) verify_thread_.join();  // no hash reads a buffer after this
  if (thread_.joinable()) thread_.join();  // drains the ChunkIo: no request touches a buffer after this
  for (Slot& s : slots_) {
    // After an engine failure a request may still own its buffer: leak it
    // rather than hand memory the kernel may write to back to the pool.
    if (s.state == SlotState::kInFlight) continue;
    pool_->Give(s.buf, s.buf_bytes);
  }
  for (const Detached& d : detached_) pool_->Give(d.buf, d.bytes);  // none: lends end before the reader does
}

ChunkReader::Slot* ChunkReader::Find(uint64_t seq) {
  for (Slot& s : slots_) {
    if (s.state != SlotState::kEmpty && s.seq == seq) return &s;
  }
  return nullptr;
}

bool ChunkReader::InTrail(uint64_t seq) const {
  return seq < pos_ && buf_ends_[pos_ - 1] - (seq > 0 ? buf_ends_[seq - 1] : 0) <= kTrailChunks * max_buf_bytes_;
}

void ChunkReader::MoveTo(uint64_t seq) {
  if (seq == pos_ || InTrail(seq)) return;  // a late request of the same stream
  // Sequential step (to a chunk inside the window): widen the window; a jump:
  // start small again.
  const bool step = seq > pos_ && seq <= WindowEnd(window_bytes_);
  window_bytes_ = step ? std::min(uint64_t{readahead_} * chunk_size_, window_bytes_ * 2) : chunk_size_;
  pos_ = seq;
  Kick();
  verify_cv_.Signal();
}

Status ChunkReader::SlotError(const Slot& s) const {
  vfs::ChunkRef ref = gen_->layout->ChunkAt(*file_, s.seq);
  std::string tensor = "?", field = "?";
  for (const vfs::TensorInfo& t : gen_->view->tensors()) {
    if (t.id != ref.tensor_id) continue;
    tensor = t.name;
    if (ref.field < t.fields.size()) field = t.fields[ref.field].name;
  }
  OPTSTATE_LOG_ERROR(
      "optstate-mount: store {} generation {} ({}/{}): tensor '{}' field '{}' chunk {}: {}",
      gen_->store_name, gen_->generation(), gen_->dir_label, file_->path, tensor, field, ref.index,
      s.status.ToString());
  return s.status;
}

Result<ChunkReader::Slot*> ChunkReader::PinChunk(uint64_t seq) {
  started_ = true;  // a read: the kernel did not hold these pages after all
  MoveTo(seq);
  // While this reader waits, seq is in waiting_: the I/O thread loads it even
  // when another reader has moved the window elsewhere, and does not evict it
  // before this reader has pinned it.
  bool waits = false;
  std::chrono::steady_clock::time_point wait_start;
  uint32_t ready_ahead = 0, in_flight_ahead = 0;  // when the wait began (debug log)
  auto stop_waiting = [&]() REQUIRES(mu_) {
    if (!waits) return;
    auto it = waiting_.find(seq);
    if (--it->second == 0) waiting_.erase(it);
    waits = false;
    const auto ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                              std::chrono::steady_clock::now() - wait_start)
                                              .count());
    if (stats_ != nullptr) {
      ++stats_->waited;
      stats_->wait_ns += ns;
    }
    OPTSTATE_LOG_DEBUG("optstate-mount: {}/{}: waited {:.2f} ms for chunk {} (window {} MiB, at the start: "
                       "{} ready and {} in flight ahead of it)",
                       gen_->dir_label, file_->path, static_cast<double>(ns) * 1e-6, seq, window_bytes_ >> 20,
                       ready_ahead, in_flight_ahead);
  };
  for (;;) {
    if (!io_error_.ok()) {
      stop_waiting();
      Slot s;
      s.seq = seq;
      s.status = io_error_;
      return SlotError(s);
    }
    Slot* s = Find(seq);
    if (s == nullptr || s->state == SlotState::kInFlight || s->state == SlotState::kLoaded ||
        s->state == SlotState::kVerifying) {
      if (!waits) {
        ++waiting_[seq];
        waits = true;
        verify_cv_.Signal();  // seq may be loaded and wait for its hash
        wait_start = std::chrono::steady_clock::now();
        if (Logger().should_log(spdlog::level::debug)) {
          for (const Slot& o : slots_) {
            if (o.seq <= seq) continue;
            ready_ahead += o.state == SlotState::kReady ? 1 : 0;
            in_flight_ahead += o.state == SlotState::kInFlight ? 1 : 0;
          }
        }
        Kick();
      }
      // With this reader's lock held: a callback must not take it.
      OPTSTATE_TEST_SYNC_POINT_CALLBACK("chunk_reader.pin.wait", &seq);
      ready_cv_.Wait(&mu_);
      continue;
    }
    stop_waiting();
    if (s->state == SlotState::kFailed) {
      Status st = SlotError(*s);
      if (s->pins == 0) s->state = SlotState::kEmpty;  // the next read retries
      Kick();
      return st;
    }
    ++s->pins;
    return s;
  }
}

void ChunkReader::Unpin(Slot* s, uint64_t bytes) {
  s->served_bytes += bytes;
  if (--s->pins > 0) return;
  // A chunk behind the window is now a free slot for read-ahead.
  if (s->seq < pos_) {
    Kick();
  } else {
    io_cv_.Signal();
  }
}

Result<uint64_t> ChunkReader::Read(uint64_t offset, uint64_t len, char* out) { return CopyOut(offset, len, out, true); }

Result<uint64_t> ChunkReader::CopyOut(uint64_t offset, uint64_t len, char* out, bool count) {
  std::vector<vfs::CheckpointSegment> segs = gen_->layout->MapRange(*file_, offset, len);
  uint64_t total = 0;
  for (const vfs::CheckpointSegment& seg : segs) {
    if (seg.memory != nullptr) {
      std::memcpy(out + seg.dst_offset, seg.memory, seg.length_bytes);
      total += seg.length_bytes;
      continue;
    }
    MutexLock l(&mu_);
    OPTSTATE_ASSIGN_OR_RETURN(Slot * s, PinChunk(seg.chunk_seq));
    char* const buf = s->buf;  // pinned: stays until Unpin
    l.Unlock();
    std::memcpy(out + seg.dst_offset, buf + seg.chunk_offset, seg.length_bytes);
    l.Lock();
    Unpin(s, seg.length_bytes);
    total += seg.length_bytes;
  }
  if (count) Count(total);
  return total;
}

Result<uint64_t> ChunkReader::ReadWith(uint64_t offset, uint64_t len,
                                       const std::function<Status(std::span<const iovec>)>& consume, bool count,
                                       bool lend) {
  std::vector<vfs::CheckpointSegment> segs = gen_->layout->MapRange(*file_, offset, len);
  std::vector<iovec> iov;
  iov.reserve(segs.size());
  std::vector<Slot*> pinned;
  std::vector<uint64_t> pinned_bytes;  // of the range, per pinned slot
  uint64_t total = 0;
  bool whole = true;  // every chunk of the range pinned
  for (const vfs::CheckpointSegment& seg : segs) {
    if (seg.memory != nullptr) {
      iov.push_back({const_cast<char*>(seg.memory), seg.length_bytes});
    } else {
      MutexLock l(&mu_);
      if (pinned.empty()) {
        OPTSTATE_ASSIGN_OR_RETURN(Slot * s, PinChunk(seg.chunk_seq));
        pinned.push_back(s);
      } else {
        // Across a chunk boundary (1 request in 8 for 1 MiB reads of 8 MiB
        // chunks that are not aligned): the next chunk only if it is verified
        // already. Waiting for it while holding a pin could deadlock
        // concurrent requests on this handle once every slot is pinned.
        Slot* s = Find(seg.chunk_seq);
        if (s == nullptr || s->state != SlotState::kReady) {
          whole = false;
          break;
        }
        MoveTo(seg.chunk_seq);
        ++s->pins;
        pinned.push_back(s);
      }
      char* const buf = pinned.back()->buf;  // pinned: stays until Unpin
      l.Unlock();
      pinned_bytes.push_back(seg.length_bytes);
      iov.push_back({buf + seg.chunk_offset, seg.length_bytes});
    }
    total += seg.length_bytes;
  }
  // served: the range went out from these slots (not when it is copied
  // instead). lent_to: the buffers are lent (recorded there) as they unpin.
  auto unpin_all = [&](bool served, std::vector<char*>* lent_to = nullptr) {
    if (pinned.empty()) return;
    {
      MutexLock l(&mu_);
      for (size_t i = 0; i < pinned.size(); ++i) {
        if (lent_to != nullptr) {
          ++pinned[i]->lends;
          lent_to->push_back(pinned[i]->buf);
        }
        Unpin(pinned[i], served ? pinned_bytes[i] : 0);
      }
    }
    pinned.clear();
  };
  if (!whole) {
    // The next chunk is not ready: copy, one chunk pinned at a time.
    unpin_all(false);
    thread_local std::vector<char> bounce;
    if (bounce.size() < len) bounce.resize(len);
    if (stats_ != nullptr && count) ++stats_->bounced;
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t n, CopyOut(offset, len, bounce.data(), count));
    iovec v{bounce.data(), n};
    OPTSTATE_RETURN_IF_ERROR(consume(std::span<const iovec>(&v, n > 0 ? 1 : 0)));
    return n;
  }
  // `lend`: the buffers are lent instead of pinned while consume runs (see the header).
  std::vector<char*> lent;
  if (lend) unpin_all(true, &lent);
  Status st = consume(iov);
  if (lend) {
    MutexLock l(&mu_);
    for (char* buf : lent) Return(buf);
  } else {
    unpin_all(true);
  }
  if (!st.ok()) return st;
  if (count) Count(total);
  return total;
}

void ChunkReader::Count(uint64_t bytes) {
  if (stats_ == nullptr) return;
  ++stats_->requests;
  stats_->bytes += bytes;
}

}  // namespace optstate::mount
