// Garbage collection (Core, vfs/internal/store_core.h): which chunk versions and
// generation records no retained, snapshotted, viewed or leased generation can
// see, and their removal in one synced batch.
#include "vfs/internal/store_core.h"
#include "base/sync_point.h"

namespace optstate::vfs::internal {

Core::GcPlan Core::PlanGc(uint64_t new_gen, bool publish, const std::vector<uint64_t>& leased) const {
  std::set<uint64_t> retained;
  const uint64_t k = std::max<uint32_t>(1, opts_.retained_generations);
  for (uint64_t g = new_gen + 1 > k ? new_gen + 1 - k : 0; g <= new_gen; ++g) retained.insert(g);
  for (const auto& [name, s] : snapshots_) retained.insert(s.generation);
  for (const auto& [g, n] : view_refs_) {
    if (n > 0) retained.insert(g);
  }
  for (uint64_t g : leased) retained.insert(g);
  GcPlan plan;
  for (const auto& [key, vs] : versions_) {
    uint64_t superseded = publish && pending_.count(key) ? new_gen : kInfinity;
    // A dropped tensor's versions end where the tensor does.
    if (auto d = dropped_.find(key.t); d != dropped_.end()) {
      superseded = std::min(superseded, d->second.dropped_generation);
    }
    for (const auto& v : vs) {
      auto r = retained.lower_bound(v.gen);
      if (r == retained.end() || *r >= superseded) {
        if (v.pack == 0) {
          plan.dead_versions.emplace_back(key, v.gen);
        } else {
          plan.dead_in_packs[{v.gen, v.pack}].push_back(key);  // in key order: versions_ is sorted
        }
      }
      superseded = v.gen;
    }
  }
  for (const auto& [g, info] : generations_) {
    if (!retained.count(g)) plan.dead_generations.push_back(g);
  }
  for (const auto& [id, t] : dropped_) {
    auto r = retained.lower_bound(t.created_generation);
    if (r == retained.end() || *r >= t.dropped_generation) plan.dead_dropped.push_back(id);
  }
  return plan;
}

void Core::AddGcToBatch(const GcPlan& plan, rocksdb::WriteBatch* b) const {
  for (const auto& [key, gen] : plan.dead_versions) b->Delete(internal::ChunkKey(key.t, key.f, key.c, gen));
  // A pack record goes when all its versions do; else it is rewritten with
  // those still alive (one index entry either way).
  for (const auto& [gp, dead] : plan.dead_in_packs) {
    const auto& [gen, pack] = gp;
    auto members = packs_.find(gp);
    std::vector<internal::PackedVersion> alive;
    if (members != packs_.end()) {
      for (const Key& key : members->second) {
        if (std::binary_search(dead.begin(), dead.end(), key)) continue;
        for (const Version& v : versions_.at(key)) {
          if (v.gen == gen) alive.push_back(internal::PackedVersion{key.t, key.f, key.c, v.ext});
        }
      }
    }
    if (alive.empty()) {
      b->Delete(internal::PackKey(gen, pack));
    } else {
      b->Put(internal::PackKey(gen, pack), internal::EncodePack(alive));
    }
  }
  for (uint64_t g : plan.dead_generations) b->Delete(internal::GenerationKey(g));
  for (uint32_t id : plan.dead_dropped) b->Delete(internal::DroppedKey(id));
}

void Core::ApplyGc(const GcPlan& plan) {
  auto drop_version = [&](const Key& key, uint64_t gen) REQUIRES(mu_) {
    auto it = versions_.find(key);
    if (it == versions_.end()) return;
    auto& vs = it->second;
    for (auto v = vs.begin(); v != vs.end(); ++v) {
      if (v->gen == gen) {
        ReleaseExtent(v->ext);
        vs.erase(v);
        break;
      }
    }
    if (vs.empty()) versions_.erase(it);
  };
  for (const auto& [key, gen] : plan.dead_versions) drop_version(key, gen);
  for (const auto& [gp, dead_keys] : plan.dead_in_packs) {
    const std::vector<Key>& dead = dead_keys;  // a lambda below takes it (clang captures no binding)
    for (const Key& key : dead) drop_version(key, gp.first);
    auto members = packs_.find(gp);
    if (members == packs_.end()) continue;
    std::erase_if(members->second, [&](const Key& k) { return std::binary_search(dead.begin(), dead.end(), k); });
    if (members->second.empty()) packs_.erase(members);
  }
  for (uint64_t g : plan.dead_generations) generations_.erase(g);
  for (uint32_t id : plan.dead_dropped) dropped_.erase(id);
}

Status Core::CollectGarbage() {
  MutexLock ll(&lease_lock_mu_);
  OPTSTATE_ASSIGN_OR_RETURN(auto lease_guard, LockLeases(LOCK_EX));
  OPTSTATE_ASSIGN_OR_RETURN(auto leased, LeasedGenerations());
  MutexLock l(&mu_);
  OPTSTATE_RETURN_IF_ERROR(CheckWritable("garbage collection"));
  GcPlan plan = PlanGc(latest_.generation, /*publish=*/false, leased);
  OPTSTATE_RETURN_IF_ERROR(WriteRetained(GenerationNumbers()));
  if (plan.dead_versions.empty() && plan.dead_in_packs.empty() && plan.dead_generations.empty() &&
      plan.dead_dropped.empty()) {
    return Status();
  }
  rocksdb::WriteBatch b;
  AddGcToBatch(plan, &b);
  OPTSTATE_TEST_SYNC_POINT("gc.before_batch");
  Status s = WriteSynced(&b, "garbage collection batch");
  if (!s.ok()) {
    Poison(s);
    return s;
  }
  ApplyGc(plan);
  RewriteRetainedAfterBatch();
  OPTSTATE_TEST_SYNC_POINT("gc.after_batch");
  return Status();
}

}  // namespace optstate::vfs::internal
