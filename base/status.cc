#include "base/status.h"

#include <cstring>

namespace optstate {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kBusy: return "Busy";
    case StatusCode::kResourceExhausted: return "ResourceExhausted";
    case StatusCode::kNoSpace: return "NoSpace";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kDataLoss: return "DataLoss";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kUnimplemented: return "Unimplemented";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

int Status::ToErrno() const {
  if (ok()) return 0;
  if (errno_ != 0) return errno_;
  switch (code_) {
    case StatusCode::kInvalidArgument: return EINVAL;
    case StatusCode::kNotFound: return ENOENT;
    case StatusCode::kAlreadyExists: return EEXIST;
    case StatusCode::kBusy: return EBUSY;
    case StatusCode::kResourceExhausted: return ENOMEM;
    case StatusCode::kNoSpace: return ENOSPC;
    case StatusCode::kCancelled: return ECANCELED;
    case StatusCode::kUnimplemented: return ENOSYS;
    case StatusCode::kFailedPrecondition: return EPERM;
    default: return EIO;
  }
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m), errno_);
}

Status ErrnoStatus(std::string_view what, int err) {
  StatusCode code = StatusCode::kIoError;
  switch (err) {
    case ENOSPC:
    case EDQUOT: code = StatusCode::kNoSpace; break;
    case ENOENT: code = StatusCode::kNotFound; break;
    case EEXIST: code = StatusCode::kAlreadyExists; break;
    case EBUSY:
    case EWOULDBLOCK: code = StatusCode::kBusy; break;
    case EINVAL: code = StatusCode::kInvalidArgument; break;
    case EMFILE:
    case ENFILE:
    case ENOMEM: code = StatusCode::kResourceExhausted; break;
    default: break;
  }
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  m += " (errno ";
  m += std::to_string(err);
  m += ")";
  return Status(code, std::move(m), err);
}

}  // namespace optstate
