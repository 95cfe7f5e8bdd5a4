// PushGate: the FUSE session as CachePushers and the fills of
// state.safetensors store into the kernel's page cache, and as the Prefetcher
// asks whether the kernel holds a page. Internal to mount/.
#pragma once

#define FUSE_USE_VERSION 312
#include <fuse3/fuse_lowlevel.h>

#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "mount/cache_pusher.h"

namespace optstate::mount::internal {

// What CachePushers store through (fuse_lowlevel_notify_store): the session
// while it serves. A store waits in the kernel (uninterruptibly) for pages
// whose READ is in flight, so at exit, once the loop has ended, one can wait
// for a READ that nobody will answer: RunMount refuses new stores, answers
// what the kernel still sends until the stores in flight are done and its
// answers to asks are processed (libfuse frees an ask then), and aborts
// the connection if one still waits (DrainPushes). The Prefetcher asks
// through it too, whether the kernel holds a page (Cached). Thread-safe.
class PushGate {
 public:
  explicit PushGate(struct fuse_session* se) : se_(se) {}
  int Store(fuse_ino_t ino, uint64_t offset, std::span<const iovec> iov) EXCLUDES(mu_) {
    {
      MutexLock l(&mu_);
      if (refused_) return -ESHUTDOWN;
      ++in_flight_;
    }
    // One fuse_bufvec over every iovec: one notification for the range.
    std::vector<char> mem(sizeof(struct fuse_bufvec) + iov.size() * sizeof(struct fuse_buf));
    auto* bv = reinterpret_cast<struct fuse_bufvec*>(mem.data());
    bv->count = iov.size();
    for (size_t i = 0; i < iov.size(); ++i) {
      bv->buf[i] = fuse_buf{};
      bv->buf[i].size = iov[i].iov_len;
      bv->buf[i].mem = iov[i].iov_base;
    }
    const int rc = fuse_lowlevel_notify_store(se_, ino, static_cast<off_t>(offset), bv, fuse_buf_copy_flags{});
    MutexLock l(&mu_);
    --in_flight_;
    return rc;
  }
  // Whether the kernel's page cache holds the page at `offset` of node ino
  // (FUSE_NOTIFY_RETRIEVE: the kernel answers with the cached bytes from
  // there, as a request that OpRetrieveReply hands to Answer). False when it
  // does not, when the kernel does not hold the node, when no answer came
  // within kRetrieveWait, or once the daemon is exiting.
  bool Cached(fuse_ino_t ino, uint64_t offset) EXCLUDES(mu_) {
    uint64_t cookie;
    {
      MutexLock l(&mu_);
      if (refused_) return false;
      ++in_flight_;  // the session stays until the call returns (as for Store)
      cookie = ++next_cookie_;
      answers_.emplace(cookie, std::nullopt);
      unanswered_.insert(cookie);  // before the ask: the answer may come before the call returns
    }
    const int rc = fuse_lowlevel_notify_retrieve(se_, ino, kPageBytes, static_cast<off_t>(offset),
                                                 reinterpret_cast<void*>(cookie));
    MutexLock l(&mu_);
    --in_flight_;
    if (rc != 0) unanswered_.erase(cookie);
    if (rc == 0) {
      const auto deadline = std::chrono::steady_clock::now() + kRetrieveWait;
      while (!answers_[cookie].has_value()) {
        const auto left = deadline - std::chrono::steady_clock::now();
        if (left <= left.zero()) break;
        answered_.WaitFor(&mu_, left);
      }
    }
    const size_t got = answers_[cookie].value_or(0);
    answers_.erase(cookie);
    return got > 0;
  }
  void Answer(uint64_t cookie, size_t bytes) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    unanswered_.erase(cookie);
    auto it = answers_.find(cookie);
    if (it == answers_.end()) return;  // the asker stopped waiting
    it->second = bytes;
    answered_.SignalAll();
  }
  void Refuse() EXCLUDES(mu_) {
    MutexLock l(&mu_);
    refused_ = true;
  }
  int InFlight() EXCLUDES(mu_) {
    MutexLock l(&mu_);
    return in_flight_;
  }
  // Asks the kernel has not answered yet (an asker that stopped waiting
  // included). libfuse frees an ask's record only when its answer is
  // processed, so at exit the loop answers them before the session goes.
  size_t Unanswered() EXCLUDES(mu_) {
    MutexLock l(&mu_);
    return unanswered_.size();
  }

 private:
  static constexpr uint64_t kPageBytes = CachePusher::kPageBytes;
  // An answer is a round trip through the FUSE loop (tens of us); beyond this
  // the page counts as not cached.
  static constexpr std::chrono::milliseconds kRetrieveWait{20};

  struct fuse_session* const se_;
  Mutex mu_;
  CondVar answered_;  // with mu_: an answer came
  bool refused_ GUARDED_BY(mu_) = false;
  int in_flight_ GUARDED_BY(mu_) = 0;
  uint64_t next_cookie_ GUARDED_BY(mu_) = 0;
  std::unordered_map<uint64_t, std::optional<size_t>> answers_ GUARDED_BY(mu_);  // cookie -> bytes retrieved
  std::unordered_set<uint64_t> unanswered_ GUARDED_BY(mu_);  // cookies asked, no answer processed yet
};

}  // namespace optstate::mount::internal
