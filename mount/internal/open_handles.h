// The handles of open files and directories (fi->fh) and the set of those
// the kernel has not released yet. Internal to mount/.
#pragma once

#define FUSE_USE_VERSION 312
#include <fuse3/fuse_lowlevel.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace optstate::mount::internal {

// fi->fh of an open file or directory: a heap-allocated shared reference,
// deleted by release/releasedir. Every other handler takes its own reference
// before it replies and holds it until it returns: the kernel may send
// RELEASE as soon as it has copied the reply to the last request of a handle,
// while that request's handler is still running (a read still unpins its
// chunk after fuse_reply_iov; the reply's iovecs point into the handle's
// buffers). Without this a release could free a ChunkReader under a read
// that then unpinned (a write) into freed memory, and ASan saw releasedir free
// a listing that readdir's writev still read: the likely cause of the daemon's
// SIGSEGV in fuse_send_msg under the kill loop and of a hung `cp -r`. Taking
// the reference is safe: the kernel sends no RELEASE while a request on the
// handle is unanswered.
//
// Every handle not yet released is also in OpenHandles, which frees the
// ones left at exit: the kernel sends RELEASE asynchronously after the last
// close, so it can come after the loop has stopped (a `cp -r` closes its
// last file just before the unmount), and LeakSanitizer saw that handle,
// its reader and its buffers left over in the ASan run of
// MountTest.WalksIntoASnapshotLookUpEachNameOnce (the daemon exited 1).
class OpenHandles {
 public:
  static OpenHandles& Get() {
    static OpenHandles* const h = new OpenHandles();  // never destroyed: handlers may run until exit
    return *h;
  }
  void Add(uint64_t fh, void (*free_fn)(uint64_t)) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    live_.emplace(fh, free_fn);
  }
  void Remove(uint64_t fh) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    live_.erase(fh);
  }
  // REQUIRES: no handler runs any more (the loop has ended).
  size_t FreeAll() EXCLUDES(mu_) {
    std::unordered_map<uint64_t, void (*)(uint64_t)> left;
    {
      MutexLock l(&mu_);
      left.swap(live_);
    }
    for (const auto& [fh, free_fn] : left) free_fn(fh);
    return left.size();
  }

 private:
  Mutex mu_;
  std::unordered_map<uint64_t, void (*)(uint64_t)> live_ GUARDED_BY(mu_);
};

template <typename T>
uint64_t NewHandle(std::shared_ptr<T> h) {
  const uint64_t fh = reinterpret_cast<uint64_t>(new std::shared_ptr<T>(std::move(h)));
  OpenHandles::Get().Add(fh, [](uint64_t v) { delete reinterpret_cast<std::shared_ptr<T>*>(v); });
  return fh;
}
template <typename T>
std::shared_ptr<T> HandleOf(const struct fuse_file_info* fi) {
  if (fi == nullptr || fi->fh == 0) return nullptr;
  return *reinterpret_cast<const std::shared_ptr<T>*>(fi->fh);
}
template <typename T>
void DeleteHandle(struct fuse_file_info* fi) {
  OpenHandles::Get().Remove(fi->fh);
  delete reinterpret_cast<std::shared_ptr<T>*>(fi->fh);
  fi->fh = 0;
}

}  // namespace optstate::mount::internal
