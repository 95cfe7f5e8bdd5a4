// Space in the data files (Core, vfs/internal/store_core.h): the slots and
// pieces of each data file, their free lists, allocation and growth.
#include "vfs/internal/store_core.h"

#include <bit>

namespace optstate::vfs::internal {

Status Core::BuildFreeLists() {
  const size_t n = identity_.data_dirs.size();
  const uint64_t slot_bytes = SlotBytes();
  space_.assign(n, {});
  dirty_.assign(n, false);
  grown_.assign(n, false);
  for (uint32_t d = 0; d < n; ++d) {
    if (!data_files_[d]) continue;
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, data_files_[d]->Size());
    space_[d].slots = size / slot_bytes;
    space_[d].backed.assign(space_[d].slots, false);  // not known: the first use allocates
  }
  // Per dir: slot -> class of what it holds (slot_bytes: used whole), and the
  // pieces in use; the first version seen in a slot names it in errors.
  struct SlotUse {
    uint64_t piece_bytes = 0;
    std::set<uint64_t> pieces;
    Key key;
    uint64_t gen = 0;
  };
  std::vector<std::map<uint64_t, SlotUse>> used(n);
  // Versions a revert made share their snapshot's extents: counted here.
  std::map<std::pair<uint32_t, uint64_t>, uint32_t> refs;
  shared_extents_.clear();
  for (const auto& [chunk_key, vs] : versions_) {
    const Key& key = chunk_key;  // a lambda below takes it (clang captures no binding)
    for (const auto& v : vs) {
      ++refs[{v.ext.dir, v.ext.file_offset}];
      auto describe = [&]() REQUIRES(mu_) {
        return Describe(AnyTensor(key.t), key, v.gen) + ": extent (data dir " +
               std::to_string(v.ext.dir) + ", offset " + std::to_string(v.ext.file_offset) + ", length " +
               std::to_string(v.ext.length) + ")";
      };
      const uint64_t bytes = v.ext.length == 0 ? 0 : AllocBytes(v.ext.length);
      if (v.ext.dir >= n || bytes == 0 || v.ext.file_offset % bytes != 0 ||
          v.ext.file_offset / slot_bytes >= space_[v.ext.dir].slots) {
        return Corruption(describe() + " lies outside the data files");
      }
      const uint64_t slot = v.ext.file_offset / slot_bytes;
      auto [it, fresh] = used[v.ext.dir].try_emplace(slot);
      SlotUse& u = it->second;
      if (fresh) {
        u.piece_bytes = bytes;
        u.key = key;
        u.gen = v.gen;
      } else if (u.piece_bytes != bytes) {
        return Corruption(describe() + " shares slot " + std::to_string(slot) + " with a " +
                          std::to_string(u.piece_bytes) + "-byte extent of " + Describe(AnyTensor(u.key.t), u.key, u.gen) +
                          " (extents of one slot must have one size class)");
      }
      u.pieces.insert((v.ext.file_offset - slot * slot_bytes) / bytes);
    }
  }
  for (const auto& [e, count] : refs) {
    if (count > 1) shared_extents_[e] = count - 1;
  }
  for (uint32_t d = 0; d < n; ++d) {
    DirSpace& sp = space_[d];
    for (uint64_t s = 0; s < sp.slots; ++s) {
      auto u = used[d].find(s);
      if (u == used[d].end()) {
        sp.free_slots.insert(s);
        continue;
      }
      if (u->second.piece_bytes == slot_bytes) continue;
      CarvedSlot& c = Carve(&sp, s, u->second.piece_bytes);
      for (uint64_t i : u->second.pieces) SetPiece(&sp, s, &c, i, true);
    }
  }
  return Status();
}

Core::CarvedSlot& Core::Carve(DirSpace* sp, uint64_t s, uint64_t piece_bytes) {
  CarvedSlot& c = sp->carved[s];
  c.piece_bytes = piece_bytes;
  c.used = 0;
  c.backed = 0;
  c.bits.assign((c.pieces(SlotBytes()) + 63) / 64, 0);
  sp->partial[piece_bytes].insert(s);
  return c;
}

void Core::SetPiece(DirSpace* sp, uint64_t s, CarvedSlot* c, uint64_t i, bool in_use) {
  if (c->InUse(i) == in_use) return;
  c->bits[i / 64] ^= uint64_t{1} << (i % 64);
  const uint64_t pieces = c->pieces(SlotBytes());
  if (in_use) {
    if (++c->used == pieces) sp->partial[c->piece_bytes].erase(s);
    return;
  }
  if (--c->used > 0) {
    sp->partial[c->piece_bytes].insert(s);
    return;
  }
  sp->partial[c->piece_bytes].erase(s);
  sp->carved.erase(s);
  sp->free_slots.insert(s);
}

uint64_t Core::FreeBytes(uint32_t d) const {
  const DirSpace& sp = space_[d];
  uint64_t b = sp.free_slots.size() * SlotBytes();
  for (const auto& [s, c] : sp.carved) b += (c.pieces(SlotBytes()) - c.used) * c.piece_bytes;
  return b;
}

Core::Held Core::HeldAs(uint32_t d, uint64_t off, uint64_t bytes) const {
  const DirSpace& sp = space_[d];
  const uint64_t s = off / SlotBytes();
  if (sp.free_slots.count(s)) return Held::kFree;
  auto c = sp.carved.find(s);
  if (c == sp.carved.end()) return bytes == SlotBytes() ? Held::kInUse : Held::kOtherClass;
  if (c->second.piece_bytes != bytes) return Held::kOtherClass;
  return c->second.InUse((off - s * SlotBytes()) / bytes) ? Held::kInUse : Held::kFree;
}

Status Core::Grow(uint32_t d, bool whole) {
  File* f = data_files_[d].get();
  DirSpace& sp = space_[d];
  const uint64_t max_slots = std::max<uint64_t>(1, opts_.preallocate_step_bytes / SlotBytes());
  const uint64_t step_slots = std::min<uint64_t>(max_slots, std::max<uint64_t>(4, sp.slots));
  Status last;
  for (uint64_t want : {step_slots, uint64_t{1}}) {
    const uint64_t off = sp.slots * SlotBytes();
    // For a piece: only the last bytes, which make the file's size.
    last = whole ? f->Fallocate(off, want * SlotBytes())
                 : f->Fallocate(off + want * SlotBytes() - kIoAlign, kIoAlign);
    if (last.ok()) {
      for (uint64_t s = sp.slots; s < sp.slots + want; ++s) sp.free_slots.insert(s);
      sp.slots += want;
      sp.backed.resize(sp.slots, whole);
      grown_[d] = true;
      return Status();
    }
    if (want == 1) break;
  }
  return last;
}

Status Core::BackSlot(uint32_t d, uint64_t s) {
  DirSpace& sp = space_[d];
  if (sp.backed[s]) return Status();
  OPTSTATE_RETURN_IF_ERROR(data_files_[d]->Fallocate(s * SlotBytes(), SlotBytes()));
  sp.backed[s] = true;
  grown_[d] = true;
  return Status();
}

Status Core::BackPiece(uint32_t d, uint64_t s, CarvedSlot* c, uint64_t i) {
  DirSpace& sp = space_[d];
  if (sp.backed[s] || i < c->backed) return Status();
  const uint64_t pieces = c->pieces(SlotBytes());
  const uint64_t to = std::min(pieces, std::max({i + 1, 2 * c->backed, uint64_t{1}}));
  OPTSTATE_RETURN_IF_ERROR(data_files_[d]->Fallocate(s * SlotBytes() + c->backed * c->piece_bytes,
                                                     (to - c->backed) * c->piece_bytes));
  c->backed = to;
  if (to == pieces) sp.backed[s] = true;
  grown_[d] = true;
  return Status();
}

Result<Extent> Core::AllocateSlot(uint64_t length) {
  const uint32_t n = static_cast<uint32_t>(data_files_.size());
  const uint64_t bytes = AllocBytes(length);
  std::string errors;
  Status first_error;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t d = (next_dir_ + i) % n;
    DirSpace& sp = space_[d];
    Extent e;
    e.dir = d;
    e.length = length;
    auto part = bytes < SlotBytes() ? sp.partial.find(bytes) : sp.partial.end();
    if (part != sp.partial.end() && !part->second.empty()) {
      const uint64_t s = *part->second.begin();
      CarvedSlot& c = sp.carved.at(s);
      uint64_t piece = 0;  // the first free one (partial: there is one)
      for (size_t w = 0; w < c.bits.size(); ++w) {
        if (c.bits[w] != ~uint64_t{0}) {
          piece = w * 64 + std::countr_one(c.bits[w]);
          break;
        }
      }
      if (Status b = BackPiece(d, s, &c, piece); !b.ok()) {
        if (first_error.ok()) first_error = b;
        errors += (errors.empty() ? "" : "; ") + b.ToString();
        continue;
      }
      SetPiece(&sp, s, &c, piece, true);
      e.file_offset = s * SlotBytes() + piece * bytes;
    } else {
      const bool whole = bytes == SlotBytes();
      if (sp.free_slots.empty()) {
        Status s = Grow(d, whole);
        if (!s.ok()) {
          if (first_error.ok()) first_error = s;
          errors += (errors.empty() ? "" : "; ") + s.ToString();
          continue;
        }
      }
      const uint64_t s = *sp.free_slots.begin();
      // Allocated in the file before it leaves the free list: a failure (no
      // space) leaves the slot free and the allocator as it was.
      Status b;
      uint64_t pieces_backed = 0;
      if (whole) {
        b = BackSlot(d, s);
      } else if (!sp.backed[s]) {
        CarvedSlot probe;
        probe.piece_bytes = bytes;
        b = BackPiece(d, s, &probe, 0);
        pieces_backed = probe.backed;
      }
      if (!b.ok()) {
        if (first_error.ok()) first_error = b;
        errors += (errors.empty() ? "" : "; ") + b.ToString();
        continue;
      }
      sp.free_slots.erase(s);
      if (!whole) {
        CarvedSlot& c = Carve(&sp, s, bytes);
        c.backed = pieces_backed;
        SetPiece(&sp, s, &c, 0, true);
      }
      e.file_offset = s * SlotBytes();
    }
    next_dir_ = (d + 1) % n;
    dirty_[d] = true;
    return e;
  }
  std::string dirs;
  for (const auto& d : identity_.data_dirs) dirs += (dirs.empty() ? "" : ", ") + d;
  const std::string msg = "store " + path_ + ": no free chunk slot and cannot grow data files in " +
                          dirs + ": " + errors;
  if (first_error.code() == StatusCode::kNoSpace) return Status(StatusCode::kNoSpace, msg, ENOSPC);
  return Status(first_error.code() == StatusCode::kOk ? StatusCode::kIoError : first_error.code(), msg,
                first_error.err());
}

void Core::FreeSlot(const Extent& e) {
  DirSpace& sp = space_[e.dir];
  const uint64_t bytes = AllocBytes(e.length);
  const uint64_t s = e.file_offset / SlotBytes();
  if (bytes == SlotBytes()) {
    sp.free_slots.insert(s);
    return;
  }
  auto c = sp.carved.find(s);
  if (c == sp.carved.end() || c->second.piece_bytes != bytes) {
    // Cannot happen while the maps match the index; Verify reports it.
    OPTSTATE_LOG_ERROR("store {}: freeing a {}-byte piece at dir {} offset {} that the allocator does not hold",
                       path_, bytes, e.dir, e.file_offset);
    return;
  }
  SetPiece(&sp, s, &c->second, (e.file_offset - s * SlotBytes()) / bytes, false);
}

void Core::ReleaseExtent(const Extent& e) {
  auto it = shared_extents_.find({e.dir, e.file_offset});
  if (it != shared_extents_.end()) {
    if (--it->second == 0) shared_extents_.erase(it);
    return;
  }
  FreeSlot(e);
}

void Core::SetPending(const Key& k, const Extent& e) {
  auto [it, inserted] = pending_.try_emplace(k, e);
  if (!inserted) {
    ReleaseExtent(it->second);
    it->second = e;
  }
  lifetime_bytes_ += e.length;
}

std::optional<Version> Core::Newest(const Key& k) const {
  auto p = pending_.find(k);
  if (p != pending_.end()) return Version{latest_.generation + 1, p->second};
  auto v = versions_.find(k);
  if (v == versions_.end() || v->second.empty()) return std::nullopt;
  return v->second.front();
}

std::optional<Version> Core::AtGeneration(const Key& k, uint64_t g) const {
  auto v = versions_.find(k);
  if (v == versions_.end()) return std::nullopt;
  for (const auto& ver : v->second) {
    if (ver.gen <= g) return ver;
  }
  return std::nullopt;
}

Result<std::pair<const TensorInfo*, uint64_t>> Core::Resolve(const std::map<uint32_t, TensorInfo>& tensors,
                                                             const ChunkRef& ref) const {
  auto t = tensors.find(ref.tensor_id);
  if (t == tensors.end()) {
    return NotFound("store " + path_ + ": no tensor with id " + std::to_string(ref.tensor_id));
  }
  if (ref.field >= t->second.fields.size()) {
    return InvalidArgument("store " + path_ + " tensor '" + t->second.name + "': no field #" +
                           std::to_string(ref.field) + " (it has " +
                           std::to_string(t->second.fields.size()) + ")");
  }
  const uint64_t n = ChunkCountOf(t->second, ref.field, chunk());
  if (ref.index >= n) {
    return InvalidArgument(Describe(&t->second, Key{ref.tensor_id, ref.field, ref.index}, kInfinity) +
                           ": out of range (the field has " + std::to_string(n) + " chunks)");
  }
  return std::make_pair(&t->second, ChunkLen(t->second, ref.field, ref.index));
}

}  // namespace optstate::vfs::internal
