// Helpers shared by the files of StreamedAdam and its step pipeline: scalar
// types, message text, and the checks of stored moment dtypes and gradient
// scales. Internal to memmgr.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/adam.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::memmgr::internal {

// Seconds on the steady clock (for stats).
double NowS();
uint32_t ScalarSize(kernels::ScalarType t);
const char* ScalarName(kernels::ScalarType t);
bool IsFloatType(kernels::ScalarType t);
DType StoredDType(kernels::ScalarType t);

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

float ToFloat(const void* src, uint64_t i, kernels::ScalarType t);

// The dtype of exp_avg (sq false) or exp_avg_sq (sq true) in a store whose
// optimizer uses moments of type t (q8: signed codes for exp_avg, unsigned for
// exp_avg_sq).
DType MomentDType(kernels::ScalarType t, bool sq);

// kInvalidArgument naming the store, the tensor, the field and both dtypes
// when a moment field of t is not stored as `want`.
Status CheckMomentFields(const vfs::TensorInfo& t, const std::string& store_path, kernels::ScalarType moment);

// A gradient scale is usable when finite and > 0.
Status CheckGradScale(float s, const std::string& what, const std::string& store_path);
}  // namespace optstate::memmgr::internal
