#include "memmgr/streamed_adam.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "memmgr/internal/manager_impl.h"
#include "vfs/log.h"

namespace optstate::memmgr {

using internal::Arena;
using internal::ChunkKey;
using internal::Device;
using internal::HostCache;
using internal::ManagerImpl;

namespace {

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint32_t ScalarSize(kernels::ScalarType t) {
  switch (t) {
    case kernels::ScalarType::kF32: return 4;
    case kernels::ScalarType::kBF16:
    case kernels::ScalarType::kF16: return 2;
    case kernels::ScalarType::kNone: return 0;
  }
  return 0;
}

const char* ScalarName(kernels::ScalarType t) {
  switch (t) {
    case kernels::ScalarType::kF32: return "f32";
    case kernels::ScalarType::kBF16: return "bf16";
    case kernels::ScalarType::kF16: return "f16";
    case kernels::ScalarType::kNone: return "none";
  }
  return "?";
}

bool IsFloatType(kernels::ScalarType t) {
  return t == kernels::ScalarType::kF32 || t == kernels::ScalarType::kBF16 || t == kernels::ScalarType::kF16;
}

vfs::DType StoredDType(kernels::ScalarType t) {
  return t == kernels::ScalarType::kBF16  ? vfs::DType::kBF16
         : t == kernels::ScalarType::kF16 ? vfs::DType::kF16
                                          : vfs::DType::kF32;
}

// s with "; note" appended to its message (s unchanged when note is empty).
Status WithNote(const Status& s, const std::string& note) {
  if (s.ok() || note.empty()) return s;
  return Status(s.code(), s.message() + "; " + note, s.err());
}

std::string DimsText(const std::vector<uint64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// "'a' (10 elements), 'b' (3 elements), ..." of at most 8 names.
template <typename It, typename Numel>
std::string NameList(It first, It last, Numel numel) {
  std::string out;
  size_t n = 0;
  for (It it = first; it != last; ++it, ++n) {
    if (n == 8) {
      out += ", ...";
      break;
    }
    out += (n ? ", '" : "'") + *it + "'";
    const uint64_t e = numel(*it);
    if (e != 0) out += " (" + std::to_string(e) + " elements)";
  }
  return out;
}

float ToFloat(const void* src, uint64_t i, kernels::ScalarType t) {
  switch (t) {
    case kernels::ScalarType::kF32: return static_cast<const float*>(src)[i];
    case kernels::ScalarType::kBF16: return kernels::Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
    case kernels::ScalarType::kF16: return kernels::HalfToFloat(static_cast<const uint16_t*>(src)[i]);
    default: return 0.0f;
  }
}

// The moment fields' dtype of a store whose optimizer uses moments of type t.
vfs::DType MomentDType(kernels::ScalarType t) {
  return t == kernels::ScalarType::kBF16 ? vfs::DType::kBF16 : vfs::DType::kF32;
}

// kInvalidArgument naming the store, the tensor, the field and both dtypes
// when a moment field of t is not stored as `want`.
Status CheckMomentFields(const vfs::TensorInfo& t, const std::string& store_path, vfs::DType want) {
  for (const vfs::FieldSpec& f : t.fields) {
    if ((f.name == "exp_avg" || f.name == "exp_avg_sq") && f.dtype != want) {
      return InvalidArgument("StreamedAdam: store " + store_path + " holds tensor '" + t.name + "' field " + f.name +
                             " as " + vfs::DTypeName(f.dtype) + ", but the optimizer was created with moment dtype " +
                             vfs::DTypeName(want) + " (moment dtypes are chosen when a store is created; open it with "
                             "moment dtype " + vfs::DTypeName(f.dtype) + ", or convert a checkpoint with "
                             "optstate-restore --moments); nothing changed");
    }
  }
  return Status::Ok();
}

// A gradient scale is usable when finite and > 0.
Status CheckGradScale(float s, const std::string& what, const std::string& store_path) {
  if (s > 0.0f && std::isfinite(s)) return Status::Ok();
  return InvalidArgument(what + ": gradient scale must be finite and > 0, got " + fmt::format("{}", s) + " (store " +
                         store_path + "); nothing changed");
}

}  // namespace

namespace internal {

// The per-step chunk pipeline. A slice is one element range of a param that
// covers whole chunks of every field: one moment chunk index of exp_avg and
// exp_avg_sq and the main chunks of the same elements (one with f32 moments;
// with bf16 moments a moment chunk holds twice the elements of an fp32 chunk,
// so two main chunks). Every buffer is then one whole chunk (the unit of I/O,
// checksum and copy-on-write), and every page stays a chunk, a multiple of the
// 2 MiB VMM granularity; the kernel runs once per main chunk on the matching
// half of the moment buffers. A slice holds one staging set (one chunk-sized
// pinned buffer per chunk: 3, or 4 with bf16 moments) from its reads to the
// completion of its writes; it holds a device slot (as many budgeted device
// pages) only from H2D to the end of D2H. So read-ahead is
// bounded by staging, not by the device budget, and a budget of one slot
// still overlaps reads, compute and writes:
//   reading (a ChunkIo read per chunk) -> ready -> computing (H2D, kernel,
//   D2H on the slot's stream; an event) -> computed (waits for write room) ->
//   writing (a copy-on-write write per chunk) -> free.
// Reads and writes have separate depth limits in one ring (queue_depth and
// write_queue_depth, counted in bytes: that many chunks' worth in flight), so
// neither direction starves the other and a submit never blocks on a full
// ring while completions wait unreaped. Slices of small tensors use small
// staging sets (kSmallSliceBytes per field), so they take neither big sets
// nor queue depth from the slices that move the bytes.
// A computed slice whose three buffers are host cache entries gives its
// staging set back at once: its writes (the write tail) go out from the
// entries, which stay in use (never evicted or reused) until each write
// completes. So with the RAM tier the step is bound by its compute, not by
// its writes, and the tail needs no memory beyond the tier's own.
// Driven by one thread (the trainer's, then the background commit's) through
// Pump().

// A slice of at most this many bytes per field goes into a small set.
constexpr uint64_t kSmallSliceBytes = 256ull << 10;

// Requests the pipeline's ring holds: with depths counted in bytes, a queue of
// small slices has more requests in flight than chunks.
inline uint32_t RingRequests(const MemoryManagerOptions& o) {
  return 4 * (std::max<uint32_t>(o.queue_depth, 6) + o.write_queue_depth);
}

// Chunks in one slice at most: two main chunks, one of each moment.
constexpr int kMaxSliceChunks = 4;

// Chunks in a full slice with moments of type t (main chunks + 2).
inline uint32_t SliceChunks(kernels::ScalarType moment) {
  return moment == kernels::ScalarType::kBF16 ? 4 : 3;
}

class StepPipeline {
 public:
  struct Job {
    uint32_t tensor_id = 0;
    // Buffers [0, n_main) are main chunks, then exp_avg's, then exp_avg_sq's.
    uint32_t n_bufs = 3;
    uint32_t n_main = 1;
    uint32_t fields[kMaxSliceChunks] = {0, 1, 2, 0};
    uint64_t chunks[kMaxSliceChunks] = {0, 0, 0, 0};  // chunk index of each buffer in its field
    uint64_t lens[kMaxSliceChunks] = {0, 0, 0, 0};    // logical bytes of each
    uint64_t chunk = 0;                               // the moments' chunk index (messages)
    uint64_t first_elem = 0;
    uint64_t elems = 0;
    kernels::ScalarType moment_type = kernels::ScalarType::kF32;
    uint64_t bytes() const {
      uint64_t b = 0;
      for (uint32_t f = 0; f < n_bufs; ++f) b += lens[f];
      return b;
    }
    const void* grad = nullptr;
    kernels::ScalarType grad_type = kernels::ScalarType::kF32;
    void* param = nullptr;
    kernels::ScalarType param_type = kernels::ScalarType::kNone;
    kernels::AdamParams params;
  };

  StepPipeline(ManagerImpl* mm, vfs::ChunkIo* io, int cpu_threads, uint64_t sync_every_bytes, const float* found_inf,
               uint64_t* inject, kernels::ScalarType moment_type)
      : bufs_(SliceChunks(moment_type)),
        mm_(mm),
        dev_(mm->device()),
        io_(io),
        sync_every_bytes_(sync_every_bytes),
        cpu_threads_(cpu_threads),
        found_inf_(found_inf),
        inject_(inject) {}
  ~StepPipeline() { Abort(); }

  // Joins the background sync; its error, if any.
  Status FinishSync() {
    if (sync_thread_.joinable()) sync_thread_.join();
    return sync_status_;
  }

  Status Begin() {
    const MemoryManagerOptions& o = mm_->options();
    if (mm_->budget_pages() < bufs_) {
      return ResourceExhausted("StreamedAdam: device budget " + std::to_string(o.device_budget_bytes) +
                               " bytes is smaller than one slice in flight (" + std::to_string(bufs_) + " x " +
                               std::to_string(mm_->page_bytes()) + " bytes)");
    }
    uint64_t ra = PipelineSlices(o);
    // Device slots: enough streams that H2D, kernels and D2H of consecutive
    // slices overlap on both copy engines (8: the host cache tier step on the
    // H200 reached 1.37x the copy floor with 4), within the budget.
    uint64_t slots = std::min<uint64_t>(mm_->budget_pages() / bufs_, 8);
    size_t total = mm_->all_staging().size();
    size_t max_bufs = total >= 5 ? total - 2 : total;  // leave two for concurrent pins
    if (max_bufs < bufs_) {
      return ResourceExhausted("StreamedAdam: " + std::to_string(total) + " staging buffers; need at least " +
                               std::to_string(bufs_) + " (one per chunk of a slice)");
    }
    read_qd_ = std::max<uint32_t>(o.queue_depth, 3);
    write_qd_ = o.write_queue_depth == 0 ? 0 : std::max<uint32_t>(o.write_queue_depth, 3);
    if (write_qd_ == 0) read_qd_ = std::max<uint32_t>(read_qd_, 6);
    ring_requests_ = RingRequests(o);
    // Adopted prefetch buffers count against the pipeline's own staging.
    const size_t want = std::min<size_t>(max_bufs, bufs_ * ra);
    staging_ = mm_->AcquireStaging(bufs_, want > extra_staging_.size() + bufs_ ? want - extra_staging_.size() : bufs_);
    chunk_bytes_ = mm_->page_bytes();
    size_t big_sets = staging_.size() / bufs_;
    // Small sets: the buffers of two big sets cut into kSmallSliceBytes
    // pieces, for slices of small tensors (norms, biases). A trainer's mix
    // has about one such slice per big one; in big sets they took half the
    // staging and half the read-ahead while moving KiB (README, "Defaults").
    const uint64_t pieces_per_buffer = chunk_bytes_ / kSmallSliceBytes;
    const size_t carve = big_sets >= 6 && pieces_per_buffer >= 2 ? 2 : 0;
    big_sets -= carve;
    sets_.resize(big_sets);
    for (size_t i = 0; i < big_sets; ++i) {
      for (uint32_t f = 0; f < bufs_; ++f) sets_[i].io[f] = staging_[bufs_ * i + f];
    }
    std::vector<void*> pieces;
    for (size_t b = bufs_ * big_sets; b < bufs_ * (big_sets + carve); ++b) {
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

  // Cache mode: the host cache tier holds the whole state and is the slices'
  // buffers (no staging copies); write_through: computed slices are also
  // written to the store (else they stay dirty in the cache only). With a
  // tier that holds only part of the state (always write-through), a chunk
  // with an entry is read from it and a missed one is admitted while there is
  // room (read from disk into the entry); the rest go through staging.
  void SetCacheMode(bool cache_mode, bool write_through) {
    cache_mode_ = cache_mode;
    write_through_ = write_through || !cache_mode;
    read_tier_ = cache_mode || mm_->cache()->enabled();
  }
  // Test hook: no completion is reaped before the step drains, so what the
  // depth limits admit (not what the disk happens to finish) is in flight.
  void SetHoldCompletions(bool hold) { hold_completions_ = hold; }
  // Chunks a prefetch read into staging buffers (whole chunks, as a read
  // into a staging set would): the pipeline owns the buffers from now on
  // (released with its staging) and a slice finds its chunk there instead of
  // reading it. REQUIRES: before Begin.
  struct Staged {
    ChunkKey key;
    uint64_t len = 0;
    void* buf = nullptr;
  };
  void Adopt(std::vector<Staged> staged) {
    for (const Staged& st : staged) {
      extra_staging_.push_back(st.buf);
      staged_[st.key] = st;
    }
  }

  // Test hook: completions are reaped only when nothing else can progress,
  // so the writes a step finds complete are those it had to wait for.
  void SetReapOnlyWhenBlocked(bool on) { reap_only_when_blocked_ = on; }

  uint32_t depth() const { return static_cast<uint32_t>(sets_.size() - small_sets_); }
  uint32_t small_depth() const { return static_cast<uint32_t>(small_sets_); }
  uint32_t device_slots() const { return static_cast<uint32_t>(slots_.size()); }

  void Enqueue(const Job& j) { queue_.push_back(j); }

  // Makes progress. drain: until everything queued is written; otherwise
  // only what is possible without waiting. until_computed (with drain): only
  // until every queued slice is computed (its kernel, param copy and D2H
  // done), its writes submitted or waiting for room.
  Status Pump(bool drain, bool until_computed = false) {
    if (!error_.ok()) return error_;
    if (hold_completions_ && !drain) {
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
      //    backend a slice's kernel runs here, synchronously (~1.5 ms per
      //    24 MiB slice on one core), and reads held back behind a few of them
      //    missed the disk's next round (the development VM completes its
      //    queue in batches every ~50 ms: the disk idled 20% of a step).
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
      if (reap_only_when_blocked_ && min == 0) {
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

  // Stops: waits for every request in flight (results ignored) and the GPU.
  // Cache entries in use are released as dirty (the caller then drops the
  // cache: ManagerImpl::OnAbortPending).
  void Abort() {
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

  // Once every slice is computed: gives the device slots back (streams,
  // events, the budgeted arena), so that the write tail can run on another
  // thread without device work and the trainer has the budget back.
  Status ReleaseDevice() {
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

  void Release() {
    (void)FinishSync();
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

  uint64_t slices = 0, read_bytes = 0, write_bytes = 0, cache_hits = 0, h2d = 0, d2h = 0;
  uint64_t small_slices = 0, peak_read_bytes = 0, peak_write_bytes = 0, prefetch_hits = 0;
  double stall_s_ = 0, compute_s_ = 0, submit_s_ = 0;

 private:
  enum class Stage : uint8_t { kFree, kReading, kReady, kComputing, kComputed, kWriting };
  struct Set {
    Stage stage = Stage::kFree;
    Job job;
    int pending = 0;
    bool small = false;  // io[] are kSmallSliceBytes pieces
    void* io[kMaxSliceChunks] = {};         // this set's staging buffers
    void* buf[kMaxSliceChunks] = {};        // in use: staging, or cache entries (cache mode)
    bool acquired[kMaxSliceChunks] = {};    // buf[f] is an acquired cache entry
  };

  void ReleaseCached(Set& s, bool dirty) {
    for (int f = 0; f < kMaxSliceChunks; ++f) {
      if (!s.acquired[f]) continue;
      mm_->cache()->Release(Key(s.job, f), dirty);
      s.acquired[f] = false;
    }
  }

  // Reads into free staging sets, only while the read queue has room for a
  // whole slice.
  Status SubmitReads(bool* progressed) {
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
      if (!ReadRoom(front.bytes())) break;
      const size_t i = FreeSetFor(front);
      if (i == kNoSet) break;
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

  // Writes computed slices while the write queue has room.
  Status SubmitComputed(bool* progressed) {
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

  // A slice's kernel and copies are done: write it, or (cache mode without
  // write-through) leave it dirty in the cache.
  void OnComputed(size_t i) {
    Set& s = sets_[i];
    if (!write_through_) {
      ReleaseCached(s, /*dirty=*/true);
      s.stage = Stage::kFree;
      ++slices;
      return;
    }
    if (std::all_of(s.acquired, s.acquired + s.job.n_bufs, [](bool a) { return a; })) {
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
      for (int f = 0; f < kMaxSliceChunks; ++f) s.acquired[f] = false;
      s.stage = Stage::kFree;
      computed_.push_back(kTailBit | t);
      return;
    }
    s.stage = Stage::kComputed;
    computed_.push_back(i);
  }
  // Slices of the write tail (OnComputed) are indices with kTailBit set, in
  // computed_ and in I/O tags.
  static constexpr size_t kTailBit = size_t{1} << 40;
  Set& SetAt(size_t i) { return (i & kTailBit) ? tail_[i & ~kTailBit] : sets_[i]; }

  // Waits for the oldest slice on the device.
  Status SyncOldestSlot() {
    DevSlot* oldest = nullptr;
    for (auto& d : slots_) {
      if (d.set >= 0 && (oldest == nullptr || d.seq < oldest->seq)) oldest = &d;
    }
    return oldest == nullptr ? Status::Ok() : dev_->SyncEvent(oldest->event);
  }
  struct DevSlot {
    void* d[kMaxSliceChunks] = {};
    void* stream = nullptr;
    void* event = nullptr;
    long set = -1;      // the slice computing here, -1 = free
    uint64_t seq = 0;   // issue order of that slice
  };

  // A free staging set for j: a small one for a slice that fits, else (or
  // when none is free) a big one; kNoSet when none.
  static constexpr size_t kNoSet = ~size_t{0};
  size_t FreeSetFor(const Job& j) const {
    const bool fits_small = *std::max_element(j.lens, j.lens + j.n_bufs) <= kSmallSliceBytes;
    size_t big = kNoSet;
    for (size_t i = 0; i < sets_.size(); ++i) {
      if (sets_[i].stage != Stage::kFree) continue;
      if (sets_[i].small == fits_small) return i;
      if (!sets_[i].small && big == kNoSet) big = i;
    }
    return big;
  }

  // Room for one more slice (bufs_ requests of `bytes` in all) of reads / writes.
  // The depths count bytes, in chunks (queue_depth x chunk size in flight
  // each way), so that small tensors' slices do not empty the disk's queue;
  // requests are capped by the ring. With a shared queue (write_queue_depth
  // 0) reads leave room for one big slice of writes.
  bool ReadRoom(uint64_t bytes) const {
    if (reads_in_flight_ == 0 && writes_in_flight_ == 0) return true;
    if (reads_in_flight_ + writes_in_flight_ + bufs_ > ring_requests_) return false;
    if (write_qd_ == 0) return read_bytes_ + write_bytes_ + bytes + bufs_ * chunk_bytes_ <= read_qd_ * chunk_bytes_;
    return read_bytes_ + bytes <= read_qd_ * chunk_bytes_;
  }
  bool WriteRoom(uint64_t bytes) const {
    if (writes_in_flight_ == 0) return true;
    if (reads_in_flight_ + writes_in_flight_ + bufs_ > ring_requests_) return false;
    if (write_qd_ == 0) return read_bytes_ + write_bytes_ + bytes <= read_qd_ * chunk_bytes_;
    return write_bytes_ + bytes <= write_qd_ * chunk_bytes_;
  }

  Status Keep(Status s) {
    if (!s.ok() && error_.ok()) error_ = s;
    return s;
  }

  // Non-blocking reap of completed I/O.
  Status ReapReady(bool* progressed) {
    if (io_->in_flight() == 0 || reap_only_when_blocked_) return Status::Ok();
    reap_buf_.clear();
    Status rs = io_->Reap(&reap_buf_, 0);
    if (!rs.ok()) return Keep(rs.WithContext("StreamedAdam: reaping chunk I/O"));
    for (const auto& c : reap_buf_) {
      OPTSTATE_RETURN_IF_ERROR(Keep(OnCompletion(c)));
      *progressed = true;
    }
    return Status::Ok();
  }

  ChunkKey Key(const Job& j, int f) const { return ChunkKey{j.tensor_id, j.fields[f], j.chunks[f]}; }

  // Every queued slice is past its compute: nothing to read, compute or copy.
  bool AllComputed() const {
    if (!queue_.empty() || !ready_.empty()) return false;
    for (const DevSlot& d : slots_) {
      if (d.set >= 0) return false;
    }
    return std::none_of(sets_.begin(), sets_.end(), [](const Set& s) {
      return s.stage == Stage::kReading || s.stage == Stage::kReady || s.stage == Stage::kComputing;
    });
  }

  Status StartReads(size_t i, const Job& j) {
    Set& s = sets_[i];
    if (s.small) ++small_slices;
    s.job = j;
    s.stage = Stage::kReading;
    s.pending = 0;
    for (uint32_t f = 0; f < j.n_bufs; ++f) {
      const uint64_t len = j.lens[f];
      s.buf[f] = s.io[f];
      if (read_tier_) {
        bool valid = false;
        void* p = mm_->cache()->Acquire(Key(j, f), len, /*may_evict=*/cache_mode_, &valid);
        if (p == nullptr && !write_through_) {
          return ResourceExhausted("StreamedAdam: host cache tier (" +
                                   std::to_string(mm_->cache()->capacity_bytes()) +
                                   " bytes) has no clean entry left for tensor id " + std::to_string(j.tensor_id) +
                                   " chunk " + std::to_string(j.chunk));
        }
        if (p != nullptr) {
          s.buf[f] = p;
          s.acquired[f] = true;
          if (valid) {
            cache_hits += len;
            if (mm_->cache()->TakePrefetched(Key(j, f))) prefetch_hits += len;
            continue;
          }
        }
      }
      if (!s.acquired[f] && !staged_.empty()) {
        auto st = staged_.find(Key(j, f));
        if (st != staged_.end() && st->second.len == len) {
          if (s.small) {
            std::memcpy(s.io[f], st->second.buf, len);
          } else {
            // The set takes the prefetched buffer; its own joins spare_,
            // which makes new sets (SubmitReads), so the pipeline grows
            // back to the depth it has without prefetch.
            spare_.push_back(s.io[f]);
            s.io[f] = st->second.buf;
            s.buf[f] = s.io[f];
          }
          staged_.erase(st);
          prefetch_hits += len;
          continue;
        }
      }
      vfs::ChunkRef ref{j.tensor_id, j.fields[f], j.chunks[f]};
      // 0: a whole chunk.
      const uint64_t buf_bytes = s.acquired[f] ? HostCache::EntryBytes(len) : s.small ? kSmallSliceBytes : 0;
      Status st = io_->SubmitRead(ref, s.buf[f], i * 4 + f, buf_bytes);
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

  Status OnCompletion(const vfs::ChunkCompletion& c) {
    const size_t i = c.tag / 4;
    int f = static_cast<int>(c.tag % 4);
    if ((i & kTailBit) ? (i & ~kTailBit) >= tail_.size() : i >= sets_.size()) {
      return Internal("StreamedAdam: completion with unknown tag " + std::to_string(c.tag));
    }
    Set& s = SetAt(i);
    const uint64_t len = s.job.lens[f];
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
      unsynced_bytes_ += len;
      if (sync_every_bytes_ > 0 && unsynced_bytes_ >= sync_every_bytes_ && !sync_running_.load()) StartSync();
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

  Status StartCompute(size_t i, size_t k) {
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
      for (uint32_t f = 0; f < j.n_bufs; ++f) {
        OPTSTATE_RETURN_IF_ERROR(dev_->CopyH2D(d.d[f], s.buf[f], j.lens[f], d.stream));
      }
      h2d += j.bytes();
    }
    if (*inject_ > 0 && --*inject_ == 0) {
      return Internal("StreamedAdam: injected kernel failure (test hook) at tensor id " +
                      std::to_string(j.tensor_id) + " chunk " + std::to_string(j.chunk));
    }
    // One kernel call per main chunk, on the moments' elements of that chunk.
    const uint32_t moment_size = ScalarSize(j.moment_type);
    uint64_t done = 0;
    for (uint32_t k = 0; k < j.n_main; ++k) {
      const uint64_t first = j.first_elem + done;
      const uint64_t n = j.lens[k] / 4;
      kernels::AdamTensors t;
      t.main = static_cast<float*>(bufs[k]);
      t.exp_avg = static_cast<char*>(bufs[j.n_main]) + done * moment_size;
      t.exp_avg_sq = static_cast<char*>(bufs[j.n_main + 1]) + done * moment_size;
      t.moment_type = j.moment_type;
      t.grad = static_cast<const char*>(j.grad) + first * ScalarSize(j.grad_type);
      t.grad_type = j.grad_type;
      t.param = j.param ? static_cast<char*>(j.param) + first * ScalarSize(j.param_type) : nullptr;
      t.param_type = j.param ? j.param_type : kernels::ScalarType::kNone;
      t.found_inf = found_inf_;
      OPTSTATE_RETURN_IF_ERROR(dev_->Adam(t, n, j.params, cpu_threads_, d.stream));
      done += n;
    }
    if (!in_place) {
      for (uint32_t f = 0; f < j.n_bufs; ++f) {
        OPTSTATE_RETURN_IF_ERROR(dev_->CopyD2H(s.buf[f], d.d[f], j.lens[f], d.stream));
      }
      d2h += j.bytes();
    }
    return dev_->RecordEvent(d.event, d.stream);  // host backend: complete already
  }

  Status StartWrites(size_t i) {
    Set& s = SetAt(i);
    const Job& j = s.job;
    s.stage = Stage::kWriting;
    s.pending = 0;
    for (uint32_t f = 0; f < j.n_bufs; ++f) {
      const uint64_t len = j.lens[f];
      // The new version; cleared on abort (ManagerImpl::OnAbortPending).
      if (!s.acquired[f]) mm_->cache()->Put(Key(j, f), s.buf[f], len);
      vfs::ChunkRef ref{j.tensor_id, j.fields[f], j.chunks[f]};
      Status st = io_->SubmitWrite(ref, s.buf[f], i * 4 + f);
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

  void StartSync() {
    if (sync_thread_.joinable()) sync_thread_.join();
    if (!sync_status_.ok()) return;
    unsynced_bytes_ = 0;
    sync_running_ = true;
    sync_thread_ = std::thread([this] {
      Status st = mm_->store()->SyncData();
      if (!st.ok()) sync_status_ = st.WithContext("StreamedAdam: background data sync");
      sync_running_ = false;
    });
  }

  const uint32_t bufs_;  // chunks (buffers, device pages) of a full slice: SliceChunks
  ManagerImpl* mm_;
  Device* dev_;
  vfs::ChunkIo* io_;  // StreamedAdam's
  // Every this many bytes of completed writes (0 = never), fdatasync the data
  // files in the background (Store::SyncData; StreamedAdamOptions).
  uint64_t sync_every_bytes_;
  std::thread sync_thread_;              // at most one background SyncData
  std::atomic<bool> sync_running_{false};
  Status sync_status_;                   // written by sync_thread_, read after join
  uint64_t unsynced_bytes_ = 0;
  int cpu_threads_;
  const float* found_inf_;
  uint64_t* inject_;
  bool started_ = false;
  bool cache_mode_ = false;
  bool write_through_ = true;
  bool read_tier_ = false;  // slices use host cache entries as buffers where they can
  bool hold_completions_ = false;  // SetHoldCompletions
  bool reap_only_when_blocked_ = false;  // SetReapOnlyWhenBlocked
  uint64_t next_seq_ = 0;
  Arena arena_;
  std::vector<void*> staging_;
  // Prefetched chunks not yet used (Adopt) and the buffers adopted with them.
  std::unordered_map<ChunkKey, Staged, internal::ChunkKeyHash> staged_;
  std::vector<void*> extra_staging_;
  std::vector<void*> spare_;  // staging buffers a set gave up for a prefetched one
  std::vector<Set> sets_;     // big sets, small sets, then sets grown from spare_
  // The write tail: computed slices in cache entries, their staging sets
  // given back (OnComputed); at most one per slice of the step, holding no
  // buffers of their own. free_tail_: unused ones; tail_busy_: in use.
  std::vector<Set> tail_;
  std::vector<size_t> free_tail_;
  size_t tail_busy_ = 0;
  std::vector<DevSlot> slots_;
  std::deque<Job> queue_;
  std::deque<size_t> ready_;
  std::deque<size_t> computed_;  // computed slices waiting for write-queue room
  std::vector<vfs::ChunkCompletion> done_;
  std::vector<vfs::ChunkCompletion> reap_buf_;
  // Depth limits (MemoryManagerOptions::queue_depth, write_queue_depth; 0 =
  // shared) and what is in flight now; the ChunkIo's ring holds both.
  uint32_t read_qd_ = 32, write_qd_ = 32;
  uint32_t reads_in_flight_ = 0, writes_in_flight_ = 0;
  uint64_t read_bytes_ = 0, write_bytes_ = 0;  // of the requests in flight
  uint64_t chunk_bytes_ = 0;
  uint32_t ring_requests_ = 0;  // the ChunkIo's queue depth (RingRequests)
  size_t small_sets_ = 0;       // small sets in sets_
  Status error_;
};

}  // namespace internal

// ------------------------------------------------------------------ StreamedAdam

// A step handed to the background: its pipeline (the write tail), the commit
// to publish, and what the thread found. The thread owns pipeline, the
// optimizer's io_ and the store's pending generation until it is joined.
struct StreamedAdam::InFlightCommit {
  std::thread thread;
  std::unique_ptr<internal::StepPipeline> pipeline;
  vfs::CommitInfo info;            // the step's generation (step counts after it)
  bool cache_mode = false;         // the step's slices lived in the host cache
  uint64_t generation = 0;         // the generation the commit publishes
  uint64_t steps = 1;              // steps it makes durable (cached ones too)
  // Written by the thread, read after join.
  Status status;
  uint64_t committed = 0;          // the generation Store::Commit returned
  uint64_t slices = 0, write_bytes = 0, peak_write_bytes = 0;
  uint64_t write_bytes_at_return = 0;  // of the step's writes, complete when Step returned
  double io_wait_seconds = 0, commit_seconds = 0;
  // Set by the thread when it is done (status and committed final); a
  // prefetch waits on it before it reads the store.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
};

// A prefetch running on a thread of the optimizer (StreamedAdam::Prefetch).
struct StreamedAdam::PrefetchRun {
  std::thread thread;
  std::atomic<bool> stop{false};  // set (under the in-flight commit's mu, if any) by StopPrefetch
  // Written by the thread, read after join.
  uint64_t read_bytes = 0;  // chunk bytes read into the host cache tier
  uint64_t disk_bytes = 0;  // chunk bytes read from the store (some may have found an entry by then)
  uint64_t failed = 0;      // chunks not read (a read error; the step reads them again)
  std::vector<StagedChunk> staged;  // read into staging buffers for the next step
  uint64_t write_mark = 0;          // the manager's nvme_write_bytes when reading started
};

StreamedAdam::StreamedAdam(vfs::Store* store, MemoryManager* mm, const StreamedAdamOptions& opts)
    : store_(store), mm_(mm), opts_(opts), grad_scale_(opts.grad_scale), step_grad_scale_(opts.grad_scale) {}

StreamedAdam::~StreamedAdam() {
  // FinishCommit logs a failure; the destructor then commits what is left.
  (void)FinishCommit();
  if (!pipeline_ && !in_step_ && (uncommitted_steps_ > 0 || registrations_pending_) && !poisoned_) {
    const uint64_t n = uncommitted_steps_;
    auto g = MakeDurable();
    if (g.ok()) {
      OPTSTATE_LOG_INFO("StreamedAdam: committed {} cached step(s) and pending registrations at destruction as "
                        "generation {} of store {}",
                        n, *g, store_->path());
    } else {
      OPTSTATE_LOG_ERROR("StreamedAdam: {} step(s) held in the host cache and pending registrations were lost at "
                         "destruction of the optimizer of store {}: {}",
                         n, store_->path(), g.status().ToString());
    }
  }
  if (pipeline_) {
    pipeline_->Abort();
    pipeline_.reset();
    if (in_step_ && !step_skip_) {
      Status s = store_->AbortPending();
      if (!s.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: abort of unfinished step failed: {}", s.ToString());
      mm_->impl()->OnAbortPending();
    }
  }
}

Result<std::unique_ptr<StreamedAdam>> StreamedAdam::Create(vfs::Store* store, MemoryManager* mm,
                                                          const StreamedAdamOptions& opts) {
  if (store == nullptr || mm == nullptr) return InvalidArgument("StreamedAdam::Create: store or manager is null");
  if (mm->store() != store) {
    return InvalidArgument("StreamedAdam::Create: the memory manager serves store " + mm->store()->path() +
                           ", not " + store->path());
  }
  ManagerImpl* impl = mm->impl();
  if (opts.moment_dtype != kernels::ScalarType::kF32 && opts.moment_dtype != kernels::ScalarType::kBF16) {
    return InvalidArgument(std::string("StreamedAdam: moment_dtype must be f32 or bf16, got ") +
                           ScalarName(opts.moment_dtype) + " (store " + store->path() + ")");
  }
  const uint32_t slice_chunks = internal::SliceChunks(opts.moment_dtype);
  if (impl->budget_pages() < slice_chunks) {
    return ResourceExhausted("StreamedAdam: device budget " + std::to_string(mm->options().device_budget_bytes) +
                             " bytes is smaller than one slice in flight (one chunk per field" +
                             (slice_chunks > 3 ? std::string(", two of main") : std::string()) + ": " +
                             std::to_string(slice_chunks) + " x " +
                             std::to_string(impl->page_bytes()) + " bytes = " +
                             std::to_string(slice_chunks * impl->page_bytes()) + " with " +
                             ScalarName(opts.moment_dtype) + " moments)");
  }
  if (!(opts.grad_scale > 0.0f) || !std::isfinite(opts.grad_scale)) {
    return InvalidArgument("StreamedAdam: grad_scale must be finite and > 0, got " + std::to_string(opts.grad_scale));
  }
  auto sa = std::unique_ptr<StreamedAdam>(new StreamedAdam(store, mm, opts));
  // Restore groups, step counts and params from the latest generation.
  vfs::GenerationInfo gen = store->LatestGeneration();
  sa->global_step_ = gen.step;
  sa->last_generation_ = gen.generation;
  for (const vfs::GroupInfo& g : gen.groups) {
    ParamGroup pg;
    pg.id = g.id;
    auto get = [&](const char* k, double def) {
      auto it = g.hyper.find(k);
      return it == g.hyper.end() ? def : it->second;
    };
    pg.lr = get("lr", pg.lr);
    pg.beta1 = get("beta1", pg.beta1);
    pg.beta2 = get("beta2", pg.beta2);
    pg.eps = get("eps", pg.eps);
    pg.weight_decay = get("weight_decay", pg.weight_decay);
    pg.adamw = get("adamw", 1.0) != 0.0;
    sa->groups_[g.id] = pg;
    sa->step_counts_[g.id] = g.step_count;
  }
  for (const vfs::TensorInfo& t : store->ListTensors()) {
    // An entry no generation has committed (a registration dropped by a
    // failed step, or a crash before the first commit) holds no state: it is
    // not a param until RegisterParam takes it over with its initial weights.
    if (t.created_generation > gen.generation) continue;
    Param p;
    p.info = t;
    auto a = store->FieldIndex(t, "main");
    auto b = store->FieldIndex(t, "exp_avg");
    auto c = store->FieldIndex(t, "exp_avg_sq");
    if (!a.ok() || !b.ok() || !c.ok()) continue;  // not an Adam tensor
    OPTSTATE_RETURN_IF_ERROR(CheckMomentFields(t, store->path(), MomentDType(opts.moment_dtype)));
    p.f_main = *a;
    p.f_m = *b;
    p.f_v = *c;
    sa->params_.emplace(t.name, std::move(p));
    if (!sa->groups_.count(t.group)) {
      sa->groups_[t.group] = ParamGroup{.id = t.group};
      sa->step_counts_[t.group] = 0;
    }
  }
  sa->committed_step_counts_ = sa->step_counts_;
  sa->committed_global_step_ = sa->global_step_;
  if (sa->opts_.durable_every_steps == 0) {
    return InvalidArgument("StreamedAdam: durable_every_steps must be >= 1");
  }
  if (sa->opts_.commit_lag_steps > 1) {
    return InvalidArgument("StreamedAdam: commit_lag_steps must be 0 (commit inside Step) or 1 (commit in the "
                           "background until the next call), got " + std::to_string(sa->opts_.commit_lag_steps) +
                           " (store " + store->path() + ")");
  }
  if (!sa->params_.empty()) {
    OPTSTATE_LOG_INFO("StreamedAdam: store {} restored at generation {} step {}: {} params, {} groups",
                      store->path(), gen.generation, gen.step, sa->params_.size(), sa->groups_.size());
  }
  return sa;
}

Status StreamedAdam::CheckUsable() const {
  if (poisoned_) return poison_status_;
  return Status::Ok();
}

Status StreamedAdam::SetGroup(const ParamGroup& g) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::SetGroup: a step is in progress");
  if (!(g.lr >= 0) || !(g.beta1 >= 0 && g.beta1 < 1) || !(g.beta2 >= 0 && g.beta2 < 1) || !(g.eps > 0) ||
      !(g.weight_decay >= 0) || !std::isfinite(g.lr) || !std::isfinite(g.weight_decay)) {
    return InvalidArgument("StreamedAdam::SetGroup " + std::to_string(g.id) + ": invalid hyperparameters (lr " +
                           std::to_string(g.lr) + ", betas " + std::to_string(g.beta1) + "/" +
                           std::to_string(g.beta2) + ", eps " + std::to_string(g.eps) + ", weight_decay " +
                           std::to_string(g.weight_decay) + ")");
  }
  groups_[g.id] = g;
  step_counts_.emplace(g.id, 0);
  return Status::Ok();
}

Result<ParamGroup> StreamedAdam::GetGroup(uint32_t id) const {
  auto it = groups_.find(id);
  if (it == groups_.end()) return NotFound("StreamedAdam: no parameter group " + std::to_string(id));
  return it->second;
}

bool StreamedAdam::HasParam(const std::string& name) const { return params_.count(name) != 0; }

std::vector<std::string> StreamedAdam::ParamNames() const {
  std::vector<std::string> out;
  for (const auto& [n, p] : params_) out.push_back(n);
  return out;
}

std::vector<std::string> StreamedAdam::UnregisteredParams() const {
  std::vector<std::string> out;
  if (!any_registered_) return out;
  for (const auto& [n, p] : params_) {
    if (!p.registered) out.push_back(n);
  }
  return out;
}

Status StreamedAdam::RetireParam(const std::string& name) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::RetireParam '" + name + "': a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  auto it = params_.find(name);
  if (it == params_.end()) {
    return NotFound("StreamedAdam::RetireParam: store " + store_->path() + " has no param '" + name + "'" +
                    (retired_.count(name) ? " (already retired in this run)" : ""));
  }
  if (it->second.registered || !it->second.committed) {
    return FailedPrecondition("StreamedAdam::RetireParam '" + name + "': registered in this run (store " +
                              store_->path() + "); only a param restored from the store and not registered can be "
                              "retired");
  }
  retired_.insert(name);
  params_.erase(it);
  OPTSTATE_LOG_INFO("StreamedAdam: param {} of store {} retired for this run; its state stays in the store unchanged",
                    name, store_->path());
  return Status::Ok();
}

Status StreamedAdam::CheckModelComplete() const {
  if (!any_registered_) return Status::Ok();
  std::vector<std::string> missing = UnregisteredParams();
  if (missing.empty()) return Status::Ok();
  return FailedPrecondition(
      "StreamedAdam: store " + store_->path() + " holds " + std::to_string(missing.size()) +
      " param(s) that this run did not register: " +
      NameList(missing.begin(), missing.end(), [&](const std::string& n) { return params_.at(n).info.numel; }) +
      "; register them (their stored state is kept) or RetireParam them (their state stays in the store, "
      "unchanged); nothing was stepped or committed");
}

Status StreamedAdam::CheckGrad(const ParamGrad& g) const {
  auto it = params_.find(g.name);
  if (it == params_.end()) {
    if (retired_.count(g.name)) {
      return InvalidArgument("StreamedAdam: gradient for param '" + g.name + "' of store " + store_->path() +
                             ", which was retired in this run");
    }
    std::string some;
    int n = 0;
    for (const auto& [name, p] : params_) {
      if (n++ == 5) break;
      some += (some.empty() ? "" : ", ") + name;
    }
    return NotFound("StreamedAdam::StepParam: unknown param '" + g.name + "' (store " + store_->path() + " has " +
                    std::to_string(params_.size()) + " params: " + some + (params_.size() > 5 ? ", ..." : "") + ")");
  }
  if (!IsFloatType(g.grad_type)) {
    return InvalidArgument("StreamedAdam::StepParam " + g.name + ": gradient dtype " + ScalarName(g.grad_type) +
                           " not supported (f32, bf16, f16)");
  }
  if (g.d_param != nullptr && !IsFloatType(g.param_type)) {
    return InvalidArgument("StreamedAdam::StepParam " + g.name + ": param dtype " + ScalarName(g.param_type) +
                           " not supported (f32, bf16, f16)");
  }
  if (g.d_grad == nullptr) return InvalidArgument("StreamedAdam::StepParam " + g.name + ": null gradient");
  if (g.numel != 0 && g.numel != it->second.info.numel) {
    return InvalidArgument("StreamedAdam::StepParam '" + g.name + "': the gradient has " + std::to_string(g.numel) +
                           " elements; store " + store_->path() + " has the param with numel " +
                           std::to_string(it->second.info.numel));
  }
  return Status::Ok();
}

Status StreamedAdam::CheckSameGeometry(const vfs::TensorInfo& t, const std::string& what, uint64_t numel,
                                       uint32_t group, kernels::ScalarType initial_type,
                                       const ShardInfo& shard) const {
  auto mismatch = [&](const std::string& field, const std::string& stored, const std::string& given) {
    return InvalidArgument("StreamedAdam::RegisterParam '" + t.name + "': store " + store_->path() + " has " + what +
                           " with " + field + " " + stored + ", registered with " + field + " " + given +
                           " (the model no longer matches the store; nothing changed)");
  };
  if (t.numel != numel) return mismatch("numel", std::to_string(t.numel), std::to_string(numel));
  if (t.group != group) return mismatch("group", std::to_string(t.group), std::to_string(group));
  if (initial_type != kernels::ScalarType::kNone && t.dtype != StoredDType(initial_type)) {
    return mismatch("dtype", vfs::DTypeName(t.dtype), vfs::DTypeName(StoredDType(initial_type)));
  }
  // The same defaults as Store::CreateTensor.
  std::vector<uint64_t> shape = shard.shape.empty() ? std::vector<uint64_t>{numel} : shard.shape;
  std::vector<uint64_t> global = shard.global_shape.empty() ? shape : shard.global_shape;
  std::vector<uint64_t> offset =
      shard.shard_offset.empty() ? std::vector<uint64_t>(global.size(), 0) : shard.shard_offset;
  if (t.shape != shape) return mismatch("shape", DimsText(t.shape), DimsText(shape));
  if (t.global_shape != global) return mismatch("global shape", DimsText(t.global_shape), DimsText(global));
  if (t.shard_offset != offset) return mismatch("shard offset", DimsText(t.shard_offset), DimsText(offset));
  return CheckMomentFields(t, store_->path(), MomentDType(opts_.moment_dtype));
}

std::string StreamedAdam::DropUncommittedRegistrations() {
  std::vector<std::string> dropped, reloaded;
  std::map<std::string, uint64_t> numels;
  for (auto it = params_.begin(); it != params_.end();) {
    Param& p = it->second;
    if (!p.committed) {
      dropped.push_back(it->first);
      numels[it->first] = p.info.numel;
      mm_->impl()->cache()->EraseTensor(p.info.id);
      (void)mm_->impl()->DropTensor(p.info.id);
      dropped_.insert(it->first);
      it = params_.erase(it);
      continue;
    }
    if (p.main_pending) {
      reloaded.push_back(it->first);
      p.main_pending = false;
      mm_->impl()->cache()->EraseTensor(p.info.id);
      (void)mm_->impl()->DropTensor(p.info.id);
    }
    ++it;
  }
  registrations_pending_ = false;
  std::string msg;
  if (!dropped.empty()) {
    msg = "the registration of " + std::to_string(dropped.size()) + " new param(s) not yet committed was dropped (" +
          NameList(dropped.begin(), dropped.end(), [&](const std::string& n) { return numels[n]; }) +
          "): register them again";
  }
  if (!reloaded.empty()) {
    msg += (msg.empty() ? "" : "; ") + std::string("the weights LoadMainFrom loaded into ") +
           NameList(reloaded.begin(), reloaded.end(), [](const std::string&) { return uint64_t{0}; }) +
           " were dropped (main is back at generation " + std::to_string(last_generation_) + "): load them again";
  }
  return msg;
}

Status StreamedAdam::AbortUncommitted(Status s) {
  Status a = store_->AbortPending();
  if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed write: {}", a.ToString());
  mm_->impl()->OnAbortPending();
  return WithNote(s, DropUncommittedRegistrations());
}

uint64_t StreamedAdam::step_count(uint32_t group) const {
  auto it = step_counts_.find(group);
  return it == step_counts_.end() ? 0 : it->second;
}

uint64_t StreamedAdam::last_generation() const { return last_generation_; }

Status StreamedAdam::EnsureIo() {
  if (io_) return Status::Ok();
  ManagerImpl* impl = mm_->impl();
  // One ring for the pipeline's reads and writes: room for both depth limits.
  vfs::ChunkIoOptions co = impl->ChunkIoOpts();
  co.queue_depth = internal::RingRequests(impl->options());
  co.defer_submit = impl->options().batch_submit;
  auto io = store_->NewChunkIo(co);
  if (!io.ok()) {
    vfs::ChunkIoOptions plain = co;
    plain.registered_buffers.clear();
    io = store_->NewChunkIo(plain);
  }
  if (!io.ok()) return io.status().WithContext("StreamedAdam: store " + store_->path());
  io_ = std::move(*io);
  return Status::Ok();
}

Status StreamedAdam::WriteMain(const Param& p, const void* d_src, kernels::ScalarType type) {
  ManagerImpl* impl = mm_->impl();
  Device* dev = impl->device();
  const uint64_t chunk = impl->page_bytes();
  const uint64_t chunk_elems = chunk / 4;
  const uint64_t numel = p.info.numel;
  const uint64_t nchunks = (numel + chunk_elems - 1) / chunk_elems;
  const uint32_t src_size = ScalarSize(type);
  impl->cache()->EraseTensor(p.info.id);
  std::vector<void*> bufs = impl->AcquireStaging(1, 8);
  std::vector<char> bounce;
  if (dev->backend() == Backend::kCuda) bounce.resize(chunk_elems * src_size);
  Status ios = EnsureIo();
  if (!ios.ok()) {
    impl->ReleaseStaging(bufs);
    return ios.WithContext("StreamedAdam: writing main of " + p.info.name);
  }
  vfs::ChunkIo* io = io_.get();
  std::vector<void*> free_bufs = bufs;
  std::vector<vfs::ChunkCompletion> done;
  Status st;
  for (uint64_t c = 0; c < nchunks && st.ok(); ++c) {
    while (free_bufs.empty() && st.ok()) {
      done.clear();
      st = io->Reap(&done, 1);
      for (auto& d : done) {
        if (!d.status.ok() && st.ok()) st = d.status;
        free_bufs.push_back(reinterpret_cast<void*>(d.tag));
      }
    }
    if (!st.ok()) break;
    void* buf = free_bufs.back();
    free_bufs.pop_back();
    uint64_t first = c * chunk_elems, n = std::min(chunk_elems, numel - first);
    const char* src = static_cast<const char*>(d_src) + first * src_size;
    if (!bounce.empty()) {
      st = dev->CopyD2H(bounce.data(), src, n * src_size, nullptr);
      if (st.ok()) st = dev->SyncStream(nullptr);
      if (!st.ok()) break;
      src = bounce.data();
    }
    float* out = static_cast<float*>(buf);
    if (type == kernels::ScalarType::kF32) {
      std::memcpy(out, src, n * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) out[i] = ToFloat(src, i, type);
    }
    st = io->SubmitWrite(vfs::ChunkRef{p.info.id, p.f_main, c}, buf, reinterpret_cast<uint64_t>(buf));
  }
  while (io->in_flight() > 0) {
    done.clear();
    Status rs = io->Reap(&done, io->in_flight());
    for (auto& d : done) {
      if (!d.status.ok() && st.ok()) st = d.status;
    }
    if (!rs.ok()) {
      if (st.ok()) st = rs;
      break;
    }
  }
  impl->ReleaseStaging(bufs);
  if (!st.ok()) return st.WithContext("StreamedAdam: writing main of " + p.info.name);
  return Status::Ok();
}

Status StreamedAdam::RegisterParam(const std::string& name, uint64_t numel, uint32_t group, const void* d_initial,
                                   kernels::ScalarType initial_type, const ShardInfo& shard) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::RegisterParam " + name + ": a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  auto it = params_.find(name);
  if (it != params_.end()) {
    OPTSTATE_RETURN_IF_ERROR(CheckSameGeometry(it->second.info, "it", numel, group, initial_type, shard));
    it->second.registered = true;
    any_registered_ = true;
    return Status::Ok();  // existing state is kept
  }
  if (retired_.count(name)) {
    return FailedPrecondition("StreamedAdam::RegisterParam '" + name + "': retired in this run (store " +
                              store_->path() + ")");
  }
  if (numel == 0) return InvalidArgument("StreamedAdam::RegisterParam " + name + ": numel is 0");
  if (d_initial != nullptr && !IsFloatType(initial_type)) {
    return InvalidArgument("StreamedAdam::RegisterParam " + name + ": initial weights dtype " +
                           ScalarName(initial_type) + " not supported (f32, bf16, f16)");
  }
  // An entry in the index that is not a param: one no generation committed
  // (it holds no state), or one whose registration a failed step dropped.
  // Taken over when the geometry matches; its main is written again.
  std::optional<vfs::TensorInfo> entry;
  if (auto found = store_->FindTensor(name); found.ok()) {
    if (found->created_generation <= last_generation_ && !dropped_.count(name)) {
      return AlreadyExists("StreamedAdam::RegisterParam '" + name + "': store " + store_->path() +
                           " has a tensor of that name that is not an Adam param (no main/exp_avg/exp_avg_sq)");
    }
    OPTSTATE_RETURN_IF_ERROR(CheckSameGeometry(*found, "an uncommitted entry for it (a registration that was never "
                                               "committed)", numel, group, initial_type, shard));
    entry = *found;
  }
  if (uncommitted_steps_ > 0) {  // the new tensor is committed with state that is on disk
    auto d = MakeDurable();
    if (!d.ok()) return d.status().WithContext("StreamedAdam::RegisterParam " + name);
  }
  if (!groups_.count(group)) {
    OPTSTATE_LOG_INFO("StreamedAdam: param {} uses group {} that has no SetGroup; default hyperparameters", name,
                      group);
    groups_[group] = ParamGroup{.id = group};
    step_counts_.emplace(group, 0);
  }
  vfs::TensorInfo info;
  if (entry) {
    info = *entry;
  } else {
    vfs::TensorSpec spec;
    spec.name = name;
    spec.dtype = StoredDType(initial_type);
    spec.numel = numel;
    spec.group = group;
    spec.shape = shard.shape;
    spec.global_shape = shard.global_shape;
    spec.shard_offset = shard.shard_offset;
    const vfs::DType md = MomentDType(opts_.moment_dtype);
    spec.fields = {{"main", vfs::DType::kF32}, {"exp_avg", md}, {"exp_avg_sq", md}};
    OPTSTATE_ASSIGN_OR_RETURN(info, store_->CreateTensor(spec));
  }
  Param p;
  p.info = info;
  OPTSTATE_ASSIGN_OR_RETURN(p.f_main, store_->FieldIndex(info, "main"));
  OPTSTATE_ASSIGN_OR_RETURN(p.f_m, store_->FieldIndex(info, "exp_avg"));
  OPTSTATE_ASSIGN_OR_RETURN(p.f_v, store_->FieldIndex(info, "exp_avg_sq"));
  p.committed = false;
  p.registered = true;
  any_registered_ = true;
  registrations_pending_ = true;
  dropped_.erase(name);
  auto [pit, inserted] = params_.emplace(name, std::move(p));
  (void)inserted;
  if (d_initial != nullptr) {
    Status ws = WriteMain(pit->second, d_initial, initial_type);
    if (!ws.ok()) return AbortUncommitted(ws.WithContext("StreamedAdam::RegisterParam " + name));
  }
  return Status::Ok();
}

Status StreamedAdam::LoadMainFrom(const std::string& name, const void* d_weights, kernels::ScalarType type) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::LoadMainFrom " + name + ": a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  auto it = params_.find(name);
  if (it == params_.end()) {
    return NotFound("StreamedAdam::LoadMainFrom: unknown param " + name + " (" + std::to_string(params_.size()) +
                    " registered in store " + store_->path() + ")");
  }
  if (d_weights == nullptr || !IsFloatType(type)) {
    return InvalidArgument("StreamedAdam::LoadMainFrom " + name + ": need non-null weights of f32/bf16/f16, got " +
                           ScalarName(type));
  }
  if (uncommitted_steps_ > 0) {  // WriteMain replaces the cache's copy of this tensor
    auto d = MakeDurable();
    if (!d.ok()) return d.status().WithContext("StreamedAdam::LoadMainFrom " + name);
  }
  OPTSTATE_RETURN_IF_ERROR(mm_->impl()->DropTensor(it->second.info.id));
  it->second.main_pending = true;
  registrations_pending_ = true;
  Status ws = WriteMain(it->second, d_weights, type);
  if (!ws.ok()) return AbortUncommitted(ws.WithContext("StreamedAdam::LoadMainFrom " + name));
  return Status::Ok();
}

vfs::CommitInfo StreamedAdam::MakeCommitInfo(bool advance) const {
  vfs::CommitInfo ci;
  ci.step = advance ? global_step_ + 1 : global_step_;
  for (const auto& [id, g] : groups_) {
    vfs::GroupInfo gi;
    gi.id = id;
    auto sc = step_counts_.find(id);
    gi.step_count = sc == step_counts_.end() ? 0 : sc->second;
    if (advance && groups_stepped_.count(id)) gi.step_count += 1;
    gi.hyper = {{"lr", g.lr},     {"beta1", g.beta1},
                {"beta2", g.beta2}, {"eps", g.eps},
                {"weight_decay", g.weight_decay}, {"adamw", g.adamw ? 1.0 : 0.0}};
    ci.groups.push_back(std::move(gi));
  }
  return ci;
}

bool StreamedAdam::CacheHoldsState() const {
  const HostCache* c = mm_->impl()->cache();
  if (!c->enabled()) return false;
  return StateCacheBytes() <= c->capacity_bytes();
}

uint64_t StreamedAdam::StateCacheBytes() const {
  const uint64_t chunk = mm_->impl()->page_bytes();
  uint64_t need = 0;
  for (const auto& [name, p] : params_) {
    for (uint32_t f : {p.f_main, p.f_m, p.f_v}) {
      const uint64_t bytes = p.info.field_bytes(f);
      const uint64_t tail = bytes % chunk ? HostCache::EntryBytes(bytes % chunk) : 0;
      need += (bytes / chunk) * HostCache::EntryBytes(chunk) + tail;
    }
  }
  return need;
}

void StreamedAdam::NoteCommitted(uint64_t gen) {
  last_generation_ = gen;
  mm_->impl()->cache()->MarkAllClean();
  uncommitted_steps_ = 0;
  committed_step_counts_ = step_counts_;
  committed_global_step_ = global_step_;
  for (auto& [name, p] : params_) {
    p.committed = true;
    p.main_pending = false;
  }
  registrations_pending_ = false;
  dropped_.clear();
}

std::string StreamedAdam::RevertUncommitted() {
  if (uncommitted_steps_ == 0) return "";
  std::string msg = std::to_string(uncommitted_steps_) +
                    " step(s) held only in the host cache were lost; the optimizer is back at generation " +
                    std::to_string(last_generation_) + " (step " + std::to_string(committed_global_step_) + ")";
  for (auto& [id, n] : step_counts_) {
    auto it = committed_step_counts_.find(id);
    n = it == committed_step_counts_.end() ? 0 : it->second;
  }
  global_step_ = committed_global_step_;
  uncommitted_steps_ = 0;
  return msg;
}

Status StreamedAdam::WriteDirtyCache() {
  HostCache* cache = mm_->impl()->cache();
  auto dirty = cache->DirtyUnwritten();
  if (dirty.empty()) return Status::Ok();
  OPTSTATE_RETURN_IF_ERROR(EnsureIo());
  const size_t depth = std::max<uint32_t>(mm_->options().queue_depth + mm_->options().write_queue_depth, 1);
  std::vector<vfs::ChunkCompletion> done;
  Status st;
  size_t next = 0;
  while ((next < dirty.size() || io_->in_flight() > 0)) {
    while (st.ok() && next < dirty.size() && io_->in_flight() < depth) {
      const ChunkKey& k = dirty[next].first;
      st = io_->SubmitWrite(vfs::ChunkRef{k.tensor_id, k.field, k.index}, dirty[next].second, next);
      if (!st.ok()) {
        st = st.WithContext("StreamedAdam: writing cached tensor id " + std::to_string(k.tensor_id) + " field " +
                            std::to_string(k.field) + " chunk " + std::to_string(k.index));
        break;
      }
      ++next;
    }
    if (io_->in_flight() == 0) break;
    done.clear();
    Status rs = io_->Reap(&done, 1);
    if (!rs.ok() && st.ok()) st = rs;
    for (const auto& c : done) {
      if (!c.status.ok()) {
        if (st.ok()) st = c.status;
        continue;
      }
      cache->MarkWritten(dirty[c.tag].first);
    }
    if (!rs.ok()) break;
  }
  return st;
}

Result<uint64_t> StreamedAdam::MakeDurable() {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::MakeDurable: a step is in progress");
  OPTSTATE_RETURN_IF_ERROR(FinishCommit());
  if (uncommitted_steps_ == 0 && !registrations_pending_) return last_generation_;
  const uint64_t n = uncommitted_steps_;
  Status s = WriteDirtyCache();
  if (s.ok()) s = mm_->Flush();
  Result<uint64_t> gen = s.ok() ? store_->Commit(MakeCommitInfo(false)) : Result<uint64_t>(s);
  if (!gen.ok()) {
    Status a = store_->AbortPending();
    if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed MakeDurable: {}", a.ToString());
    // The cache still holds the steps: keep them (dirty) and let the caller
    // retry. Their chunks written before the failure went with the dropped
    // generation, so every dirty entry must be written again by the retry.
    // Registrations and loaded mains were only in the pending generation:
    // they are gone, and the error says so.
    mm_->impl()->OnAbortPending(/*keep_dirty_cache=*/true);
    const std::string dropped = DropUncommittedRegistrations();
    Status err = gen.status().WithContext("StreamedAdam::MakeDurable of " + std::to_string(n) +
                                          " cached step(s) of store " + store_->path());
    if (n > 0) {
      err = WithNote(err, "the " + std::to_string(n) + " step(s) stay in the host cache (generation " +
                              std::to_string(last_generation_) + " is the last commit): call MakeDurable again");
    }
    return WithNote(err, dropped);
  }
  NoteCommitted(*gen);
  return *gen;
}

Status StreamedAdam::Fail(Status s) {
  if (pipeline_) {
    pipeline_->Abort();
    pipeline_.reset();
  }
  Status a = store_->AbortPending();
  if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed step: {}", a.ToString());
  mm_->impl()->OnAbortPending();
  in_step_ = false;
  stepped_.clear();
  const std::string lost = RevertUncommitted();
  if (!lost.empty()) s = s.WithContext(lost);
  s = WithNote(s, DropUncommittedRegistrations());
  // A CUDA error is sticky for the process: refuse to continue.
  if (mm_->backend() == Backend::kCuda && s.message().find("CUDA") != std::string::npos) {
    poisoned_ = true;
    poison_status_ = s.WithContext("StreamedAdam is unusable after a CUDA error");
  }
  OPTSTATE_LOG_ERROR("StreamedAdam: step aborted, nothing committed: {}", s.ToString());
  return s;
}

Status StreamedAdam::SetGradScale(float grad_scale) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::SetGradScale: a step is in progress (store " +
                                          store_->path() + ")");
  OPTSTATE_RETURN_IF_ERROR(CheckGradScale(grad_scale, "StreamedAdam::SetGradScale", store_->path()));
  grad_scale_ = grad_scale;
  return Status::Ok();
}

Status StreamedAdam::BeginStep(const float* d_found_inf, const float* d_grad_scale) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::BeginStep: the previous step has not ended");
  const double t_begin = NowS();
  double wait_s = 0;
  {
    Status fs = FinishCommit(&wait_s, /*keep_staged=*/true);  // completes the previous step's stats
    if (!fs.ok()) DropStaged();  // the step they were read for is gone
    OPTSTATE_RETURN_IF_ERROR(fs);
  }
  // Staged prefetched chunks go to this step's pipeline below; any early
  // return gives them back.
  struct DropUnadopted {
    StreamedAdam* sa;
    ~DropUnadopted() { sa->DropStaged(); }
  } drop_unadopted{this};
  if (!staged_.empty() && mm_->stats().nvme_write_bytes != staged_write_mark_) {
    DropStaged();  // a write-back through pins may have changed what they hold
  }
  OPTSTATE_RETURN_IF_ERROR(CheckModelComplete());
  step_found_inf_ = d_found_inf;
  step_skip_ = false;
  groups_stepped_.clear();
  stepped_.clear();
  last_stats_ = StepStats{};
  last_stats_.seconds = t_begin;
  last_stats_.commit_wait_seconds = wait_s;
  last_stats_.prefetch_read_bytes = prefetch_read_bytes_;
  prefetch_read_bytes_ = 0;
  if (d_found_inf != nullptr) {
    float flag = 0;
    OPTSTATE_RETURN_IF_ERROR(mm_->CopyToHost(&flag, d_found_inf, sizeof(float)));
    if (flag != 0.0f) {
      step_skip_ = true;
      in_step_ = true;
      return Status::Ok();
    }
  }
  step_grad_scale_ = grad_scale_;
  if (d_grad_scale != nullptr) {
    float scale = 0;
    OPTSTATE_RETURN_IF_ERROR(mm_->CopyToHost(&scale, d_grad_scale, sizeof(float)));
    OPTSTATE_RETURN_IF_ERROR(CheckGradScale(scale, "StreamedAdam: the step's d_grad_scale", store_->path()));
    step_grad_scale_ = scale;
  }
  // Registrations and LoadMainFrom since the last commit are in the pending
  // generation: this step's commit publishes them with its own writes.
  OPTSTATE_RETURN_IF_ERROR(EnsureIo());
  step_cache_mode_ = CacheHoldsState();
  if (!step_cache_mode_ && opts_.durable_every_steps > 1 && !warned_cache_small_) {
    warned_cache_small_ = true;
    OPTSTATE_LOG_WARN("StreamedAdam: durable_every_steps {} needs the host cache tier ({} bytes) to hold the whole "
                      "state of store {}; every step commits",
                      opts_.durable_every_steps, mm_->impl()->cache()->capacity_bytes(), store_->path());
  }
  if (!step_cache_mode_ && mm_->impl()->cache()->enabled() && !warned_cache_partial_) {
    warned_cache_partial_ = true;
    OPTSTATE_LOG_INFO("StreamedAdam: the host cache tier ({} bytes) holds part of the {} bytes of state of store {}; "
                      "steps read the chunks it admits from RAM and the rest from disk",
                      mm_->impl()->cache()->capacity_bytes(), StateCacheBytes(), store_->path());
  }
  const bool write_through = !step_cache_mode_ || uncommitted_steps_ + 1 >= opts_.durable_every_steps;
  pipeline_ = std::make_unique<internal::StepPipeline>(mm_->impl(), io_.get(), opts_.cpu_threads,
                                                       opts_.background_sync_bytes, d_found_inf,
                                                       &inject_kernel_failure_after_, opts_.moment_dtype);
  pipeline_->SetCacheMode(step_cache_mode_, write_through);
  pipeline_->SetHoldCompletions(hold_completions_);
  pipeline_->SetReapOnlyWhenBlocked(reap_only_when_blocked_);
  if (!staged_.empty()) {
    std::vector<internal::StepPipeline::Staged> adopt;
    for (const StagedChunk& c : staged_) {
      adopt.push_back({ChunkKey{c.tensor_id, c.field, c.chunk}, c.len, c.buf});
    }
    staged_.clear();
    pipeline_->Adopt(std::move(adopt));
  }
  step_order_.clear();
  step_write_through_ = write_through;
  Status s = pipeline_->Begin();
  if (!s.ok()) {
    pipeline_->Release();
    pipeline_.reset();
    return s;
  }
  in_step_ = true;
  return Status::Ok();
}

Status StreamedAdam::StepParam(const ParamGrad& g) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (!in_step_) return FailedPrecondition("StreamedAdam::StepParam " + g.name + ": no BeginStep");
  if (Status cs = CheckGrad(g); !cs.ok()) return Fail(cs);
  auto it = params_.find(g.name);
  const Param& p = it->second;
  if (step_skip_) return Status::Ok();
  if (stepped_.count(g.name)) {
    return Fail(InvalidArgument("StreamedAdam::StepParam " + g.name + ": given twice in one step"));
  }
  Status ds = mm_->impl()->DropTensor(p.info.id);
  if (!ds.ok()) return Fail(ds.WithContext("StreamedAdam::StepParam " + g.name));
  stepped_.insert(g.name);
  step_order_.push_back(StepOrderEntry{p.info.id, {p.f_main, p.f_m, p.f_v}, p.info.numel});
  const ParamGroup& grp = groups_.at(p.info.group);
  kernels::AdamParams ap;
  ap.lr = grp.lr;
  ap.beta1 = grp.beta1;
  ap.beta2 = grp.beta2;
  ap.eps = grp.eps;
  ap.weight_decay = grp.weight_decay;
  ap.mode = grp.adamw ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
  ap.step = step_count(p.info.group) + 1;
  ap.grad_scale = step_grad_scale_;
  groups_stepped_[p.info.group] = true;
  // A slice is one chunk of each moment and the main chunks of its elements
  // (see StepPipeline).
  const uint64_t chunk = mm_->impl()->page_bytes();
  const uint32_t moment_size = ScalarSize(opts_.moment_dtype);
  const uint64_t slice_elems = chunk / moment_size;
  for (uint64_t c = 0, first = 0; first < p.info.numel; ++c, first += slice_elems) {
    internal::StepPipeline::Job j;
    j.tensor_id = p.info.id;
    j.chunk = c;
    j.first_elem = first;
    j.elems = std::min(slice_elems, p.info.numel - first);
    j.moment_type = opts_.moment_dtype;
    const uint64_t main_bytes = j.elems * 4;
    j.n_main = static_cast<uint32_t>((main_bytes + chunk - 1) / chunk);
    j.n_bufs = j.n_main + 2;
    for (uint32_t k = 0; k < j.n_main; ++k) {
      j.fields[k] = p.f_main;
      j.chunks[k] = c * (4 / moment_size) + k;
      j.lens[k] = std::min(chunk, main_bytes - k * chunk);
    }
    j.fields[j.n_main] = p.f_m;
    j.fields[j.n_main + 1] = p.f_v;
    j.chunks[j.n_main] = j.chunks[j.n_main + 1] = c;
    j.lens[j.n_main] = j.lens[j.n_main + 1] = j.elems * moment_size;
    j.grad = g.d_grad;
    j.grad_type = g.grad_type;
    j.param = g.d_param;
    j.param_type = g.d_param ? g.param_type : kernels::ScalarType::kNone;
    j.params = ap;
    pipeline_->Enqueue(j);
  }
  Status ps = pipeline_->Pump(false);
  if (!ps.ok()) return Fail(ps);
  return Status::Ok();
}

Result<uint64_t> StreamedAdam::EndStep() {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (!in_step_) return FailedPrecondition("StreamedAdam::EndStep: no BeginStep");
  stepped_.clear();
  if (step_skip_) {
    in_step_ = false;
    last_step_skipped_ = true;
    last_stats_.seconds = NowS() - last_stats_.seconds;
    OPTSTATE_LOG_INFO("StreamedAdam: found-inf set; step skipped, nothing committed (generation {})",
                      last_generation_);
    return last_generation_;
  }
  // Pipelined commit: once every slice is computed (params updated), the
  // write tail and the commit go to the background, unless found-inf was
  // raised meanwhile (then the step is drained and dropped below).
  const bool pipelined = opts_.commit_lag_steps > 0 && step_write_through_;
  Status ds = pipeline_->Pump(true, /*until_computed=*/pipelined);
  if (!ds.ok()) return Fail(ds);
  if (pipelined) {
    float flag = 0;
    if (step_found_inf_ != nullptr) {
      Status cs = mm_->CopyToHost(&flag, step_found_inf_, sizeof(float));
      if (!cs.ok()) return Fail(cs);
    }
    if (flag == 0.0f) {
      last_stats_.device_slots = pipeline_->device_slots();
      Status rs = pipeline_->ReleaseDevice();
      if (!rs.ok()) return Fail(rs.WithContext("StreamedAdam: end of the step's device work"));
      NoteReadSideStats(*pipeline_);
      StartBackgroundCommit();
      const uint64_t gen = inflight_->generation;
      for (const auto& [id, stepped] : groups_stepped_) step_counts_[id] += 1;
      ++global_step_;
      last_step_skipped_ = false;
      in_step_ = false;
      last_stats_.seconds = NowS() - last_stats_.seconds;
      return gen;
    }
    ds = pipeline_->Pump(true);
    if (!ds.ok()) return Fail(ds);
  }
  ds = pipeline_->FinishSync();
  if (!ds.ok()) return Fail(ds);
  internal::StepPipeline& pl = *pipeline_;
  NoteReadSideStats(pl);
  last_stats_.slices = pl.slices;
  last_stats_.write_bytes = pl.write_bytes;
  last_stats_.peak_write_bytes_in_flight = pl.peak_write_bytes;
  last_stats_.device_slots = pl.device_slots();
  last_stats_.io_wait_seconds = pl.stall_s_;
  mm_->impl()->AddStats(pl.read_bytes, pl.write_bytes, pl.cache_hits, pl.h2d, pl.d2h, pl.stall_s_);
  pipeline_->Release();
  pipeline_.reset();
  if (step_found_inf_ != nullptr) {
    // Incremental form: the flag may have been set after BeginStep. The kernel
    // skipped every slice after it was set; drop the step as a whole.
    float flag = 0;
    Status cs = mm_->CopyToHost(&flag, step_found_inf_, sizeof(float));
    if (!cs.ok()) return Fail(cs);
    if (flag != 0.0f) {
      Status a = store_->AbortPending();
      mm_->impl()->OnAbortPending();
      in_step_ = false;
      last_step_skipped_ = true;
      if (step_cache_mode_) {
        // Slices before the flag were updated in place in the cache.
        const std::string lost = RevertUncommitted();
        OPTSTATE_LOG_WARN("StreamedAdam: found-inf raised during a cached step; step dropped{}{}",
                          lost.empty() ? "" : "; ", lost);
      }
      if (!a.ok()) return a;
      // The dropped pending generation also held what this step was to commit
      // with it: say so rather than return OK without it.
      const std::string dropped = DropUncommittedRegistrations();
      if (!dropped.empty()) {
        return FailedPrecondition("StreamedAdam: found-inf was raised after BeginStep; the step was dropped and "
                                  "nothing committed (store " + store_->path() + ", generation " +
                                  std::to_string(last_generation_) + "); " + dropped);
      }
      return last_generation_;
    }
  }
  if (!step_write_through_) {
    // Deferred durability: the step lives in the host cache only.
    for (const auto& [id, stepped] : groups_stepped_) step_counts_[id] += 1;
    ++global_step_;
    ++uncommitted_steps_;
    last_step_skipped_ = false;
    in_step_ = false;
    last_stats_.seconds = NowS() - last_stats_.seconds;
    return last_generation_;
  }
  if (step_cache_mode_) {
    // Params not stepped now may hold earlier uncommitted steps in the cache.
    Status ws = WriteDirtyCache();
    if (!ws.ok()) return Fail(ws);
  }
  Status fs = mm_->Flush();
  if (!fs.ok()) return Fail(fs);
  double tcommit = NowS();
  auto gen = store_->Commit(MakeCommitInfo(true));
  last_stats_.commit_seconds = NowS() - tcommit;
  if (!gen.ok()) return Fail(gen.status().WithContext("StreamedAdam: commit of step " + std::to_string(global_step_ + 1)));
  for (const auto& [id, stepped] : groups_stepped_) step_counts_[id] += 1;
  ++global_step_;
  NoteCommitted(*gen);
  last_step_skipped_ = false;
  in_step_ = false;
  last_stats_.seconds = NowS() - last_stats_.seconds;
  return *gen;
}

void StreamedAdam::StartBackgroundCommit() {
  auto c = std::make_unique<InFlightCommit>();
  c->pipeline = std::move(pipeline_);
  c->info = MakeCommitInfo(true);
  c->cache_mode = step_cache_mode_;
  c->generation = store_->LatestGeneration().generation + 1;
  c->steps = uncommitted_steps_ + 1;
  c->write_bytes_at_return = c->pipeline->write_bytes;
  c->pipeline->SetReapOnlyWhenBlocked(false);
  uncommitted_steps_ = 0;  // the cached steps are written with this one
  InFlightCommit* ip = c.get();
  mm_->impl()->BeginBackgroundCommit();
  ip->thread = std::thread([this, ip] {
    internal::StepPipeline& pl = *ip->pipeline;
    Status s = pl.Pump(true);
    if (s.ok()) s = pl.FinishSync();
    ip->slices = pl.slices;
    ip->write_bytes = pl.write_bytes;
    ip->peak_write_bytes = pl.peak_write_bytes;
    ip->io_wait_seconds = pl.stall_s_;
    if (s.ok()) {
      mm_->impl()->AddStats(pl.read_bytes, pl.write_bytes, pl.cache_hits, pl.h2d, pl.d2h, pl.stall_s_);
      pl.Release();
    } else {
      pl.Abort();
    }
    ip->pipeline.reset();
    // Params not stepped now may hold earlier uncommitted steps in the cache.
    if (s.ok() && ip->cache_mode) s = WriteDirtyCache();
    if (s.ok()) s = mm_->impl()->Flush();  // not MemoryManager::Flush: that waits for this thread
    if (s.ok()) {
      const double t0 = NowS();
      auto gen = store_->Commit(ip->info);
      ip->commit_seconds = NowS() - t0;
      if (gen.ok()) {
        ip->committed = *gen;
      } else {
        s = gen.status();
      }
    }
    if (!s.ok()) {
      // Drop the step before anyone waiting in the manager reads the store.
      Status a = store_->AbortPending();
      if (!a.ok()) OPTSTATE_LOG_ERROR("StreamedAdam: AbortPending after a failed background commit: {}", a.ToString());
      mm_->impl()->OnAbortPending();
    }
    ip->status = s;
    mm_->impl()->EndBackgroundCommit();
    {
      std::lock_guard<std::mutex> l(ip->mu);
      ip->done = true;
    }
    ip->cv.notify_all();
  });
  inflight_ = std::move(c);
}

Status StreamedAdam::FinishCommit(double* wait_s, bool keep_staged) {
  if (wait_s != nullptr) *wait_s = 0;
  StopPrefetch();
  if (!keep_staged) DropStaged();
  if (!inflight_) return Status::Ok();
  const double t0 = NowS();
  inflight_->thread.join();
  if (wait_s != nullptr) *wait_s = NowS() - t0;
  std::unique_ptr<InFlightCommit> c = std::move(inflight_);
  last_stats_.slices = c->slices;
  last_stats_.write_bytes = c->write_bytes;
  last_stats_.peak_write_bytes_in_flight = c->peak_write_bytes;
  last_stats_.io_wait_seconds = c->io_wait_seconds;
  last_stats_.commit_seconds = c->commit_seconds;
  last_stats_.write_tail_bytes = c->write_bytes - std::min(c->write_bytes, c->write_bytes_at_return);
  if (c->status.ok()) {
    NoteCommitted(c->committed);
    // The counts the generation holds (set_global_step may have moved on).
    committed_global_step_ = c->info.step;
    committed_step_counts_.clear();
    for (const vfs::GroupInfo& g : c->info.groups) committed_step_counts_[g.id] = g.step_count;
    return Status::Ok();
  }
  // The thread dropped the pending generation (and the host cache with it):
  // back to the last commit, as after an aborted step.
  for (auto& [id, n] : step_counts_) {
    auto it = committed_step_counts_.find(id);
    n = it == committed_step_counts_.end() ? 0 : it->second;
  }
  global_step_ = committed_global_step_;
  uncommitted_steps_ = 0;
  Status err = c->status.WithContext(
      "StreamedAdam: the background commit of step " + std::to_string(c->info.step) + " as generation " +
      std::to_string(c->generation) + " of store " + store_->path() + " failed");
  err = WithNote(err, "nothing of it was committed" +
                          (c->steps > 1 ? " (" + std::to_string(c->steps) + " steps, cached ones included)"
                                        : std::string()) +
                          "; the optimizer and the store are at generation " + std::to_string(last_generation_) +
                          " (step " + std::to_string(committed_global_step_) +
                          "); the params that step updated are ahead of the store: copy the store's mains into "
                          "them, or resume from the store");
  err = WithNote(err, DropUncommittedRegistrations());
  OPTSTATE_LOG_ERROR("{}", err.ToString());
  return err;
}

Status StreamedAdam::WaitForCommit() { return FinishCommit(); }

// The step's stats known once its kernels are done (a pipelined step's
// writes and commit are accounted when its commit is joined).
void StreamedAdam::NoteReadSideStats(const internal::StepPipeline& pl) {
  last_stats_.read_bytes = pl.read_bytes;
  last_stats_.slices_in_flight = pl.depth();
  last_stats_.small_sets = pl.small_depth();
  last_stats_.small_slices = pl.small_slices;
  last_stats_.peak_read_bytes_in_flight = pl.peak_read_bytes;
  last_stats_.compute_seconds = pl.compute_s_;
  last_stats_.submit_seconds = pl.submit_s_;
  last_stats_.prefetch_hit_bytes = pl.prefetch_hits;
}

Status StreamedAdam::Prefetch() {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  // During a step the step itself is reading; a prefetch already runs.
  if (in_step_ || prefetch_) return Status::Ok();
  ManagerImpl* impl = mm_->impl();
  const MemoryManagerOptions& mo = impl->options();
  // Chunks outside the tier go into staging buffers for the step's pipeline
  // to adopt: at most its own staging less one slice (StepPipeline::Begin).
  size_t stage_limit = 0;
  if (!CacheHoldsState() && staged_.empty()) {
    const size_t total = impl->all_staging().size();
    const size_t max_bufs = total >= 5 ? total - 2 : total;
    const size_t slice_bufs = internal::SliceChunks(opts_.moment_dtype);
    const size_t want = std::min<size_t>(max_bufs, slice_bufs * static_cast<size_t>(internal::PipelineSlices(mo)));
    stage_limit = want > slice_bufs ? want - slice_bufs : 0;
  }
  if (!impl->cache()->enabled() && stage_limit == 0) return Status::Ok();
  if (!inflight_) OPTSTATE_RETURN_IF_ERROR(EnsureIo());  // else the commit's thread owns io_ (it exists)
  std::vector<StepOrderEntry> order = step_order_;
  if (order.empty()) {
    for (const auto& [name, p] : params_) {
      if (!retired_.count(name)) order.push_back(StepOrderEntry{p.info.id, {p.f_main, p.f_m, p.f_v}, p.info.numel});
    }
  }
  auto run = std::make_unique<PrefetchRun>();
  PrefetchRun* r = run.get();
  InFlightCommit* commit = inflight_.get();
  mm_->impl()->BeginBackgroundCommit();
  r->thread = std::thread([this, r, commit, stage_limit, order = std::move(order)] {
    ManagerImpl* impl = mm_->impl();
    if (commit != nullptr) {
      // The store shows the step's generation once its commit is done; a
      // failed commit dropped the tier, and its error comes at the next wait.
      std::unique_lock<std::mutex> l(commit->mu);
      commit->cv.wait(l, [&] { return commit->done || r->stop.load(); });
      if (!commit->done || !commit->status.ok()) {
        l.unlock();
        impl->EndBackgroundCommit();
        return;
      }
    }
    HostCache* cache = impl->cache();
    const uint64_t chunk_bytes = impl->page_bytes();
    // The step's slices (BeginParam): one chunk of each moment and the main
    // chunks of its elements, read in that order.
    const uint32_t moment_size = ScalarSize(opts_.moment_dtype);
    const uint64_t slice_elems = chunk_bytes / moment_size;
    // Staging for the reads (the tier's entries are filled by a copy, so a
    // concurrent reader of the tier never sees a half-read entry): up to a
    // read queue's worth, leaving two for concurrent pins.
    const size_t total = impl->all_staging().size();
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
    for (const StepOrderEntry& e : order) {
      for (uint64_t c = 0, first = 0; ok && first < e.numel && !r->stop.load(); ++c, first += slice_elems) {
        const uint64_t elems = std::min(slice_elems, e.numel - first);
        const uint64_t main_bytes = elems * 4;
        const uint32_t n_main = static_cast<uint32_t>((main_bytes + chunk_bytes - 1) / chunk_bytes);
        for (uint32_t k = 0; k < n_main + 2 && ok && !r->stop.load(); ++k) {
          const bool is_main = k < n_main;
          const uint64_t len = is_main ? std::min(chunk_bytes, main_bytes - k * chunk_bytes) : elems * moment_size;
          const ChunkKey key{e.tensor_id, e.fields[is_main ? 0 : k - n_main + 1],
                             is_main ? c * (4 / moment_size) + k : c};
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
  });
  prefetch_ = std::move(run);
  return Status::Ok();
}

void StreamedAdam::DropStaged() {
  if (staged_.empty()) return;
  std::vector<void*> bufs;
  for (const StagedChunk& c : staged_) bufs.push_back(c.buf);
  mm_->impl()->ReleaseStaging(bufs);
  staged_.clear();
}

void StreamedAdam::StopPrefetch() {
  if (!prefetch_) return;
  if (inflight_) {
    std::lock_guard<std::mutex> l(inflight_->mu);
    prefetch_->stop = true;
  } else {
    prefetch_->stop = true;
  }
  if (inflight_) inflight_->cv.notify_all();
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

Status StreamedAdam::Step(std::span<const ParamGrad> grads, const float* d_found_inf, const float* d_grad_scale) {
  OPTSTATE_RETURN_IF_ERROR(CheckUsable());
  if (in_step_) return FailedPrecondition("StreamedAdam::Step: a step begun with BeginStep has not ended");
  // Every gradient is checked before the step starts: a mismatch leaves the
  // optimizer, the store and the pending registrations as they were.
  std::set<std::string_view> seen;
  for (const ParamGrad& g : grads) {
    OPTSTATE_RETURN_IF_ERROR(CheckGrad(g));
    if (!seen.insert(g.name).second) {
      return InvalidArgument("StreamedAdam::Step: param '" + g.name + "' of store " + store_->path() +
                             " given twice in one step");
    }
  }
  OPTSTATE_RETURN_IF_ERROR(BeginStep(d_found_inf, d_grad_scale));
  for (const ParamGrad& g : grads) OPTSTATE_RETURN_IF_ERROR(StepParam(g));
  auto r = EndStep();
  return r.status();
}

}  // namespace optstate::memmgr
