// Status and Result<T>: how every part of optstate reports failure.
//
// No exceptions cross a boundary: FUSE callbacks reply with an errno, io_uring
// reports -errno in a completion, CUDA reports at a later sync, RocksDB returns
// its own Status. Each foreign error is converted to a Status in exactly one
// function (ErrnoStatus here, RocksStatus in vfs/internal, CudaStatus in
// memmgr/internal) and back to errno at the FUSE edge (Status::ToErrno).
//
// Messages name the thing: store path, tensor, field, chunk, generation, file,
// offset, errno text. A user must be able to act on the message alone.
// Thread-safety: values; safe to copy between threads.
#pragma once

#include <cerrno>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace optstate {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     // bad input from the caller (names, sizes, flags)
  kNotFound,            // store, tensor, field, snapshot, generation missing
  kAlreadyExists,
  kFailedPrecondition,  // wrong state: store poisoned, pins outstanding, ...
  kBusy,                // held by another process (lock), mountpoint in use
  kResourceExhausted,   // budget, fd limit, memlock, queue full
  kNoSpace,             // ENOSPC / EDQUOT
  kIoError,             // any other I/O failure; errno() says which
  kCorruption,          // checksum mismatch, bad record, damaged store
  kDataLoss,            // acknowledged data is gone (failed fsync poisoning)
  kCancelled,
  kUnimplemented,
  kInternal,            // a bug of ours
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, int err = 0)
      : code_(code), errno_(err), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // The errno behind an I/O failure, 0 when there is none.
  int err() const { return errno_; }
  const std::string& message() const { return message_; }
  // "IoError: pwrite /nvme/s/data.0 offset 8388608: No space left on device (errno 28)"
  std::string ToString() const;
  // Errno for a FUSE reply: the recorded errno when there is one, else a
  // mapping of the code (kNotFound->ENOENT, kCorruption->EIO, ...).
  int ToErrno() const;
  // Returns a copy with "context: " prepended to the message.
  Status WithContext(std::string_view context) const;

  bool IsNotFound() const { return code_ == StatusCode::kNotFound; }
  bool IsCorruption() const { return code_ == StatusCode::kCorruption; }
  bool IsNoSpace() const { return code_ == StatusCode::kNoSpace; }

 private:
  StatusCode code_ = StatusCode::kOk;
  int errno_ = 0;
  std::string message_;
};

// The one conversion of errno to Status: "<what>: <strerror> (errno N)".
// ENOSPC/EDQUOT -> kNoSpace, ENOENT -> kNotFound, EEXIST -> kAlreadyExists,
// EBUSY/EWOULDBLOCK -> kBusy, EINVAL -> kInvalidArgument, EMFILE/ENFILE/ENOMEM
// -> kResourceExhausted, anything else -> kIoError.
Status ErrnoStatus(std::string_view what, int err);

inline Status InvalidArgument(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
inline Status NotFound(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
inline Status AlreadyExists(std::string m) { return Status(StatusCode::kAlreadyExists, std::move(m)); }
inline Status FailedPrecondition(std::string m) { return Status(StatusCode::kFailedPrecondition, std::move(m)); }
inline Status Busy(std::string m) { return Status(StatusCode::kBusy, std::move(m)); }
inline Status ResourceExhausted(std::string m) { return Status(StatusCode::kResourceExhausted, std::move(m)); }
inline Status Corruption(std::string m) { return Status(StatusCode::kCorruption, std::move(m)); }
inline Status DataLoss(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }
inline Status Internal(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
inline Status Unimplemented(std::string m) { return Status(StatusCode::kUnimplemented, std::move(m)); }
inline Status IoError(std::string m, int err = 0) { return Status(StatusCode::kIoError, std::move(m), err); }

// Result<T>: a T or a non-OK Status, shaped like std::expected<T, Status>.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}  // NOLINT
  Result(Status status) : v_(std::in_place_index<1>, std::move(status)) {  // NOLINT
    if (std::get<1>(v_).ok()) {
      v_.template emplace<1>(Internal("Result constructed from an OK Status"));
    }
  }
  template <typename U, typename = std::enable_if_t<std::is_convertible_v<U&&, T> &&
                                                    !std::is_same_v<std::decay_t<U>, Status> &&
                                                    !std::is_same_v<std::decay_t<U>, T>>>
  Result(U&& value) : v_(std::in_place_index<0>, T(std::forward<U>(value))) {}  // NOLINT

  bool ok() const { return v_.index() == 0; }
  bool has_value() const { return ok(); }
  explicit operator bool() const { return ok(); }
  // REQUIRES: ok()
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  // OK when a value is held.
  Status status() const { return ok() ? Status() : std::get<1>(v_); }
  const Status& error() const { return std::get<1>(v_); }

 private:
  std::variant<T, Status> v_;
};

#define OPTSTATE_CONCAT_INNER_(a, b) a##b
#define OPTSTATE_CONCAT_(a, b) OPTSTATE_CONCAT_INNER_(a, b)

#define OPTSTATE_RETURN_IF_ERROR(expr)              \
  do {                                              \
    ::optstate::Status optstate_status_ = (expr);   \
    if (!optstate_status_.ok()) return optstate_status_; \
  } while (0)

#define OPTSTATE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()

// OPTSTATE_ASSIGN_OR_RETURN(auto x, MakeX()); or (x, MakeX());
#define OPTSTATE_ASSIGN_OR_RETURN(lhs, expr) \
  OPTSTATE_ASSIGN_OR_RETURN_IMPL_(OPTSTATE_CONCAT_(optstate_result_, __LINE__), lhs, expr)

}  // namespace optstate
