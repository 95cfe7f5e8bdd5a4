// The error plumbing of the C ABI (capi/internal/c_types.h).
#include "capi/internal/c_types.h"

#include <cstdlib>
#include <cstring>
#include <string>

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

}  // namespace optstate::capi::internal
