// Helpers shared by the files of StreamedAdam and its step pipeline: element
// sizes, message text, and the checks of stored moment dtypes and gradient
// scales. Internal to memmgr.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

// Seconds on the steady clock (for stats).
double NowS();
// DTypeName, or "none" for an operand that was not given.
const char* DTypeText(const std::optional<DType>& t);

// s with "; note" appended to its message (s unchanged when note is empty).
Status WithNote(const Status& s, const std::string& note);
std::string DimsText(const std::vector<uint64_t>& v);

// "'a' (10 elements), 'b' (3 elements), ..." of at most 8 names.
template <typename It, typename Numel>
std::string NameList(It first, It last, Numel numel) {
  std::string out;
  size_t n = 0;
  for (It it = first; it != last; ++it, ++n) {
    if (n == 8) {
      out += ", ...";
      break;
    }
    out += (n ? ", '" : "'") + *it + "'";
    const uint64_t e = numel(*it);
    if (e != 0) out += " (" + std::to_string(e) + " elements)";
  }
  return out;
}

// kInvalidArgument naming the store, the tensor, the field and both dtypes
// when a moment field of t is not stored as `want`.
Status CheckMomentFields(const vfs::TensorInfo& t, const std::string& store_path, MomentDType moment);

// A gradient scale is usable when finite and > 0.
Status CheckGradScale(float s, const std::string& what, const std::string& store_path);
}  // namespace optstate::memmgr::internal
