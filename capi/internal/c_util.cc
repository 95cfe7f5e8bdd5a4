// The error plumbing of the C ABI (capi/internal/c_types.h).
#include "capi/internal/c_types.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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
    std::lock_guard<std::mutex> lock(store->open_mu);
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
