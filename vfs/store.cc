// Store (vfs/store.h): the small public helpers and StoreImpl, the Store
// over a Core (vfs/internal/store_core.h). The store's other ideas live in
// files of their own:
//   store_open.cc        Create, Open, OpenReadOnly: the steps in order
//   store_data_files.cc  data dirs, data files and the writer's claim on them
//   store_index.cc       the in-memory maps loaded from the index; digests
//   store_secondary.cc   read-only stores: secondary instance and catch-up
//   store_space.cc       slots, pieces and free lists of the data files
//   store_commit.cc      commit and data sync
//   store_gc.cc          garbage collection
//   store_marks.cc       COMMITTED and RETAINED
//   store_leases.cc      reader leases, and leasing a generation's view
//   generation_view.cc   GenerationView
//   chunk_io.cc          ChunkIo and the synchronous chunk read
//   store_verify.cc      Verify
#include "vfs/store.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include "vfs/internal/chunk_io.h"
#include "vfs/io_buffer.h"
#include "vfs/internal/generation_view.h"
#include "vfs/internal/rocks_util.h"
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_open.h"
#include "vfs/internal/store_format.h"
#include "vfs/reshard.h"
#include "base/sync_point.h"

namespace optstate::vfs {

// ---------------------------------------------------------------------------
// Small public helpers declared in store.h.

std::string Q8ScalesField(std::string_view codes) { return std::string(codes) + ".absmax"; }

uint64_t TensorStepCount(const GenerationInfo& g, const TensorInfo& t) {
  if (auto it = g.tensor_steps.find(t.id); it != g.tensor_steps.end()) return it->second;
  for (const GroupInfo& gr : g.groups) {
    if (gr.id == t.group) return gr.step_count;
  }
  return 0;
}

std::vector<FieldSpec> AdamFields() {
  return {{"main", DType::kF32}, {"exp_avg", DType::kF32}, {"exp_avg_sq", DType::kF32}};
}

std::vector<FieldSpec> AdamQ8Fields(uint64_t numel, uint64_t chunk_size_bytes) {
  const uint64_t blocks = Q8Blocks(numel);
  const uint64_t scale_chunk = chunk_size_bytes / (kQ8BlockElems / sizeof(float));
  return {{"main", DType::kF32},
          {"exp_avg", DType::kQ8S},
          {"exp_avg_sq", DType::kQ8U},
          {Q8ScalesField("exp_avg"), DType::kF32, blocks, scale_chunk},
          {Q8ScalesField("exp_avg_sq"), DType::kF32, blocks, scale_chunk}};
}

uint64_t TensorSpec::field_numel(uint32_t field) const {
  if (field >= fields.size()) return 0;
  return fields[field].numel != 0 ? fields[field].numel : numel;
}

uint64_t TensorSpec::field_bytes(uint32_t field) const {
  if (field >= fields.size()) return 0;
  return field_numel(field) * DTypeSize(fields[field].dtype);
}

uint64_t TensorSpec::field_chunk_bytes(uint32_t field, uint64_t store_chunk_bytes) const {
  if (field >= fields.size()) return 0;
  return fields[field].chunk_bytes != 0 ? fields[field].chunk_bytes : store_chunk_bytes;
}

uint64_t TensorSpec::field_chunk_count(uint32_t field, uint64_t store_chunk_bytes) const {
  const uint64_t cb = field_chunk_bytes(field, store_chunk_bytes);
  return cb == 0 ? 0 : (field_bytes(field) + cb - 1) / cb;
}

int TensorSpec::FieldIndexOf(std::string_view name) const {
  for (size_t i = 0; i < fields.size(); ++i) {
    if (fields[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

Status ValidateFields(const TensorSpec& spec, uint64_t chunk_size_bytes, std::string_view where) {
  const std::string prefix = std::string(where) + ": tensor '" + spec.name + "' field '";
  std::set<std::string> seen;
  for (uint32_t i = 0; i < spec.fields.size(); ++i) {
    const FieldSpec& f = spec.fields[i];
    if (f.name.empty() || f.name.find('\0') != std::string::npos || f.name.find('/') != std::string::npos ||
        !seen.insert(f.name).second) {
      return InvalidArgument(std::string(where) + ": tensor '" + spec.name + "': invalid or duplicate field name '" +
                             f.name + "'");
    }
    if (f.chunk_bytes != 0 && (f.chunk_bytes % 4096 != 0 || f.chunk_bytes > chunk_size_bytes)) {
      return InvalidArgument(prefix + f.name + "': chunk_bytes " + std::to_string(f.chunk_bytes) +
                             " is not a multiple of 4096 of at most the chunk size (" +
                             std::to_string(chunk_size_bytes) + " bytes)");
    }
  }
  for (uint32_t i = 0; i < spec.fields.size(); ++i) {
    const FieldSpec& f = spec.fields[i];
    if (!IsQ8(f.dtype)) continue;
    const std::string scales = Q8ScalesField(f.name);
    const int s = spec.FieldIndexOf(scales);
    if (s < 0) {
      return InvalidArgument(prefix + f.name + "' (dtype " + DTypeName(f.dtype) + "): its scales field '" + scales +
                             "' is missing");
    }
    const FieldSpec& sf = spec.fields[static_cast<uint32_t>(s)];
    const uint64_t blocks = Q8Blocks(spec.field_numel(i));
    const uint64_t want_chunk = spec.field_chunk_bytes(i, chunk_size_bytes) / (kQ8BlockElems / sizeof(float));
    if (sf.dtype != DType::kF32) {
      return InvalidArgument(prefix + scales + "': dtype " + DTypeName(sf.dtype) + ", the scales of '" + f.name +
                             "' must be f32");
    }
    if (spec.field_numel(static_cast<uint32_t>(s)) != blocks) {
      return InvalidArgument(prefix + scales + "': " + std::to_string(spec.field_numel(static_cast<uint32_t>(s))) +
                             " elements, the scales of '" + f.name + "' (" + std::to_string(spec.field_numel(i)) +
                             " elements) must have " + std::to_string(blocks) + " (one per 256)");
    }
    if (spec.field_chunk_bytes(static_cast<uint32_t>(s), chunk_size_bytes) != want_chunk) {
      return InvalidArgument(prefix + scales + "': chunks of " +
                             std::to_string(spec.field_chunk_bytes(static_cast<uint32_t>(s), chunk_size_bytes)) +
                             " bytes, the scales of '" + f.name + "' must be in chunks of " +
                             std::to_string(want_chunk) + " bytes (1/64 of its chunk)");
    }
  }
  return Status();
}

namespace {

using internal::ClosestNames;
using internal::Core;
using internal::Extent;
using internal::Key;
using internal::kInfinity;
using internal::kIoAlign;
using internal::MakeChunkIo;
using internal::NowUnixMs;
using internal::OpenGenerationView;
using internal::ReadVersion;
using internal::RocksStatus;
using internal::RoundUp;
using internal::Version;
using internal::VerifyStore;

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

}  // namespace

namespace internal {

// A friend of Core (store_core.h): the Store API works on the catalog.
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
    if (Status st = CheckShardGeometry(t.numel, t.shape, t.global_shape, t.shard_offset); !st.ok()) {
      return st.WithContext("store " + core_->path_ + ": tensor '" + spec.name + "'");
    }
    MutexLock l(&core_->mu_);
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
    MutexLock l(&core_->mu_);
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

  std::optional<TensorInfo> LookupTensor(std::string_view name) const override {
    MutexLock l(&core_->mu_);
    auto it = core_->names_.find(name);
    if (it != core_->names_.end() && Visible(core_->tensors_.at(it->second))) return core_->tensors_.at(it->second);
    return std::nullopt;
  }

  std::vector<TensorInfo> ListTensors() const override {
    MutexLock l(&core_->mu_);
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
      MutexLock l(&core_->mu_);
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
      MutexLock l(&core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("chunk write"));
      OPTSTATE_ASSIGN_OR_RETURN(auto res, core_->Resolve(core_->tensors_, ref));
      t = *res.first;
      auto e = core_->AllocateSlot(res.second);
      if (!e.ok()) return e.status().WithContext("write of " + core_->Describe(&t, k, kInfinity));
      ext = *e;
      ++core_->writes_in_flight_;
    }
    ext.checksum = ChunkChecksum(buf, ext.length);
    OPTSTATE_TEST_SYNC_POINT("extent.before_write");
    Status s = core_->data_files_[ext.dir]->Pwrite(ext.file_offset, buf, RoundUp(ext.length, kIoAlign));
    MutexLock l(&core_->mu_);
    --core_->writes_in_flight_;
    if (!s.ok()) {
      core_->FreeSlot(ext);
      return s.WithContext("write of " + core_->Describe(&t, k, kInfinity));
    }
    core_->SetPending(k, ext);
    OPTSTATE_TEST_SYNC_POINT("extent.after_write");
    return Status();
  }

  Result<uint64_t> Commit(const CommitInfo& info) override {
    if (core_->read_only_) return core_->CheckNotReadOnly("commit");
    return core_->Commit(info);
  }

  Result<uint64_t> DropTensors(const std::vector<std::string>& names) override {
    if (core_->read_only_) return core_->CheckNotReadOnly("drop tensors");
    CommitInfo info;
    std::vector<uint32_t> ids;
    {
      MutexLock l(&core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("drop tensors"));
      if (names.empty()) return InvalidArgument("store " + core_->path_ + ": drop of no tensors");
      for (const auto& [id, t] : core_->tensors_) {
        if (t.created_generation > core_->latest_.generation) {
          return FailedPrecondition("store " + core_->path_ + ": drop tensors refused while tensor '" + t.name +
                                    "' is registered but not committed; commit or abort the pending generation first");
        }
      }
      if (!core_->pending_.empty() || core_->writes_in_flight_ > 0) {
        return FailedPrecondition("store " + core_->path_ +
                                  ": drop tensors refused while chunk writes are pending; commit or abort them first");
      }
      std::set<std::string_view> seen;
      for (const std::string& n : names) {
        if (!seen.insert(n).second) {
          return InvalidArgument("store " + core_->path_ + ": tensor '" + n + "' named twice in one drop");
        }
        auto it = core_->names_.find(n);
        if (it == core_->names_.end()) {
          std::vector<std::string> all;
          for (const auto& [name, id] : core_->names_) all.push_back(name);
          return NotFound("store " + core_->path_ + ": drop of tensor '" + n + "', which the latest generation " +
                          std::to_string(core_->latest_.generation) + " does not hold" +
                          ClosestNames(n, all.begin(), all.end()));
        }
        ids.push_back(it->second);
      }
      info.step = core_->latest_.step;
      info.groups = core_->latest_.groups;
      for (const auto& [id, t] : core_->tensors_) {
        if (std::find(ids.begin(), ids.end(), id) == ids.end()) {
          info.tensor_steps[id] = TensorStepCount(core_->latest_, t);
        }
      }
    }
    // Commit checks again under its own locks (a concurrent write between the
    // two is refused there).
    return core_->Commit(info, ids);
  }

  Status SyncData() override {
    if (core_->read_only_) return core_->CheckNotReadOnly("data sync");
    return core_->SyncData();
  }

  Status AbortPending() override {
    MutexLock l(&core_->mu_);
    OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("abort pending"));
    if (core_->writes_in_flight_ > 0) {
      return FailedPrecondition("store " + core_->path_ + ": abort with chunk writes in flight");
    }
    for (const auto& [k, e] : core_->pending_) core_->ReleaseExtent(e);
    core_->pending_.clear();
    return core_->DropUncommittedTensors();
  }

  GenerationInfo LatestGeneration() const override {
    MutexLock l(&core_->mu_);
    return core_->latest_;
  }

  std::vector<GenerationInfo> ListGenerations() const override {
    MutexLock l(&core_->mu_);
    std::vector<GenerationInfo> out;
    for (const auto& [g, info] : core_->generations_) out.push_back(info);
    return out;
  }

  Result<std::unique_ptr<GenerationView>> OpenGeneration(uint64_t generation) override {
    return OpenGenerationView(core_, generation, "");
  }

  Result<std::unique_ptr<GenerationView>> OpenSnapshot(std::string_view name) override {
    return OpenGenerationView(core_, 0, std::string(name));
  }

  Result<SnapshotInfo> CreateSnapshot(const std::string& name) override {
    OPTSTATE_RETURN_IF_ERROR(ValidateSnapshotName(name));
    MutexLock l(&core_->mu_);
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
    OPTSTATE_TEST_SYNC_POINT("snapshot.create");
    OPTSTATE_RETURN_IF_ERROR(core_->WriteSynced(&b, "create snapshot '" + name + "'"));
    core_->snapshots_[name] = s;
    return s;
  }

  Result<RevertResult> RevertToSnapshot(const std::string& name) override {
    const std::string what = "store " + core_->path_ + ": revert to snapshot '" + name + "'";
    GenerationInfo target, head;
    std::vector<ChunkRef> zeros;
    {
      MutexLock l(&core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("revert to snapshot '" + name + "'"));
      auto snap = core_->snapshots_.find(name);
      if (snap == core_->snapshots_.end()) return core_->SnapshotNotFound(name);
      head = core_->latest_;
      if (!core_->pending_.empty() || core_->writes_in_flight_ > 0) {
        return FailedPrecondition(what + ": the store has uncommitted writes (" +
                                  std::to_string(core_->pending_.size()) + " chunks written, " +
                                  std::to_string(core_->writes_in_flight_) +
                                  " in flight); commit or abort them first");
      }
      const uint64_t s = snap->second.generation;
      if (s == head.generation) return RevertResult{head.generation, ""};
      auto g = core_->generations_.find(s);
      if (g == core_->generations_.end()) {
        return Corruption(what + ": its generation " + std::to_string(s) + " has no record in the index");
      }
      target = g->second;
      std::vector<std::string> newer;
      for (const auto& [id, t] : core_->tensors_) {
        if (t.created_generation > s) newer.push_back("'" + t.name + "'");
      }
      if (!newer.empty()) {
        std::string names;
        for (size_t i = 0; i < newer.size() && i < 8; ++i) names += (i ? ", " : "") + newer[i];
        if (newer.size() > 8) names += ", ... " + std::to_string(newer.size()) + " in all";
        return FailedPrecondition(what + " (generation " + std::to_string(s) + "): the store holds tensors created "
                                  "after it (" + names + "), which a revert would drop; restore a checkpoint of "
                                  "the snapshot into a new store instead");
      }
      std::vector<std::string> dropped;
      for (const auto& [id, t] : core_->dropped_) {
        if (t.created_generation <= s && t.dropped_generation > s) dropped.push_back("'" + t.name + "'");
      }
      if (!dropped.empty()) {
        std::string names;
        for (size_t i = 0; i < dropped.size() && i < 8; ++i) names += (i ? ", " : "") + dropped[i];
        if (dropped.size() > 8) names += ", ... " + std::to_string(dropped.size()) + " in all";
        return FailedPrecondition(what + " (generation " + std::to_string(s) + "): it holds tensors dropped since (" +
                                  names + "), which the head no longer has; restore a checkpoint of the snapshot "
                                  "(optstate-restore --force) instead");
      }
      for (const auto& [key, vs] : core_->versions_) {
        if (!core_->tensors_.count(key.t)) continue;  // a dropped tensor's versions, kept until GC
        if (!core_->VersionAt(key, s)) zeros.push_back(ChunkRef{key.t, key.f, key.c});
      }
    }
    if (!zeros.empty()) {
      IoBuffer buf(chunk_size_bytes());
      if (!buf.ok()) return ResourceExhausted(what + ": out of memory for a chunk buffer");
      std::memset(buf.as<char>(), 0, chunk_size_bytes());
      for (const ChunkRef& ref : zeros) {
        Status st = WriteChunk(ref, buf.as<char>());
        if (!st.ok()) {
          (void)AbortPending();
          return st.WithContext(what);
        }
      }
    }
    const int64_t ms = NowUnixMs();
    std::string keep = "pre-revert-" + std::to_string(head.generation) + "-" + std::to_string(ms);
    {
      MutexLock l(&core_->mu_);
      for (int n = 2; core_->snapshots_.count(keep); ++n) {
        keep = "pre-revert-" + std::to_string(head.generation) + "-" + std::to_string(ms) + "-" + std::to_string(n);
      }
    }
    CommitInfo ci;
    ci.step = target.step;
    ci.groups = target.groups;
    ci.tensor_steps = target.tensor_steps;
    internal::Core::RevertSpec spec{target.generation, keep};
    OPTSTATE_TEST_SYNC_POINT("revert.before_commit");
    auto gen = core_->Commit(ci, &spec);
    if (!gen.ok()) {
      Status ab = AbortPending();
      if (!ab.ok()) OPTSTATE_LOG_ERROR("{}: AbortPending after a failed revert: {}", what, ab.ToString());
      return gen.status().WithContext(what);
    }
    OPTSTATE_LOG_INFO("{}: generation {} (step {}) is the head again as generation {}; the generation {} it "
                      "replaced is kept as snapshot {}", what, target.generation, target.step, *gen, head.generation,
                      keep);
    return RevertResult{*gen, keep};
  }

  Status ReleaseSnapshot(const std::string& name) override {
    {
      MutexLock l(&core_->mu_);
      OPTSTATE_RETURN_IF_ERROR(core_->CheckWritable("release snapshot '" + name + "'"));
      if (!core_->snapshots_.count(name)) return core_->SnapshotNotFound(name);
      rocksdb::WriteBatch b;
      b.Delete(internal::SnapshotKey(name));
      OPTSTATE_TEST_SYNC_POINT("snapshot.release");
      OPTSTATE_RETURN_IF_ERROR(core_->WriteSynced(&b, "release snapshot '" + name + "'"));
      core_->snapshots_.erase(name);
    }
    return core_->CollectGarbage();
  }

  std::vector<SnapshotInfo> ListSnapshots() const override {
    MutexLock l(&core_->mu_);
    std::vector<SnapshotInfo> out;
    for (const auto& [n, s] : core_->snapshots_) out.push_back(s);
    return out;
  }

  Status CollectGarbage() override {
    if (core_->read_only_) return core_->CheckNotReadOnly("garbage collection");
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
    MutexLock l(&core_->mu_);
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

  Result<VerifyReport> Verify() override { return VerifyStore(core_); }

 private:
  bool Visible(const TensorInfo& t) const REQUIRES(core_->mu_) {
    return !core_->read_only_ || t.created_generation <= core_->latest_.generation;
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
    OPTSTATE_RETURN_IF_ERROR(ValidateFields(spec, core_->chunk(), "store " + core_->path_));
    return Status();
  }

  std::shared_ptr<Core> core_;
};

std::unique_ptr<Store> NewStore(std::shared_ptr<Core> core) { return std::make_unique<StoreImpl>(std::move(core)); }

}  // namespace internal
}  // namespace optstate::vfs
