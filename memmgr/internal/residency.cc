// Residency: regions of device address space per tensor field, the LRU of
// unpinned resident chunks, physical pages within the budget (pool, creation,
// eviction), write-back of dirty chunks, and the optimizer's arenas.
#include <algorithm>
#include <iterator>
#include <utility>

#include "memmgr/internal/manager_impl.h"
#include "base/log.h"

namespace optstate::memmgr::internal {

Result<ManagerImpl::Region*> ManagerImpl::GetRegion(std::string_view tensor, std::string_view field) {
  auto tit = tensors_.find(tensor);
  if (tit == tensors_.end()) {
    OPTSTATE_ASSIGN_OR_RETURN(vfs::TensorInfo found, store_->FindTensor(tensor));
    tit = tensors_.emplace(std::string(tensor), std::move(found)).first;
  }
  const vfs::TensorInfo& info = tit->second;
  OPTSTATE_ASSIGN_OR_RETURN(uint32_t f, store_->FieldIndex(info, field));
  // A region maps chunk c of its field at c pages: a field with chunks of its
  // own size (the scales of q8 moments) does not fit that mapping.
  if (info.field_chunk_bytes(f, page_bytes_) != page_bytes_) {
    return InvalidArgument(fmt::format(
        "store {}: tensor '{}' field '{}' has chunks of {} bytes, not the store's {}; pins and prefetches map "
        "whole chunks and cannot hold it (read it with optstate-inspect or optstate_store_read_field)",
        store_->path(), info.name, info.fields[f].name, info.field_chunk_bytes(f, page_bytes_),
        page_bytes_));
  }
  auto key = std::make_pair(info.id, f);
  auto it = regions_.find(key);
  if (it != regions_.end()) return it->second.get();
  auto r = std::make_unique<Region>();
  r->info = info;
  r->field = f;
  r->elem_bytes = DTypeSize(info.fields[f].dtype);
  r->field_bytes = info.field_bytes(f);
  uint64_t chunks = (r->field_bytes + page_bytes_ - 1) / page_bytes_;
  r->reserved = std::max<uint64_t>(chunks, 1) * page_bytes_;
  OPTSTATE_ASSIGN_OR_RETURN(r->base, dev_->Reserve(r->reserved));
  r->slots.resize(chunks);
  Region* raw = r.get();
  regions_by_tensor_[info.id].push_back(raw);
  regions_.emplace(key, std::move(r));
  return raw;
}

uint64_t ManagerImpl::ChunkLen(const Region& r, uint64_t c) const {
  return std::min(page_bytes_, r.field_bytes - c * page_bytes_);
}

ManagerImpl::Slot& ManagerImpl::SlotOf(const ChunkKey& k) {
  return regions_.at({k.tensor_id, k.field})->slots[k.index];
}

void ManagerImpl::LruRemove(Slot& s) {
  if (s.in_lru) {
    lru_.erase(s.lru);
    s.in_lru = false;
  }
}
void ManagerImpl::LruPush(const ChunkKey& k, Slot& s) {
  LruRemove(s);
  lru_.push_back(k);
  s.lru = std::prev(lru_.end());
  s.in_lru = true;
}
void ManagerImpl::NoteResident() { peak_pages_ = std::max(peak_pages_, physical_pages_); }

bool ManagerImpl::TryTakePage(uint64_t* handle, Status* err) {
  if (!pool_.empty()) {
    *handle = pool_.back();
    pool_.pop_back();
    return true;
  }
  if (physical_pages_ < budget_pages_) {
    auto r = dev_->CreatePage(page_bytes_);
    if (!r.ok()) {
      *err = r.status();
      return false;
    }
    *handle = *r;
    ++physical_pages_;
    NoteResident();
    return true;
  }
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    Region* r = regions_.at({it->tensor_id, it->field}).get();
    Slot& s = r->slots[it->index];
    if (s.dirty || s.pins != 0 || s.state != State::kResident) continue;
    Status st = dev_->Unmap(r->base + it->index * page_bytes_, page_bytes_);
    if (!st.ok()) {
      *err = st;
      return false;
    }
    *handle = s.page;
    s.state = State::kAbsent;
    s.in_lru = false;
    lru_.erase(it);
    ++evictions_;
    return true;
  }
  return false;
}

Status ManagerImpl::WriteBackLocked(const ChunkKey& k) {
  Region* r = regions_.at({k.tensor_id, k.field}).get();
  Slot& s = r->slots[k.index];
  s.state = State::kWriting;
  s.dirty = false;
  LruRemove(s);
  IoItem item{k, reinterpret_cast<void*>(r->base + k.index * page_bytes_), ChunkLen(*r, k.index)};
  mu_.Unlock();
  Status st = StoreChunks({item});
  mu_.Lock();
  Slot& s2 = r->slots[k.index];
  s2.state = State::kResident;
  if (!st.ok()) s2.dirty = true;
  if (s2.pins == 0) LruPush(k, s2);
  cv_.SignalAll();
  return st;
}

bool ManagerImpl::WriteBackOneLocked(Status* err) {
  for (const ChunkKey& k : lru_) {
    Slot& s = SlotOf(k);
    if (s.dirty && s.pins == 0 && s.state == State::kResident) {
      ChunkKey key = k;
      *err = WriteBackLocked(key);
      return true;
    }
  }
  return false;
}

Status ManagerImpl::Flush() {
  // Let queued background work finish first (it may hold chunks in kWriting).
  {
    MutexLock l(&task_mu_);
    while (!(tasks_.empty() && busy_ == 0) && worker_.get_id() != std::thread::id()) task_cv_.Wait(&task_mu_);
  }
  MutexLock lock(&mu_);
  for (;;) {
    bool busy = false;
    const ChunkKey* todo = nullptr;
    ChunkKey key;
    for (auto& [rk, r] : regions_) {
      for (uint64_t c = 0; c < r->slots.size(); ++c) {
        Slot& s = r->slots[c];
        if (s.state == State::kLoading || s.state == State::kWriting) busy = true;
        if (s.state == State::kResident && s.dirty && s.pins == 0 && todo == nullptr) {
          key = Key(*r, c);
          todo = &key;
        }
      }
    }
    if (todo != nullptr) {
      OPTSTATE_RETURN_IF_ERROR(WriteBackLocked(key));
      continue;
    }
    if (busy) {
      cv_.Wait(&mu_);
      continue;
    }
    break;
  }
  if (!bg_error_.ok()) {
    Status e = bg_error_;
    bg_error_ = Status::Ok();
    return e.WithContext("background write-back failed");
  }
  return Status::Ok();
}

Status ManagerImpl::ReleaseAll() {
  {
    MutexLock lock(&mu_);
    if (!pins_.empty() || arena_pages_ != 0) {
      return FailedPrecondition("ReleaseAll: " + std::to_string(pins_.size()) + " pins and " +
                                std::to_string(arena_pages_) + " optimizer slot pages outstanding");
    }
  }
  OPTSTATE_RETURN_IF_ERROR(Flush());
  MutexLock lock(&mu_);
  for (auto& [rk, r] : regions_) {
    for (uint64_t c = 0; c < r->slots.size(); ++c) {
      Slot& s = r->slots[c];
      if (s.state == State::kAbsent) continue;
      if (s.pins != 0 || s.dirty || s.state != State::kResident) {
        return FailedPrecondition("ReleaseAll: chunk " + std::to_string(c) + " of " + r->info.name + "/" +
                                  r->info.fields[r->field].name + " was pinned or dirtied concurrently");
      }
      OPTSTATE_RETURN_IF_ERROR(dev_->Unmap(r->base + c * page_bytes_, page_bytes_));
      dev_->DestroyPage(s.page, page_bytes_);
      --physical_pages_;
      LruRemove(s);
      s.state = State::kAbsent;
    }
  }
  for (uint64_t h : pool_) dev_->DestroyPage(h, page_bytes_);
  physical_pages_ -= pool_.size();
  pool_.clear();
  cv_.SignalAll();
  return Status::Ok();
}

Status ManagerImpl::DropTensor(uint32_t tensor_id) {
  MutexLock lock(&mu_);
  auto it = regions_by_tensor_.find(tensor_id);
  if (it == regions_by_tensor_.end()) return Status::Ok();
  for (;;) {
    bool again = false;
    for (Region* r : it->second) {
      for (uint64_t c = 0; c < r->slots.size() && !again; ++c) {
        Slot& s = r->slots[c];
        if (s.state == State::kAbsent) continue;
        if (s.pins != 0) {
          return FailedPrecondition("tensor " + r->info.name + " field " + r->info.fields[r->field].name +
                                    " chunk " + std::to_string(c) + " is pinned; unpin before Step");
        }
        if (s.state != State::kResident) {
          cv_.Wait(&mu_);
          again = true;
          break;
        }
        if (s.dirty) {
          OPTSTATE_RETURN_IF_ERROR(WriteBackLocked(Key(*r, c)));
          again = true;
          break;
        }
        OPTSTATE_RETURN_IF_ERROR(dev_->Unmap(r->base + c * page_bytes_, page_bytes_));
        pool_.push_back(s.page);
        LruRemove(s);
        s.state = State::kAbsent;
      }
      if (again) break;
    }
    if (!again) break;
  }
  cv_.SignalAll();
  return Status::Ok();
}

Result<Arena> ManagerImpl::AcquireArena(uint64_t min_pages, uint64_t max_pages, bool wait) {
  if (min_pages > budget_pages_) {
    return ResourceExhausted("device budget " + Mib(budget_pages_ * page_bytes_) + " is smaller than " +
                             std::to_string(min_pages) + " chunks in flight (" + Mib(min_pages * page_bytes_) +
                             "; one chunk per field of a slice)");
  }
  max_pages = std::max(max_pages, min_pages);
  MutexLock lock(&mu_);
  uint64_t take = 0;
  for (;;) {
    uint64_t avail = pool_.size() + (budget_pages_ - physical_pages_);
    bool dirty_evictable = false;
    for (const ChunkKey& k : lru_) {
      const Slot& s = SlotOf(k);
      if (s.pins != 0 || s.state != State::kResident) continue;
      if (s.dirty) {
        dirty_evictable = true;
      } else {
        ++avail;
      }
    }
    if (avail >= max_pages || (avail >= min_pages && !dirty_evictable)) {
      take = std::min(avail, max_pages);
      break;
    }
    if (dirty_evictable) {
      Status err;
      WriteBackOneLocked(&err);
      OPTSTATE_RETURN_IF_ERROR(err);
      continue;
    }
    if (!wait) {
      return Busy("device budget: " + std::to_string(avail) + " of " + std::to_string(min_pages) +
                  " pages free now (the rest pinned or in use)");
    }
    cv_.Wait(&mu_);
  }
  Arena a;
  a.page_bytes = page_bytes_;
  Status err;
  for (uint64_t i = 0; i < take; ++i) {
    uint64_t h = 0;
    if (!TryTakePage(&h, &err)) break;
    a.handles.push_back(h);
  }
  auto give_back = [&](Status e) REQUIRES(mu_) -> Status {
    for (uint64_t h : a.handles) pool_.push_back(h);
    cv_.SignalAll();
    return e;
  };
  if (!err.ok()) return give_back(err);
  if (a.handles.size() < min_pages) return give_back(Internal("AcquireArena: page accounting mismatch"));
  a.pages = a.handles.size();
  auto base = dev_->Reserve(a.pages * page_bytes_);
  if (!base.ok()) return give_back(base.status());
  a.base = *base;
  for (uint64_t i = 0; i < a.pages; ++i) {
    Status ms = dev_->Map(a.base + i * page_bytes_, page_bytes_, a.handles[i]);
    if (!ms.ok()) {
      for (uint64_t j = 0; j < i; ++j) (void)dev_->Unmap(a.base + j * page_bytes_, page_bytes_);
      dev_->Unreserve(a.base, a.pages * page_bytes_);
      return give_back(ms);
    }
  }
  arena_pages_ += a.pages;
  return a;
}

void ManagerImpl::ReleaseArena(Arena* a) {
  if (a->pages == 0) return;
  MutexLock lock(&mu_);
  for (uint64_t i = 0; i < a->pages; ++i) {
    Status s = dev_->Unmap(a->base + i * page_bytes_, page_bytes_);
    if (!s.ok()) OPTSTATE_LOG_ERROR("memmgr: unmapping optimizer slot page: {}", s.ToString());
    pool_.push_back(a->handles[i]);
  }
  dev_->Unreserve(a->base, a->pages * page_bytes_);
  arena_pages_ -= a->pages;
  a->pages = 0;
  a->handles.clear();
  cv_.SignalAll();
}

}  // namespace optstate::memmgr::internal
