// The error plumbing of the C ABI (capi/internal/c_types.h).
#include "capi/internal/c_types.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "kernels/adam.h"

// optstate/c.h's copies of the vocabulary (its codes and dtypes) are
// base's: a row added or renumbered on one side fails the build here.
#define OPTSTATE_SAME_CODE(c, k) \
  static_assert(c == static_cast<int>(optstate::StatusCode::k), #c " is not StatusCode::" #k)
OPTSTATE_SAME_CODE(OPTSTATE_OK, kOk);
OPTSTATE_SAME_CODE(OPTSTATE_INVALID_ARGUMENT, kInvalidArgument);
OPTSTATE_SAME_CODE(OPTSTATE_NOT_FOUND, kNotFound);
OPTSTATE_SAME_CODE(OPTSTATE_ALREADY_EXISTS, kAlreadyExists);
OPTSTATE_SAME_CODE(OPTSTATE_FAILED_PRECONDITION, kFailedPrecondition);
OPTSTATE_SAME_CODE(OPTSTATE_BUSY, kBusy);
OPTSTATE_SAME_CODE(OPTSTATE_RESOURCE_EXHAUSTED, kResourceExhausted);
OPTSTATE_SAME_CODE(OPTSTATE_NO_SPACE, kNoSpace);
OPTSTATE_SAME_CODE(OPTSTATE_IO_ERROR, kIoError);
OPTSTATE_SAME_CODE(OPTSTATE_CORRUPTION, kCorruption);
OPTSTATE_SAME_CODE(OPTSTATE_DATA_LOSS, kDataLoss);
OPTSTATE_SAME_CODE(OPTSTATE_CANCELLED, kCancelled);
OPTSTATE_SAME_CODE(OPTSTATE_UNIMPLEMENTED, kUnimplemented);
OPTSTATE_SAME_CODE(OPTSTATE_INTERNAL, kInternal);
#undef OPTSTATE_SAME_CODE

#define OPTSTATE_SAME_DTYPE(c, k) \
  static_assert(c == static_cast<int>(optstate::DType::k), #c " is not DType::" #k)
OPTSTATE_SAME_DTYPE(OPTSTATE_F32, kF32);
OPTSTATE_SAME_DTYPE(OPTSTATE_BF16, kBF16);
OPTSTATE_SAME_DTYPE(OPTSTATE_F16, kF16);
OPTSTATE_SAME_DTYPE(OPTSTATE_Q8S, kQ8S);
OPTSTATE_SAME_DTYPE(OPTSTATE_Q8U, kQ8U);
#undef OPTSTATE_SAME_DTYPE
static_assert(OPTSTATE_NONE == optstate::kernels::kNoDTypeCode, "OPTSTATE_NONE is not kNoDTypeCode");

namespace optstate::capi::internal {

int SaveError(char** errptr, const Status& s) {
  if (s.ok()) return OPTSTATE_OK;
  if (errptr != nullptr) {
    std::free(*errptr);
    *errptr = strdup(s.ToString().c_str());
  }
  return static_cast<int>(s.code());
}

Status NullArgument(const char* what, const char* arg) {
  return InvalidArgument(std::string(what) + ": " + arg + " is NULL");
}

Status WaitForCommits(optstate_store_t* store, const char* what) {
  std::vector<optstate_adam_t*> adams;
  {
    optstate::MutexLock lock(&store->open_mu);
    adams.assign(store->open_adams.begin(), store->open_adams.end());
  }
  for (optstate_adam_t* a : adams) {
    Status st = a->rep->WaitForCommit();
    if (!st.ok()) {
      return st.WithContext(std::string(what) + ": the last step's commit to store " + store->rep->path() +
                            " failed");
    }
  }
  return Status::Ok();
}

}  // namespace optstate::capi::internal
