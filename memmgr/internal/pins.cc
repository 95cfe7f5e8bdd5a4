// Pin, Unpin and Prefetch, and the background worker that serves the
// write-backs Unpin schedules and the prefetches.
#include <string>
#include <utility>
#include <vector>

#include "memmgr/internal/manager_impl.h"
#include "base/log.h"

namespace optstate::memmgr::internal {

Result<PinnedRange> ManagerImpl::Pin(std::string_view tensor, std::string_view field, uint64_t first,
                                     uint64_t count, Access access) {
  if (count == 0) {
    return InvalidArgument("Pin " + std::string(tensor) + "/" + std::string(field) + ": count is 0");
  }
  MutexLock lock(&mu_);
  OPTSTATE_ASSIGN_OR_RETURN(Region * r, GetRegion(tensor, field));
  uint64_t numel = r->info.numel;
  if (first > numel || count > numel - first) {
    return InvalidArgument("Pin " + std::string(tensor) + "/" + std::string(field) + ": elements [" +
                           std::to_string(first) + ", " + std::to_string(first + count) +
                           ") outside the tensor's " + std::to_string(numel) + " elements");
  }
  const uint64_t eb = r->elem_bytes;
  const uint64_t c0 = first * eb / page_bytes_;
  const uint64_t c1 = ((first + count) * eb - 1) / page_bytes_;
  const uint64_t n = c1 - c0 + 1;
  if (n > budget_pages_) {
    return ResourceExhausted("Pin " + std::string(tensor) + "/" + std::string(field) + " [" +
                             std::to_string(first) + ", +" + std::to_string(count) + "): needs " +
                             std::to_string(n) + " chunks = " + Mib(n * page_bytes_) +
                             ", more than the whole device budget " + Mib(budget_pages_ * page_bytes_) +
                             "; pin a smaller range or raise device_budget_bytes");
  }
  std::vector<uint64_t> to_load;
  for (;;) {
    if (!bg_error_.ok()) {
      Status e = bg_error_;
      bg_error_ = Status::Ok();
      return e.WithContext("background write-back failed");
    }
    bool busy = false;
    uint64_t missing = 0;
    for (uint64_t c = c0; c <= c1; ++c) {
      State st = r->slots[c].state;
      if (st == State::kLoading || st == State::kWriting) busy = true;
      if (st == State::kAbsent) ++missing;
    }
    if (busy) {
      cv_.Wait(&mu_);
      continue;
    }
    uint64_t avail = pool_.size() + (budget_pages_ - physical_pages_);
    bool dirty_evictable = false;
    for (const ChunkKey& k : lru_) {
      if (k.tensor_id == r->info.id && k.field == r->field && k.index >= c0 && k.index <= c1) continue;
      const Slot& s = SlotOf(k);
      if (s.pins != 0 || s.state != State::kResident) continue;
      if (s.dirty) {
        dirty_evictable = true;
      } else {
        ++avail;
      }
    }
    if (avail >= missing) break;
    if (dirty_evictable) {
      Status err;
      WriteBackOneLocked(&err);
      if (!err.ok()) return err.WithContext("Pin: evicting a dirty chunk");
      continue;
    }
    cv_.Wait(&mu_);
  }
  // Claim: pin the resident chunks first so that taking pages cannot evict them.
  for (uint64_t c = c0; c <= c1; ++c) {
    Slot& s = r->slots[c];
    s.pins++;
    LruRemove(s);
  }
  Status err;
  for (uint64_t c = c0; c <= c1; ++c) {
    Slot& s = r->slots[c];
    if (s.state != State::kAbsent) continue;
    uint64_t h = 0;
    if (!TryTakePage(&h, &err)) {
      if (err.ok()) err = Internal("Pin: budget accounting found no page although one was counted");
      break;
    }
    Status ms = dev_->Map(r->base + c * page_bytes_, page_bytes_, h);
    if (!ms.ok()) {
      pool_.push_back(h);
      err = ms;
      break;
    }
    s.page = h;
    s.state = State::kLoading;
    to_load.push_back(c);
  }
  auto undo = [&](const Status& e) REQUIRES(mu_) -> Status {
    for (uint64_t c : to_load) {
      Slot& s = r->slots[c];
      (void)dev_->Unmap(r->base + c * page_bytes_, page_bytes_);
      pool_.push_back(s.page);
      s.state = State::kAbsent;
    }
    for (uint64_t c = c0; c <= c1; ++c) {
      Slot& s = r->slots[c];
      s.pins--;
      if (s.pins == 0 && s.state == State::kResident) LruPush(Key(*r, c), s);
    }
    cv_.SignalAll();
    return e.WithContext("Pin " + r->info.name + "/" + r->info.fields[r->field].name);
  };
  if (!err.ok()) return undo(err);
  if (access != Access::kRead) {
    for (uint64_t c = c0; c <= c1; ++c) cache_->Erase(Key(*r, c));
  }
  std::vector<IoItem> items;
  for (uint64_t c : to_load) {
    uint64_t lo = c * page_bytes_, len = ChunkLen(*r, c);
    bool covered = first * eb <= lo && (first + count) * eb >= lo + len;
    if (access == Access::kWrite && covered) continue;
    items.push_back(IoItem{Key(*r, c), reinterpret_cast<void*>(r->base + lo), len});
  }
  lock.Unlock();
  Status ls = LoadChunks(items);
  lock.Lock();
  if (!ls.ok()) return undo(ls);
  for (uint64_t c : to_load) r->slots[c].state = State::kResident;
  cv_.SignalAll();
  uint64_t id = next_pin_id_++;
  pins_.emplace(id, PinRec{r, c0, c1, access});
  ++pins_total_;
  PinnedRange pr;
  pr.impl_ = this;
  pr.pin_id_ = id;
  pr.data_ = reinterpret_cast<void*>(r->base + first * eb);
  pr.size_bytes_ = count * eb;
  pr.stream_ = copy_stream_;
  return pr;
}

Status ManagerImpl::Unpin(uint64_t pin_id) {
  std::vector<ChunkKey> dirty;
  {
    MutexLock lock(&mu_);
    auto it = pins_.find(pin_id);
    if (it == pins_.end()) return Internal("Unpin: unknown pin id " + std::to_string(pin_id));
    PinRec rec = it->second;
    pins_.erase(it);
    for (uint64_t c = rec.c0; c <= rec.c1; ++c) {
      Slot& s = rec.region->slots[c];
      s.pins--;
      if (rec.access != Access::kRead) s.dirty = true;
      if (s.pins == 0) {
        LruPush(Key(*rec.region, c), s);
        if (s.dirty) dirty.push_back(Key(*rec.region, c));
      }
    }
  }
  cv_.SignalAll();
  if (!dirty.empty()) {
    {
      MutexLock l(&task_mu_);
      for (const ChunkKey& k : dirty) {
        Task t;
        t.prefetch = false;
        t.key = k;
        tasks_.push_back(std::move(t));
      }
    }
    task_cv_.Signal();
  }
  return Status::Ok();
}

Status ManagerImpl::Prefetch(std::string_view tensor, std::string_view field, uint64_t first, uint64_t count) {
  {
    // Validate now so the caller hears about bad names at once.
    MutexLock lock(&mu_);
    OPTSTATE_ASSIGN_OR_RETURN(Region * r, GetRegion(tensor, field));
    if (first > r->info.numel || count > r->info.numel - first) {
      return InvalidArgument("Prefetch " + std::string(tensor) + "/" + std::string(field) +
                             ": range outside the tensor's " + std::to_string(r->info.numel) + " elements");
    }
  }
  if (count == 0) return Status::Ok();
  {
    MutexLock l(&task_mu_);
    Task t;
    t.prefetch = true;
    t.tensor = std::string(tensor);
    t.field = std::string(field);
    t.first = first;
    t.count = count;
    tasks_.push_back(std::move(t));
  }
  task_cv_.Signal();
  return Status::Ok();
}

void ManagerImpl::WorkerLoop() {
  for (;;) {
    Task t;
    {
      MutexLock l(&task_mu_);
      while (!stop_ && tasks_.empty()) task_cv_.Wait(&task_mu_);
      if (stop_ && tasks_.empty()) return;
      t = std::move(tasks_.front());
      tasks_.pop_front();
      ++busy_;
    }
    MutexLock lock(&mu_);
    if (!t.prefetch) {
      auto rit = regions_.find({t.key.tensor_id, t.key.field});
      if (rit != regions_.end()) {
        Slot& s = rit->second->slots[t.key.index];
        if (s.dirty && s.pins == 0 && s.state == State::kResident) {
          Status st = WriteBackLocked(t.key);
          if (!st.ok()) {
            OPTSTATE_LOG_ERROR("memmgr: background write-back failed: {}", st.ToString());
            if (bg_error_.ok()) bg_error_ = st;
          }
        }
      }
    } else {
      auto rr = GetRegion(t.tensor, t.field);
      if (rr.ok()) {
        Region* r = *rr;
        uint64_t eb = r->elem_bytes;
        uint64_t c0 = t.first * eb / page_bytes_, c1 = ((t.first + t.count) * eb - 1) / page_bytes_;
        std::vector<uint64_t> loading;
        std::vector<IoItem> items;
        for (uint64_t c = c0; c <= c1; ++c) {
          Slot& s = r->slots[c];
          if (s.state != State::kAbsent) continue;
          uint64_t h = 0;
          Status err;
          if (!TryTakePage(&h, &err)) break;
          if (!dev_->Map(r->base + c * page_bytes_, page_bytes_, h).ok()) {
            pool_.push_back(h);
            break;
          }
          s.page = h;
          s.state = State::kLoading;
          loading.push_back(c);
          items.push_back(IoItem{Key(*r, c), reinterpret_cast<void*>(r->base + c * page_bytes_), ChunkLen(*r, c)});
        }
        lock.Unlock();
        Status st = LoadChunks(items);
        lock.Lock();
        for (uint64_t c : loading) {
          Slot& s = r->slots[c];
          if (st.ok()) {
            s.state = State::kResident;
            if (s.pins == 0) LruPush(Key(*r, c), s);
          } else {
            (void)dev_->Unmap(r->base + c * page_bytes_, page_bytes_);
            pool_.push_back(s.page);
            s.state = State::kAbsent;
          }
        }
        if (!st.ok()) OPTSTATE_LOG_WARN("memmgr: prefetch of {}/{} failed: {}", t.tensor, t.field, st.ToString());
        cv_.SignalAll();
      }
    }
    lock.Unlock();
    {
      MutexLock l(&task_mu_);
      --busy_;
    }
    task_cv_.SignalAll();
  }
}

}  // namespace optstate::memmgr::internal
