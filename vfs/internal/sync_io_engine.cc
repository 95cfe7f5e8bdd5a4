#include "vfs/internal/sync_io_engine.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/log.h"

namespace optstate::vfs::internal {
namespace {

constexpr uint64_t kAlign = 4096;
constexpr int kMaxNoProgress = 1000;

std::string Describe(const IoRequest& r, uint64_t offset, uint64_t len) {
  std::string s = r.op == IoRequest::Op::kRead ? "pread " : "pwrite ";
  s += r.file->path();
  s += " offset ";
  s += std::to_string(offset);
  s += " length ";
  s += std::to_string(len);
  return s;
}

}  // namespace

Result<std::unique_ptr<IoEngine>> SyncIoEngine::Create(uint64_t staging_bytes) {
  if (staging_bytes == 0) return InvalidArgument("sync io engine: staging_bytes must be > 0");
  staging_bytes = (staging_bytes + kAlign - 1) / kAlign * kAlign;
  std::unique_ptr<SyncIoEngine> e(new SyncIoEngine());
  void* p = nullptr;
  if (int rc = ::posix_memalign(&p, kAlign, staging_bytes); rc != 0) {
    return ErrnoStatus("sync io engine: allocate " + std::to_string(staging_bytes) +
                           " bytes of staging buffer",
                       rc);
  }
  e->staging_ = static_cast<std::byte*>(p);
  e->staging_bytes_ = staging_bytes;
  if (::mlock(p, staging_bytes) == 0) {
    e->locked_ = true;
  } else {
    OPTSTATE_LOG_DEBUG("sync io engine: mlock of {} bytes of staging failed ({}); using it unpinned",
                       staging_bytes, std::strerror(errno));
  }
  return std::unique_ptr<IoEngine>(std::move(e));
}

SyncIoEngine::~SyncIoEngine() {
  if (staging_ != nullptr) {
    if (locked_) ::munlock(staging_, staging_bytes_);
    std::free(staging_);
  }
}

Status SyncIoEngine::Transfer(const IoRequest& r, bool read, uint64_t offset, uint64_t len) {
  const int fd = r.file->fd();
  uint64_t done = 0;
  int no_progress = 0;
  while (done < len) {
    ssize_t n = read ? ::pread(fd, staging_ + done, len - done, static_cast<off_t>(offset + done))
                     : ::pwrite(fd, staging_ + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      int err = errno;
      if ((err == EINTR || err == EAGAIN) && ++no_progress < kMaxNoProgress) continue;
      return ErrnoStatus(Describe(r, r.offset, r.length) + " (failed at file offset " +
                             std::to_string(offset + done) + ")",
                         err);
    }
    if (n == 0) {
      if (read) {
        return IoError(Describe(r, r.offset, r.length) + ": end of file at offset " +
                       std::to_string(offset + done) + " (the file is shorter than the range read)");
      }
      if (++no_progress >= kMaxNoProgress) {
        return IoError(Describe(r, r.offset, r.length) + ": no progress", EIO);
      }
      continue;
    }
    no_progress = 0;
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status SyncIoEngine::DoRequest(const IoRequest& r, uint64_t first_len) {
  const bool read = r.op == IoRequest::Op::kRead;
  const bool direct = r.file->direct();
  auto* user = static_cast<std::byte*>(r.buf);
  uint64_t done = 0;
  while (done < r.length) {
    uint64_t piece = std::min(staging_bytes_, r.length - done);
    // A hook's short transfer: the first piece stops early, the rest follows
    // (block-aligned for O_DIRECT files).
    if (done == 0 && first_len < piece) {
      piece = direct ? first_len - first_len % kAlign : first_len;
      if (piece == 0) piece = std::min(staging_bytes_, r.length);
    }
    if (read) {
      OPTSTATE_RETURN_IF_ERROR(Transfer(r, true, r.offset + done, piece));
      std::memcpy(user + done, staging_, piece);
    } else {
      std::memcpy(staging_, user + done, piece);
      OPTSTATE_RETURN_IF_ERROR(Transfer(r, false, r.offset + done, piece));
    }
    done += piece;
  }
  return Status::Ok();
}

Status SyncIoEngine::Submit(std::span<const IoRequest> requests) {
  for (const IoRequest& r : requests) {
    if (r.file == nullptr) return InvalidArgument("sync io request tag " + std::to_string(r.tag) + ": null file");
    if (r.op != IoRequest::Op::kRead && r.op != IoRequest::Op::kWrite) {
      return InvalidArgument(Describe(r, r.offset, r.length) + ": unknown op");
    }
    if (r.buf == nullptr && r.length > 0) return InvalidArgument(Describe(r, r.offset, r.length) + ": null buffer");
    if (r.file->direct() && (r.offset % kAlign != 0 || r.length % kAlign != 0 ||
                             reinterpret_cast<uintptr_t>(r.buf) % kAlign != 0)) {
      return InvalidArgument(Describe(r, r.offset, r.length) +
                             ": O_DIRECT file needs offset, length and buffer aligned to 4096");
    }
  }
  for (const IoRequest& r : requests) {
    uint64_t first_len = r.length;
    FaultHooks* h = r.file->hooks();
    if (h != nullptr) {
      OpClass c = r.op == IoRequest::Op::kRead ? OpClass::kRead : OpClass::kWrite;
      Status s = h->BeforeOp(c, r.file->path(), r.offset, r.length, &first_len);
      if (!s.ok()) {
        ready_.push_back(IoCompletion{r.tag, std::move(s)});
        continue;
      }
    }
    Status s = DoRequest(r, first_len);
    if (s.ok() && h != nullptr && r.op == IoRequest::Op::kWrite) h->AfterWrite(r.file->path(), r.offset, r.length);
    ready_.push_back(IoCompletion{r.tag, std::move(s)});
  }
  return Status::Ok();
}

Status SyncIoEngine::Reap(std::vector<IoCompletion>* out, size_t /*min_complete*/) {
  // Everything submitted has already completed.
  while (!ready_.empty()) {
    out->push_back(std::move(ready_.front()));
    ready_.pop_front();
  }
  return Status::Ok();
}

}  // namespace optstate::vfs::internal
