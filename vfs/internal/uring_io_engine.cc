#include "vfs/internal/uring_io_engine.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "base/log.h"

namespace optstate::vfs::internal {
namespace {

constexpr uint64_t kDirectAlign = 4096;
// One SQE moves at most this much; a larger request continues as if short.
// (io_uring reports results as int32, and registered buffers are at most 1 GiB.)
constexpr uint64_t kMaxSqeBytes = 1ull << 30;
// Consecutive -EAGAIN/-EINTR results before the request fails with that errno.
constexpr uint32_t kMaxRetries = 1000;
// Consecutive completions that moved no byte (a read at or past end of file,
// a device reporting 0) before the request fails: retried, never looped on.
constexpr uint32_t kMaxZeroResults = 3;
// IoEngineOptions::max_sqe_bytes: parts per request at most.
constexpr uint64_t kMaxParts = 16;
// user_data of the wake poll's CQEs (op indexes are < 32768).
constexpr uint64_t kWakeTag = UINT64_MAX;

const char* OpName(IoRequest::Op op) { return op == IoRequest::Op::kRead ? "read" : "write"; }

std::string Describe(const IoRequest& r) {
  std::string s = "io_uring ";
  s += OpName(r.op);
  s += ' ';
  s += r.file != nullptr ? r.file->path() : std::string("<null file>");
  s += " offset ";
  s += std::to_string(r.offset);
  s += " length ";
  s += std::to_string(r.length);
  return s;
}

}  // namespace

UringIoEngine::UringIoEngine(const IoEngineOptions& opts) : opts_(opts) {}

Result<std::unique_ptr<IoEngine>> UringIoEngine::Create(const IoEngineOptions& opts) {
  if (opts.queue_depth == 0) return InvalidArgument("io_uring engine: queue_depth must be > 0");
  if (opts.queue_depth > 32768) {
    return InvalidArgument("io_uring engine: queue_depth " + std::to_string(opts.queue_depth) +
                           " exceeds the io_uring limit of 32768");
  }
  std::unique_ptr<UringIoEngine> e(new UringIoEngine(opts));
  OPTSTATE_RETURN_IF_ERROR(e->Init());
  return std::unique_ptr<IoEngine>(std::move(e));
}

Status UringIoEngine::Init() {
  queue_depth_ = opts_.queue_depth;
  if (opts_.max_sqe_bytes % kDirectAlign != 0) {
    return InvalidArgument("io_uring engine: max_sqe_bytes " + std::to_string(opts_.max_sqe_bytes) +
                           " is not a multiple of 4096");
  }
  ring_entries_ = static_cast<uint32_t>(
      std::min<uint64_t>(32768, uint64_t{queue_depth_} * (opts_.max_sqe_bytes > 0 ? kMaxParts : 1)));
  unsigned flags = opts_.sqpoll ? IORING_SETUP_SQPOLL : 0;
  int rc = io_uring_queue_init(ring_entries_ + (opts_.wakeable ? 1 : 0), &ring_, flags);
  if (rc < 0) {
    return ErrnoStatus("io_uring_queue_init (queue depth " + std::to_string(queue_depth_) +
                           (opts_.sqpoll ? ", SQPOLL" : "") +
                           "): io_uring is unavailable (kernel.io_uring_disabled, seccomp, a "
                           "container policy or RLIMIT_MEMLOCK); use the sync engine instead",
                       -rc);
  }
  ring_ok_ = true;

  // Registered buffers, split into pieces of at most 1 GiB (the kernel's limit
  // per registered buffer).
  std::vector<iovec> iovs;
  for (const auto& span : opts_.registered_buffers) {
    for (size_t off = 0; off < span.size(); off += kMaxSqeBytes) {
      size_t len = std::min<size_t>(kMaxSqeBytes, span.size() - off);
      buffers_.push_back(span.subspan(off, len));
      iovs.push_back(iovec{span.data() + off, len});
    }
  }
  if (!iovs.empty()) {
    rc = io_uring_register_buffers(&ring_, iovs.data(), static_cast<unsigned>(iovs.size()));
    if (rc < 0) {
      uint64_t total = 0;
      for (const auto& b : buffers_) total += b.size();
      return ErrnoStatus("io_uring_register_buffers (" + std::to_string(iovs.size()) +
                             " buffers, " + std::to_string(total) +
                             " bytes): registered buffers count against RLIMIT_MEMLOCK "
                             "(ulimit -l) for non-root users; raise it or register less",
                         -rc);
    }
  }

  if (opts_.registered_file_slots > 0) {
    rc = io_uring_register_files_sparse(&ring_, opts_.registered_file_slots);
    if (rc < 0) {
      // Sparse file tables need Linux 5.19; plain fds work everywhere.
      OPTSTATE_LOG_DEBUG("io_uring_register_files_sparse({}): {}; using plain fds",
                         opts_.registered_file_slots, std::strerror(-rc));
    } else {
      file_slots_ = opts_.registered_file_slots;
    }
  }
  ops_.resize(ring_entries_);
  free_ops_.reserve(ring_entries_);
  for (uint32_t i = ring_entries_; i > 0; --i) free_ops_.push_back(i - 1);
  requests_.resize(queue_depth_);
  free_requests_.reserve(queue_depth_);
  for (uint32_t i = queue_depth_; i > 0; --i) free_requests_.push_back(i - 1);
  if (opts_.wakeable) {
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) return ErrnoStatus("io_uring engine: eventfd for Wake()", errno);
    ArmWake();
    OPTSTATE_RETURN_IF_ERROR(SubmitPrepared());
  }
  return Status::Ok();
}

void UringIoEngine::ArmWake() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  while (sqe == nullptr) {  // only with SQPOLL (see Prepare)
    io_uring_submit(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  io_uring_prep_poll_multishot(sqe, wake_fd_, POLLIN);
  io_uring_sqe_set_data64(sqe, kWakeTag);
  ++prepared_;
}

void UringIoEngine::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  // EAGAIN only when the counter is about to overflow: a wake is pending anyway.
  (void)!::write(wake_fd_, &one, sizeof(one));
}

UringIoEngine::~UringIoEngine() {
  if (!ring_ok_) return;
  // The kernel may still write into callers' buffers: wait for everything.
  while (active_ > 0) {
    Status s = WaitOne();
    if (!s.ok()) {
      OPTSTATE_LOG_ERROR("io_uring engine: abandoning {} requests at destruction: {}", active_,
                         s.ToString());
      break;
    }
  }
  io_uring_queue_exit(&ring_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

Status UringIoEngine::Validate(const IoRequest& r) const {
  if (r.op != IoRequest::Op::kRead && r.op != IoRequest::Op::kWrite) {
    return InvalidArgument(Describe(r) + ": unknown op " + std::to_string(static_cast<int>(r.op)));
  }
  if (r.file == nullptr) {
    return InvalidArgument("io_uring request tag " + std::to_string(r.tag) + ": null file");
  }
  if (r.buf == nullptr && r.length > 0) return InvalidArgument(Describe(r) + ": null buffer");
  if (r.file->direct() &&
      (r.offset % kDirectAlign != 0 || r.length % kDirectAlign != 0 ||
       reinterpret_cast<uintptr_t>(r.buf) % kDirectAlign != 0)) {
    return InvalidArgument(Describe(r) +
                           ": O_DIRECT file needs offset, length and buffer aligned to 4096");
  }
  return Status::Ok();
}

int UringIoEngine::BufIndexFor(const IoRequest& r) const {
  auto* b = static_cast<std::byte*>(r.buf);
  for (size_t i = 0; i < buffers_.size(); ++i) {
    std::byte* lo = buffers_[i].data();
    if (b >= lo && b + r.length <= lo + buffers_[i].size()) return static_cast<int>(i);
  }
  return -1;
}

int UringIoEngine::FileSlotFor(const IoRequest& r, std::unordered_map<int, int>* checked) {
  if (file_slots_ == 0) return -1;
  const int fd = r.file->fd();
  if (auto it = checked->find(fd); it != checked->end()) return it->second;
  // fds are reused after close: a slot is only valid while it holds the same
  // open file (device, inode and open flags).
  struct stat st;
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fstat(fd, &st) != 0) {
    (*checked)[fd] = -1;
    return -1;  // the plain fd will report the error in the completion
  }
  FileSlot want{fd, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), flags};
  int slot = -1;
  if (auto it = fd_to_slot_.find(fd); it != fd_to_slot_.end()) {
    const FileSlot& have = slots_[it->second];
    if (have.dev == want.dev && have.ino == want.ino && have.flags == want.flags) {
      (*checked)[fd] = it->second;
      return it->second;
    }
    slot = it->second;  // same fd number, another file: replace in place
  } else if (slots_.size() < file_slots_) {
    slot = static_cast<int>(slots_.size());
    slots_.push_back(FileSlot{});
  } else {
    // In-flight requests keep their file referenced in the kernel, so an
    // occupied slot may be replaced at any time.
    slot = static_cast<int>(next_evict_++ % file_slots_);
    fd_to_slot_.erase(slots_[slot].fd);
  }
  int rc = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &want.fd, 1);
  if (rc < 0) {
    OPTSTATE_LOG_DEBUG("io_uring_register_files_update slot {} fd {} ({}): {}; using the plain fd",
                       slot, fd, r.file->path(), std::strerror(-rc));
    slots_[slot] = FileSlot{};
    (*checked)[fd] = -1;
    return -1;
  }
  slots_[slot] = want;
  fd_to_slot_[fd] = slot;
  (*checked)[fd] = slot;
  return slot;
}

void UringIoEngine::Prepare(uint32_t idx) {
  Op& op = ops_[idx];
  if (op.first_len == UINT64_MAX) ++stats_.resubmissions;
  uint64_t remaining = op.req.length - op.done;
  if (op.first_len < remaining) remaining = op.first_len;  // a hook's short first transfer
  op.first_len = UINT64_MAX;
  const auto len = static_cast<uint32_t>(std::min(remaining, kMaxSqeBytes));
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  while (sqe == nullptr) {
    // Only with SQPOLL can the ring be full here (the kernel thread has not
    // consumed yet); otherwise active_ <= ring_entries_ = SQ entries.
    io_uring_submit(&ring_);
    io_uring_sqring_wait(&ring_);
    sqe = io_uring_get_sqe(&ring_);
  }
  const int fd = op.file_slot >= 0 ? op.file_slot : op.req.file->fd();
  char* buf = static_cast<char*>(op.req.buf) + op.done;
  const uint64_t off = op.req.offset + op.done;
  if (op.req.op == IoRequest::Op::kRead) {
    if (op.buf_index >= 0) {
      io_uring_prep_read_fixed(sqe, fd, buf, len, off, op.buf_index);
    } else {
      io_uring_prep_read(sqe, fd, buf, len, off);
    }
  } else {
    if (op.buf_index >= 0) {
      io_uring_prep_write_fixed(sqe, fd, buf, len, off, op.buf_index);
    } else {
      io_uring_prep_write(sqe, fd, buf, len, off);
    }
  }
  if (op.file_slot >= 0) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data64(sqe, idx);
  op.sqe_len = len;
  ++prepared_;
  ++stats_.sqes;
  if (op.buf_index >= 0) ++stats_.fixed_buffer_sqes;
  if (op.file_slot >= 0) ++stats_.fixed_file_sqes;
}

void UringIoEngine::Finish(uint32_t idx, Status status) {
  Op& op = ops_[idx];
  if (status.ok() && op.req.op == IoRequest::Op::kWrite) {
    if (FaultHooks* h = op.req.file->hooks()) h->AfterWrite(op.req.file->path(), op.req.offset, op.req.length);
  }
  Request& r = requests_[op.request];
  if (!status.ok() && r.status.ok()) r.status = std::move(status);
  if (--r.parts_left == 0) {
    ready_.push_back(IoCompletion{r.tag, std::move(r.status)});
    r = Request{};
    free_requests_.push_back(op.request);
    --requests_active_;
  }
  op = Op{};
  free_ops_.push_back(idx);
  --active_;
}

void UringIoEngine::Process(const io_uring_cqe* cqe) {
  if (io_uring_cqe_get_data64(cqe) == kWakeTag) {
    uint64_t count = 0;
    (void)!::read(wake_fd_, &count, sizeof(count));  // reset; EAGAIN: already read
    woken_ = true;
    if ((cqe->flags & IORING_CQE_F_MORE) == 0) ArmWake();  // the kernel ended the multishot poll
    return;
  }
  const auto idx = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
  Op& op = ops_[idx];
  int32_t res = cqe->res;
  if (opts_.completion_fault) res = opts_.completion_fault(op.req, op.req.offset + op.done, op.sqe_len, res);
  if (res < 0) {
    const int err = -res;
    if ((err == EAGAIN || err == EINTR) && ++op.retries < kMaxRetries) {
      Prepare(idx);
      return;
    }
    Finish(idx, ErrnoStatus(Describe(op.req) + " (failed at byte " + std::to_string(op.done) + ")", err));
    return;
  }
  op.retries = 0;
  const uint64_t before = op.done;
  op.done += std::min<uint64_t>(static_cast<uint64_t>(res), op.sqe_len);
  if (op.done >= op.req.length) {
    Finish(idx, Status::Ok());
    return;
  }
  // A short O_DIRECT transfer that ends mid-block: redo from the block start
  // so the remainder stays aligned (re-reading/re-writing the same bytes).
  if (op.direct) op.done -= op.done % kDirectAlign;
  if (op.done == before) {
    if (++op.zero_results >= kMaxZeroResults) {
      std::string what = Describe(op.req) + ": " + std::to_string(kMaxZeroResults) +
                         " completions in a row moved no byte at byte " + std::to_string(op.done);
      what += op.req.op == IoRequest::Op::kRead ? " (end of file: the file is shorter than the range read)"
                                                 : " (the device accepts no data)";
      Finish(idx, IoError(std::move(what), op.req.op == IoRequest::Op::kRead ? 0 : EIO));
      return;
    }
  } else {
    op.zero_results = 0;
  }
  Prepare(idx);
}

void UringIoEngine::DrainReady() {
  io_uring_cqe* cqe = nullptr;
  while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
    io_uring_cqe local = *cqe;
    io_uring_cqe_seen(&ring_, cqe);
    Process(&local);
  }
}

Status UringIoEngine::SubmitPrepared() {
  while (prepared_ > 0) {
    int rc = io_uring_submit(&ring_);
    if (rc == -EINTR) continue;
    if (rc == -EAGAIN || rc == -EBUSY) return Status::Ok();  // retried by the next wait
    if (rc < 0) return ErrnoStatus("io_uring_submit", -rc);
    prepared_ -= std::min<uint32_t>(prepared_, static_cast<uint32_t>(rc));
    if (rc == 0) break;
  }
  return Status::Ok();
}

Status UringIoEngine::WaitOne() {
  int rc;
  do {
    if (prepared_ > 0) {
      rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc >= 0) {
        prepared_ -= std::min<uint32_t>(prepared_, static_cast<uint32_t>(rc));
        rc = 0;
      }
    } else {
      io_uring_cqe* cqe = nullptr;
      rc = io_uring_wait_cqe(&ring_, &cqe);
    }
  } while (rc == -EINTR);
  if (rc < 0) return ErrnoStatus("io_uring wait for completions", -rc);
  DrainReady();
  return Status::Ok();
}

Status UringIoEngine::Submit(std::span<const IoRequest> requests) {
  for (const IoRequest& r : requests) OPTSTATE_RETURN_IF_ERROR(Validate(r));
  std::unordered_map<int, int> checked;  // fds validated in this call
  for (const IoRequest& r : requests) {
    ++stats_.requests;
    uint64_t first_len = r.length;
    if (FaultHooks* h = r.file->hooks()) {
      OpClass c = r.op == IoRequest::Op::kRead ? OpClass::kRead : OpClass::kWrite;
      Status s = h->BeforeOp(c, r.file->path(), r.offset, r.length, &first_len);
      if (!s.ok()) {
        ++accepted_;
        ready_.push_back(IoCompletion{r.tag, std::move(s)});
        continue;
      }
    }
    if (r.length == 0) {
      ++accepted_;
      ready_.push_back(IoCompletion{r.tag, Status::Ok()});
      continue;
    }
    // Parts: max_sqe_bytes each (at most kMaxParts); not when a hook asked
    // for a short first transfer (tests of the remainder path).
    uint64_t part = r.length;
    if (opts_.max_sqe_bytes > 0 && r.length > opts_.max_sqe_bytes && first_len == r.length) {
      const uint64_t even = (r.length + kMaxParts - 1) / kMaxParts;
      part = std::max(opts_.max_sqe_bytes, (even + kDirectAlign - 1) / kDirectAlign * kDirectAlign);
    }
    const auto parts = static_cast<uint32_t>((r.length + part - 1) / part);
    while (requests_active_ >= queue_depth_ || active_ + parts > ring_entries_) {
      OPTSTATE_RETURN_IF_ERROR(WaitOne());
    }
    const uint32_t ri = free_requests_.back();
    free_requests_.pop_back();
    requests_[ri] = Request{r.tag, parts, Status::Ok()};
    ++requests_active_;
    ++accepted_;
    const int file_slot = FileSlotFor(r, &checked);
    if (parts > 1) OPTSTATE_RETURN_IF_ERROR(SubmitPrepared());  // see below: unplugged
    for (uint32_t k = 0; k < parts; ++k) {
      uint32_t idx = free_ops_.back();
      free_ops_.pop_back();
      Op& op = ops_[idx];
      op = Op{};
      op.req = r;
      op.req.offset = r.offset + k * part;
      op.req.length = std::min(part, r.length - k * part);
      op.req.buf = static_cast<std::byte*>(r.buf) + k * part;
      op.request = ri;
      op.direct = r.file->direct();
      op.first_len = parts == 1 ? first_len : op.req.length;
      if (op.direct) op.first_len -= op.first_len % kDirectAlign;
      op.buf_index = BufIndexFor(op.req);
      op.file_slot = file_slot;
      ++active_;
      Prepare(idx);
      // io_uring plugs the block layer for a batch of more than two SQEs,
      // and a plug merges adjacent bios into one request up to
      // max_sectors_kb: the parts would reach the disk as the large request
      // the split exists to avoid. At most two per io_uring_enter: unplugged.
      if (parts > 1 && prepared_ >= 2) OPTSTATE_RETURN_IF_ERROR(SubmitPrepared());
    }
  }
  return opts_.defer_submit ? Status::Ok() : SubmitPrepared();
}

Status UringIoEngine::Reap(std::vector<IoCompletion>* out, size_t min_complete) {
  OPTSTATE_RETURN_IF_ERROR(SubmitPrepared());
  DrainReady();
  size_t got = 0;
  auto move_ready = [&] {
    while (!ready_.empty()) {
      out->push_back(std::move(ready_.front()));
      ready_.pop_front();
      ++got;
      ++delivered_;
    }
  };
  move_ready();
  while (got < min_complete && active_ > 0 && !woken_) {
    OPTSTATE_RETURN_IF_ERROR(WaitOne());
    move_ready();
  }
  woken_ = false;
  // Resubmissions prepared while draining must reach the kernel now, or a
  // caller polling with min_complete 0 would never see them finish.
  return SubmitPrepared();
}

}  // namespace optstate::vfs::internal
