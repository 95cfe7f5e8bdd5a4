// Commit (Core, vfs/internal/store_core.h): data file syncs, the synced batch
// that publishes a generation, its COMMITTED mark, and poisoning on failure.
#include "vfs/internal/store_core.h"
#include "base/sync_point.h"

namespace optstate::vfs::internal {

Status Core::WriteSynced(rocksdb::WriteBatch* b, std::string_view what) {
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return RocksStatus("store " + path_ + ": " + std::string(what), db_->Write(wo, b));
}

void Core::Poison(const Status& why) {  // mu_ held
                  if (!poisoned_) {
    poisoned_ = true;
    poison_reason_ = why.ToString();
    OPTSTATE_LOG_ERROR("store {} poisoned until reopen: {}", path_, poison_reason_);
  }
}

Status Core::SyncData() {
  std::vector<std::pair<uint32_t, File*>> files;
  {
    MutexLock l(&mu_);
    OPTSTATE_RETURN_IF_ERROR(CheckWritable("data sync"));
    for (uint32_t d = 0; d < data_files_.size(); ++d) {
      if (dirty_[d] || grown_[d]) files.emplace_back(d, data_files_[d].get());
    }
  }
  for (const auto& [d, f] : files) {
    Status s = f->Fdatasync();
    if (!s.ok()) {
      Status e(StatusCode::kDataLoss, "store " + path_ + ": sync of " + FileName(d) + " failed: " + s.ToString(),
               s.err());
      MutexLock l(&mu_);
      Poison(e);
      return e;
    }
  }
  return Status();
}

Result<uint64_t> Core::Commit(const CommitInfo& info, const std::vector<uint32_t>& drop) {
  return CommitGeneration(info, nullptr, drop);
}

Result<uint64_t> Core::Commit(const CommitInfo& info, const RevertSpec* revert) {
  return CommitGeneration(info, revert, {});
}

Result<uint64_t> Core::CommitGeneration(const CommitInfo& info, const RevertSpec* revert,
                                        const std::vector<uint32_t>& drop) {
  MutexLock ll(&lease_lock_mu_);
  OPTSTATE_ASSIGN_OR_RETURN(auto lease_guard, LockLeases(LOCK_EX));
  OPTSTATE_ASSIGN_OR_RETURN(auto leased, LeasedGenerations());
  MutexLock l(&mu_);
  OPTSTATE_RETURN_IF_ERROR(CheckWritable("commit"));
  if (writes_in_flight_ > 0) {
    return FailedPrecondition("store " + path_ + ": commit with " + std::to_string(writes_in_flight_) +
                              " chunk writes in flight; reap them first");
  }
  const uint64_t gen = latest_.generation + 1;
  if (revert != nullptr) {
    // Every chunk whose newest version is not revert_to's takes revert_to's
    // extent (shared: ReleaseExtent frees it once no version references it).
    // A chunk revert_to never wrote was written as zeros (pending) by the caller.
    for (const auto& [key, vs] : versions_) {
      if (pending_.count(key) || !tensors_.count(key.t)) continue;  // dropped tensors' versions stay until GC
      const std::optional<Version> want = AtGeneration(key, revert->revert_to);
      if (!want) {
        auto t = tensors_.find(key.t);
        return FailedPrecondition(Describe(t == tensors_.end() ? nullptr : &t->second, key, revert->revert_to) +
                                  ": never written in the generation to revert to, and no zeros pending for it");
      }
      if (want->gen == vs.front().gen) continue;
      pending_[key] = want->ext;
      ++shared_extents_[{want->ext.dir, want->ext.file_offset}];
    }
  }
  // Per-tensor counts: only tensors of this generation, and only those that
  // differ from their group's count are recorded (the record stays small).
  std::map<uint32_t, uint64_t> tensor_steps;
  std::vector<TensorInfo> dropping;
  for (uint32_t id : drop) {
    auto t = tensors_.find(id);
    if (t == tensors_.end() || t->second.created_generation > latest_.generation) {
      return InvalidArgument("store " + path_ + ": commit of generation " + std::to_string(gen) +
                             ": drop of tensor id " + std::to_string(id) + ", which the latest generation does not hold");
    }
    if (!pending_.empty()) {
      return FailedPrecondition("store " + path_ + ": commit of generation " + std::to_string(gen) +
                                " drops tensor '" + t->second.name + "' while chunk writes are pending");
    }
    dropping.push_back(t->second);
    dropping.back().dropped_generation = gen;
  }
  for (const auto& [id, n] : info.tensor_steps) {
    auto t = tensors_.find(id);
    if (t == tensors_.end() || std::find(drop.begin(), drop.end(), id) != drop.end()) {
      return InvalidArgument("store " + path_ + ": commit of generation " + std::to_string(gen) +
                             ": step count " + std::to_string(n) + " given for tensor id " + std::to_string(id) +
                             ", which the store does not hold");
    }
    uint64_t group_count = 0;
    for (const GroupInfo& gr : info.groups) {
      if (gr.id == t->second.group) group_count = gr.step_count;
    }
    if (n != group_count) tensor_steps[id] = n;
  }
  OPTSTATE_TEST_SYNC_POINT("commit.before_sync");
  for (uint32_t d = 0; d < data_files_.size(); ++d) {
    if (!dirty_[d] && !grown_[d]) continue;
    Status s = grown_[d] ? data_files_[d]->Fsync() : data_files_[d]->Fdatasync();
    if (!s.ok()) {
      Status e(StatusCode::kDataLoss,
               "store " + path_ + ": commit of generation " + std::to_string(gen) + ": sync of " +
                   FileName(d) + " failed: " + s.ToString(),
               s.err());
      Poison(e);
      return e;
    }
    dirty_[d] = grown_[d] = false;
  }
  GenerationInfo g;
  g.generation = gen;
  g.step = info.step;
  g.groups = info.groups;
  g.tensor_steps = std::move(tensor_steps);
  g.commit_time_unix_ms = NowUnixMs();
  g.index_digest = CommitDigest(gen, drop);
  rocksdb::WriteBatch b;
  // Format 2: the chunk versions go in pack records (pack p holds the p-th
  // run of kPackVersions versions in key order; see store_format.h).
  const bool packed = identity_.format_version >= 2;
  auto pack_of = [](size_t i) { return static_cast<uint32_t>(1 + i / internal::kPackVersions); };
  if (packed) {
    std::vector<internal::PackedVersion> pack;
    size_t i = 0;
    for (const auto& [key, ext] : pending_) {
      pack.push_back(internal::PackedVersion{key.t, key.f, key.c, ext});
      if (++i % internal::kPackVersions == 0 || i == pending_.size()) {
        b.Put(internal::PackKey(gen, pack_of(i - 1)), internal::EncodePack(pack));
        pack.clear();
      }
    }
  } else {
    for (const auto& [key, ext] : pending_) {
      b.Put(internal::ChunkKey(key.t, key.f, key.c, gen), internal::EncodeExtent(ext));
    }
  }
  b.Put(internal::GenerationKey(gen), internal::EncodeGeneration(g));
  b.Put(internal::kLatestKey, internal::EncodeU64(gen));
  b.Put(internal::kLifetimeKey, internal::EncodeU64(lifetime_bytes_));
  // A revert keeps the head it replaces as a snapshot, published with it.
  std::optional<SnapshotInfo> kept;
  if (revert != nullptr && !revert->keep_head_as.empty()) {
    kept = SnapshotInfo{revert->keep_head_as, latest_.generation, g.commit_time_unix_ms};
    b.Put(internal::SnapshotKey(kept->name), internal::EncodeSnapshot(*kept));
    snapshots_[kept->name] = *kept;  // so PlanGc keeps the head (removed below on failure)
  }
  for (const TensorInfo& t : dropping) {
    b.Delete(internal::TensorKey(t.name));
    b.Put(internal::DroppedKey(t.id), internal::EncodeTensor(t));
  }
  // So PlanGc sees the new record, the kept head and the drops (undone below
  // until the batch is durable).
  generations_[gen] = g;
  for (const TensorInfo& t : dropping) dropped_[t.id] = t;
  GcPlan plan = PlanGc(gen, /*publish=*/true, leased);
  generations_.erase(gen);
  if (kept) snapshots_.erase(kept->name);
  for (const TensorInfo& t : dropping) dropped_.erase(t.id);
  OPTSTATE_RETURN_IF_ERROR(
      WriteRetained(GenerationNumbers(gen)).WithContext("commit of generation " + std::to_string(gen)));
  AddGcToBatch(plan, &b);
  OPTSTATE_TEST_SYNC_POINT("commit.before_batch");
  Status s = WriteSynced(&b, "commit of generation " + std::to_string(gen));
  if (!s.ok()) {
    // The batch may or may not be in the WAL: nothing in memory can be
    // trusted to match the index any more.
    Poison(s);
    return Status(StatusCode::kDataLoss, s.message() + " (store poisoned until reopen)", s.err());
  }
  if (Status w = WriteCommittedMark(gen); !w.ok()) {
    // The generation is in the index (a reopen may show it) but is not
    // acknowledged: keep the previous one in memory, refuse more commits.
    Status e(StatusCode::kDataLoss,
             "store " + path_ + ": generation " + std::to_string(gen) +
                 " is in the index but its COMMITTED mark could not be made durable: " + w.ToString() +
                 " (store poisoned until reopen)",
             w.err());
    Poison(e);
    return e;
  }
  size_t i = 0;
  for (const auto& [key, ext] : pending_) {
    auto& vs = versions_[key];
    const uint32_t pack = packed ? pack_of(i++) : 0;
    vs.insert(vs.begin(), Version{gen, ext, pack});
    if (packed) packs_[{gen, pack}].push_back(key);
  }
  pending_.clear();
  for (const TensorInfo& t : dropping) {
    names_.erase(t.name);
    tensors_.erase(t.id);
    dropped_[t.id] = t;
  }
  generations_[gen] = g;
  if (kept) snapshots_[kept->name] = *kept;
  latest_ = g;
  ApplyGc(plan);
  RewriteRetainedAfterBatch();
  OPTSTATE_TEST_SYNC_POINT("commit.after_batch");
  return gen;
}

}  // namespace optstate::vfs::internal
