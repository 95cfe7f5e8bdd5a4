// optstate-inspect STORE show TENSOR: values and statistics of its fields.
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

// A statistic over the finite values: null when there are none.
json FiniteOrNull(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

Result<vfs::TensorInfo> FindTensorOrSuggest(const vfs::GenerationView& v, const std::string& name) {
  auto t = v.FindTensor(name);
  if (t.ok()) return t;
  if (!t.status().IsNotFound()) return t.status();
  std::vector<std::string> names;
  for (const auto& x : v.tensors()) names.push_back(x.name);
  return NotFound(UnknownNameMessage("tensor", name, names));
}

// min, max and mean are over the finite values (null when there are none);
// l2 may overflow to "Infinity".
json StatsJson(const FieldStats& s) {
  return {{"count", s.count}, {"min", FiniteOrNull(s.finite() ? s.min : NAN)},
          {"max", FiniteOrNull(s.finite() ? s.max : NAN)}, {"mean", FiniteOrNull(s.mean())},
          {"l2", JsonNumber(s.l2())}, {"nan", s.nan}, {"inf", s.inf}};
}

}  // namespace

int Show(const Args& a) {
  auto s = OpenStore(a.store);
  if (!s.ok()) return FailWith(kTool, s.status());
  auto v = OpenView(**s, a);
  if (!v.ok()) return FailWith(kTool, v.status());
  auto t = FindTensorOrSuggest(**v, a.tensor);
  if (!t.ok()) return FailWith(kTool, t.status());
  std::vector<uint32_t> fields;
  if (a.fields.empty()) {
    for (uint32_t f = 0; f < t->fields.size(); ++f) fields.push_back(f);
  } else {
    for (const auto& name : a.fields) {
      auto f = FieldByName(*t, name);
      if (!f.ok()) return FailWith(kTool, f.status());
      fields.push_back(*f);
    }
  }
  Range r{0, t->numel};
  if (!a.range.empty()) {
    auto pr = ParseRange(a.range, t->numel);
    if (!pr.ok()) return FailWith(kTool, pr.status().WithContext("--range"));
    r = *pr;
  }
  json out = {{"store", a.store}, {"generation", (*v)->info().generation},
              {"tensor", t->name}, {"numel", t->numel}, {"range", {r.begin, r.end}},
              {"fields", json::array()}};
  std::string text = fmt::format("tensor {} (numel {}, shape {}, group {}), generation {}, "
                                 "elements [{}, {})\n",
                                 t->name, t->numel, Shape(EffectiveShape(*t)), t->group,
                                 (*v)->info().generation, r.begin, r.end);
  ProgressBar bar("reading", static_cast<uint64_t>(fields.size()) * (r.end - r.begin));
  uint64_t done = 0;
  for (uint32_t f : fields) {
    FieldStats st;
    std::vector<double> vals;
    DType d = t->fields[f].dtype;
    // A field with fewer elements (q8 scales: one per 256) is read over its own part of the range.
    const uint64_t fend = std::min(r.end, t->field_numel(f));
    Status rs = ForEachRange(**v, *t, f, std::min(r.begin, fend), fend,
                             [&](uint64_t, const void* data, uint64_t n) -> Status {
                               for (uint64_t i = 0; i < n; ++i) {
                                 double x = ElementAsDouble(d, data, i);
                                 st.Add(x);
                                 if (vals.size() < a.values) vals.push_back(x);
                               }
                               done += n;
                               bar.Update(done);
                               return Status::Ok();
                             });
    if (!rs.ok()) {
      bar.Finish();
      return FailWith(kTool, rs.WithContext(fmt::format("tensor {} field {}", t->name, t->fields[f].name)));
    }
    json jv = json::array();
    for (double x : vals) jv.push_back(JsonNumber(x));
    out["fields"].push_back({{"name", t->fields[f].name}, {"dtype", DTypeName(d)},
                             {"values", jv}, {"stats", StatsJson(st)}});
    text += fmt::format("\n{} ({}):\n  values[{}..{}):", t->fields[f].name, DTypeName(d),
                        r.begin, r.begin + vals.size());
    for (double x : vals) text += " " + FormatDouble(x, 7);
    if (r.end - r.begin > vals.size()) text += " ...";
    text += fmt::format("\n  min {}  max {}  mean {}  L2 {}  NaN {}  Inf {}\n",
                        FormatDouble(st.finite() ? st.min : NAN, 7),
                        FormatDouble(st.finite() ? st.max : NAN, 7), FormatDouble(st.mean(), 7),
                        FormatDouble(st.l2(), 7), st.nan, st.inf);
  }
  bar.Finish();
  if (a.json) PrintJson(out);
  else std::cout << text;
  return 0;
}

}  // namespace optstate::tools::inspect
