// SlicePipeline: the chunk pipeline of one StreamedAdam step (internal to
// memmgr): schedules the reads, kernels and writes of the units a step
// plans (internal/step_plan.h); its staging plan is internal/step_pipeline.h.
// A slice is one element range of a tensor that covers whole chunks of every
// field of the update rule (SliceLayout: with AdamW's f32 moments
// one chunk of each of main, exp_avg and exp_avg_sq; bf16 moments two of
// main; q8 moments four of main and one of each codes and scales field: 3,
// 4 or 8 chunks). Every buffer is then one whole chunk (the unit of I/O,
// checksum and copy-on-write), and every page stays a chunk, a multiple of
// the 2 MiB VMM granularity; the rule's kernel runs once per piece that is
// contiguous in every field. A slice holds one staging set (one chunk-sized
// pinned buffer per chunk of the slice) from its reads to the
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
// A computed slice whose buffers are all host cache entries gives its
// staging set back at once: its writes (the write tail) go out from the
// entries, which stay in use (never evicted or reused) until each write
// completes. So with the RAM tier the step is bound by its compute, not by
// its writes, and the tail needs no memory beyond the tier's own.
// A step may mix rules (a job carries its rule and layout; staging sets are
// as wide as the widest slice). A whole-tensor rule's job (SliceUnit::
// kTensor) is a unit with a device window of its own (TensorUnitSize pages):
// every chunk of every field gathered into it (from the host cache tier, a
// prefetched buffer or the disk), one kernel call, each chunk scattered back
// and written. A unit starts, without waiting for the slices before it,
// whenever the budget's free pages hold its window beside the slots' window
// and the other units' (up to kMaxUnits windows), so the next matrices'
// reads run while one computes and its writes go out, and the disk keeps as
// many reads in flight as with slices. When a window does not fit, the
// slots' pages are lent to the units while no slice computes on them or
// waits for them (so a matrix as large as the budget still runs, alone,
// and matrices that fit the budget together run side by side), and are
// taken back, whole (as many slots as before), as soon as the budget has
// them free again; once a slice read meanwhile waits for them, no further
// unit starts until they are back. The budget stays a hard cap: every
// window is budgeted pages. A unit borrows the free staging sets its
// gather keeps busy (a buffer per chunk, up to a read queue's worth; at
// most half the sets) for its reads and writes; its copies into and out of
// the window are queued on a stream of its own and waited for once per
// round of buffers, not per chunk. On the host backend, whose kernels run
// on the pumping thread, one unit's kernel runs per pass, with the I/O
// between them. Its reads and writes count in the depth limits and the
// in-flight peaks as a slice's do.
// When it reaps I/O completions is a policy given at construction
// (ReapPolicy). Driven by one thread (the trainer's, then the background
// commit's) through Pump().
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "memmgr/internal/device.h"
#include "memmgr/internal/engine_memory.h"
#include "memmgr/internal/slice_layout.h"
#include "memmgr/internal/step_pipeline.h"
#include "memmgr/internal/step_plan.h"
#include "memmgr/internal/step_state.h"
#include "memmgr/memory_manager.h"
#include "memmgr/update_rule.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

// When the pipeline reaps I/O completions. The product reaps whenever it
// can; tests fix the order of a step's I/O with the other two (the engine
// picks one at BeginStep; nothing in the product asks for them).
enum class ReapPolicy : uint8_t {
  kEager,
  // Nothing is reaped before the step drains (Pump with drain), so exactly
  // the reads the depth limits admit are in flight, whatever the disk's
  // speed.
  kHoldUntilDrain,
  // Completions are reaped only when nothing else can progress, so the
  // writes a step finds complete are those it had to wait for.
  kOnlyWhenBlocked,
};

class SlicePipeline {
 public:
  using Job = PlanUnit;
  using Staged = StagedChunk;

  // size: the widest slice of any job's layout (each job's rule and layout
  // are not owned and outlive the pipeline).
  // on_written: told the bytes of each completed write (the data syncs).
  // reap: when completions are reaped (ReapPolicy; the product's is kEager).
  SlicePipeline(EngineMemory* mm, vfs::ChunkIo* io, int cpu_threads, std::function<void(uint64_t)> on_written,
                const float* found_inf, SliceSize size, ReapPolicy reap = ReapPolicy::kEager)
      : bufs_(size.chunks),
        size_(size),
        mm_(mm),
        dev_(mm->device()),
        io_(io),
        on_written_(std::move(on_written)),
        cpu_threads_(cpu_threads),
        found_inf_(found_inf),
        reap_(reap) {}
  ~SlicePipeline() { Abort(); }

  Status Begin();

  // The step's mode (StepMode): cached, the host cache tier holds the whole
  // state and is the slices' buffers (no staging copies), and computed
  // slices are written to the store unless the step is held in the cache
  // only (kCachedDeferred: they stay dirty there). Staged with a tier that
  // holds only part of the state, a chunk with an entry is read from it and
  // a missed one is admitted while there is room (read from disk into the
  // entry); the rest go through staging. REQUIRES: before Begin.
  void SetMode(StepMode mode);
  // The slices of the state the step walks (StreamedAdam's registered
  // params): Begin then makes as many small sets as they use, and no big set
  // when every slice is small; when whole-tensor units hold most of its
  // bytes, two device slots (the rest of the budget is the units' windows).
  // Without it, Begin plans for a large state.
  // REQUIRES: before Begin; every slice enqueued is one of them.
  void SetStateSlices(const StateSlices& s) {
    state_ = s;
  }
  // Chunks a prefetch read into staging buffers: the pipeline owns the
  // buffers from now on (released with its staging) and a slice finds its
  // chunk there instead of reading it. REQUIRES: before Begin.
  void Adopt(std::vector<Staged> staged);
  // The write tail goes to the background commit's thread, which reaps
  // whenever it can (ReapPolicy::kEager) whatever the step's policy was.
  void HandOffTail() { reap_ = ReapPolicy::kEager; }

  uint32_t depth() const { return static_cast<uint32_t>(sets_.size() - small_sets_); }
  uint32_t small_depth() const { return static_cast<uint32_t>(small_sets_); }
  uint32_t device_slots() const { return static_cast<uint32_t>(slots_.size()); }

  // Queues a param's units (they keep the plan's order).
  void Enqueue(const ParamPlan& plan) { queue_.insert(queue_.end(), plan.units().begin(), plan.units().end()); }

  // Makes progress. drain: until everything queued is written; otherwise
  // only what is possible without waiting. until_computed (with drain): only
  // until every queued slice is computed (its kernel, param copy and D2H
  // done), its writes submitted or waiting for room.
  Status Pump(bool drain, bool until_computed = false);

  // Stops: waits for every request in flight (results ignored) and the GPU.
  // Cache entries in use are released as dirty (the caller then drops the
  // cache: EngineMemory::OnAbortPending).
  void Abort();

  // Once every slice is computed: gives the device slots back (streams,
  // events, the budgeted arena), so that the write tail can run on another
  // thread without device work and the trainer has the budget back.
  Status ReleaseDevice();

  void Release();

  uint64_t slices = 0, read_bytes = 0, write_bytes = 0, cache_hits = 0, h2d = 0, d2h = 0;
  uint64_t small_slices = 0, peak_read_bytes = 0, peak_write_bytes = 0, prefetch_hits = 0;
  uint64_t peak_unit_windows = 0;  // whole-tensor units holding a device window at once
  double stall_s_ = 0, compute_s_ = 0, submit_s_ = 0;

 private:
  // kUnit: lent to a whole-tensor unit (its staging buffers), not a slice's.
  enum class Stage : uint8_t { kFree, kReading, kReady, kComputing, kComputed, kWriting, kUnit };
  struct Set {
    Stage stage = Stage::kFree;
    Job job;
    int pending = 0;
    bool small = false;  // io[] are kSmallSliceBytes pieces
    void* io[kMaxSliceChunks] = {};         // this set's staging buffers
    void* buf[kMaxSliceChunks] = {};        // in use: staging, or cache entries (cache mode)
    bool acquired[kMaxSliceChunks] = {};    // buf[f] is an acquired cache entry
  };

  void ReleaseCached(Set& s, bool dirty);

  // Reads into free staging sets, only while the read queue has room for a
  // whole slice.
  Status SubmitReads(bool* progressed);

  // Writes computed slices while the write queue has room.
  Status SubmitComputed(bool* progressed);

  // A slice's kernel and copies are done: write it, or (cache mode without
  // write-through) leave it dirty in the cache.
  void OnComputed(size_t i);
  // Slices of the write tail (OnComputed) are indices with kTailBit set, in
  // computed_ and in I/O tags.
  static constexpr size_t kTailBit = size_t{1} << 40;
  Set& SetAt(size_t i) { return (i & kTailBit) ? tail_[i & ~kTailBit] : sets_[i]; }
  // A slice request's tag (ChunkIo's 64-bit tag): the set (of the write
  // tail, or of sets_) and the chunk of its slice.
  struct IoTag {
    bool tail = false;
    uint64_t set = 0;    // index in tail_ or sets_
    uint32_t chunk = 0;  // index in the slice's chunks (< kMaxSliceChunks)
    // From a set index as computed_ holds it (kTailBit for the tail).
    static IoTag Of(size_t i, uint32_t chunk) { return IoTag{(i & kTailBit) != 0, i & ~kTailBit, chunk}; }
    size_t Index() const { return tail ? (set | kTailBit) : set; }
    uint64_t Pack() const { return (tail ? uint64_t{1} << 63 : 0) | set << 8 | chunk; }
    static IoTag Unpack(uint64_t t) {
      return IoTag{(t >> 63) != 0, (t & ~(uint64_t{1} << 63)) >> 8, static_cast<uint32_t>(t & 0xff)};
    }
  };
  static_assert(kMaxSliceChunks <= 256, "IoTag packs the chunk in 8 bits");

  // Waits for the oldest slice on the device.
  Status SyncOldestSlot();
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
  size_t FreeSetFor(const Job& j) const;

  // Room for one more slice (bufs_ requests of `bytes` in all) of reads / writes.
  // The depths count bytes, in chunks (queue_depth x chunk size in flight
  // each way), so that small tensors' slices do not empty the disk's queue;
  // requests are capped by the ring. With a shared queue (write_queue_depth
  // 0) reads leave room for one big slice of writes.
  bool ReadRoom(uint64_t bytes) const;
  bool WriteRoom(uint64_t bytes) const;

  Status Keep(Status s);

  // Non-blocking reap of completed I/O.
  Status ReapReady(bool* progressed);

  static ChunkKey Key(const Job& j, uint32_t f) {
    const SliceLayout::Chunk& c = j.slice.chunks[f];
    return ChunkKey{j.tensor_id, j.tensor_fields[c.rule_field], c.index};
  }

  // Every queued slice is past its compute: nothing to read, compute or copy.
  bool AllComputed() const;

  Status StartReads(size_t i, const Job& j);

  // Where a chunk that a unit reads comes from (internal/step_plan.h): a
  // host cache entry that holds it; an entry to read it into (admitted, or
  // the cache mode's own); a chunk a prefetch staged (its buffer, no longer
  // in staged_); else a read into a staging buffer.
  struct ChunkSource {
    enum class Kind : uint8_t { kEntry, kEntryToRead, kPrefetched, kStagingRead };
    Kind kind = Kind::kStagingRead;
    void* buf = nullptr;  // the entry (kEntry, kEntryToRead; acquired) or the prefetched buffer
  };
  // Counts the hits; kResourceExhausted when a step held in the cache only
  // finds no entry (what(): the chunk, for the message).
  Status SourceOf(const ChunkKey& key, uint64_t len, const std::function<std::string()>& what, ChunkSource* src);

  Status OnCompletion(const vfs::ChunkCompletion& c);

  Status StartCompute(size_t i, size_t k);

  Status StartWrites(size_t i);

  // A whole-tensor unit in flight (see the file comment). Its phases:
  //   kGather (its chunks read and copied into the window) -> kKernel (the
  //   kernel queued; an event) -> kScatter (each chunk copied out of the
  //   window, a round at a time, and written; the window goes back once
  //   the last copy is done) -> kWriting (writes in flight) -> done.
  struct UnitPiece {
    ChunkKey key;
    uint64_t len = 0;
    char* dst = nullptr;     // in the window
    void* entry = nullptr;   // an acquired host cache entry, else null
    void* buf = nullptr;     // the staging buffer in use, else null
    uint64_t cap = 0;        // buf's capacity
  };
  struct Unit {
    enum class Phase : uint8_t { kGather, kKernel, kScatter, kWriting };
    Phase phase = Phase::kGather;
    Job job;
    TensorUnitSize size;
    Arena window;
    size_t lane = 0;     // its stream and event (lanes_), while it holds its window
    uint64_t id = 0;     // in its I/O tags
    std::vector<UnitPiece> pieces;
    std::vector<size_t> sets;                          // the staging sets it borrowed
    std::vector<std::pair<void*, uint64_t>> free_bufs;  // their buffers not in use, with capacity
    // Buffers whose copy into the window is queued but maybe not done
    // (reused after one stream sync); spare: a prefetched buffer that goes
    // to spare_ then.
    struct Copying {
      void* buf;
      uint64_t cap;
      bool spare;
    };
    std::vector<Copying> copying;
    size_t next = 0;       // next piece to gather (kGather) or scatter (kScatter)
    size_t pending = 0;    // its reads (kGather) or writes (kScatter, kWriting) in flight
    std::string what;      // for messages
  };
  struct Lane {
    void* stream = nullptr;
    void* event = nullptr;
    bool busy = false;
  };
  // A unit's I/O tag: kUnitBit, its id (22 bits: unique among the units in
  // flight) and the piece (40 bits).
  static constexpr uint64_t kUnitBit = uint64_t{1} << 62;
  static constexpr uint64_t kPieceMask = (uint64_t{1} << 40) - 1;
  static uint64_t UnitTag(uint64_t id, size_t piece) { return kUnitBit | (id & 0x3fffff) << 40 | piece; }
  // Windows held at once (units writing hold none); the ids of the units in
  // flight stay unique in UnitTag's 22 bits.
  static constexpr size_t kMaxUnits = 64;

  // The queue's front is a whole-tensor job: starts it when a staging set
  // is free and its window fits (see the file comment). started: it did.
  Status StartUnit(const Job& j, bool* started);
  // Moves every unit on as far as it can without waiting (kernels after
  // every unit's I/O, so the next unit's reads are in flight during one).
  Status AdvanceUnits(bool* progressed);
  Status AdvanceUnitIo(Unit& u, bool* progressed);
  Status LaunchUnit(Unit& u);
  Status OnUnitCompletion(const vfs::ChunkCompletion& c);
  // Waits for the unit's queued copies into the window; their buffers are
  // free again.
  Status RecycleCopies(Unit& u);
  // A unit's device work is done: its window back (and lent slots, when
  // the budget now has their pages).
  Status ReleaseWindow(Unit& u);
  void EndUnit(size_t k, bool dirty);
  bool UnitGpuPending() const;
  std::vector<Unit> units_;  // in flight, in queue order
  uint64_t next_unit_id_ = 0;
  std::vector<Lane> lanes_;
  bool slots_lent_ = false;  // the slots' pages are lent to units' windows

  // Takes the slots' window back from the units: wait false, whole (as many
  // slots as Begin made) and only when its pages are free now; wait true,
  // at least one slot, as many as the budget has free (only pins hold pages
  // then).
  Status ReacquireSlots(bool wait);
  // The slots of a state mostly of whole-tensor units (Begin).
  static constexpr uint64_t kUnitStateSlots = 2;
  // One slot (stream, event, pages) per bufs_ pages of arena_.
  Status MapSlots();
  size_t slot_count_ = 0;  // the slots Begin made (the whole window's)
  // Units holding a window, and its pages in all.
  size_t WindowsHeld(uint64_t* pages) const;

  const uint32_t bufs_;  // chunks (buffers, device pages) of the widest slice
  const SliceSize size_;
  EngineMemory* mm_;
  Device* dev_;
  vfs::ChunkIo* io_;  // StreamedAdam's
  std::function<void(uint64_t)> on_written_;
  int cpu_threads_;
  const float* found_inf_;
  bool started_ = false;
  StepMode mode_ = StepMode::kStaged;
  bool cache_mode() const { return mode_ != StepMode::kStaged; }
  bool write_through() const { return mode_ != StepMode::kCachedDeferred; }
  bool read_tier_ = false;  // slices use host cache entries as buffers where they can (SetMode)
  ReapPolicy reap_;
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
  std::optional<StateSlices> state_;  // SetStateSlices
  Status error_;
};

}  // namespace optstate::memmgr::internal
