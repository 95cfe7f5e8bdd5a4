#include "memmgr/internal/streamed_adam_util.h"

#include <chrono>
#include <cmath>

#include <fmt/format.h>

namespace optstate::memmgr::internal {

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const char* DTypeText(const std::optional<DType>& t) { return t ? DTypeName(*t) : "none"; }

Status WithNote(const Status& s, const std::string& note) {
  if (s.ok() || note.empty()) return s;
  return Status(s.code(), s.message() + "; " + note, s.err());
}

std::string DimsText(const std::vector<uint64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

Status CheckMomentFields(const vfs::TensorInfo& t, const std::string& store_path, MomentDType moment) {
  for (const vfs::FieldSpec& f : t.fields) {
    if (f.name != "exp_avg" && f.name != "exp_avg_sq") continue;
    const DType want = MomentFieldDType(moment, f.name);
    if (f.dtype != want) {
      // The moment dtype to suggest is one the optimizer takes (f32, bf16,
      // q8), not the field's storage dtype (q8 stores exp_avg as q8s).
      std::string held;
      for (MomentDType m : {MomentDType::kF32, MomentDType::kBF16, MomentDType::kQ8}) {
        if (MomentFieldDType(m, f.name) == f.dtype) held = MomentDTypeName(m);
      }
      const std::string open_with =
          held.empty() ? "open it with the moment dtype it was created with"
                       : "open it with moment dtype " + held;
      return InvalidArgument("StreamedAdam: store " + store_path + " holds tensor '" + t.name + "' field " + f.name +
                             " as " + DTypeName(f.dtype) + ", but the optimizer was created with moment dtype " +
                             MomentDTypeName(moment) + " (" + f.name + " as " + DTypeName(want) +
                             "; moment dtypes are chosen when a store is created; " + open_with +
                             ", or convert a checkpoint with optstate-restore --moments); nothing changed");
    }
  }
  return Status::Ok();
}

Status CheckGradScale(float s, const std::string& what, const std::string& store_path) {
  if (s > 0.0f && std::isfinite(s)) return Status::Ok();
  return InvalidArgument(what + ": gradient scale must be finite and > 0, got " + fmt::format("{}", s) + " (store " +
                         store_path + "); nothing changed");
}

}  // namespace optstate::memmgr::internal
