#include "mount/chunk_reader.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "vfs/log.h"

namespace optstate::mount {
namespace {

// Process-wide pool of chunk buffers. A reader's buffers are returned here on
// close and reused by the next open, so a `cp -r` of many files does not pay
// for fresh 8 MiB allocations whose first touch (page faults inside the
// io_uring submit) delays each file's first reads. Bounded; thread-safe.
class BufferPool {
 public:
  static BufferPool& Get() {
    static BufferPool* p = new BufferPool();  // leaked: readers may outlive static destruction
    return *p;
  }
  char* Take(uint64_t bytes) {
    {
      std::lock_guard<std::mutex> l(mu_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].first == bytes) {
          char* b = free_[i].second;
          free_[i] = free_.back();
          free_.pop_back();
          return b;
        }
      }
    }
    return static_cast<char*>(std::aligned_alloc(4096, bytes));
  }
  void Give(char* buf, uint64_t bytes) {
    if (buf == nullptr) return;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (free_.size() < kMaxFree) {
        free_.emplace_back(bytes, buf);
        return;
      }
    }
    std::free(buf);
  }

 private:
  static constexpr size_t kMaxFree = 64;  // 512 MiB at 8 MiB chunks
  std::mutex mu_;
  std::vector<std::pair<uint64_t, char*>> free_;
};

}  // namespace

ChunkReader::ChunkReader(std::shared_ptr<const Generation> gen, const vfs::CheckpointFile* file,
                         uint32_t readahead_chunks)
    : gen_(std::move(gen)),
      file_(file),
      readahead_(std::max<uint32_t>(1, readahead_chunks)),
      chunk_size_(gen_->view->identity().chunk_size_bytes),
      seq_len_(gen_->layout->ChunkSequenceLength(*file)) {
  slots_.resize(std::min<uint64_t>(readahead_ + 1, std::max<uint64_t>(seq_len_, 1)));
}

ChunkReader::~ChunkReader() {
  if (io_) {
    // Buffers must outlive their requests.
    std::vector<vfs::ChunkCompletion> c;
    while (io_->in_flight() > 0) {
      c.clear();
      if (!io_->Reap(&c, io_->in_flight()).ok()) break;
    }
    io_.reset();
  }
  const uint64_t bytes = (chunk_size_ + 4095) / 4096 * 4096;
  for (Slot& s : slots_) BufferPool::Get().Give(s.buf, bytes);
}

Status ChunkReader::EnsureIo() {
  if (io_ || sync_fallback_) return Status();
  vfs::ChunkIoOptions o;
  o.queue_depth = static_cast<uint32_t>(slots_.size());
  auto io = gen_->view->NewChunkIo(o);
  if (!io.ok()) {
    OPTSTATE_LOG_WARN("optstate-mount: store {}: no async chunk I/O ({}); reading synchronously",
                      gen_->store_name, io.status().ToString());
    sync_fallback_ = true;
    return Status();
  }
  io_ = std::move(io).value();
  return Status();
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

Status ChunkReader::ReapOne() {
  std::vector<vfs::ChunkCompletion> done;
  OPTSTATE_RETURN_IF_ERROR(io_->Reap(&done, 1));
  for (vfs::ChunkCompletion& c : done) {
    Slot& s = slots_[c.tag];
    s.state = c.status.ok() ? SlotState::kReady : SlotState::kFailed;
    s.status = std::move(c.status);
  }
  return Status();
}

Result<bool> ChunkReader::Submit(uint64_t seq, uint64_t window_lo, uint64_t window_hi) {
  Slot* victim = nullptr;
  for (Slot& s : slots_) {
    if (s.state != SlotState::kEmpty && s.seq == seq) return true;  // held or in flight
  }
  for (Slot& s : slots_) {
    if (s.state == SlotState::kEmpty) {
      victim = &s;
      break;
    }
  }
  if (victim == nullptr) {
    // Evict a completed chunk outside the window, the farthest behind first.
    for (Slot& s : slots_) {
      if (s.state == SlotState::kInFlight) continue;
      if (s.seq >= window_lo && s.seq <= window_hi) continue;
      if (victim == nullptr || s.seq < victim->seq) victim = &s;
    }
  }
  if (victim == nullptr) return false;
  if (victim->buf == nullptr) {
    victim->buf = BufferPool::Get().Take((chunk_size_ + 4095) / 4096 * 4096);
    if (victim->buf == nullptr) return ResourceExhausted("optstate-mount: out of memory for a chunk buffer");
  }
  victim->seq = seq;
  victim->status = Status();
  vfs::ChunkRef ref = gen_->layout->ChunkAt(*file_, seq);
  if (sync_fallback_) {
    victim->status = gen_->view->ReadChunk(ref, victim->buf);
    victim->state = victim->status.ok() ? SlotState::kReady : SlotState::kFailed;
    return true;
  }
  Status st = io_->SubmitRead(ref, victim->buf, static_cast<uint64_t>(victim - slots_.data()));
  if (!st.ok()) {
    victim->state = SlotState::kFailed;
    victim->status = st;
    return true;
  }
  victim->state = SlotState::kInFlight;
  return true;
}

Result<ChunkReader::Slot*> ChunkReader::WaitFor(uint64_t seq) {
  for (;;) {
    Slot* slot = nullptr;
    for (Slot& s : slots_) {
      if (s.state != SlotState::kEmpty && s.seq == seq) slot = &s;
    }
    if (slot == nullptr) {
      OPTSTATE_ASSIGN_OR_RETURN(bool ok, Submit(seq, seq, seq));
      if (!ok) {
        OPTSTATE_RETURN_IF_ERROR(ReapOne());  // every slot in flight: wait for one
      }
      continue;
    }
    if (slot->state == SlotState::kInFlight) {
      OPTSTATE_RETURN_IF_ERROR(ReapOne());
      continue;
    }
    if (slot->state == SlotState::kFailed) {
      Status st = SlotError(*slot);
      slot->state = SlotState::kEmpty;  // a later read retries
      return st;
    }
    return slot;
  }
}

Result<uint64_t> ChunkReader::Read(uint64_t offset, uint64_t len, char* out) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<vfs::CheckpointSegment> segs = gen_->layout->MapRange(*file_, offset, len);
  uint64_t total = 0;
  for (const vfs::CheckpointSegment& seg : segs) {
    if (seg.memory != nullptr) {
      std::memcpy(out + seg.dst_offset, seg.memory, seg.length_bytes);
      total += seg.length_bytes;
      continue;
    }
    OPTSTATE_RETURN_IF_ERROR(EnsureIo());
    // Keep [seq, seq + readahead] in flight (as far as free slots allow).
    const uint64_t hi = std::min(seq_len_ - 1, seg.chunk_seq + readahead_);
    if (!sync_fallback_) {
      for (uint64_t s = seg.chunk_seq; s <= hi; ++s) {
        OPTSTATE_ASSIGN_OR_RETURN(bool ok, Submit(s, seg.chunk_seq, hi));
        if (!ok) break;
      }
    }
    OPTSTATE_ASSIGN_OR_RETURN(Slot * slot, WaitFor(seg.chunk_seq));
    std::memcpy(out + seg.dst_offset, slot->buf + seg.chunk_offset, seg.length_bytes);
    total += seg.length_bytes;
  }
  return total;
}

}  // namespace optstate::mount
