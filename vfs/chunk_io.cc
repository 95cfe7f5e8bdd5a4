// ChunkIo (vfs/internal/chunk_io.h): chunk reads and writes through an
// IoEngine, checksummed and verified (on hasher threads for big chunks).
#include "vfs/internal/chunk_io.h"

#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "vfs/internal/chunk_hasher.h"
#include "vfs/internal/generation_view.h"
#include "vfs/io_buffer.h"
#include "vfs/io_engine.h"
#include "base/sync_point.h"

namespace optstate::vfs::internal {

// `what` + ": checksum mismatch (expected xxh3 E, read R) at [PATH ]offset O".
Status ChecksumMismatch(const std::string& what, uint64_t expected, uint64_t read, const std::string& path,
                        uint64_t offset) {
  char m[96];
  snprintf(m, sizeof(m), ": checksum mismatch (expected xxh3 %016llx, read %016llx) at ",
           static_cast<unsigned long long>(expected), static_cast<unsigned long long>(read));
  return Corruption(what + m + (path.empty() ? "" : path + " ") + "offset " + std::to_string(offset));
}

// Reads one version synchronously into buf (buf_bytes long: the tail past the
// chunk is zeroed up to there) and verifies it.
Status ReadVersion(Core* core, const TensorInfo* t, const Key& k, const Version& v, void* buf, uint64_t buf_bytes) {
  File* f = core->data_file(v.ext.dir);
  if (f == nullptr) {
    return IoError(core->Describe(t, k, v.gen) + ": data file of dir " + std::to_string(v.ext.dir) +
                   " is missing");
  }
  Status s = f->Pread(v.ext.file_offset, buf, RoundUp(v.ext.length, kIoAlign));
  if (!s.ok()) return s.WithContext("read of " + core->Describe(t, k, v.gen));
  const uint64_t sum = ChunkChecksum(buf, v.ext.length);
  if (sum != v.ext.checksum) {
    return ChecksumMismatch(core->Describe(t, k, v.gen), v.ext.checksum, sum, f->path(), v.ext.file_offset);
  }
  if (v.ext.length < buf_bytes) std::memset(static_cast<char*>(buf) + v.ext.length, 0, buf_bytes - v.ext.length);
  return Status();
}

// A caller's buffer size (0 = a whole chunk), checked against the chunk it is
// to hold: the one rule of ChunkIo::SubmitRead and GenerationView::ReadChunk.
Result<uint64_t> BufferBytesFor(const Core& core, const TensorInfo* t, const Key& k, uint64_t chunk_len,
                                uint64_t buf_bytes) {
  const uint64_t n = buf_bytes == 0 ? core.chunk() : std::min(buf_bytes, core.chunk());
  if (RoundUp(chunk_len, kIoAlign) > n) {
    return InvalidArgument(core.Describe(t, k, kInfinity) + ": a " + std::to_string(chunk_len) +
                           "-byte chunk does not fit the " + std::to_string(n) + "-byte buffer");
  }
  return n;
}

namespace {

class ChunkIoImpl final : public ChunkIo {
 public:
  ChunkIoImpl(std::shared_ptr<Core> core, std::shared_ptr<ViewData> view, std::unique_ptr<IoEngine> engine,
              bool verify, uint32_t hash_threads)
      : core_(std::move(core)), view_(std::move(view)), engine_(std::move(engine)), verify_(verify) {
    if (hash_threads > 0) {
      IoEngine* e = engine_.get();
      hasher_ = std::make_unique<internal::ChunkHasher>(hash_threads, [e] { e->Wake(); });
    }
  }

  ~ChunkIoImpl() override {
    // Drain: the engine and the hashers must not touch buffers or files after
    // we are gone, and completed writes must reach the pending map.
    std::vector<ChunkCompletion> sink;
    while (in_flight() > 0) {
      if (!Reap(&sink, 1).ok()) break;
    }
    hasher_.reset();  // before the engine its threads wake
  }

  Status SubmitRead(const ChunkRef& ref, void* buf, uint64_t tag, uint64_t buf_bytes) override {
    const Key k{ref.tensor_id, ref.field, ref.index};
    Op op;
    op.user_tag = tag;
    op.key = k;
    op.buf = buf;
    {
      MutexLock l(&core_->mu());
      const auto& tensors = view_ ? view_->by_id : core_->tensors();
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(tensors, ref));
      OPTSTATE_ASSIGN_OR_RETURN(op.buf_bytes, BufferBytesFor(*core_, res.first, k, res.second, buf_bytes));
      std::optional<Version> v;
      if (view_) {
        auto it = view_->chunks.find(k);
        if (it != view_->chunks.end()) v = it->second;
      } else {
        v = core_->Newest(k);
      }
      if (!v) {
        std::memset(buf, 0, op.buf_bytes);
        ChunkCompletion zero;  // never written: zeros, nothing to verify
        zero.tag = tag;
        ready_.push_back(std::move(zero));
        return Status();
      }
      op.version = *v;
    }
    File* f = core_->data_file(op.version.ext.dir);
    if (f == nullptr) return IoError(DescribeOp(k, op.version.gen) + ": data file missing");
    IoRequest r;
    r.op = IoRequest::Op::kRead;
    r.file = f;
    r.offset = op.version.ext.file_offset;
    r.length = RoundUp(op.version.ext.length, kIoAlign);
    r.buf = buf;
    r.tag = next_tag_++;
    OPTSTATE_RETURN_IF_ERROR(
        engine_->Submit(std::span<const IoRequest>(&r, 1)).WithContext("read of " +
                                                                         DescribeOp(k, op.version.gen)));
    ops_.emplace(r.tag, std::move(op));
    return Status();
  }

  Status SubmitWrite(const ChunkRef& ref, const void* buf, uint64_t tag) override {
    if (view_) {
      return FailedPrecondition("store " + core_->path() + ": writes through a GenerationView's ChunkIo");
    }
    const Key k{ref.tensor_id, ref.field, ref.index};
    Op op;
    op.user_tag = tag;
    op.key = k;
    op.write = true;
    {
      MutexLock l(&core_->mu());
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("chunk write"));
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors(), ref));
      const uint64_t len = res.second;
      auto ext = core_->AllocateSlot(len);
      if (!ext.ok()) return ext.status().WithContext("write of " + core_->Describe(res.first, k, kInfinity));
      op.version.ext = *ext;
      op.version.gen = core_->latest_generation() + 1;
      core_->WriteStarted();
    }
    if (const uint64_t alloc = core_->AllocBytes(op.version.ext.length);
        alloc <= kPackChunkMaxBytes && alloc < core_->SlotBytes()) {
      OPTSTATE_TEST_SYNC_POINT("extent.before_write");
      AddToPack(std::move(op), buf, alloc);
      return Status();
    }
    // A big chunk is hashed by the hashers while its write is in flight.
    const bool async_hash = hasher_ != nullptr && op.version.ext.length >= kAsyncHashMinBytes;
    if (!async_hash) op.version.ext.checksum = ChunkChecksum(buf, op.version.ext.length);
    OPTSTATE_TEST_SYNC_POINT("extent.before_write");
    IoRequest r;
    r.op = IoRequest::Op::kWrite;
    r.file = core_->data_file(op.version.ext.dir);
    r.offset = op.version.ext.file_offset;
    r.length = RoundUp(op.version.ext.length, kIoAlign);
    r.buf = const_cast<void*>(buf);
    r.tag = next_tag_++;
    Status s = engine_->Submit(std::span<const IoRequest>(&r, 1));
    if (!s.ok()) {
      MutexLock l(&core_->mu());
      core_->FreeSlot(op.version.ext);
      core_->WriteEnded();
      return s.WithContext("write of " + DescribeLocked(k, kInfinity));
    }
    if (async_hash) {
      op.hashing = true;
      hasher_->Post(r.tag, buf, op.version.ext.length);
    }
    ops_.emplace(r.tag, std::move(op));
    return Status();
  }

  // A completion is handed out once its I/O and, with hashers, its hash (a
  // big write's checksum, posted at submit; a big read's verification, posted
  // here when the read lands) are both done. Waits in the engine while it has
  // requests in flight (a hasher's result wakes it), else for a hash.
  Status Reap(std::vector<ChunkCompletion>* out, size_t min_complete) override {
    // The open pack goes out when this Reap would wait for it, or after
    // kPackMaxPolls Reaps (a caller that only polls still sees it complete).
    if (!open_.empty() && (ready_.size() < min_complete || ++open_polls_ >= kPackMaxPolls)) FlushPacks();
    size_t got = 0;
    while (!ready_.empty()) {
      out->push_back(std::move(ready_.front()));
      ready_.pop_front();
      ++got;
    }
    std::vector<IoCompletion> done;
    for (;;) {
      got += CollectHashes(out);
      if (const size_t n = engine_->in_flight(); n > 0) {
        // A pack's one I/O completes many chunks: wait for one at a time then.
        const size_t want = std::min(min_complete - std::min(got, min_complete), packs_in_flight_.empty() ? n : 1);
        OPTSTATE_RETURN_IF_ERROR(engine_->Reap(&done, want));
        for (auto& c : done) got += OnIoDone(c, out);
        done.clear();
      } else if (got < min_complete && hasher_ != nullptr && !ops_.empty()) {
        hasher_->WaitForResult();  // everything left is hashing
        continue;
      } else {
        return Status();  // nothing in flight, nothing to wait for
      }
      if (got >= min_complete || (ops_.empty() && packs_in_flight_.empty())) return Status();
    }
  }

  // ops_ holds every request not handed out yet: in the engine, or hashing;
  // packed_ops_ those in the open pack or a pack in flight.
  size_t in_flight() const override { return ops_.size() + ready_.size() + packed_ops_; }
  void Wake() override { engine_->Wake(); }

 private:
  struct Op {
    uint64_t user_tag = 0;
    Key key;
    bool write = false;
    Version version;
    void* buf = nullptr;
    uint64_t buf_bytes = 0;  // zeroed past the chunk's length up to here
    // A hash job is out for this op (hashers only); the I/O is done
    // (io_status holds its result); a hash came back (sum).
    bool hashing = false;
    bool io_done = false;
    Status io_status;
    std::optional<uint64_t> sum;
  };

  // The engine finished op c.tag: hands it out, or first posts its
  // verification (a big read) or waits for the hash posted at submit (a big
  // write). Returns the completions handed out (0 or 1).
  size_t OnIoDone(IoCompletion& c, std::vector<ChunkCompletion>* out) {
    if (auto p = packs_in_flight_.find(c.tag); p != packs_in_flight_.end()) {
      Pack pack = std::move(p->second);
      packs_in_flight_.erase(p);
      for (const Op& op : pack.ops) {
        ChunkCompletion cc;
        cc.tag = op.user_tag;
        cc.status = Finish(op, c.status, &cc);
        out->push_back(std::move(cc));
      }
      packed_ops_ -= pack.ops.size();
      free_pack_bufs_.push_back(std::move(pack.buf));
      return pack.ops.size();
    }
    auto it = ops_.find(c.tag);
    if (it == ops_.end()) return 0;
    Op& op = it->second;
    op.io_done = true;
    op.io_status = std::move(c.status);
    if (hasher_ != nullptr && !op.write && verify_ && op.io_status.ok() &&
        op.version.ext.length >= kAsyncHashMinBytes) {
      op.hashing = true;
      hasher_->Post(c.tag, op.buf, op.version.ext.length);
    }
    if (op.hashing) return 0;
    HandOut(it, out);
    return 1;
  }

  // Takes the hashers' results; hands out the ops whose I/O is done too.
  size_t CollectHashes(std::vector<ChunkCompletion>* out) {
    if (hasher_ == nullptr) return 0;
    hashed_.clear();
    hasher_->Collect(&hashed_);
    size_t n = 0;
    for (const auto& h : hashed_) {
      auto it = ops_.find(h.tag);
      if (it == ops_.end()) continue;
      it->second.hashing = false;
      it->second.sum = h.sum;
      if (it->second.io_done) {
        HandOut(it, out);
        ++n;
      }
    }
    return n;
  }

  // Finishes a done op (I/O and any hash) and hands its completion out.
  void HandOut(std::unordered_map<uint64_t, Op>::iterator it, std::vector<ChunkCompletion>* out) {
    Op op = std::move(it->second);
    ops_.erase(it);
    if (op.write && op.sum) op.version.ext.checksum = *op.sum;
    ChunkCompletion cc;
    cc.tag = op.user_tag;
    cc.status = Finish(op, op.io_status, &cc);
    out->push_back(std::move(cc));
  }

  Status Finish(const Op& op, const Status& io, ChunkCompletion* out) {
    if (op.write) {
      MutexLock l(&core_->mu());
      core_->WriteEnded();
      if (!io.ok()) {
        core_->FreeSlot(op.version.ext);
        return io.WithContext("write of " + DescribeLocked(op.key, kInfinity));
      }
      core_->SetPending(op.key, op.version.ext);
      OPTSTATE_TEST_SYNC_POINT("extent.after_write");
      return Status();
    }
    if (!io.ok()) return io.WithContext("read of " + DescribeOp(op.key, op.version.gen));
    if (verify_) {
      const uint64_t sum = op.sum ? *op.sum : ChunkChecksum(op.buf, op.version.ext.length);
      if (sum != op.version.ext.checksum) {
        return ChecksumMismatch(DescribeOp(op.key, op.version.gen), op.version.ext.checksum, sum,
                                "", op.version.ext.file_offset);
      }
    } else {
      out->needs_verify = true;
      out->verify_length = op.version.ext.length;
      out->expected_checksum = op.version.ext.checksum;
      out->file_offset = op.version.ext.file_offset;
      out->what = DescribeOp(op.key, op.version.gen);
    }
    if (op.version.ext.length < op.buf_bytes) {
      std::memset(static_cast<char*>(op.buf) + op.version.ext.length, 0, op.buf_bytes - op.version.ext.length);
    }
    return Status();
  }

  // Chunk k named as Core::Describe names it (store, tensor, field, chunk,
  // generation). An op carries only the tensor's id, looked up here when an
  // error or a deferred verification needs its name: a copy of the
  // TensorInfo per chunk I/O cost a step of many small tensors more than
  // its I/O. DescribeLocked: core_->mu() held.
  std::string DescribeLocked(const Key& k, uint64_t gen) const REQUIRES(core_->mu()) {
    const TensorInfo* t = nullptr;
    if (view_) {
      if (auto it = view_->by_id.find(k.t); it != view_->by_id.end()) t = &it->second;
    } else {
      t = core_->AnyTensor(k.t);
    }
    return core_->Describe(t, k, gen);
  }
  std::string DescribeOp(const Key& k, uint64_t gen) const {
    MutexLock l(&core_->mu());
    return DescribeLocked(k, gen);
  }

  // Small-write packs. A short chunk's write (a piece of at most
  // kPackChunkMaxBytes) is copied into the open pack, which collects writes
  // to adjacent pieces (the allocator hands out the lowest free piece first,
  // so a step's small chunks mostly are) and goes to the disk as one I/O:
  // thousands of tiny tensors cost a few large writes, not one 4 KiB request
  // each. Each write still gets its own extent, checksum and completion.
  static constexpr uint64_t kPackChunkMaxBytes = 64 * 1024;
  static constexpr uint64_t kPackBytes = 256 * 1024;
  static constexpr int kPackMaxPolls = 16;
  struct Pack {
    IoBuffer buf;
    uint32_t dir = 0;
    uint64_t offset = 0;       // file offset of buf's first byte
    uint64_t bytes = 0;        // to the end of the last write's piece
    uint64_t write_bytes = 0;  // to the end of the last write's bytes (4 KiB-rounded)
    std::vector<Op> ops;
  };

  // Adds a small write (its slot allocated, WriteStarted) to the open pack
  // of its data dir and piece size, flushing that first when the write's
  // piece does not follow it. (Pieces of one size share carved slots, so a
  // model whose small tensors differ in size, norms next to biases, still
  // makes long runs of adjacent pieces: one per size.)
  void AddToPack(Op op, const void* buf, uint64_t alloc) {
    const Extent& e = op.version.ext;
    const std::pair<uint32_t, uint64_t> key{e.dir, alloc};
    auto it = open_.find(key);
    if (it != open_.end() && (e.file_offset != it->second.offset + it->second.bytes ||
                              it->second.bytes + alloc > kPackBytes)) {
      FlushPack(it);
      it = open_.end();
    }
    if (it == open_.end()) {
      if (open_.empty()) open_polls_ = 0;
      it = open_.emplace(key, Pack{}).first;
      Pack& p = it->second;
      if (!free_pack_bufs_.empty()) {
        p.buf = std::move(free_pack_bufs_.back());
        free_pack_bufs_.pop_back();
      } else {
        p.buf = IoBuffer(kPackBytes);
      }
      p.dir = e.dir;
      p.offset = e.file_offset;
    }
    Pack& p = it->second;
    const uint64_t wlen = RoundUp(e.length, kIoAlign);
    op.version.ext.checksum = ChunkChecksum(buf, e.length);
    ++packed_ops_;
    if (!p.buf.ok()) {  // no memory for a pack: the write fails alone
      p.ops.push_back(std::move(op));
      FailPack(&p, IoError("no memory for a write buffer of " + std::to_string(kPackBytes) + " bytes"));
      open_.erase(it);
      return;
    }
    // Only the chunk's bytes: its padding (never checksummed, zeroed on
    // every read) keeps what the buffer held.
    std::memcpy(p.buf.data() + p.bytes, buf, e.length);
    p.write_bytes = p.bytes + wlen;
    p.bytes += alloc;
    p.ops.push_back(std::move(op));
    if (p.bytes >= kPackBytes) FlushPack(it);
  }

  void FlushPacks() {
    while (!open_.empty()) FlushPack(open_.begin());
  }

  // Submits open pack `it` as one write (and closes it). A failed submit
  // completes each of its writes with the error (their slots freed).
  void FlushPack(std::map<std::pair<uint32_t, uint64_t>, Pack>::iterator it) {
    Pack p = std::move(it->second);
    open_.erase(it);
    IoRequest r;
    r.op = IoRequest::Op::kWrite;
    r.file = core_->data_file(p.dir);
    r.offset = p.offset;
    r.length = p.write_bytes;
    r.buf = p.buf.data();
    r.tag = next_tag_++;
    Status s = engine_->Submit(std::span<const IoRequest>(&r, 1));
    if (!s.ok()) {
      FailPack(&p, s);
      return;
    }
    packs_in_flight_.emplace(r.tag, std::move(p));
  }

  // Completes every write of p with `why` (at the next Reap), freeing their slots.
  void FailPack(Pack* p, const Status& why) {
    MutexLock l(&core_->mu());
    for (const Op& op : p->ops) {
      core_->FreeSlot(op.version.ext);
      core_->WriteEnded();
      ChunkCompletion cc;
      cc.tag = op.user_tag;
      cc.status = why.WithContext("write of " + DescribeLocked(op.key, kInfinity));
      ready_.push_back(std::move(cc));
    }
    packed_ops_ -= p->ops.size();
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<ViewData> view_;  // null: the store's newest versions
  std::unique_ptr<IoEngine> engine_;
  const bool verify_;  // ChunkIoOptions::verify_reads
  std::unordered_map<uint64_t, Op> ops_;
  std::deque<ChunkCompletion> ready_;  // zero chunks, completed at submit
  uint64_t next_tag_ = 1;
  std::unique_ptr<internal::ChunkHasher> hasher_;  // ChunkIoOptions::hash_threads > 0
  std::vector<internal::ChunkHasher::Result> hashed_;  // CollectHashes' scratch
  // The open packs, by (data dir, piece bytes); each holds at least one write.
  std::map<std::pair<uint32_t, uint64_t>, Pack> open_;
  int open_polls_ = 0;  // Reaps since the oldest open pack opened
  std::unordered_map<uint64_t, Pack> packs_in_flight_;  // by engine tag
  // Buffers of packs that completed, for the next packs: as many as were
  // ever in flight at once (at most the engine's queue depth).
  std::vector<IoBuffer> free_pack_bufs_;
  size_t packed_ops_ = 0;  // writes in the open pack and in packs in flight
};

}  // namespace

Result<std::unique_ptr<ChunkIo>> MakeChunkIo(const std::shared_ptr<Core>& core, std::shared_ptr<ViewData> view,
                                             const ChunkIoOptions& opts) {
  std::unique_ptr<IoEngine> engine;
  // io_uring, else the synchronous engine. Tests take the synchronous engine
  // where io_uring works too, to exercise that path: the callback of this
  // point sets the bool (base/sync_point.h; nothing in the product arms it).
  bool use_sync_engine = false;
  OPTSTATE_TEST_SYNC_POINT_CALLBACK("chunk_io.use_sync_engine", &use_sync_engine);
  if (!use_sync_engine) {
    IoEngineOptions eo;
    eo.queue_depth = opts.queue_depth;
    eo.registered_buffers = opts.registered_buffers;
    eo.max_sqe_bytes = opts.max_sqe_bytes;
    eo.wakeable = opts.wakeable || opts.hash_threads > 0;  // a hasher's result wakes Reap
    eo.defer_submit = opts.defer_submit;
    auto e = IoEngine::NewUring(eo);
    if (e.ok()) {
      engine = std::move(*e);
    } else {
      static std::once_flag warned;
      std::call_once(warned, [&] {
        OPTSTATE_LOG_WARN("io_uring unavailable ({}); using the synchronous engine", e.status().ToString());
      });
    }
  }
  if (!engine) {
    OPTSTATE_ASSIGN_OR_RETURN(engine, IoEngine::NewSync(core->chunk()));
  }
  return std::unique_ptr<ChunkIo>(new ChunkIoImpl(core, std::move(view), std::move(engine), opts.verify_reads,
                                                   opts.hash_threads));
}

}  // namespace optstate::vfs::internal

namespace optstate::vfs {

Status VerifyChunkRead(const ChunkCompletion& c, const void* buf) {
  if (!c.needs_verify) return Status();
  const uint64_t sum = ChunkChecksum(buf, c.verify_length);
  if (sum == c.expected_checksum) return Status();
  return internal::ChecksumMismatch(c.what, c.expected_checksum, sum, "", c.file_offset);
}

}  // namespace optstate::vfs
