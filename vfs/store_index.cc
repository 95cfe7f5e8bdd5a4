// The store's index in memory (Core, vfs/internal/store_core.h): loading the
// maps from RocksDB, and the generation digests that let a reader check its copy.
#include "vfs/internal/store_core.h"

namespace optstate::vfs::internal {
namespace {

// GenerationInfo::index_digest is a wrapping sum of one XXH3 per tensor the
// generation sees and one per chunk version it sees, so the writer (its maps
// plus the pending versions) and a reader (its own index) need not walk them
// in the same order.
uint64_t TensorDigest(const TensorInfo& t) {
  const uint64_t a[4] = {t.id, t.numel, t.fields.size(), t.created_generation};
  return ChunkChecksum(a, sizeof(a));
}
uint64_t VersionDigest(const Key& k, const Version& v) {
  const uint64_t a[8] = {k.t, k.f, k.c, v.gen, v.ext.dir, v.ext.file_offset, v.ext.length, v.ext.checksum};
  return ChunkChecksum(a, sizeof(a));
}

}  // namespace

Status Core::LoadIndex() {
  tensors_.clear();
  names_.clear();
  dropped_.clear();
  generations_.clear();
  snapshots_.clear();
  versions_.clear();
  packs_.clear();
  rocksdb::ReadOptions ro;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
  bool have_latest = false, have_identity = false, any_packs = false;
  uint64_t latest = 0;
  const std::string where = "store " + path_ + ": index";
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string_view k(it->key().data(), it->key().size());
    const std::string_view v(it->value().data(), it->value().size());
    if (k.starts_with(internal::kChunkPrefix)) {
      OPTSTATE_ASSIGN_OR_RETURN(auto parts, internal::ParseChunkKey(k));
      OPTSTATE_ASSIGN_OR_RETURN(auto ext, internal::DecodeExtent(v));
      // Keys sort newest first within a chunk.
      versions_[Key{parts.tensor, parts.field, parts.chunk}].push_back(Version{parts.gen, ext});
    } else if (k.starts_with(internal::kPackPrefix)) {
      auto parts = internal::ParsePackKey(k);
      if (!parts.ok()) return parts.status().WithContext(where);
      const std::string what = where + " generation " + std::to_string(parts->gen) + " pack " +
                               std::to_string(parts->pack);
      OPTSTATE_ASSIGN_OR_RETURN(auto packed, internal::DecodePack(v, what));
      auto& members = packs_[{parts->gen, parts->pack}];
      for (const auto& p : packed) {
        const Key key{p.tensor, p.field, p.chunk};
        versions_[key].push_back(Version{parts->gen, p.ext, parts->pack});
        members.push_back(key);
      }
      any_packs = true;
    } else if (k.starts_with(internal::kTensorPrefix)) {
      auto t = internal::DecodeTensor(v);
      if (!t.ok()) return t.status().WithContext(where);
      names_[t->name] = t->id;
      tensors_[t->id] = std::move(*t);
    } else if (k.starts_with(internal::kDroppedPrefix)) {
      auto t = internal::DecodeTensor(v);
      if (!t.ok()) return t.status().WithContext(where + " (dropped tensor)");
      dropped_[t->id] = std::move(*t);
    } else if (k.starts_with(internal::kGenerationPrefix)) {
      auto g = internal::DecodeGeneration(v);
      if (!g.ok()) return g.status().WithContext(where);
      generations_[g->generation] = std::move(*g);
    } else if (k.starts_with(internal::kSnapshotPrefix)) {
      auto s = internal::DecodeSnapshot(k.substr(internal::kSnapshotPrefix.size()), v);
      if (!s.ok()) return s.status().WithContext(where);
      snapshots_[s->name] = std::move(*s);
    } else if (k == internal::kLatestKey) {
      OPTSTATE_ASSIGN_OR_RETURN(latest, internal::DecodeU64(v, where + " latest"));
      have_latest = true;
    } else if (k == internal::kNextTensorIdKey) {
      OPTSTATE_ASSIGN_OR_RETURN(uint64_t n, internal::DecodeU64(v, where + " next tensor id"));
      next_tensor_id_ = static_cast<uint32_t>(n);
    } else if (k == internal::kLifetimeKey) {
      OPTSTATE_ASSIGN_OR_RETURN(lifetime_bytes_, internal::DecodeU64(v, where + " lifetime"));
    } else if (k == internal::kIdentityKey) {
      auto id = internal::DecodeIdentity(v, where + " identity");
      if (!id.ok()) return id.status();
      if (id->uuid != identity_.uuid) {
        return Corruption(where + " belongs to store uuid " + id->uuid + " but IDENTITY says " +
                          identity_.uuid);
      }
      have_identity = true;
    }
  }
  OPTSTATE_RETURN_IF_ERROR(RocksStatus(where + " scan", it->status()));
  if (!have_latest || !have_identity) {
    return Corruption(where + " lacks its identity or latest-generation record");
  }
  auto g = generations_.find(latest);
  if (g == generations_.end()) {
    return Corruption(where + ": latest generation " + std::to_string(latest) + " has no record");
  }
  latest_ = g->second;
  // Versions newer than latest cannot exist (published with latest in one
  // batch); a secondary instance might see them mid-catch-up: drop them.
  for (auto& [key, vs] : versions_) {
    std::erase_if(vs, [&](const Version& v) { return v.gen > latest; });
    // Pack records sort by generation, oldest first: newest first here too.
    if (any_packs) std::sort(vs.begin(), vs.end(), [](const Version& a, const Version& b) { return a.gen > b.gen; });
  }
  std::erase_if(packs_, [&](const auto& kv) { return kv.first.first > latest; });
  std::erase_if(versions_, [](const auto& kv) { return kv.second.empty(); });
  return Status();
}

const TensorInfo* Core::AnyTensor(uint32_t id) const {
  if (auto t = tensors_.find(id); t != tensors_.end()) return &t->second;
  if (auto t = dropped_.find(id); t != dropped_.end()) return &t->second;
  return nullptr;
}

const TensorInfo* Core::TensorAt(uint32_t id, uint64_t g) const {
  const TensorInfo* t = AnyTensor(id);
  if (t == nullptr || t->created_generation > g) return nullptr;
  if (t->dropped_generation != 0 && t->dropped_generation <= g) return nullptr;
  return t;
}

uint64_t Core::IndexDigest(uint64_t g) const {
  uint64_t d = 0;
  for (const auto* m : {&tensors_, &dropped_}) {
    for (const auto& [id, t] : *m) {
      if (TensorAt(id, g)) d += TensorDigest(t);
    }
  }
  for (const auto& [key, vs] : versions_) {
    if (!TensorAt(key.t, g)) continue;
    for (const auto& v : vs) {
      if (v.gen <= g) {
        d += VersionDigest(key, v);
        break;
      }
    }
  }
  return d;
}

uint64_t Core::CommitDigest(uint64_t gen, const std::vector<uint32_t>& drop) const {
  auto held = [&](uint32_t id) REQUIRES(mu_) {
    return tensors_.count(id) && std::find(drop.begin(), drop.end(), id) == drop.end();
  };
  uint64_t d = 0;
  for (const auto& [id, t] : tensors_) {
    if (held(id)) d += TensorDigest(t);
  }
  for (const auto& [key, vs] : versions_) {
    // Versions of dropped tensors stay for the older generations that hold them.
    if (!vs.empty() && !pending_.count(key) && held(key.t)) d += VersionDigest(key, vs.front());
  }
  for (const auto& [key, ext] : pending_) d += VersionDigest(key, Version{gen, ext});
  return d;
}

Status Core::CheckIndexOf(uint64_t g) const {
  auto it = generations_.find(g);
  if (it == generations_.end() || it->second.index_digest == 0) return Status();
  const uint64_t d = IndexDigest(g);
  if (d == it->second.index_digest) return Status();
  char m[96];
  snprintf(m, sizeof(m), " as it was committed (index digest %016llx, recorded %016llx)",
           static_cast<unsigned long long>(d), static_cast<unsigned long long>(it->second.index_digest));
  return Busy("store " + path_ + ": this reader's copy of the index does not show generation " +
              std::to_string(g) + m + ": the RocksDB secondary instance lags the writer");
}

Status Core::DropUncommittedTensors() {
  rocksdb::WriteBatch b;
  std::vector<uint32_t> ids;
  for (const auto& [id, t] : tensors_) {
    if (t.created_generation > latest_.generation) {
      b.Delete(internal::TensorKey(t.name));
      ids.push_back(id);
    }
  }
  if (ids.empty()) return Status();
  // Not synced: an entry that survives a crash is dropped again at Open.
  OPTSTATE_RETURN_IF_ERROR(RocksStatus("store " + path_ + ": drop uncommitted tensors",
                                       db_->Write(rocksdb::WriteOptions(), &b)));
  for (uint32_t id : ids) {
    names_.erase(tensors_.at(id).name);
    tensors_.erase(id);
  }
  return Status();
}

}  // namespace optstate::vfs::internal
