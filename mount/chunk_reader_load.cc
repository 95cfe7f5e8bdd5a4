// ChunkReader (mount/chunk_reader.h), its loading side: the I/O thread that
// keeps the window's chunks in flight on the reader's ChunkIo, and the verify
// thread that checks each loaded chunk before a reader may see it. The
// reading side (pins, copies, ReadWith) is in chunk_reader.cc.
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

namespace {

// The verify thread hashes chunks from the window start up to this many ahead
// of it (and any chunk a reader waits for): a chunk hashed just before the
// reader copies it can still be in the CPU's cache for those copies, one
// hashed 64 MiB earlier cannot.
constexpr uint64_t kVerifyAhead = 2;

}  // namespace

ChunkReader::Slot* ChunkReader::NextToVerify() {
  const uint64_t verify_end = WindowEnd(kVerifyAhead * chunk_size_);
  Slot* best = nullptr;
  for (Slot& s : slots_) {
    if (s.state != SlotState::kLoaded) continue;
    if (waiting_.count(s.seq) > 0) return &s;
    if (s.seq >= pos_ && s.seq <= verify_end && (best == nullptr || s.seq < best->seq)) best = &s;
  }
  return best;
}

void ChunkReader::VerifyLoop() {
  MutexLock l(&mu_);
  while (!stop_) {
    Slot* s = NextToVerify();
    if (s == nullptr) {
      verify_cv_.Wait(&mu_);
      continue;
    }
    // kVerifying: not evicted, not pinned; its buffer is ours until we set it back.
    s->state = SlotState::kVerifying;
    const vfs::ChunkCompletion& loaded = s->loaded;
    const char* const buf = s->buf;
    l.Unlock();
    Status st = vfs::VerifyChunkRead(loaded, buf);
    l.Lock();
    s->state = st.ok() ? SlotState::kReady : SlotState::kFailed;
    s->status = std::move(st);
    s->loaded = vfs::ChunkCompletion();
    ready_cv_.SignalAll();
    // A verified slot may be evicted: a reader may wait for a chunk that the
    // I/O thread found no slot or buffer for (a tight pool) while this one
    // was being hashed.
    if (!waiting_.empty()) Kick();
  }
}

void ChunkReader::Start() {
  MutexLock l(&mu_);
  if (started_) return;
  started_ = true;
  Kick();
}

void ChunkReader::Kick() {
  io_cv_.Signal();
  // The I/O thread may instead sleep in Reap until the disk completes a chunk
  // (several ms at the disk's pace): without this wake a slot a reader frees
  // meanwhile stays idle until then.
  if (reaping_ && !wake_sent_) {
    wake_sent_ = true;
    io_->Wake();
  }
}

ChunkReader::Slot* ChunkReader::NextSubmission() {
  if (!io_error_.ok() || !started_) return nullptr;
  const uint64_t hi = WindowEnd(window_bytes_);
  // Chunks readers wait for come first: the window follows the reader that
  // moved last, and a reader waiting elsewhere must not depend on it.
  for (const auto& [seq, readers] : waiting_) {
    if (Find(seq) != nullptr) continue;
    if (Slot* s = Claim(seq, hi, /*demand=*/true)) return s;
  }
  for (uint64_t seq = pos_; seq <= hi; ++seq) {
    if (Find(seq) != nullptr) continue;
    return Claim(seq, hi, /*demand=*/false);
  }
  return nullptr;
}

bool ChunkReader::AllBuffersPinned() const {
  for (const Slot& s : slots_) {
    if (s.buf != nullptr && s.pins == 0) return false;  // a lent one: detached for a waited chunk instead
  }
  return true;
}

ChunkReader::Slot* ChunkReader::Claim(uint64_t seq, uint64_t hi, bool demand) {
  // A slot for seq: an empty one that has a buffer, else the loaded chunk
  // farthest behind the window (or past it), else a new buffer from the pool
  // while its budget and this reader's (cap_bytes_) last, else the loaded
  // chunk farthest ahead inside the window: ahead of seq for read-ahead (after
  // a backward seek the window fills from its start; each such eviction trades
  // a later chunk for an earlier one, so this ends), any for a chunk a reader
  // waits for. Among empty and behind slots, one whose buffer has the size seq
  // needs first. Never a chunk being copied out (pinned) or one a woken reader
  // is about to pin. A buffer of the wrong size goes back to the pool, and
  // buffers of other evictable slots (in the same order) make room under
  // cap_bytes_ for the new one.
  const uint64_t need = BufBytesFor(seq);
  enum Rank : int { kEmptySized, kBehindSized, kEmptyBuffered, kBehind, kGrow, kTrail, kAhead, kLent, kNone };
  auto rank_of = [&](const Slot& s) REQUIRES(mu_) -> Rank {
    if (s.state == SlotState::kEmpty) {
      if (s.buf == nullptr) return kGrow;
      return s.buf_bytes == need ? kEmptySized : kEmptyBuffered;
    }
    if (s.state == SlotState::kInFlight || s.state == SlotState::kVerifying || s.pins > 0 ||
        s.buf == nullptr || waiting_.count(s.seq) > 0) {
      return kNone;
    }
    // Lent (a CachePusher stores it): kept for read-ahead, as a pinned chunk
    // was; taken last for a chunk a reader waits for, whose READ the lend's
    // store may wait for in the kernel (its buffer is detached, below).
    if (s.lends > 0) return demand ? kLent : kNone;
    if (s.seq < pos_ && InTrail(s.seq) && s.served_bytes < chunk_bytes_[s.seq]) {
      return demand ? kTrail : kNone;  // late requests of the stream may still come for it
    }
    if (s.seq < pos_ || s.seq > hi) return s.buf_bytes == need ? kBehindSized : kBehind;
    return demand || s.seq > seq ? kAhead : kNone;
  };
  // The best slot by rank; behind: the farthest back; ahead: the farthest ahead.
  auto best_slot = [&](const Slot* except, bool with_buffer) REQUIRES(mu_) {
    Slot* best = nullptr;
    Rank best_rank = kNone;
    for (Slot& s : slots_) {
      const Rank r = rank_of(s);
      if (&s == except || r == kNone || (with_buffer && s.buf == nullptr)) continue;
      const bool better = r < best_rank || (r == best_rank && ((r == kBehindSized || r == kBehind)
                                                                   ? s.seq < best->seq
                                                                   : r == kAhead && s.seq > best->seq));
      if (better) best = &s, best_rank = r;
    }
    return best;
  };
  Slot* victim = best_slot(nullptr, false);
  if (victim == nullptr) return nullptr;  // loaded as far as slots allow
  if (victim->buf != nullptr && (victim->buf_bytes != need || victim->lends > 0)) DropBuffer(victim);
  if (victim->buf == nullptr) {
    // A new buffer, within cap_bytes_ and the pool's budget: other evictable
    // slots give theirs back (best first) until one can be had; holding none,
    // this reader may take one past the pool's budget (`must`). None left to
    // give: wait until a chunk is unpinned or loaded (Kick comes then).
    for (;;) {
      // Past both budgets (`must`) when this reader holds no buffer (a lent
      // one detached above counts as none: the store it was lent to may wait
      // in the kernel for pages whose READ wants seq), or when a reader waits
      // for seq and every buffer held is pinned (copies out, which end
      // without waiting for anything). At most one buffer per pin or lend.
      const bool must = held_bytes_ == 0 || (demand && AllBuffersPinned());
      if (must || held_bytes_ + need <= cap_bytes_) {
        victim->buf = pool_->Take(need, must);
        if (victim->buf != nullptr) break;
        if (held_bytes_ == 0) {
          victim->seq = seq;
          victim->state = SlotState::kFailed;
          victim->status = ResourceExhausted(fmt::format("out of memory for a {} byte chunk buffer", need));
          ready_cv_.SignalAll();
          return nullptr;
        }
      }
      Slot* other = best_slot(victim, true);
      if (other == nullptr) return nullptr;
      DropBuffer(other);
    }
    victim->buf_bytes = need;
    held_bytes_ += need;
  }
  victim->seq = seq;
  victim->state = SlotState::kInFlight;
  victim->status = Status();
  victim->served_bytes = 0;
  return victim;
}

void ChunkReader::IoLoop() {
  if (seq_len_ == 1) {
    sync_fallback_ = true;  // see Open
  } else {
    vfs::ChunkIoOptions o;
    {
      MutexLock l(&mu_);  // slots_ never changes size; the lock is for the analysis
      o.queue_depth = static_cast<uint32_t>(slots_.size());
    }
    o.max_sqe_bytes = max_sqe_bytes_;
    o.wakeable = true;
    o.verify_reads = false;  // VerifyLoop
    auto io = gen_->view->NewChunkIo(o);
    if (io.ok()) {
      io_ = std::move(io).value();
    } else {
      OPTSTATE_LOG_WARN("optstate-mount: store {}: no async chunk I/O ({}); reading synchronously",
                        gen_->store_name, io.status().ToString());
      sync_fallback_ = true;
    }
  }
  std::vector<vfs::ChunkCompletion> done;
  MutexLock l(&mu_);
  while (!stop_) {
    if (OPTSTATE_TEST_SYNC_POINTS_ENABLED()) {
      // Unlocked: tests hold the I/O thread here, before it looks for work,
      // while readers move the window and wait.
      l.Unlock();
      OPTSTATE_TEST_SYNC_POINT("chunk_reader.io_loop.before_work");
      l.Lock();
      if (stop_) break;
    }
    if (Slot* s = NextSubmission(); s != nullptr) {
      // The slot is kInFlight: no reader touches its buffer; submit unlocked
      // (an 8 MiB O_DIRECT submit pins pages and builds bios inline).
      const uint64_t tag = static_cast<uint64_t>(s - slots_.data());
      char* buf = s->buf;
      const uint64_t buf_bytes = s->buf_bytes;
      const vfs::ChunkRef ref = gen_->layout->ChunkAt(*file_, s->seq);
      l.Unlock();
      Status st = sync_fallback_ ? gen_->view->ReadChunk(ref, buf, buf_bytes)
                                 : io_->SubmitRead(ref, buf, tag, buf_bytes);
      l.Lock();
      if (sync_fallback_ || !st.ok()) {
        if (sync_fallback_ && st.ok() && stats_ != nullptr) ++stats_->chunks_loaded;
        s->state = st.ok() ? SlotState::kReady : SlotState::kFailed;
        s->status = std::move(st);
        ready_cv_.SignalAll();
      }
      continue;
    }
    if (sync_fallback_ || !io_error_.ok() || io_->in_flight() == 0) {
      io_cv_.Wait(&mu_);
      continue;
    }
    // Completions come back unhashed (verify_reads = false): VerifyLoop checks
    // them. Readers that make work for this thread meanwhile Kick() it out.
    reaping_ = true;
    wake_sent_ = false;
    l.Unlock();
    done.clear();
    Status st = io_->Reap(&done, 1);
    l.Lock();
    reaping_ = false;
    if (stats_ != nullptr) {
      for (const vfs::ChunkCompletion& c : done) stats_->chunks_loaded += c.status.ok() ? 1 : 0;
    }
    bool loaded = false;
    for (vfs::ChunkCompletion& c : done) {
      Slot& s = slots_[c.tag];
      if (c.status.ok() && c.needs_verify) {
        s.state = SlotState::kLoaded;
        s.loaded = std::move(c);
        loaded = true;
        continue;
      }
      s.state = c.status.ok() ? SlotState::kReady : SlotState::kFailed;
      s.status = std::move(c.status);
    }
    if (loaded) verify_cv_.Signal();
    if (!st.ok()) {
      io_error_ = st;
      for (Slot& s : slots_) {
        if (s.state != SlotState::kInFlight) continue;
        s.status = st;  // stays kInFlight for the destructor; readers see io_error_
      }
    }
    if (!done.empty() || !st.ok()) ready_cv_.SignalAll();  // none after a Kick's early return
  }
  const bool io_ok = io_error_.ok();  // only this thread sets it
  l.Unlock();
  if (io_ && io_ok) {
    while (io_->in_flight() > 0) {
      done.clear();
      if (!io_->Reap(&done, io_->in_flight()).ok()) return;  // buffers stay leaked
      MutexLock drained(&mu_);
      for (vfs::ChunkCompletion& c : done) slots_[c.tag].state = SlotState::kEmpty;
    }
  }
  if (io_ok) io_.reset();
}

}  // namespace optstate::mount
