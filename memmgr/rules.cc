#include "memmgr/rules.h"

#include "memmgr/internal/adamw_rule.h"
#include "memmgr/momentum_rules.h"
#include "memmgr/muon_rule.h"

namespace optstate::memmgr {

bool IsRuleName(const std::string& name) {
  return name == "adamw" || name == "lion" || name == "sgd" || name == "sgd_plain" || name == "muon";
}

Result<std::unique_ptr<UpdateRule>> NewRuleByName(const std::string& name, MomentDType moments) {
  if (!IsRuleName(name)) {
    return InvalidArgument("update rule '" + name + "' is not one of adamw, lion, sgd, sgd_plain, muon");
  }
  if (name == "adamw") return internal::NewAdamWRule(moments);
  if (moments == MomentDType::kQ8) {
    return InvalidArgument("update rule " + name + " keeps its moment as f32 or bf16; q8 moments are adamw's alone");
  }
  if (name == "lion") return NewLionRule(moments);
  if (name == "sgd") return NewSgdRule(moments, /*momentum_buffer=*/true);
  if (name == "sgd_plain") return NewSgdRule(moments, /*momentum_buffer=*/false);
  return NewMuonRule(moments);
}

}  // namespace optstate::memmgr
