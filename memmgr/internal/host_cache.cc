// HostCache: the host cache tier (see host_cache.h).
#include "memmgr/internal/host_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "base/log.h"

namespace optstate::memmgr::internal {

bool CacheBudget::Take(uint64_t bytes) {
  MutexLock l(&mu_);
  if (used_ + bytes > capacity_) return false;
  used_ += bytes;
  return true;
}

void CacheBudget::Give(uint64_t bytes) {
  MutexLock l(&mu_);
  used_ -= std::min(used_, bytes);
}

uint64_t CacheBudget::used_bytes() const {
  MutexLock l(&mu_);
  return used_;
}

uint64_t CacheBudget::free_bytes() const {
  MutexLock l(&mu_);
  return capacity_ - used_;
}

namespace {
// min(MemAvailable / 2, MemAvailable - 4 GiB) / LOCAL_WORLD_SIZE; *why says
// how it was derived.
uint64_t AutoHostCacheBytes(std::string* why) {
  constexpr uint64_t kFreeFloorBytes = 4ull << 30;
  uint64_t avail = 0;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") {
      avail = kib << 10;
      break;
    }
  }
  uint64_t ranks = 1;
  if (const char* e = std::getenv("LOCAL_WORLD_SIZE"); e != nullptr && std::strtoull(e, nullptr, 10) > 0) {
    ranks = std::strtoull(e, nullptr, 10);
  }
  const uint64_t bytes = avail > kFreeFloorBytes ? std::min(avail / 2, avail - kFreeFloorBytes) / ranks : 0;
  *why = "auto: half of MemAvailable " + std::to_string(avail >> 20) + " MiB, at least 4 GiB left free, / " +
         std::to_string(ranks) + " local rank(s), shared by the process's managers";
  return bytes;
}
}  // namespace

std::shared_ptr<CacheBudget> SharedAutoCacheBudget(std::string* why) {
  static std::mutex mu;
  static std::weak_ptr<CacheBudget> shared;  // guarded by mu
  static std::string shared_why;             // guarded by mu
  std::lock_guard<std::mutex> l(mu);
  if (auto b = shared.lock()) {
    *why = shared_why + "; " + std::to_string(b->used_bytes() >> 20) + " MiB of it in use by other managers";
    return b;
  }
  auto b = std::make_shared<CacheBudget>(AutoHostCacheBytes(&shared_why));
  shared = b;
  *why = shared_why;
  return b;
}

HostCache::HostCache(Device* dev, std::shared_ptr<CacheBudget> budget) : dev_(dev), budget_(std::move(budget)) {}

HostCache::~HostCache() {
  for (auto& [k, e] : entries_) dev_->FreePinnedHost(e.h_buf, e.buf_bytes);
  for (auto& [bytes, bufs] : free_) {
    for (void* b : bufs) dev_->FreePinnedHost(b, bytes);
  }
  if (budget_) budget_->Give(allocated_);
}

uint64_t HostCache::capacity_bytes() const {
  if (!budget_) return 0;
  MutexLock l(&mu_);
  return allocated_ + budget_->free_bytes();
}

HostCache::EntryMap::iterator HostCache::Drop(EntryMap::iterator it) {
  lru_.erase(it->second.lru);
  free_[it->second.buf_bytes].push_back(it->second.h_buf);
  entry_bytes_ -= it->second.buf_bytes;
  return entries_.erase(it);
}

void* HostCache::TakeBuffer(uint64_t bytes, bool may_evict) {
  for (;;) {
    auto same = free_.find(bytes);
    if (same != free_.end() && !same->second.empty()) {
      void* b = same->second.back();
      same->second.pop_back();
      return b;
    }
    if (budget_->Take(bytes)) break;
    // Over capacity: return free buffers of other sizes first, then (only
    // when asked) the oldest clean unused entry.
    auto other = std::find_if(free_.begin(), free_.end(), [](const auto& f) { return !f.second.empty(); });
    if (other != free_.end()) {
      dev_->FreePinnedHost(other->second.back(), other->first);
      other->second.pop_back();
      allocated_ -= other->first;
      budget_->Give(other->first);
      continue;
    }
    if (!may_evict) return nullptr;
    auto victim = std::find_if(lru_.begin(), lru_.end(), [this](const ChunkKey& k) {
      mu_.AssertHeld();  // called here, under the lock
      const Entry& e = entries_.find(k)->second;
      return !e.dirty && e.users == 0;
    });
    if (victim == lru_.end()) return nullptr;
    Drop(entries_.find(*victim));
  }
  auto r = dev_->AllocPinnedHost(bytes);
  if (!r.ok()) {
    budget_->Give(bytes);
    if (!warned_alloc_) {
      warned_alloc_ = true;
      OPTSTATE_LOG_WARN("memmgr: host cache tier stops growing at {} bytes: {}", allocated_, r.status().ToString());
    }
    return nullptr;
  }
  allocated_ += bytes;
  return *r;
}

void* HostCache::SlotFor(const ChunkKey& k, uint64_t len, bool may_evict) {
  const uint64_t bytes = EntryBytes(len);
  auto it = entries_.find(k);
  if (it != entries_.end()) {
    Entry& e = it->second;
    if (e.buf_bytes == bytes) {
      lru_.splice(lru_.end(), lru_, e.lru);
      e.len = len;
      return e.h_buf;
    }
    if (e.dirty || e.users != 0) return nullptr;
    Drop(it);
  }
  void* buf = TakeBuffer(bytes, may_evict);
  if (buf == nullptr) return nullptr;
  lru_.push_back(k);
  Entry e;
  e.h_buf = buf;
  e.len = len;
  e.buf_bytes = bytes;
  e.lru = std::prev(lru_.end());
  entries_[k] = e;
  entry_bytes_ += bytes;
  return buf;
}

bool HostCache::Get(const ChunkKey& k, void* dst, uint64_t len, bool dst_is_device, void* stream) {
  if (!enabled()) return false;
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  if (it == entries_.end() || it->second.len != len) return false;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  if (dst_is_device) {
    if (!dev_->CopyH2D(dst, it->second.h_buf, len, stream).ok() || !dev_->SyncStream(stream).ok()) return false;
  } else {
    std::memcpy(dst, it->second.h_buf, len);
  }
  return true;
}

void HostCache::Put(const ChunkKey& k, const void* src, uint64_t len) {
  if (!enabled()) return;
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  if (it != entries_.end() && it->second.users != 0) return;  // StreamedAdam's working copy wins
  const bool dirty = it != entries_.end() && it->second.dirty;
  void* buf = SlotFor(k, len, /*may_evict=*/false);
  if (buf == nullptr) {
    // No room for the new bytes: an older copy must not stay behind.
    if (auto old = entries_.find(k); old != entries_.end() && !old->second.dirty) Drop(old);
    return;
  }
  std::memcpy(buf, src, len);
  entries_[k].prefetched = false;
  // Put is called with bytes just written to the store (or read from it): a
  // dirty entry stays dirty (newer than the commit) but is now in the pending
  // generation.
  if (dirty) entries_[k].written = true;
}

void* HostCache::Acquire(const ChunkKey& k, uint64_t len, bool may_evict, bool* valid) {
  *valid = false;
  if (!enabled()) return nullptr;
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  *valid = it != entries_.end() && it->second.len == len;
  void* buf = SlotFor(k, len, may_evict);
  if (buf == nullptr) {
    *valid = false;
    return nullptr;
  }
  ++entries_[k].users;
  return buf;
}

void HostCache::Release(const ChunkKey& k, bool dirty) {
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  if (it == entries_.end()) return;
  if (it->second.users > 0) --it->second.users;
  if (dirty) {
    it->second.dirty = true;
    it->second.written = false;
    it->second.prefetched = false;
  }
}

bool HostCache::WantsPrefetch(const ChunkKey& k, uint64_t len) const {
  if (!enabled()) return false;
  MutexLock l(&mu_);
  const uint64_t bytes = EntryBytes(len);
  if (entries_.find(k) != entries_.end()) return false;
  // Room without evicting: this cache's free buffers (TakeBuffer returns
  // those of other sizes to the budget) and what the budget has left.
  return allocated_ - entry_bytes_ + budget_->free_bytes() >= bytes;
}

bool HostCache::PutPrefetched(const ChunkKey& k, const void* src, uint64_t len) {
  if (!enabled()) return false;
  MutexLock l(&mu_);
  // An entry that appeared meanwhile (a write-back's Put) holds newer bytes.
  if (entries_.find(k) != entries_.end()) return false;
  void* buf = SlotFor(k, len, /*may_evict=*/false);
  if (buf == nullptr) return false;
  std::memcpy(buf, src, len);
  entries_[k].prefetched = true;
  return true;
}

bool HostCache::Contains(const ChunkKey& k, uint64_t len) const {
  if (!enabled()) return false;
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  return it != entries_.end() && it->second.len == len;
}

bool HostCache::CopyIdle(const ChunkKey& k, void* dst, uint64_t len) const {
  if (!enabled()) return false;
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  if (it == entries_.end() || it->second.len != len || it->second.users != 0) return false;
  std::memcpy(dst, it->second.h_buf, len);
  return true;
}

bool HostCache::TakePrefetched(const ChunkKey& k) {
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  if (it == entries_.end() || !it->second.prefetched) return false;
  it->second.prefetched = false;
  return true;
}

void HostCache::MarkWritten(const ChunkKey& k) {
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  if (it != entries_.end()) it->second.written = true;
}

std::vector<std::pair<ChunkKey, void*>> HostCache::DirtyUnwritten() const {
  MutexLock l(&mu_);
  std::vector<std::pair<ChunkKey, void*>> out;
  for (const auto& [k, e] : entries_) {
    if (e.dirty && !e.written) out.emplace_back(k, e.h_buf);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

bool HostCache::HasDirty() const {
  MutexLock l(&mu_);
  for (const auto& [k, e] : entries_) {
    if (e.dirty) return true;
  }
  return false;
}

void HostCache::MarkAllClean() {
  MutexLock l(&mu_);
  for (auto& [k, e] : entries_) e.dirty = e.written = false;
}

void HostCache::ForgetPendingWrites() {
  if (!enabled()) return;
  MutexLock l(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.dirty || e.users != 0) {
      e.written = false;
      ++it;
      continue;
    }
    it = Drop(it);
  }
}

void HostCache::PutFromDevice(const ChunkKey& k, const void* d_src, uint64_t len, void* stream) {
  if (!enabled()) return;
  MutexLock l(&mu_);
  void* buf = SlotFor(k, len, /*may_evict=*/false);
  if (buf == nullptr) {
    if (auto old = entries_.find(k); old != entries_.end() && !old->second.dirty && old->second.users == 0) Drop(old);
    return;
  }
  if (!dev_->CopyD2H(buf, d_src, len, stream).ok() || !dev_->SyncStream(stream).ok()) Drop(entries_.find(k));
}

void HostCache::Erase(const ChunkKey& k) {
  if (!enabled()) return;
  MutexLock l(&mu_);
  auto it = entries_.find(k);
  // A dirty entry is the only copy of uncommitted steps: keep it (a Pin for
  // writing then loads it, and its write-back Puts the new bytes).
  if (it == entries_.end() || it->second.dirty || it->second.users != 0) return;
  Drop(it);
}

void HostCache::EraseTensor(uint32_t tensor_id) {
  if (!enabled()) return;
  MutexLock l(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = it->first.tensor_id == tensor_id ? Drop(it) : std::next(it);
  }
}

void HostCache::Clear() {
  if (!enabled()) return;
  MutexLock l(&mu_);
  for (auto it = entries_.begin(); it != entries_.end();) it = Drop(it);
}

uint64_t HostCache::bytes() const {
  MutexLock l(&mu_);
  return entry_bytes_;
}

}  // namespace optstate::memmgr::internal
