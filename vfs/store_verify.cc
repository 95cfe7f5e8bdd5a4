// Store::Verify (vfs/store.h): every retained generation read back under a
// lease and checked against its checksums, the allocator's maps checked against
// the index (no dangling, shared, overlapping or leaked space), and COMMITTED
// and RETAINED checked against the index.
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_open.h"

#include <iterator>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "vfs/internal/chunk_io.h"
#include "vfs/internal/generation_view.h"
#include "vfs/io_buffer.h"

namespace optstate::vfs::internal {

Result<VerifyReport> VerifyStore(const std::shared_ptr<Core>& core) {
  struct Item {
    TensorInfo tensor;
    Key key;
    Version v;
    uint64_t expected_len;
  };
  VerifyReport rep;
  Core* c = core.get();
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
    auto v = OpenGenerationView(core, kLatest, "");
    if (!v.ok()) return v.status().WithContext("store " + c->path_ + ": verify: lease on the latest generation");
    views.push_back(std::move(*v));
  }
  std::vector<uint64_t> gens;
  {
    MutexLock l(&c->mu_);
    for (const auto& [g, i] : c->generations_) {
      if (g != views[0]->info().generation) gens.push_back(g);
    }
  }
  for (uint64_t g : gens) {
    auto v = OpenGenerationView(core, g, "");
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
    const ViewData& d = ViewDataOf(*view);
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
    MutexLock l(&c->mu_);
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
    auto claim = [&](const TensorInfo* tp, const Key& k, uint64_t gen, const Extent& e) REQUIRES(c->mu_) {
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
        // A revert's version shares its snapshot's extent: the same chunk, the same bytes.
        if (!(it->second.key == k && it->second.bytes == bytes)) {
          rep.problems.push_back(what + " is also referenced by generation " + std::to_string(it->second.gen));
        }
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
      const TensorInfo* tp = c->AnyTensor(k.t);  // live or dropped
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
  IoBuffer buf(core->chunk());
  if (!buf.ok()) return ResourceExhausted("store " + core->path_ + ": verify: out of memory for a chunk buffer");
  for (const auto& it : items) {
    if (it.v.ext.length != it.expected_len) {
      rep.problems.push_back(core->Describe(&it.tensor, it.key, it.v.gen) + ": extent length " +
                             std::to_string(it.v.ext.length) + " != chunk length " +
                             std::to_string(it.expected_len));
      continue;
    }
    Status s = ReadVersion(core.get(), &it.tensor, it.key, it.v, buf.data(), core->chunk());
    ++rep.chunks_checked;
    rep.bytes_checked += it.v.ext.length;
    if (!s.ok()) rep.problems.push_back(s.ToString());
  }
  if (!core->read_only_ && owned_bytes + free_bytes > allocated) {
    rep.problems.push_back("store " + core->path_ + ": space accounting: " + std::to_string(owned_bytes) +
                           " bytes referenced/pending + " + std::to_string(free_bytes) + " free but only " +
                           std::to_string(allocated) + " allocated");
  }
  c->VerifyMarks(index_latest, &rep.problems);
  return rep;
}

}  // namespace optstate::vfs::internal
