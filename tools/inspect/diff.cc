// optstate-inspect STORE diff A B: per tensor and field, how two generations differ;
// exit 0 identical, 3 (kExitDiffer) when they differ.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tools/inspect/common.h"
#include "tools/internal/cli.h"
#include "tools/internal/store_read.h"

namespace optstate::tools::inspect {
namespace {

using nlohmann::json;

}  // namespace

int Diff(const Args& a) {
  auto s = OpenStore(a.store);
  if (!s.ok()) return FailWith(kTool, s.status());
  auto va = OpenNamed(**s, a.snap_a);
  auto vb = OpenNamed(**s, a.snap_b);
  if (!va.ok() && !vb.ok()) {
    return FailWith(kTool, NotFound(fmt::format("{}; and {}", va.status().message(),
                                                vb.status().message())));
  }
  if (!va.ok()) return FailWith(kTool, va.status());
  if (!vb.ok()) return FailWith(kTool, vb.status());
  json out = {{"store", a.store},
              {"a", {{"name", a.snap_a}, {"generation", (*va)->info().generation}, {"step", (*va)->info().step}}},
              {"b", {{"name", a.snap_b}, {"generation", (*vb)->info().generation}, {"step", (*vb)->info().step}}},
              {"tensors", json::array()}, {"only_in_a", json::array()}, {"only_in_b", json::array()}};
  Table table({"tensor", "field", "max |a-b|", "L2(a-b)", "L2(a)", "L2(b)", "differing"},
              {false, false, true, true, true, true, true});
  std::vector<std::string> notes;
  uint64_t total = 0;
  for (const auto& t : (*va)->tensors()) total += t.numel * t.fields.size();
  ProgressBar bar("diff", total);
  uint64_t done = 0;
  bool any_diff = false;
  for (const auto& ta : (*va)->tensors()) {
    auto tb = (*vb)->FindTensor(ta.name);
    if (!tb.ok()) {
      out["only_in_a"].push_back(ta.name);
      notes.push_back(fmt::format("tensor {} only in {}", ta.name, a.snap_a));
      any_diff = true;
      continue;
    }
    if (tb->numel != ta.numel) {
      notes.push_back(fmt::format("tensor {}: numel {} vs {}", ta.name, ta.numel, tb->numel));
      out["tensors"].push_back({{"name", ta.name}, {"error", "numel differs"}});
      any_diff = true;
      continue;
    }
    json fields = json::array();
    for (uint32_t f = 0; f < ta.fields.size(); ++f) {
      auto fb = FieldByName(*tb, ta.fields[f].name);
      if (!fb.ok()) {
        notes.push_back(fmt::format("tensor {} field {} only in {}", ta.name, ta.fields[f].name, a.snap_a));
        continue;
      }
      // Read B's field into memory chunk by chunk alongside A.
      double max_abs = 0, diff_sq = 0, na = 0, nb = 0;
      uint64_t differing = 0;
      DType da = ta.fields[f].dtype, db = tb->fields[*fb].dtype;
      std::vector<double> bvals;
      Status st = ForEachRange(**va, ta, f, 0, ta.field_numel(f),
                               [&](uint64_t first, const void* data, uint64_t n) -> Status {
                                 bvals.clear();
                                 Status sb = ForEachRange(
                                     **vb, *tb, *fb, first, first + n,
                                     [&](uint64_t, const void* d2, uint64_t n2) -> Status {
                                       for (uint64_t i = 0; i < n2; ++i) bvals.push_back(ElementAsDouble(db, d2, i));
                                       return Status::Ok();
                                     });
                                 OPTSTATE_RETURN_IF_ERROR(sb);
                                 for (uint64_t i = 0; i < n; ++i) {
                                   double x = ElementAsDouble(da, data, i), y = bvals[i];
                                   na += x * x;
                                   nb += y * y;
                                   bool same = (x == y) || (std::isnan(x) && std::isnan(y));
                                   if (!same) {
                                     ++differing;
                                     double dd = std::fabs(x - y);
                                     if (std::isnan(dd)) dd = INFINITY;
                                     max_abs = std::max(max_abs, dd);
                                     if (std::isfinite(dd)) diff_sq += dd * dd;
                                   }
                                 }
                                 done += n;
                                 bar.Update(done);
                                 return Status::Ok();
                               });
      if (!st.ok()) {
        bar.Finish();
        return FailWith(kTool, st.WithContext(fmt::format("tensor {} field {}", ta.name, ta.fields[f].name)));
      }
      if (differing) any_diff = true;
      fields.push_back({{"name", ta.fields[f].name}, {"max_abs_diff", JsonNumber(max_abs)},
                        {"l2_diff", JsonNumber(std::sqrt(diff_sq))}, {"l2_a", JsonNumber(std::sqrt(na))},
                        {"l2_b", JsonNumber(std::sqrt(nb))}, {"differing_elements", differing}});
      table.AddRow({ta.name, ta.fields[f].name, FormatDouble(max_abs, 4),
                    FormatDouble(std::sqrt(diff_sq), 4), FormatDouble(std::sqrt(na), 6),
                    FormatDouble(std::sqrt(nb), 6), std::to_string(differing)});
    }
    out["tensors"].push_back({{"name", ta.name}, {"fields", fields}});
  }
  for (const auto& tb : (*vb)->tensors()) {
    if (!(*va)->FindTensor(tb.name).ok()) {
      out["only_in_b"].push_back(tb.name);
      notes.push_back(fmt::format("tensor {} only in {}", tb.name, a.snap_b));
      any_diff = true;
    }
  }
  bar.Finish();
  out["identical"] = !any_diff;
  if (a.json) {
    PrintJson(out);
  } else {
    std::cout << fmt::format("diff {} (generation {}, step {}) vs {} (generation {}, step {})\n\n",
                             a.snap_a, (*va)->info().generation, (*va)->info().step, a.snap_b,
                             (*vb)->info().generation, (*vb)->info().step);
    std::cout << table.Render();
    for (const auto& n : notes) std::cout << n << "\n";
    std::cout << (any_diff ? "\nthe two differ\n" : "\nidentical\n");
  }
  return any_diff ? kExitDiffer : 0;
}

}  // namespace optstate::tools::inspect
