// Store implementation (vfs/store.h): RocksDB index, copy-on-write chunk
// versions in preallocated data files, generations, snapshots, leases, GC.
//
// Shared state lives in Core, owned by shared_ptr by the Store, its
// GenerationViews and ChunkIos, so a view or ChunkIo may outlive the Store
// object (the index and LOCK stay open until the last one goes).
//
// Lock order: Core::mu_ may be taken while holding the lease flock
// (leases/.lock, LOCK_EX in GC); never the other way round.
#include "vfs/store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <cerrno>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "vfs/internal/chunk_hasher.h"
#include "vfs/internal/rocks_util.h"
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_format.h"
#include "vfs/io_buffer.h"
#include "vfs/io_engine.h"
#include "vfs/log.h"

namespace optstate::vfs {

// ---------------------------------------------------------------------------
// Small public helpers declared in store.h.

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view s) {
  if (s == "f32" || s == "float32") return DType::kF32;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f16" || s == "float16") return DType::kF16;
  return InvalidArgument("unknown dtype '" + std::string(s) + "' (expected f32, bf16 or f16)");
}

uint32_t DTypeSize(DType d) { return d == DType::kF32 ? 4 : 2; }

std::vector<FieldSpec> AdamFields() {
  return {{"main", DType::kF32}, {"exp_avg", DType::kF32}, {"exp_avg_sq", DType::kF32}};
}

uint64_t TensorInfo::field_bytes(uint32_t field) const {
  if (field >= fields.size()) return 0;
  return numel * DTypeSize(fields[field].dtype);
}

namespace {

using internal::Core;
using internal::Extent;
using internal::FlockGuard;
using internal::Key;
using internal::RocksStatus;
using internal::Version;
using internal::kInfinity;
using internal::kIoAlign;
using internal::AbsPath;
using internal::JoinPath;
using internal::NowUnixMs;
using internal::RoundUp;

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// "; closest: 'a', 'b', 'c'" over `names`, or "" when there are none.
template <typename It>
std::string ClosestNames(std::string_view want, It begin, It end) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (It it = begin; it != end; ++it) scored.emplace_back(EditDistance(want, *it), *it);
  if (scored.empty()) return "; the store has no tensors";
  std::sort(scored.begin(), scored.end());
  std::string s = "; closest:";
  for (size_t i = 0; i < scored.size() && i < 3; ++i) s += (i ? ", '" : " '") + scored[i].second + "'";
  return s;
}

bool ValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<uint8_t>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

Status ValidateSnapshotName(const std::string& name) {
  if (name.empty() || name.size() > 255 || name == "." || name == "..") {
    return InvalidArgument("invalid snapshot name '" + name + "': 1..255 characters, not '.' or '..'");
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return InvalidArgument("invalid snapshot name '" + name + "': only [A-Za-z0-9._-] allowed");
    }
  }
  return Status();
}

// Forwards RocksDB's warnings and errors to our log instead of a LOG file
// (also keeps RocksDB's background logging out of fault-injection op counts).
class RocksLogger : public rocksdb::Logger {
 public:
  RocksLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char buf[1024];
    vsnprintf(buf, sizeof(buf), format, ap);
    OPTSTATE_LOG_WARN("rocksdb: {}", buf);
  }
};


// ---------------------------------------------------------------------------
// Views.

// A frozen generation: its tensors and chunk versions, plus the lease that
// keeps them (released when the last holder goes).
struct ViewData {
  std::shared_ptr<Core> core;
  GenerationInfo info;
  std::vector<TensorInfo> tensors;        // sorted by name
  std::map<uint32_t, TensorInfo> by_id;
  std::map<Key, Version> chunks;          // written chunks only
  std::string lease_file;                 // read-only stores: the lease file
  std::unique_ptr<File> lease_handle;     // open, flock'ed: the lease is alive
  bool in_process_ref = false;            // writable stores: Core::view_refs_

  ~ViewData() {
    if (in_process_ref) {
      std::lock_guard l(core->mu_);
      if (--core->view_refs_[info.generation] <= 0) core->view_refs_.erase(info.generation);
    }
    if (!lease_file.empty()) (void)core->fs_->Remove(lease_file);
    lease_handle.reset();  // after the removal: never an unlocked lease file the writer could misjudge
  }
};

// Builds the frozen view of generation g. mu_ held.
std::shared_ptr<ViewData> BuildView(const std::shared_ptr<Core>& core, uint64_t g) {
  auto v = std::make_shared<ViewData>();
  v->core = core;
  v->info = core->generations_.at(g);
  for (const auto& [id, t] : core->tensors_) {
    if (t.created_generation <= g) {
      v->tensors.push_back(t);
      v->by_id[id] = t;
    }
  }
  std::sort(v->tensors.begin(), v->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  for (const auto& [key, vs] : core->versions_) {
    if (!v->by_id.count(key.t)) continue;
    for (const auto& ver : vs) {
      if (ver.gen <= g) {
        v->chunks.emplace(key, ver);
        break;
      }
    }
  }
  return v;
}

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
  File* f = v.ext.dir < core->data_files_.size() ? core->data_files_[v.ext.dir].get() : nullptr;
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

// ---------------------------------------------------------------------------
// ChunkIo.

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
      std::lock_guard l(core_->mu_);
      const auto& tensors = view_ ? view_->by_id : core_->tensors_;
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(tensors, ref));
      op.tensor = *res.first;
      OPTSTATE_ASSIGN_OR_RETURN(op.buf_bytes, BufferBytesFor(*core_, &op.tensor, k, res.second, buf_bytes));
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
    File* f = op.version.ext.dir < core_->data_files_.size() ? core_->data_files_[op.version.ext.dir].get()
                                                            : nullptr;
    if (f == nullptr) return IoError(core_->Describe(&op.tensor, k, op.version.gen) + ": data file missing");
    IoRequest r;
    r.op = IoRequest::Op::kRead;
    r.file = f;
    r.offset = op.version.ext.file_offset;
    r.length = RoundUp(op.version.ext.length, kIoAlign);
    r.buf = buf;
    r.tag = next_tag_++;
    OPTSTATE_RETURN_IF_ERROR(
        engine_->Submit(std::span<const IoRequest>(&r, 1)).WithContext("read of " +
                                                                         core_->Describe(&op.tensor, k, op.version.gen)));
    ops_.emplace(r.tag, std::move(op));
    return Status();
  }

  Status SubmitWrite(const ChunkRef& ref, const void* buf, uint64_t tag) override {
    if (view_) {
      return FailedPrecondition("store " + core_->path_ + ": writes through a GenerationView's ChunkIo");
    }
    const Key k{ref.tensor_id, ref.field, ref.index};
    Op op;
    op.user_tag = tag;
    op.key = k;
    op.write = true;
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("chunk write"));
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors_, ref));
      op.tensor = *res.first;
      const uint64_t len = res.second;
      auto ext = core_->AllocateSlot(len);
      if (!ext.ok()) return ext.status().WithContext("write of " + core_->Describe(&op.tensor, k, kInfinity));
      op.version.ext = *ext;
      op.version.gen = core_->latest_.generation + 1;
      ++core_->writes_in_flight_;
    }
    // A big chunk is hashed by the hashers while its write is in flight.
    const bool async_hash = hasher_ != nullptr && op.version.ext.length >= kAsyncHashMinBytes;
    if (!async_hash) op.version.ext.checksum = ChunkChecksum(buf, op.version.ext.length);
    CrashPoint("extent.before_write");
    IoRequest r;
    r.op = IoRequest::Op::kWrite;
    r.file = core_->data_files_[op.version.ext.dir].get();
    r.offset = op.version.ext.file_offset;
    r.length = RoundUp(op.version.ext.length, kIoAlign);
    r.buf = const_cast<void*>(buf);
    r.tag = next_tag_++;
    Status s = engine_->Submit(std::span<const IoRequest>(&r, 1));
    if (!s.ok()) {
      std::lock_guard l(core_->mu_);
      core_->FreeSlot(op.version.ext);
      --core_->writes_in_flight_;
      return s.WithContext("write of " + core_->Describe(&op.tensor, k, kInfinity));
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
        OPTSTATE_RETURN_IF_ERROR(engine_->Reap(&done, got >= min_complete ? 0 : std::min(min_complete - got, n)));
        for (auto& c : done) got += OnIoDone(c, out);
        done.clear();
      } else if (got < min_complete && hasher_ != nullptr && !ops_.empty()) {
        hasher_->WaitForResult();  // everything left is hashing
        continue;
      } else {
        return Status();  // nothing in flight, nothing to wait for
      }
      if (got >= min_complete || ops_.empty()) return Status();
    }
  }

  // ops_ holds every request not handed out yet: in the engine, or hashing.
  size_t in_flight() const override { return ops_.size() + ready_.size(); }
  void Wake() override { engine_->Wake(); }

 private:
  struct Op {
    uint64_t user_tag = 0;
    Key key;
    bool write = false;
    TensorInfo tensor;
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
    Core* c = core_.get();
    if (op.write) {
      std::lock_guard l(c->mu_);
      --c->writes_in_flight_;
      if (!io.ok()) {
        c->FreeSlot(op.version.ext);
        return io.WithContext("write of " + c->Describe(&op.tensor, op.key, kInfinity));
      }
      c->SetPending(op.key, op.version.ext);
      CrashPoint("extent.after_write");
      return Status();
    }
    if (!io.ok()) return io.WithContext("read of " + c->Describe(&op.tensor, op.key, op.version.gen));
    if (verify_) {
      const uint64_t sum = op.sum ? *op.sum : ChunkChecksum(op.buf, op.version.ext.length);
      if (sum != op.version.ext.checksum) {
        return ChecksumMismatch(c->Describe(&op.tensor, op.key, op.version.gen), op.version.ext.checksum, sum,
                                "", op.version.ext.file_offset);
      }
    } else {
      out->needs_verify = true;
      out->verify_length = op.version.ext.length;
      out->expected_checksum = op.version.ext.checksum;
      out->file_offset = op.version.ext.file_offset;
      out->what = c->Describe(&op.tensor, op.key, op.version.gen);
    }
    if (op.version.ext.length < op.buf_bytes) {
      std::memset(static_cast<char*>(op.buf) + op.version.ext.length, 0, op.buf_bytes - op.version.ext.length);
    }
    return Status();
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
};

}  // namespace

Status VerifyChunkRead(const ChunkCompletion& c, const void* buf) {
  if (!c.needs_verify) return Status();
  const uint64_t sum = ChunkChecksum(buf, c.verify_length);
  if (sum == c.expected_checksum) return Status();
  return ChecksumMismatch(c.what, c.expected_checksum, sum, "", c.file_offset);
}

namespace {

Result<std::unique_ptr<ChunkIo>> MakeChunkIo(const std::shared_ptr<Core>& core, std::shared_ptr<ViewData> view,
                                             const ChunkIoOptions& opts) {
  std::unique_ptr<IoEngine> engine;
  if (!opts.use_sync_engine) {
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

// ---------------------------------------------------------------------------

class GenerationViewImpl final : public GenerationView {
 public:
  explicit GenerationViewImpl(std::shared_ptr<ViewData> v) : v_(std::move(v)) {}
  const StoreIdentity& identity() const override { return v_->core->identity_; }
  const GenerationInfo& info() const override { return v_->info; }
  const std::vector<TensorInfo>& tensors() const override { return v_->tensors; }
  Result<TensorInfo> FindTensor(std::string_view name) const override {
    for (const auto& t : v_->tensors) {
      if (t.name == name) return t;
    }
    std::vector<std::string> names;
    for (const auto& t : v_->tensors) names.push_back(t.name);
    return NotFound("store " + v_->core->path_ + " generation " + std::to_string(v_->info.generation) +
                    ": no tensor '" + std::string(name) + "'" + ClosestNames(name, names.begin(), names.end()));
  }
  uint64_t ChunkCount(const TensorInfo& t, uint32_t field) const override {
    return Core::ChunkCountOf(t, field, v_->core->chunk());
  }
  Result<ChunkInfo> Chunk(const ChunkRef& ref) const override {
    const Core* c = v_->core.get();
    uint64_t len;
    {
      std::lock_guard l(c->mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto res, c->Resolve(v_->by_id, ref));
      len = res.second;
    }
    ChunkInfo info;
    info.offset_bytes = ref.index * c->chunk();
    info.length_bytes = len;
    auto it = v_->chunks.find(Key{ref.tensor_id, ref.field, ref.index});
    if (it == v_->chunks.end()) {
      info.zero = true;
      info.checksum = ZeroChecksum(len);
      return info;
    }
    info.zero = false;
    info.checksum = it->second.ext.checksum;
    info.written_generation = it->second.gen;
    info.data_dir = it->second.ext.dir;
    info.file_offset = it->second.ext.file_offset;
    return info;
  }
  Status ReadChunk(const ChunkRef& ref, void* buf, uint64_t buf_bytes) const override {
    Core* c = v_->core.get();
    const Key k{ref.tensor_id, ref.field, ref.index};
    const TensorInfo* t;
    uint64_t n = 0;
    {
      std::lock_guard l(c->mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto res, c->Resolve(v_->by_id, ref));
      t = res.first;
      OPTSTATE_ASSIGN_OR_RETURN(n, BufferBytesFor(*c, t, k, res.second, buf_bytes));
    }
    auto it = v_->chunks.find(k);
    if (it == v_->chunks.end()) {
      std::memset(buf, 0, n);
      return Status();
    }
    return ReadVersion(c, t, k, it->second, buf, n);
  }
  Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions& opts) const override {
    return MakeChunkIo(v_->core, v_, opts);
  }
  const ViewData& data() const { return *v_; }

 private:
  uint64_t ZeroChecksum(uint64_t len) const {
    static thread_local std::vector<char> zeros;
    if (zeros.size() < len) zeros.assign(len, 0);
    return ChunkChecksum(zeros.data(), len);
  }
  std::shared_ptr<ViewData> v_;
};

// ---------------------------------------------------------------------------
// Opening.

}  // namespace

rocksdb::Options internal::IndexOptions(Core* core) {
  rocksdb::Options o;
  o.env = core->env_ ? core->env_.get() : rocksdb::Env::Default();
  core->logger_ = std::make_shared<RocksLogger>();
  o.info_log = core->logger_;
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  o.max_open_files = -1;       // required for secondary instances
  o.paranoid_checks = true;
  o.keep_log_file_num = 2;
  o.write_buffer_size = 16 << 20;
  return o;
}

namespace {

Status ValidateOptions(const StoreOptions& opts) {
  if (opts.chunk_size_bytes == 0 || opts.chunk_size_bytes % kChunkAlignBytes != 0) {
    return InvalidArgument("chunk_size_bytes " + std::to_string(opts.chunk_size_bytes) +
                           " is not a positive multiple of 2 MiB");
  }
  if (opts.retained_generations == 0) return InvalidArgument("retained_generations must be >= 1");
  return Status();
}

Result<StoreIdentity> ReadIdentity(FileSystem* fs, const std::string& path) {
  auto exists = fs->Exists(path);
  if (!exists.ok()) return exists.status().WithContext("store " + path);
  if (!*exists) return NotFound("store " + path + " does not exist");
  auto text = fs->ReadFileToString(JoinPath(path, "IDENTITY"));
  if (!text.ok()) {
    return Corruption("store " + path + " is missing or damaged: cannot read IDENTITY: " +
                      text.status().ToString());
  }
  return internal::DecodeIdentity(*text, "store " + path + ": IDENTITY");
}

Status OpenDataFiles(Core* core, bool create_missing) {
  const auto& dirs = core->identity_.data_dirs;
  core->data_files_.resize(dirs.size());
  for (uint32_t d = 0; d < dirs.size(); ++d) {
    if (core->data_files_[d]) continue;
    const std::string name = core->FileName(d);
    OPTSTATE_ASSIGN_OR_RETURN(bool exists, core->fs_->Exists(name));
    if (!exists && !create_missing) continue;  // checked against references later
    OpenOptions oo;
    oo.read_only = core->read_only_;
    oo.create = !exists;
    oo.direct = core->opts_.direct_io;
    auto f = core->fs_->Open(name, oo);
    if (!f.ok()) return f.status().WithContext("store " + core->path_ + ": data file");
    core->data_files_[d] = std::move(*f);
    if (!exists) {
      OPTSTATE_RETURN_IF_ERROR(core->data_files_[d]->Fsync());
      OPTSTATE_RETURN_IF_ERROR(core->fs_->SyncDir(dirs[d]));
    }
  }
  return Status();
}

// What a user can do to get a second, independent store from one.
constexpr const char* kIndependentCopyHint =
    "to make an independent copy of a store, copy a checkpoint of it (`cp -r MOUNT/<store>/latest DIR` from "
    "optstate-mount, or a snapshot's directory) and import it with `optstate-restore DIR NEW_STORE --create NAME`";

// Turns the data dirs recorded in IDENTITY into absolute paths for this store
// directory (identity_.data_dirs) and marks which lie inside it. A relative
// dir is inside. An absolute one was written by an older version, which
// recorded every dir absolute: inside this directory, it is inside; naming a
// dir of the directory the store was created in (this one is a copy or was
// moved), this directory's own copy of it is used, recognised by this store's
// data file being there; inside any other store directory, refused (the copy
// would write another store's data file). Others are external.
Status ResolveDataDirs(Core* c) {
  auto& dirs = c->identity_.data_dirs;
  c->internal_dirs_.assign(dirs.size(), false);
  const std::string data_file = c->identity_.uuid + ".chunks";
  for (size_t d = 0; d < dirs.size(); ++d) {
    const std::string rec = dirs[d];
    if (!rec.starts_with("/")) {
      dirs[d] = rec == "." ? c->path_ : AbsPath(JoinPath(c->path_, rec));
      c->internal_dirs_[d] = true;
      continue;
    }
    if (internal::RelativeToStore(rec, c->path_)) {
      c->internal_dirs_[d] = true;
      c->identity_needs_rewrite_ = true;
      continue;
    }
    std::vector<std::string> parts;
    for (const auto& part : std::filesystem::path(rec)) {
      if (!part.empty() && part != "/") parts.push_back(part.string());
    }
    std::string rel;
    for (size_t k = parts.size(); k-- > 0 && !c->internal_dirs_[d];) {
      rel = rel.empty() ? parts[k] : parts[k] + "/" + rel;
      const std::string here = JoinPath(c->path_, rel);
      auto e = c->fs_->Exists(JoinPath(here, data_file));
      if (e.ok() && *e) {
        OPTSTATE_LOG_INFO("store {}: data dir {} recorded by an older version is this store directory's {}", c->path_,
                          rec, here);
        dirs[d] = here;
        c->internal_dirs_[d] = true;
        c->identity_needs_rewrite_ = true;
      }
    }
    if (c->internal_dirs_[d]) continue;
    for (std::filesystem::path a(rec); !a.empty(); a = a.parent_path()) {
      const std::string anc = a.string();
      auto e = c->fs_->Exists(JoinPath(anc, "IDENTITY"));
      if (e.ok() && *e && anc != c->path_) {
        return FailedPrecondition(
            "store " + c->path_ + ": IDENTITY names data dir " + rec + ", which lies inside the store directory " +
            anc + ", and this directory has no copy of it (no " + rel + "/" + data_file +
            "): this store is a copy of " + anc + " (or was moved from there) made without its data, and opening it "
            "would use that store's data file. Copy the whole store directory with `cp -a`, or " +
            kIndependentCopyHint);
      }
      if (anc == "/") break;
    }
  }
  return Status();
}

// Writer: makes each open data file this store directory's, or refuses. The
// data file is flock'ed (LOCK_EX) for as long as it is open, so no two
// processes ever write it; its owner record (<uuid>.owner) names the store
// directory that writes it. A record naming another directory is taken over
// when the data file is not the one that directory wrote (a copy of the store
// directory copied it: its inode differs); the same data file owned by another
// directory (a copied store sharing an external data dir, or a hard-linked
// copy) is refused.
Status ClaimDataFiles(Core* c) {
  struct stat self;
  if (::stat(c->path_.c_str(), &self) != 0) return ErrnoStatus("store " + c->path_ + ": stat", errno);
  c->claimed_.resize(c->data_files_.size(), false);
  c->data_locks_.resize(c->data_files_.size());
  for (uint32_t d = 0; d < c->data_files_.size(); ++d) {
    File* f = c->data_files_[d].get();
    if (f == nullptr || c->claimed_[d]) continue;
    const std::string file = c->FileName(d);
    const std::string owner_path = JoinPath(c->identity_.data_dirs[d], c->identity_.uuid + ".owner");
    auto owner_text = c->fs_->ReadFileToString(owner_path);
    std::optional<internal::DataFileOwner> owner;
    if (owner_text.ok()) {
      auto o = internal::DecodeDataFileOwner(*owner_text, owner_path);
      if (o.ok()) {
        owner = std::move(*o);
      } else {
        OPTSTATE_LOG_WARN("store {}: {}; rewriting it", c->path_, o.status().ToString());
      }
    } else if (!owner_text.status().IsNotFound()) {
      return owner_text.status().WithContext("store " + c->path_ + ": owner record of data file " + file);
    }
    const std::string other = owner ? owner->store_path : std::string("unknown (no owner record)");
    OpenOptions lo;
    lo.read_only = true;
    auto lock = c->fs_->Open(file, lo);
    if (!lock.ok()) return lock.status().WithContext("store " + c->path_ + ": lock of data file");
    for (;;) {
      if (::flock((*lock)->fd(), LOCK_EX | LOCK_NB) == 0) break;
      const int e = errno;
      if (e == EINTR) continue;
      if (e == EWOULDBLOCK) {
        return Status(StatusCode::kBusy,
                      "store " + c->path_ + ": data file " + file + " is open for writing by another process, a "
                      "writer of store " + other + ": two stores never write one data file. The two are copies "
                      "of one store that share a data dir outside them (or hard-linked copies); close the other "
                      "writer and use one of them, or " + kIndependentCopyHint,
                      e);
      }
      return ErrnoStatus("store " + c->path_ + ": flock data file " + file, e);
    }
    struct statx st;
    if (::statx(f->fd(), "", AT_EMPTY_PATH, STATX_INO | STATX_NLINK | STATX_BTIME, &st) != 0) {
      return ErrnoStatus("store " + c->path_ + ": statx " + file, errno);
    }
    if (st.stx_nlink > 1) {
      return FailedPrecondition("store " + c->path_ + ": data file " + file + " has " +
                                std::to_string(st.stx_nlink) +
                                " hard links: another store directory may share it (a copy made with `cp -l` "
                                "or `rsync --link-dest`). Copy a store with `cp -a`, or " + kIndependentCopyHint);
    }
    internal::DataFileOwner mine;
    mine.uuid = c->identity_.uuid;
    mine.store_path = c->path_;
    mine.store_dev = static_cast<uint64_t>(self.st_dev);
    mine.store_ino = static_cast<uint64_t>(self.st_ino);
    mine.data_dev = (uint64_t{st.stx_dev_major} << 32) | st.stx_dev_minor;
    mine.data_ino = st.stx_ino;
    if (st.stx_mask & STATX_BTIME) {
      mine.data_btime_ns = static_cast<uint64_t>(st.stx_btime.tv_sec) * 1000000000ull + st.stx_btime.tv_nsec;
    }
    bool write = true;
    if (owner) {
      // Same directory: same inode, and same device or same path (device
      // numbers of drives can change across reboots; a rename keeps both).
      const bool same_dir = owner->store_ino == mine.store_ino &&
                            (owner->store_dev == mine.store_dev || owner->store_path == mine.store_path);
      const bool same_file = owner->data_ino == mine.data_ino &&
                             (owner->data_btime_ns == 0 || mine.data_btime_ns == 0 ||
                              owner->data_btime_ns == mine.data_btime_ns) &&
                             (owner->data_dev == mine.data_dev || same_dir);
      if (owner->uuid != mine.uuid) {
        return FailedPrecondition("store " + c->path_ + ": data file " + file + " has an owner record (" +
                                  owner_path + ") of another store, uuid " + owner->uuid +
                                  "; the data directory was tampered with: " + kIndependentCopyHint);
      }
      if (same_dir) {
        write = owner->store_path != mine.store_path || owner->store_dev != mine.store_dev ||
                owner->data_dev != mine.data_dev || owner->data_ino != mine.data_ino ||
                owner->data_btime_ns != mine.data_btime_ns;
      } else if (!same_file) {
        OPTSTATE_LOG_INFO("store {}: data file {} is this store directory's own copy (its owner record named {}); "
                          "taking it over", c->path_, file, owner->store_path);
      } else {
        struct stat o;
        const bool other_exists = ::stat(owner->store_path.c_str(), &o) == 0 &&
                                  static_cast<uint64_t>(o.st_ino) == owner->store_ino;
        return FailedPrecondition(
            "store " + c->path_ + ": data file " + file + " belongs to the store directory " + owner->store_path +
            (other_exists ? " (which still exists)" : " (which is no longer there)") +
            ": this store is a copy of it, or it was moved or restored from a backup, and its data dir " +
            c->identity_.data_dirs[d] +
            (c->internal_dirs_[d] ? " is the same directory for both (a symbolic link or mount copied as such)"
                                  : " lies outside the store directory") +
            ", so a copy would write the same data file. A store whose data dirs are not its own cannot be "
            "copied with cp; " + kIndependentCopyHint +
            ". If this directory replaces " + owner->store_path + " (moved, or the only copy left) and no other "
            "copy will be opened, delete " + owner_path + " and open it again");
      }
    }
    if (write) {
      OPTSTATE_RETURN_IF_ERROR(c->fs_->WriteFileAtomic(owner_path, internal::EncodeDataFileOwner(mine))
                                   .WithContext("store " + c->path_ + ": owner record of data file " + file));
    }
    c->data_locks_[d] = std::move(*lock);
    c->claimed_[d] = true;
  }
  return Status();
}

Status CheckReferencedFiles(Core* core) {  // mu_ held
  for (const auto& [key, vs] : core->versions_) {
    for (const auto& v : vs) {
      if (v.ext.dir >= core->data_files_.size() || !core->data_files_[v.ext.dir]) {
        return Corruption("store " + core->path_ + ": data file " +
                          (v.ext.dir < core->identity_.data_dirs.size() ? core->FileName(v.ext.dir)
                                                                         : "#" + std::to_string(v.ext.dir)) +
                          " is missing but generation " + std::to_string(v.gen) + " references it");
      }
    }
  }
  return Status();
}

class StoreImpl final : public Store {
 public:
  explicit StoreImpl(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  const std::string& path() const override { return core_->path_; }
  const StoreIdentity& identity() const override { return core_->identity_; }
  bool read_only() const override { return core_->read_only_; }

  Status CatchUp() override {
    if (!core_->read_only_) return Status();
    return core_->CatchUpChecked(/*reopen_first=*/false);
  }

  Result<TensorInfo> CreateTensor(const TensorSpec& spec) override {
    OPTSTATE_RETURN_IF_ERROR(ValidateSpec(spec));
    TensorInfo t;
    static_cast<TensorSpec&>(t) = spec;
    if (t.fields.empty()) t.fields = AdamFields();
    if (t.shape.empty()) t.shape = {t.numel};
    if (t.global_shape.empty()) t.global_shape = t.shape;
    if (t.shard_offset.empty()) t.shard_offset.assign(t.global_shape.size(), 0);
    if (t.shard_offset.size() != t.global_shape.size()) {
      return InvalidArgument("tensor '" + spec.name + "': shard_offset rank " +
                             std::to_string(t.shard_offset.size()) + " != global_shape rank " +
                             std::to_string(t.global_shape.size()));
    }
    std::lock_guard l(core_->mu_);
    OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("create tensor '" + spec.name + "'"));
    if (core_->names_.count(spec.name)) {
      return AlreadyExists("store " + core_->path_ + ": tensor '" + spec.name + "' already exists");
    }
    t.id = core_->next_tensor_id_;
    t.created_generation = core_->latest_.generation + 1;
    rocksdb::WriteBatch b;
    b.Put(internal::TensorKey(t.name), internal::EncodeTensor(t));
    b.Put(internal::kNextTensorIdKey, internal::EncodeU64(t.id + 1));
    // Not synced: the next commit's synced batch makes it durable (one WAL).
    OPTSTATE_RETURN_IF_ERROR(RocksStatus("store " + core_->path_ + ": create tensor '" + t.name + "'",
                                         core_->db_->Write(rocksdb::WriteOptions(), &b)));
    core_->next_tensor_id_ = t.id + 1;
    core_->names_[t.name] = t.id;
    core_->tensors_[t.id] = t;
    return t;
  }

  Result<TensorInfo> FindTensor(std::string_view name) const override {
    std::lock_guard l(core_->mu_);
    auto it = core_->names_.find(name);
    if (it != core_->names_.end() && Visible(core_->tensors_.at(it->second))) {
      return core_->tensors_.at(it->second);
    }
    std::vector<std::string> names;
    for (const auto& [id, t] : core_->tensors_) {
      if (Visible(t)) names.push_back(t.name);
    }
    return NotFound("store " + core_->path_ + ": no tensor '" + std::string(name) + "'" +
                    ClosestNames(name, names.begin(), names.end()));
  }

  std::vector<TensorInfo> ListTensors() const override {
    std::lock_guard l(core_->mu_);
    std::vector<TensorInfo> out;
    for (const auto& [name, id] : core_->names_) {
      const auto& t = core_->tensors_.at(id);
      if (Visible(t)) out.push_back(t);
    }
    return out;
  }

  uint64_t ChunkCount(const TensorInfo& t, uint32_t field) const override {
    return Core::ChunkCountOf(t, field, core_->chunk());
  }

  Result<uint32_t> FieldIndex(const TensorInfo& t, std::string_view field) const override {
    std::string names;
    for (uint32_t i = 0; i < t.fields.size(); ++i) {
      if (t.fields[i].name == field) return i;
      names += (i ? ", " : "") + t.fields[i].name;
    }
    return NotFound("store " + core_->path_ + " tensor '" + t.name + "': no field '" + std::string(field) +
                    "' (fields: " + names + ")");
  }

  Result<std::unique_ptr<ChunkIo>> NewChunkIo(const ChunkIoOptions& opts) override {
    return MakeChunkIo(core_, nullptr, opts);
  }

  Status ReadChunk(const ChunkRef& ref, void* buf) override {
    const Key k{ref.tensor_id, ref.field, ref.index};
    TensorInfo t;
    std::optional<Version> v;
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors_, ref));
      t = *res.first;
      v = core_->Newest(k);
    }
    if (!v) {
      std::memset(buf, 0, core_->chunk());
      return Status();
    }
    return ReadVersion(core_.get(), &t, k, *v, buf, core_->chunk());
  }

  Status WriteChunk(const ChunkRef& ref, const void* buf) override {
    const Key k{ref.tensor_id, ref.field, ref.index};
    TensorInfo t;
    Extent ext;
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("chunk write"));
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors_, ref));
      t = *res.first;
      auto e = core_->AllocateSlot(res.second);
      if (!e.ok()) return e.status().WithContext("write of " + core_->Describe(&t, k, kInfinity));
      ext = *e;
      ++core_->writes_in_flight_;
    }
    ext.checksum = ChunkChecksum(buf, ext.length);
    CrashPoint("extent.before_write");
    Status s = core_->data_files_[ext.dir]->Pwrite(ext.file_offset, buf, RoundUp(ext.length, kIoAlign));
    std::lock_guard l(core_->mu_);
    --core_->writes_in_flight_;
    if (!s.ok()) {
      core_->FreeSlot(ext);
      return s.WithContext("write of " + core_->Describe(&t, k, kInfinity));
    }
    core_->SetPending(k, ext);
    CrashPoint("extent.after_write");
    return Status();
  }

  Result<uint64_t> Commit(const CommitInfo& info) override {
    if (core_->read_only_) return core_->CheckWritable("commit");
    return core_->Commit(info);
  }

  Status SyncData() override {
    if (core_->read_only_) return core_->CheckWritable("data sync");
    return core_->SyncData();
  }

  Status AbortPending() override {
    std::lock_guard l(core_->mu_);
    OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("abort pending"));
    if (core_->writes_in_flight_ > 0) {
      return FailedPrecondition("store " + core_->path_ + ": abort with chunk writes in flight");
    }
    for (const auto& [k, e] : core_->pending_) core_->FreeSlot(e);
    core_->pending_.clear();
    return core_->DropUncommittedTensors();
  }

  GenerationInfo LatestGeneration() const override {
    std::lock_guard l(core_->mu_);
    return core_->latest_;
  }

  std::vector<GenerationInfo> ListGenerations() const override {
    std::lock_guard l(core_->mu_);
    std::vector<GenerationInfo> out;
    for (const auto& [g, info] : core_->generations_) out.push_back(info);
    return out;
  }

  Result<std::unique_ptr<GenerationView>> OpenGeneration(uint64_t generation) override {
    return OpenView(generation, "");
  }

  Result<std::unique_ptr<GenerationView>> OpenSnapshot(std::string_view name) override {
    return OpenView(0, std::string(name));
  }

  Result<SnapshotInfo> CreateSnapshot(const std::string& name) override {
    OPTSTATE_RETURN_IF_ERROR(ValidateSnapshotName(name));
    std::lock_guard l(core_->mu_);
    OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("create snapshot '" + name + "'"));
    if (core_->snapshots_.count(name)) {
      return AlreadyExists("store " + core_->path_ + ": snapshot '" + name + "' already exists (generation " +
                           std::to_string(core_->snapshots_[name].generation) + ")");
    }
    SnapshotInfo s;
    s.name = name;
    s.generation = core_->latest_.generation;
    s.create_time_unix_ms = NowUnixMs();
    rocksdb::WriteBatch b;
    b.Put(internal::SnapshotKey(name), internal::EncodeSnapshot(s));
    CrashPoint("snapshot.create");
    OPTSTATE_RETURN_IF_ERROR(core_->WriteSynced(&b, "create snapshot '" + name + "'"));
    core_->snapshots_[name] = s;
    return s;
  }

  Status ReleaseSnapshot(const std::string& name) override {
    {
      std::lock_guard l(core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("release snapshot '" + name + "'"));
      if (!core_->snapshots_.count(name)) return SnapshotNotFound(name);
      rocksdb::WriteBatch b;
      b.Delete(internal::SnapshotKey(name));
      CrashPoint("snapshot.release");
      OPTSTATE_RETURN_IF_ERROR(core_->WriteSynced(&b, "release snapshot '" + name + "'"));
      core_->snapshots_.erase(name);
    }
    return core_->CollectGarbage();
  }

  std::vector<SnapshotInfo> ListSnapshots() const override {
    std::lock_guard l(core_->mu_);
    std::vector<SnapshotInfo> out;
    for (const auto& [n, s] : core_->snapshots_) out.push_back(s);
    return out;
  }

  Status CollectGarbage() override {
    if (core_->read_only_) return core_->CheckWritable("garbage collection");
    return core_->CollectGarbage();
  }

  Result<StoreStats> Stats() const override {
    StoreStats st;
    std::vector<uint64_t> leased;
    if (core_->lease_lock_file_) {
      auto names = core_->fs_->ListDir(core_->leases_dir_);
      if (names.ok()) {
        for (const auto& n : *names) {
          if (!n.empty() && n[0] != '.') ++st.leases;
        }
      }
    }
    std::lock_guard l(core_->mu_);
    for (const auto& [g, n] : core_->view_refs_) st.leases += n;
    st.latest_generation = core_->latest_.generation;
    for (const auto& [key, vs] : core_->versions_) {
      if (!vs.empty()) st.live_bytes += vs.front().ext.length;
      for (const auto& v : vs) st.referenced_extent_bytes += core_->AllocBytes(v.ext.length);
    }
    // A pending write of a chunk never written before adds live bytes only at commit.
    for (const auto& [key, e] : core_->pending_) st.pending_bytes += core_->AllocBytes(e.length);
    for (uint32_t d = 0; d < core_->data_files_.size(); ++d) {
      uint64_t size = 0;
      if (core_->data_files_[d]) {
        auto s = core_->data_files_[d]->Size();
        if (s.ok()) size = *s;
      }
      st.data_file_bytes.push_back(size);
      st.data_free_bytes.push_back(core_->read_only_ ? 0 : core_->FreeBytes(d));
    }
    st.lifetime_bytes_written = core_->lifetime_bytes_;
    st.generations_retained = core_->generations_.size();
    st.snapshots = core_->snapshots_.size();
    return st;
  }

  Result<VerifyReport> Verify() override;

  // Opening helpers.
  Result<std::unique_ptr<GenerationView>> OpenView(uint64_t generation, const std::string& snapshot);

 private:
  bool Visible(const TensorInfo& t) const {  // mu_ held
    return !core_->read_only_ || t.created_generation <= core_->latest_.generation;
  }

  Status SnapshotNotFound(const std::string& name) const {  // mu_ held
    std::string names;
    for (const auto& [n, s] : core_->snapshots_) names += (names.empty() ? "" : ", ") + n;
    return NotFound("store " + core_->path_ + ": no snapshot '" + name + "' (snapshots: " +
                    (names.empty() ? "none" : names) + ")");
  }

  Status ValidateSpec(const TensorSpec& spec) const {
    if (spec.name.empty() || spec.name.size() > 4096 || spec.name.find('\0') != std::string::npos ||
        !ValidUtf8(spec.name)) {
      return InvalidArgument("store " + core_->path_ + ": invalid tensor name (1..4096 bytes of UTF-8, no NUL)");
    }
    if (!spec.shape.empty()) {
      uint64_t n = 1;
      for (uint64_t d : spec.shape) n *= d;
      if (n != spec.numel) {
        return InvalidArgument("tensor '" + spec.name + "': shape has " + std::to_string(n) +
                               " elements but numel is " + std::to_string(spec.numel));
      }
    }
    std::set<std::string> seen;
    for (const auto& f : spec.fields) {
      if (f.name.empty() || f.name.find('\0') != std::string::npos || f.name.find('/') != std::string::npos ||
          !seen.insert(f.name).second) {
        return InvalidArgument("tensor '" + spec.name + "': invalid or duplicate field name '" + f.name + "'");
      }
    }
    return Status();
  }

  std::shared_ptr<Core> core_;
};

Result<std::unique_ptr<GenerationView>> StoreImpl::OpenView(uint64_t generation, const std::string& snapshot) {
  Core* c = core_.get();
  auto resolve = [&](uint64_t* g) -> Status {  // mu_ held
    if (!snapshot.empty()) {
      auto s = c->snapshots_.find(snapshot);
      if (s == c->snapshots_.end()) return SnapshotNotFound(snapshot);
      *g = s->second.generation;
    } else {
      *g = generation == kLatest ? c->latest_.generation : generation;
    }
    if (!c->generations_.count(*g)) {
      std::string have;
      for (const auto& [x, i] : c->generations_) have += (have.empty() ? "" : ", ") + std::to_string(x);
      return NotFound("store " + c->path_ + ": generation " + std::to_string(*g) +
                      " is not retained (retained: " + have + ")");
    }
    return Status();
  };
  if (!c->read_only_) {
    std::lock_guard l(c->mu_);
    uint64_t g;
    OPTSTATE_RETURN_IF_ERROR(resolve(&g));
    auto v = BuildView(core_, g);
    ++c->view_refs_[g];
    v->in_process_ref = true;
    return std::unique_ptr<GenerationView>(new GenerationViewImpl(std::move(v)));
  }
  // Read-only: a lease file, then (under the same shared flock) RETAINED says
  // whether the writer still keeps g; g's entries come from this process's
  // index, checked against g's digest.
  static std::atomic<uint64_t> nonce{0};
  std::mt19937_64 rng(std::random_device{}());
  bool reopen = false;
  Status why = Busy("the writer collected each generation before a lease on it was taken");
  for (int attempt = 0; attempt < 20; ++attempt) {
    OPTSTATE_RETURN_IF_ERROR(c->CatchUpChecked(reopen));
    reopen = false;
    uint64_t g;
    {
      std::lock_guard l(c->mu_);
      OPTSTATE_RETURN_IF_ERROR(resolve(&g));
    }
    const std::string lease =
        JoinPath(c->leases_dir_, std::to_string(getpid()) + "." + std::to_string(g) + "." +
                                     std::to_string((rng() & 0xffffffffull) * 1000 + nonce++ % 1000) +
                                     std::string(Core::kLeaseSuffix));
    std::optional<std::vector<uint64_t>> retained;
    std::unique_ptr<File> handle;
    {
      std::lock_guard ll(c->lease_lock_mu_);
      OPTSTATE_ASSIGN_OR_RETURN(auto guard, c->LockLeases(LOCK_SH));
      OpenOptions oo;
      oo.create = true;
      oo.exclusive = true;
      auto f = c->fs_->Open(lease, oo);
      if (!f.ok()) return f.status().WithContext("store " + c->path_ + ": take reader lease");
      handle = std::move(*f);
      // Locked before the lease flock is released: the writer's GC, which
      // lists leases under LOCK_EX, never sees this file unlocked while we live.
      while (::flock(handle->fd(), LOCK_EX | LOCK_NB) != 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        handle.reset();
        (void)c->fs_->Remove(lease);
        return ErrnoStatus("store " + c->path_ + ": flock reader lease " + lease, e);
      }
      retained = c->ReadRetained();
    }
    // Without RETAINED (a store last opened by an older writer): a GC that
    // dropped g before the lease existed is in the index by now.
    Status s = retained ? Status() : c->CatchUpChecked(false);
    const bool kept = retained ? std::binary_search(retained->begin(), retained->end(), g) : true;
    std::unique_lock l(c->mu_);
    if (s.ok() && kept && c->generations_.count(g)) {
      s = c->CheckIndexOf(g);
      if (s.ok()) {
        auto v = BuildView(core_, g);
        v->lease_file = lease;
        v->lease_handle = std::move(handle);
        l.unlock();
        return std::unique_ptr<GenerationView>(new GenerationViewImpl(std::move(v)));
      }
      reopen = true;  // g's entries in this index are stale
      why = s;
    } else if (s.ok() && kept) {
      reopen = true;  // the writer keeps g, this index lost it: stale
    }
    l.unlock();
    (void)c->fs_->Remove(lease);
    handle.reset();
    if (!s.ok() && s.code() != StatusCode::kBusy) return s;
    if (!kept && generation != kLatest && snapshot.empty()) {
      return NotFound("store " + c->path_ + ": generation " + std::to_string(g) +
                      " was collected before a lease could be taken");
    }
  }
  return Busy("store " + c->path_ + ": could not lease a generation after 20 attempts: " + why.ToString());
}

Result<VerifyReport> StoreImpl::Verify() {
  struct Item {
    TensorInfo tensor;
    Key key;
    Version v;
    uint64_t expected_len;
  };
  VerifyReport rep;
  Core* c = core_.get();
  if (c->read_only_) OPTSTATE_RETURN_IF_ERROR(c->CatchUpChecked(/*reopen_first=*/false));
  // Every generation is read through a view that holds a lease on it (a read-
  // only store's lease file, a writable store's in-process reference), so the
  // writer (another process, or this one on another thread) never reuses an
  // extent that is being checked. A generation the writer collected before its
  // lease could be taken is skipped: it is no longer part of the store.
  // The latest generation first: leasing it retries with a newer one when
  // the writer collects it meanwhile, so at least one is always checked.
  std::vector<std::unique_ptr<GenerationView>> views;
  {
    auto v = OpenView(kLatest, "");
    if (!v.ok()) return v.status().WithContext("store " + c->path_ + ": verify: lease on the latest generation");
    views.push_back(std::move(*v));
  }
  std::vector<uint64_t> gens;
  {
    std::lock_guard l(c->mu_);
    for (const auto& [g, i] : c->generations_) {
      if (g != views[0]->info().generation) gens.push_back(g);
    }
  }
  for (uint64_t g : gens) {
    auto v = OpenView(g, "");
    if (v.ok()) {
      views.push_back(std::move(*v));
    } else if (v.status().IsNotFound()) {
      ++rep.generations_skipped;
    } else {
      return v.status().WithContext("store " + c->path_ + ": verify: lease on generation " + std::to_string(g));
    }
  }
  std::vector<Item> items;
  std::set<std::tuple<Key, uint64_t>> planned;
  for (const auto& view : views) {
    const ViewData& d = static_cast<const GenerationViewImpl&>(*view).data();
    ++rep.generations_checked;
    for (const auto& [k, v] : d.chunks) {
      if (!planned.insert({k, v.gen}).second) continue;
      const TensorInfo& t = d.by_id.at(k.t);
      if (k.f >= t.fields.size() || k.c >= Core::ChunkCountOf(t, k.f, c->chunk())) continue;  // reported below
      items.push_back(Item{t, k, v, c->ChunkLen(t, k.f, k.c)});
    }
  }
  // (dir, offset) -> the version using it and its allocation (slot or piece) size.
  struct Owner {
    const TensorInfo* tensor;
    Key key;
    uint64_t gen;
    uint64_t bytes;
  };
  std::map<std::pair<uint32_t, uint64_t>, Owner> owner;
  uint64_t allocated = 0, free_bytes = 0, owned_bytes = 0;
  uint64_t index_latest = 0;
  {
    std::lock_guard l(core_->mu_);
    index_latest = c->latest_.generation;
    for (const auto& [n, s] : c->snapshots_) {
      if (!c->generations_.count(s.generation)) {
        rep.problems.push_back("store " + c->path_ + ": snapshot '" + n + "' pins generation " +
                               std::to_string(s.generation) + " which has no record");
      }
    }
    // References: every committed and pending version, inside the files, no
    // two on overlapping space, each held in use by the allocator as an
    // extent of its size class.
    const uint64_t slot_bytes = c->SlotBytes();
    auto claim = [&](const TensorInfo* tp, const Key& k, uint64_t gen, const Extent& e) {
      const uint64_t bytes = c->AllocBytes(e.length);
      const std::string what = c->Describe(tp, k, gen) + ": extent (dir " + std::to_string(e.dir) + ", offset " +
                               std::to_string(e.file_offset) + ", " + std::to_string(bytes) + " bytes)";
      if (e.dir >= c->space_.size() || e.file_offset % bytes != 0 ||
          (!c->read_only_ && e.file_offset / slot_bytes >= c->space_[e.dir].slots)) {
        rep.problems.push_back(what + " is dangling");
        return;
      }
      auto [it, fresh] = owner.try_emplace({e.dir, e.file_offset}, Owner{tp, k, gen, bytes});
      if (!fresh) {
        rep.problems.push_back(what + " is also referenced by generation " + std::to_string(it->second.gen));
        return;
      }
      owned_bytes += bytes;
      auto overlaps = [&](auto lo, auto hi) {
        return lo->first.first == hi->first.first && lo->first.second + lo->second.bytes > hi->first.second;
      };
      if (it != owner.begin() && overlaps(std::prev(it), it)) {
        const Owner& o = std::prev(it)->second;
        rep.problems.push_back(what + " overlaps the extent of " + c->Describe(o.tensor, o.key, o.gen));
      }
      if (std::next(it) != owner.end() && overlaps(it, std::next(it))) {
        const Owner& o = std::next(it)->second;
        rep.problems.push_back(what + " overlaps the extent of " + c->Describe(o.tensor, o.key, o.gen));
      }
      if (c->read_only_) return;
      switch (c->HeldAs(e.dir, e.file_offset, bytes)) {
        case Core::Held::kInUse: break;
        case Core::Held::kFree: rep.problems.push_back(what + ": referenced extent is on the free list"); break;
        case Core::Held::kOtherClass:
          rep.problems.push_back(what + ": the allocator holds its slot for another size class");
          break;
      }
    };
    for (const auto& [k, vs] : c->versions_) {
      auto t = c->tensors_.find(k.t);
      const TensorInfo* tp = t == c->tensors_.end() ? nullptr : &t->second;
      if (!tp) {
        rep.problems.push_back(c->Describe(nullptr, k, kInfinity) + ": versions of an unknown tensor");
      } else if (k.f >= tp->fields.size() || k.c >= Core::ChunkCountOf(*tp, k.f, c->chunk())) {
        rep.problems.push_back(c->Describe(tp, k, kInfinity) + ": version outside the tensor's chunks");
      }
      for (const auto& v : vs) claim(tp, k, v.gen, v.ext);
    }
    for (const auto& [k, e] : c->pending_) {
      auto t = c->tensors_.find(k.t);
      claim(t == c->tensors_.end() ? nullptr : &t->second, k, c->latest_.generation + 1, e);
    }
    // Leaks: space the allocator holds in use that no version owns.
    if (!c->read_only_) {
      for (uint32_t d = 0; d < c->space_.size(); ++d) {
        const Core::DirSpace& sp = c->space_[d];
        allocated += sp.slots * slot_bytes;
        free_bytes += c->FreeBytes(d);
        for (uint64_t s = 0; s < sp.slots; ++s) {
          if (sp.free_slots.count(s)) continue;
          auto cs = sp.carved.find(s);
          if (cs == sp.carved.end()) {
            if (!owner.count({d, s * slot_bytes})) ++rep.leaked_slots;
            continue;
          }
          const Core::CarvedSlot& cv = cs->second;
          uint64_t in_use = 0;
          for (uint64_t i = 0; i < cv.pieces(slot_bytes); ++i) {
            if (!cv.InUse(i)) continue;
            ++in_use;
            if (!owner.count({d, s * slot_bytes + i * cv.piece_bytes})) ++rep.leaked_slots;
          }
          if (in_use != cv.used || in_use == 0) {
            rep.problems.push_back("store " + c->path_ + ": data dir " + std::to_string(d) + " slot " +
                                   std::to_string(s) + " of " + std::to_string(cv.piece_bytes) +
                                   "-byte pieces counts " + std::to_string(cv.used) + " in use, its map " +
                                   std::to_string(in_use));
          }
        }
      }
    }
  }
  IoBuffer buf(core_->chunk());
  if (!buf.ok()) return ResourceExhausted("store " + core_->path_ + ": verify: out of memory for a chunk buffer");
  for (const auto& it : items) {
    if (it.v.ext.length != it.expected_len) {
      rep.problems.push_back(core_->Describe(&it.tensor, it.key, it.v.gen) + ": extent length " +
                             std::to_string(it.v.ext.length) + " != chunk length " +
                             std::to_string(it.expected_len));
      continue;
    }
    Status s = ReadVersion(core_.get(), &it.tensor, it.key, it.v, buf.data(), core_->chunk());
    ++rep.chunks_checked;
    rep.bytes_checked += it.v.ext.length;
    if (!s.ok()) rep.problems.push_back(s.ToString());
  }
  if (!core_->read_only_ && owned_bytes + free_bytes > allocated) {
    rep.problems.push_back("store " + core_->path_ + ": space accounting: " + std::to_string(owned_bytes) +
                           " bytes referenced/pending + " + std::to_string(free_bytes) + " free but only " +
                           std::to_string(allocated) + " allocated");
  }
  c->VerifyMarks(index_latest, &rep.problems);
  return rep;
}

Status CleanStaleCreations(FileSystem* fs, const std::string& parent, const std::string& base) {
  auto names = fs->ListDir(parent);
  if (!names.ok()) return names.status();
  const std::string prefix = "." + base + ".creating-";
  for (const auto& n : *names) {
    if (!n.starts_with(prefix)) continue;
    const long pid = std::strtol(n.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && pid != getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      OPTSTATE_LOG_INFO("removing half-created store {}", JoinPath(parent, n));
      (void)fs->RemoveAll(JoinPath(parent, n));
    }
  }
  return Status();
}

Result<std::shared_ptr<Core>> NewCore(const std::string& path, const StoreOptions& opts, bool read_only) {
  auto core = std::make_shared<Core>();
  core->path_ = AbsPath(path);
  core->opts_ = opts;
  core->fs_ = opts.fs ? opts.fs : FileSystem::Default();
  core->read_only_ = read_only;
  core->leases_dir_ = JoinPath(core->path_, "leases");
  if (core->fs_->hooks() != nullptr) core->env_ = internal::NewHookedEnv(core->fs_->hooks());
  return core;
}

// Opens (creating if absent) COMMITTED and refuses an index older than the
// generation it records: the acknowledged generations must all be there. A
// store whose index holds committed generations must have a whole COMMITTED
// (missing, empty, truncated or with no valid slot is damage: no crash makes
// it so, and without it a lost index write-ahead log would go unnoticed),
// unless the user accepted the index as it is (kAcceptIndexFile).
Status OpenCommittedMark(Core* c) {
  const std::string name = JoinPath(c->path_, "COMMITTED");
  const std::string accept = JoinPath(c->path_, Core::kAcceptIndexFile);
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, c->fs_->Exists(name));
  OPTSTATE_ASSIGN_OR_RETURN(bool accepted, c->fs_->Exists(accept));
  OpenOptions oo;
  oo.create = !exists;
  std::unique_ptr<File> f;
  uint64_t size = 0;
  if (exists || c->latest_.generation == 0 || accepted) {
    auto opened = c->fs_->Open(name, oo);
    if (!opened.ok()) return opened.status().WithContext("store " + c->path_ + ": COMMITTED");
    f = std::move(*opened);
    OPTSTATE_ASSIGN_OR_RETURN(size, f->Size());
  }
  std::lock_guard l(c->mu_);
  const uint64_t index_latest = c->latest_.generation;
  std::string damage;  // what is wrong with COMMITTED, if anything
  std::optional<uint64_t> acked;
  bool both_valid = false;
  if (!exists) {
    damage = "is missing";
  } else if (size == 0) {
    damage = "is empty";
  } else {
    // The newest valid slot; an invalid slot is a torn or lost unsynced write.
    std::string contents(std::min<uint64_t>(size, Core::kCommittedBytes), '\0');
    Status rs = f->Pread(0, contents.data(), contents.size());
    if (!rs.ok()) return rs.WithContext("store " + c->path_ + ": COMMITTED");
    std::string why;
    acked = Core::NewestCommittedMark(contents, "slot", &why);
    both_valid = acked && why.empty();
    if (size < Core::kCommittedBytes) {
      damage = "is truncated to " + std::to_string(size) + " bytes (" + std::to_string(Core::kCommittedBytes) +
               " written)";
    } else if (!acked) {
      damage = "holds no valid record (" + why + ")";
    }
  }
  std::string problem;
  if (!damage.empty() && index_latest > 0) {
    problem = "store " + c->path_ + " is damaged: COMMITTED " + damage +
              ", but the index (index/) holds committed generations up to " + std::to_string(index_latest) +
              ": the store cannot tell whether the index lost acknowledged generations. ";
  } else if (acked && index_latest < *acked) {
    problem = "store " + c->path_ + " is damaged: its index (RocksDB, index/) holds generation " +
              std::to_string(index_latest) + " but generation " + std::to_string(*acked) +
              " was committed and acknowledged (COMMITTED): the index write-ahead log was lost or damaged; "
              "refusing to open an older state silently. ";
  }
  if (!problem.empty()) {
    if (!accepted) return Corruption(problem + c->CommittedRecoveryHint(index_latest));
    OPTSTATE_LOG_WARN("{}{} exists: accepting the index as it is, generation {}", problem, accept, index_latest);
  }
  if (damage.empty() && both_valid && acked == index_latest) {
    c->committed_file_ = std::move(f);
  } else {
    // A fresh store (or one whose creation crashed before COMMITTED was
    // written), an index ahead of the mark (a crash after the commit batch,
    // before the mark), a torn slot, or the user's acceptance: both slots anew.
    if (f == nullptr) {
      auto opened = c->fs_->Open(name, oo);
      if (!opened.ok()) return opened.status().WithContext("store " + c->path_ + ": COMMITTED");
      f = std::move(*opened);
    }
    c->committed_file_ = std::move(f);
    OPTSTATE_RETURN_IF_ERROR(
        c->WriteCommittedMark(index_latest, /*both_slots=*/true).WithContext("store " + c->path_ + ": COMMITTED"));
    if (!exists) OPTSTATE_RETURN_IF_ERROR(c->fs_->SyncDir(c->path_));
  }
  if (accepted) {
    OPTSTATE_RETURN_IF_ERROR(c->fs_->Remove(accept).WithContext("store " + c->path_));
    OPTSTATE_RETURN_IF_ERROR(c->fs_->SyncDir(c->path_));
  }
  return Status();
}

Status OpenLeaseLock(Core* c) {
  OPTSTATE_RETURN_IF_ERROR(c->fs_->CreateDir(c->leases_dir_));
  OpenOptions oo;
  oo.create = true;
  auto f = c->fs_->Open(JoinPath(c->leases_dir_, ".lock"), oo);
  if (!f.ok()) return f.status().WithContext("store " + c->path_ + ": leases/.lock");
  c->lease_lock_file_ = std::move(*f);
  return Status();
}

}  // namespace

// ---------------------------------------------------------------------------

Result<std::unique_ptr<Store>> Store::Create(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  FileSystem* fs = opts.fs ? opts.fs : FileSystem::Default();
  const std::string path = AbsPath(path_in);
  const std::filesystem::path p(path);
  const std::string parent = p.parent_path().string();
  const std::string base = p.filename().string();
  if (base.empty() || base == "." || base == "..") return InvalidArgument("store path '" + path_in + "' has no name");
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, fs->Exists(path));
  if (exists) return AlreadyExists("store " + path + " already exists");
  OPTSTATE_ASSIGN_OR_RETURN(bool parent_exists, fs->Exists(parent));
  if (!parent_exists) return NotFound("store " + path + ": parent directory " + parent + " does not exist");
  OPTSTATE_RETURN_IF_ERROR(CleanStaleCreations(fs, parent, base));

  const std::string tmp = JoinPath(parent, "." + base + ".creating-" + std::to_string(getpid()));
  OPTSTATE_ASSIGN_OR_RETURN(bool tmp_exists, fs->Exists(tmp));
  if (tmp_exists) OPTSTATE_RETURN_IF_ERROR(fs->RemoveAll(tmp));
  OPTSTATE_RETURN_IF_ERROR(fs->CreateDir(tmp));
  CrashPoint("store.create.begin");

  StoreIdentity id;
  id.name = opts.name.empty() ? base : opts.name;
  {
    std::random_device rd;
    char u[40];
    const uint64_t a = (uint64_t{rd()} << 32) | rd(), b = (uint64_t{rd()} << 32) | rd();
    snprintf(u, sizeof(u), "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32),
             static_cast<unsigned>((a >> 16) & 0xffff), static_cast<unsigned>(a & 0xfff),
             static_cast<unsigned>(0x8000 | ((b >> 48) & 0x3fff)),
             static_cast<unsigned long long>(b & 0xffffffffffffull));
    id.uuid = u;
  }
  id.chunk_size_bytes = opts.chunk_size_bytes;
  id.create_time_unix_ms = NowUnixMs();
  std::vector<std::string> real_dirs;  // where the dirs are while building
  if (opts.data_dirs.empty()) {
    id.data_dirs = {JoinPath(path, "data")};
    real_dirs = {JoinPath(tmp, "data")};
  } else {
    for (const auto& d : opts.data_dirs) {
      const std::string a = AbsPath(d);
      id.data_dirs.push_back(a);
      real_dirs.push_back(a == path || a.starts_with(path + "/") ? tmp + a.substr(path.size()) : a);
    }
  }
  auto fail = [&](const Status& s) {
    (void)fs->RemoveAll(tmp);
    return s.WithContext("create store " + path);
  };
  for (size_t d = 0; d < real_dirs.size(); ++d) {
    Status s = fs->CreateDir(real_dirs[d]);
    if (!s.ok()) return fail(s);
    OpenOptions oo;
    oo.create = true;
    oo.exclusive = true;
    auto f = fs->Open(JoinPath(real_dirs[d], id.uuid + ".chunks"), oo);
    if (!f.ok()) return fail(f.status());
    s = (*f)->Fsync();
    if (s.ok()) s = fs->SyncDir(real_dirs[d]);
    if (!s.ok()) return fail(s);
  }
  {
    Status s = fs->WriteFileAtomic(JoinPath(tmp, "IDENTITY"), internal::EncodeIdentity(id, path));
    if (!s.ok()) return fail(s);
  }
  CrashPoint("store.create.identity");
  {
    auto core = NewCore(tmp, opts, false);
    if (!core.ok()) return fail(core.status());
    Status s = fs->CreateDir(JoinPath(tmp, "index"));
    if (!s.ok()) return fail(s);
    rocksdb::Options o = IndexOptions(core->get());
    o.create_if_missing = true;
    o.error_if_exists = true;
    rocksdb::DB* raw = nullptr;
    s = RocksStatus("create index", rocksdb::DB::Open(o, JoinPath(tmp, "index"), &raw));
    if (!s.ok()) return fail(s);
    (*core)->db_.reset(raw);
    GenerationInfo g0;
    g0.commit_time_unix_ms = id.create_time_unix_ms;
    rocksdb::WriteBatch b;
    b.Put(internal::kIdentityKey, internal::EncodeIdentity(id, path));
    b.Put(internal::kLatestKey, internal::EncodeU64(0));
    b.Put(internal::kNextTensorIdKey, internal::EncodeU64(0));
    b.Put(internal::kLifetimeKey, internal::EncodeU64(0));
    b.Put(internal::GenerationKey(0), internal::EncodeGeneration(g0));
    s = (*core)->WriteSynced(&b, "initial index");
    if (!s.ok()) return fail(s);
  }
  CrashPoint("store.create.index");
  {
    Status s = fs->CreateDir(JoinPath(tmp, "leases"));
    if (s.ok()) s = fs->SyncDir(tmp);
    if (s.ok()) s = fs->Rename(tmp, path);
    if (!s.ok()) return fail(s);
    s = fs->SyncDir(parent);
    if (!s.ok()) return s.WithContext("create store " + path);
  }
  CrashPoint("store.create.renamed");
  return Open(path, opts);
}

Result<std::unique_ptr<Store>> Store::Open(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  OPTSTATE_ASSIGN_OR_RETURN(auto core, NewCore(path_in, opts, false));
  const std::string& path = core->path_;
  FileSystem* fs = core->fs_;
  OPTSTATE_ASSIGN_OR_RETURN(core->identity_, ReadIdentity(fs, path));
  OPTSTATE_RETURN_IF_ERROR(ResolveDataDirs(core.get()));

  // LOCK: one writer per store; the holder's pid inside for the error message.
  {
    OpenOptions oo;
    oo.create = true;
    const std::string lock_path = JoinPath(path, "LOCK");
    auto f = fs->Open(lock_path, oo);
    if (!f.ok()) return f.status().WithContext("store " + path + ": LOCK");
    if (::flock((*f)->fd(), LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e == EWOULDBLOCK) {
        auto text = fs->ReadFileToString(lock_path);
        std::string pid = text.ok() ? std::to_string(std::strtoll(text->c_str(), nullptr, 10)) : "unknown";
        return Status(StatusCode::kBusy, "store " + path + " is in use by pid " + pid, e);
      }
      return ErrnoStatus("store " + path + ": flock LOCK", e);
    }
    char pid[32];
    snprintf(pid, sizeof(pid), "%-23d\n", static_cast<int>(getpid()));
    OPTSTATE_RETURN_IF_ERROR((*f)->Pwrite(0, pid, 24).WithContext("store " + path + ": LOCK"));
    core->lock_file_ = std::move(*f);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenLeaseLock(core.get()));

  {
    const std::string index = JoinPath(path, "index");
    OPTSTATE_ASSIGN_OR_RETURN(bool has_index, fs->Exists(index));
    if (!has_index) return Corruption("store " + path + " is damaged: index/ is missing");
    rocksdb::Options o = IndexOptions(core.get());
    o.create_if_missing = false;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status rs = rocksdb::DB::Open(o, index, &raw);
    if (!rs.ok()) {
      Status s = RocksStatus("store " + path + " is damaged or unreadable: index", rs);
      if (s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound) {
        return Corruption(s.message());
      }
      return s;
    }
    core->db_.reset(raw);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/false));
  OPTSTATE_RETURN_IF_ERROR(ClaimDataFiles(core.get()));
  {
    std::lock_guard l(core->mu_);
    OPTSTATE_RETURN_IF_ERROR(core->LoadIndex());
    OPTSTATE_RETURN_IF_ERROR(CheckReferencedFiles(core.get()));
    OPTSTATE_RETURN_IF_ERROR(core->DropUncommittedTensors());
  }
  OPTSTATE_RETURN_IF_ERROR(OpenCommittedMark(core.get()));
  {
    OpenOptions oo;
    oo.create = true;
    auto f = fs->Open(JoinPath(path, "RETAINED"), oo);  // written by the GC below
    if (!f.ok()) return f.status().WithContext("store " + path + ": RETAINED");
    core->retained_file_ = std::move(*f);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/true));
  OPTSTATE_RETURN_IF_ERROR(ClaimDataFiles(core.get()));
  if (core->identity_needs_rewrite_) {
    // Data dirs inside the store directory recorded relative to it from now on.
    OPTSTATE_RETURN_IF_ERROR(fs->WriteFileAtomic(JoinPath(path, "IDENTITY"),
                                                 internal::EncodeIdentity(core->identity_, path))
                                 .WithContext("store " + path + ": rewrite of IDENTITY"));
  }
  {
    std::lock_guard l(core->mu_);
    OPTSTATE_RETURN_IF_ERROR(core->BuildFreeLists());
  }
  OPTSTATE_RETURN_IF_ERROR(core->CollectGarbage().WithContext("store " + path + ": garbage collection at open"));
  return std::unique_ptr<Store>(new StoreImpl(std::move(core)));
}

namespace {

// Read-only stores keep a RocksDB secondary instance in a directory of their
// own under /tmp (its info log; the instance holds no data). A reader killed
// by SIGKILL or a power loss leaves it behind, so each reader flocks
// <dir>.lock while it lives, and every read-only open removes the directories
// whose lock nobody holds: the kernel drops a flock when its process ends,
// however it ends, in any pid namespace. Directories of readers that predate
// the lock file are removed when their pid (the name's first number) is gone.
constexpr const char* kSecondaryRoot = "/tmp";
constexpr const char* kSecondaryPrefix = "optstate-secondary-";

int LockSecondaryBase(const std::string& base) {
  int fd = ::open((base + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return -1;  // the directory then only ages out by its pid
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Removes <root>/<base> and its reopened instances <base>-r<N>.
void RemoveSecondaryBase(const std::string& root, const std::string& base) {
  namespace sfs = std::filesystem;
  std::error_code ec;
  std::vector<sfs::path> doomed;
  for (sfs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == base || name.rfind(base + "-r", 0) == 0) doomed.push_back(it->path());
  }
  for (const auto& p : doomed) sfs::remove_all(p, ec);
}

void RemoveStaleSecondaryDirs(const std::string& root) {
  namespace sfs = std::filesystem;
  std::error_code ec;
  std::map<std::string, bool> bases;  // base -> has a lock file
  const size_t prefix = std::strlen(kSecondaryPrefix);
  for (sfs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kSecondaryPrefix, 0) != 0) continue;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".lock") == 0) {
      bases[name.substr(0, name.size() - 5)] = true;
      continue;
    }
    const auto r = name.find("-r", prefix);
    bases.emplace(r == std::string::npos ? name : name.substr(0, r), false);
  }
  for (const auto& [base, has_lock] : bases) {
    const std::string lock_path = root + "/" + base + ".lock";
    if (has_lock) {
      const int fd = ::open(lock_path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {  // its reader is gone
        RemoveSecondaryBase(root, base);
        (void)::unlink(lock_path.c_str());
      }
      ::close(fd);
      continue;
    }
    const char* digits = base.c_str() + prefix;
    char* end = nullptr;
    const long pid = std::strtol(digits, &end, 10);
    if (end == digits || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    RemoveSecondaryBase(root, base);
  }
}

}  // namespace

Result<std::unique_ptr<Store>> Store::OpenReadOnly(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  OPTSTATE_ASSIGN_OR_RETURN(auto core, NewCore(path_in, opts, true));
  const std::string& path = core->path_;
  FileSystem* fs = core->fs_;
  OPTSTATE_ASSIGN_OR_RETURN(core->identity_, ReadIdentity(fs, path));
  OPTSTATE_RETURN_IF_ERROR(ResolveDataDirs(core.get()));
  {
    OpenOptions oo;
    oo.create = true;  // a store created before leases/ existed has none yet
    auto f = fs->Open(JoinPath(core->leases_dir_, ".lock"), oo);
    if (!f.ok()) return f.status().WithContext("store " + path + ": leases/.lock");
    core->lease_lock_file_ = std::move(*f);
  }
  static std::atomic<uint64_t> counter{0};
  RemoveStaleSecondaryDirs(kSecondaryRoot);
  core->secondary_base_ = std::string(kSecondaryRoot) + "/" + kSecondaryPrefix + std::to_string(getpid()) + "-" +
                          std::to_string(counter++) + "-" + std::to_string(std::random_device{}());
  core->secondary_dir_ = core->secondary_base_;
  core->secondary_lock_fd_ = LockSecondaryBase(core->secondary_base_);
  {
    OPTSTATE_ASSIGN_OR_RETURN(bool has_index, fs->Exists(JoinPath(path, "index")));
    if (!has_index) return Corruption("store " + path + " is damaged: index/ is missing");
    OPTSTATE_ASSIGN_OR_RETURN(core->db_,
                              core->OpenSecondary(core->secondary_dir_, " is damaged or unreadable: index (secondary)"));
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/false));
  Status loaded;
  {
    std::lock_guard l(core->mu_);
    loaded = core->LoadIndexChecked(core->ReadAckedGeneration());
  }
  if (!loaded.ok()) OPTSTATE_RETURN_IF_ERROR(core->CatchUpChecked(/*reopen_first=*/true));
  std::lock_guard l(core->mu_);
  OPTSTATE_RETURN_IF_ERROR(CheckReferencedFiles(core.get()));
  core->space_.assign(core->data_files_.size(), {});  // slot counts only: no allocation here
  for (uint32_t d = 0; d < core->data_files_.size(); ++d) {
    if (!core->data_files_[d]) continue;
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, core->data_files_[d]->Size());
    core->space_[d].slots = size / core->SlotBytes();
  }
  return std::unique_ptr<Store>(new StoreImpl(std::move(core)));
}

}  // namespace optstate::vfs
