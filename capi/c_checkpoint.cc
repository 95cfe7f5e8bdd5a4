// The C ABI's checkpoint directories (optstate/c.h "checkpoint directories"):
// export, restore and reshard over vfs/checkpoint.h and vfs/reshard.h.
#include "optstate/c.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "capi/internal/c_types.h"
#include "base/status.h"
#include "vfs/checkpoint.h"
#include "vfs/reshard.h"

using optstate::InvalidArgument;
using optstate::Result;
using optstate::Status;
using optstate::capi::internal::Guard;
using optstate::capi::internal::NullArgument;
namespace vfs = optstate::vfs;

extern "C" {

// ---- checkpoint directories ----

int optstate_checkpoint_export(optstate_store_t* store, const char* snapshot, const char* dest,
                               uint64_t* generation, char** errptr) {
  const char* what = "optstate_checkpoint_export";
  return Guard(errptr, what, [&]() -> Status {
    if (store == nullptr) return NullArgument(what, "store");
    if (dest == nullptr || *dest == '\0') return InvalidArgument(std::string(what) + ": empty destination path");
    vfs::ExportOptions opts;
    if (snapshot != nullptr) opts.snapshot = snapshot;
    auto r = vfs::ExportCheckpoint(store->rep.get(), dest, opts);
    if (!r.ok()) return r.status();
    if (generation != nullptr) *generation = r->generation;
    return Status::Ok();
  });
}

int optstate_checkpoint_restore(optstate_store_t* store, const char* src, uint64_t* generation, char** errptr) {
  const char* what = "optstate_checkpoint_restore";
  return Guard(errptr, what, [&]() -> Status {
    if (store == nullptr) return NullArgument(what, "store");
    if (src == nullptr || *src == '\0') return InvalidArgument(std::string(what) + ": empty checkpoint path");
    auto r = vfs::RestoreCheckpoint(store->rep.get(), src);
    if (!r.ok()) return r.status();
    if (generation != nullptr) *generation = *r;
    return Status::Ok();
  });
}

namespace {
Result<std::vector<std::string>> SourceList(const char* what, const char* const* sources, size_t n) {
  if (sources == nullptr && n > 0) return NullArgument(what, "sources");
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) {
    if (sources[i] == nullptr || *sources[i] == '\0') {
      return InvalidArgument(std::string(what) + ": source " + std::to_string(i) + " is an empty path");
    }
    out.emplace_back(sources[i]);
  }
  return out;
}
}  // namespace

int optstate_checkpoint_reshard(const char* const* sources, size_t num_sources, const char* layout_json,
                                const char* dest, uint32_t* ranks, char** errptr) {
  const char* what = "optstate_checkpoint_reshard";
  return Guard(errptr, what, [&]() -> Status {
    if (layout_json == nullptr) return NullArgument(what, "layout_json");
    if (dest == nullptr || *dest == '\0') return InvalidArgument(std::string(what) + ": empty destination path");
    auto srcs = SourceList(what, sources, num_sources);
    if (!srcs.ok()) return srcs.status();
    auto layout = vfs::ParseTargetLayout(layout_json, "(layout_json argument)");
    if (!layout.ok()) return layout.status();
    auto r = vfs::Reshard(*srcs, *layout, dest);
    if (!r.ok()) return r.status();
    if (ranks != nullptr) *ranks = r->ranks;
    return Status::Ok();
  });
}

int optstate_checkpoint_reshard_layout(const char* const* sources, size_t num_sources, uint32_t ranks,
                                       const char* split, char** layout_json, char** errptr) {
  const char* what = "optstate_checkpoint_reshard_layout";
  return Guard(errptr, what, [&]() -> Status {
    if (layout_json == nullptr) return NullArgument(what, "layout_json");
    if (ranks == 0) return InvalidArgument(std::string(what) + ": ranks must be >= 1");
    const std::string s = split == nullptr ? "rows" : split;
    std::vector<vfs::SplitRule> rules;
    for (size_t pos = 0; pos <= s.size();) {
      const size_t end = std::min(s.find_first_of(",\n", pos), s.size());
      const std::string text = s.substr(pos, end - pos);
      pos = end + 1;
      if (text.empty()) continue;
      auto rule = vfs::ParseSplitRule(text);
      if (!rule.ok()) return rule.status().WithContext(what);
      rules.push_back(std::move(*rule));
    }
    if (rules.empty()) return InvalidArgument(std::string(what) + ": split '" + s + "' holds no rule");
    auto srcs = SourceList(what, sources, num_sources);
    if (!srcs.ok()) return srcs.status();
    auto globals = vfs::GlobalTensorsOf(*srcs);
    if (!globals.ok()) return globals.status();
    auto layout = vfs::MakeRuleLayout(*globals, ranks, rules);
    if (!layout.ok()) return layout.status();
    const std::string json = vfs::SerializeTargetLayout(*layout);
    *layout_json = strdup(json.c_str());
    if (*layout_json == nullptr) return optstate::ResourceExhausted(std::string(what) + ": out of memory");
    return Status::Ok();
  });
}

}  // extern "C"
