// optstate-inspect STORE ls: the tensors of a generation, or the stores under
// a directory of stores.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tools/inspect/common.h"
#include "tools/internal/cli.h"
#include "tools/internal/store_read.h"

namespace optstate::tools::inspect {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// ---- ls over a directory of stores ----
int LsRoot(const Args& a) {
  std::vector<std::string> dirs;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(a.store, ec)) {
    if (e.is_directory() && IsStoreDir(e.path().string())) dirs.push_back(e.path().string());
  }
  if (ec) return FailWith(kTool, ErrnoStatus(fmt::format("list {}", a.store), ec.value()));
  std::sort(dirs.begin(), dirs.end());
  json out = {{"root", a.store}, {"stores", json::array()}};
  Table table({"store", "name", "generation", "step", "tensors", "live"},
              {false, false, true, true, true, true});
  for (const auto& d : dirs) {
    auto s = vfs::Store::OpenReadOnly(d, vfs::StoreOptions{});
    if (!s.ok()) {
      out["stores"].push_back({{"path", d}, {"error", s.status().ToString()}});
      table.AddRow({fs::path(d).filename().string(), "(error: " + s.status().ToString() + ")"});
      continue;
    }
    auto g = (*s)->LatestGeneration();
    auto st = (*s)->Stats();
    uint64_t live = st.ok() ? st->live_bytes : 0;
    size_t nt = (*s)->ListTensors().size();
    out["stores"].push_back({{"path", d}, {"name", (*s)->identity().name},
                             {"uuid", (*s)->identity().uuid}, {"generation", g.generation},
                             {"step", g.step}, {"tensors", nt}, {"live_bytes", live}});
    table.AddRow({fs::path(d).filename().string(), (*s)->identity().name,
                  std::to_string(g.generation), std::to_string(g.step), std::to_string(nt),
                  FormatBytes(live)});
  }
  if (a.json) {
    PrintJson(out);
  } else if (dirs.empty()) {
    std::cout << fmt::format("{}: no stores (directories with an IDENTITY file)\n", a.store);
  } else {
    std::cout << table.Render();
  }
  return 0;
}

}  // namespace

int Ls(const Args& a) {
  if (!IsStoreDir(a.store) && fs::is_directory(a.store)) return LsRoot(a);
  auto s = OpenStore(a.store);
  if (!s.ok()) return FailWith(kTool, s.status());
  auto v = OpenView(**s, a);
  if (!v.ok()) return FailWith(kTool, v.status());
  const auto& tensors = (*v)->tensors();
  json out = {{"store", a.store}, {"name", (*v)->identity().name},
              {"generation", (*v)->info().generation}, {"step", (*v)->info().step},
              {"tensors", json::array()}};
  Table table({"tensor", "dtype", "numel", "shape", "group", "fields", "bytes/field"},
              {false, false, true, false, true, false, true});
  uint64_t total = 0;
  for (const auto& t : tensors) {
    json fields = json::array();
    std::string fnames;
    uint64_t per_field = 0;
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      uint64_t bytes = t.field_bytes(f);
      fields.push_back({{"name", t.fields[f].name}, {"dtype", DTypeName(t.fields[f].dtype)},
                        {"bytes", bytes}});
      fnames += (f ? "," : "") + t.fields[f].name;
      per_field = std::max(per_field, bytes);
      total += bytes;
    }
    out["tensors"].push_back({{"name", t.name}, {"id", t.id}, {"dtype", DTypeName(t.dtype)},
                              {"numel", t.numel}, {"shape", EffectiveShape(t)},
                              {"global_shape", t.global_shape}, {"shard_offset", t.shard_offset},
                              {"group", t.group}, {"fields", fields}});
    table.AddRow({t.name, DTypeName(t.dtype), std::to_string(t.numel),
                  Shape(EffectiveShape(t)), std::to_string(t.group), fnames, FormatBytes(per_field)});
  }
  out["total_bytes"] = total;
  if (a.json) {
    PrintJson(out);
  } else {
    std::cout << fmt::format("store {} ({}), generation {}, step {}: {} tensors, {} of state\n\n",
                             a.store, (*v)->identity().name, (*v)->info().generation,
                             (*v)->info().step, tensors.size(), FormatBytes(total));
    if (!tensors.empty()) std::cout << table.Render();
  }
  return 0;
}

}  // namespace optstate::tools::inspect
