#include "memmgr/update_rule.h"

namespace optstate::memmgr {

Status UpdateRule::CheckHyperparams(uint32_t, const Hyperparams&) const { return Status::Ok(); }

Status UpdateRule::CheckShape(const std::string&, const std::string&, const std::vector<uint64_t>&,
                              uint64_t) const {
  return Status::Ok();
}

Status UpdateRule::CheckStored(const std::string& store_path, const vfs::TensorInfo& t) const {
  for (const RuleField& want : Fields()) {
    for (const vfs::FieldSpec& f : t.fields) {
      if (f.name != want.name || f.dtype == want.dtype) continue;
      return InvalidArgument(std::string(name()) + ": store " + store_path + " holds tensor '" + t.name + "' field " +
                             f.name + " as " + DTypeName(f.dtype) + ", but the optimizer keeps it as " +
                             DTypeName(want.dtype) + "; nothing changed");
    }
  }
  return Status::Ok();
}

}  // namespace optstate::memmgr
