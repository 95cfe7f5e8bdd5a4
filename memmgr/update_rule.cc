#include "memmgr/update_rule.h"

#include <algorithm>

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
  // A field the rule does not keep is another rule's state (SGD with
  // momentum's momentum_buffer under plain SGD, AdamW's exp_avg_sq under
  // Lion): stepping the tensor would leave it stale behind the main.
  std::string keeps;
  for (const RuleField& want : Fields()) keeps += (keeps.empty() ? "" : ", ") + want.name;
  for (const vfs::FieldSpec& f : t.fields) {
    const bool kept =
        std::any_of(Fields().begin(), Fields().end(), [&](const RuleField& w) { return w.name == f.name; });
    if (kept) continue;
    return InvalidArgument(std::string(name()) + ": store " + store_path + " holds tensor '" + t.name +
                           "' with field " + f.name + ", which this optimizer does not keep (it keeps " + keeps +
                           "): the store was written by another update rule or with other options; open it with "
                           "those; nothing changed");
  }
  return Status::Ok();
}

}  // namespace optstate::memmgr
