// The update rules by name, for callers that choose them at run time (the C
// ABI, tools): "adamw" (exp_avg, exp_avg_sq: f32, bf16 or q8), "lion"
// (exp_avg), "sgd" (momentum_buffer), "sgd_plain" (main only) and "muon"
// (momentum_buffer; whole 2-D matrices). memmgr/momentum_rules.h and
// memmgr/muon_rule.h describe each.
#pragma once

#include <memory>
#include <string>

#include "base/dtype.h"
#include "base/status.h"
#include "memmgr/update_rule.h"

namespace optstate::memmgr {

// The rule `name` with `moments` for its state fields. kInvalidArgument for
// another name, or q8 moments for a rule other than adamw.
Result<std::unique_ptr<UpdateRule>> NewRuleByName(const std::string& name, MomentDType moments);

// True when `name` is one of NewRuleByName's names.
bool IsRuleName(const std::string& name);

}  // namespace optstate::memmgr
