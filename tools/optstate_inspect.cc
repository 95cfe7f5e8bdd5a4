// optstate-inspect STORE COMMAND: read-only inspection of a store.
//
// Opens the store with Store::OpenReadOnly (a RocksDB secondary instance, no
// LOCK), so it works while a trainer has the store open and after the trainer
// died. Commands: ls, stat, show, verify, diff; --json on every one. When
// STORE is a directory of stores (a store root), `ls` lists the stores.
// Exit codes: every tool's (tools/internal/cli.h: 0 success, 1 error, 2 a
// malformed command line), and 3 when verify found problems.
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "tools/internal/cli.h"
#include "tools/internal/process.h"
#include "tools/internal/store_read.h"
#include "vfs/checkpoint.h"
#include "vfs/store.h"

namespace optstate::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kTool = "optstate-inspect";
constexpr int kExitProblems = 3;

struct Args {
  std::string store;
  bool json = false;
  // which generation (ls, show)
  std::string snapshot;
  int64_t generation = -1;
  // show
  std::string tensor;
  std::vector<std::string> fields;
  std::string range;
  uint64_t values = 8;
  // diff
  std::string snap_a, snap_b;
  // stat: the step time the drive writes per day are projected at
  double step_seconds = 1.0;
};

bool IsStoreDir(const std::string& p) { return fs::exists(fs::path(p) / "IDENTITY"); }

std::string Shape(const std::vector<uint64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

std::vector<uint64_t> EffectiveShape(const vfs::TensorInfo& t) {
  return t.shape.empty() ? std::vector<uint64_t>{t.numel} : t.shape;
}

// A statistic over the finite values: null when there are none.
json FiniteOrNull(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

// Hyperparameters as the manifest writes them: flags (adamw) as booleans.
json HyperJson(const std::map<std::string, double>& hyper) {
  json h = json::object();
  for (const auto& [k, v] : hyper) {
    if (vfs::IsFlagHyperparameter(k) && (v == 0.0 || v == 1.0)) {
      h[k] = (v == 1.0);
    } else {
      h[k] = JsonNumber(v);
    }
  }
  return h;
}

json GroupsJson(const std::vector<vfs::GroupInfo>& groups) {
  json g = json::array();
  for (const auto& x : groups) {
    g.push_back({{"id", x.id}, {"step_count", x.step_count}, {"hyper", HyperJson(x.hyper)}});
  }
  return g;
}

Result<std::unique_ptr<vfs::Store>> OpenStore(const std::string& path) {
  if (!fs::exists(path)) return NotFound(fmt::format("store {} does not exist", path));
  if (!IsStoreDir(path)) {
    return NotFound(fmt::format("{} is not a store (no IDENTITY file); a directory of stores "
                                "can be listed with `{} {} ls`",
                                path, kTool, path));
  }
  return vfs::Store::OpenReadOnly(path, vfs::StoreOptions{});
}

std::vector<std::string> SnapshotNames(const vfs::Store& s) {
  std::vector<std::string> names;
  for (const auto& x : s.ListSnapshots()) names.push_back(x.name);
  return names;
}

// "latest", a snapshot name, or "gen:N" of a retained generation. A name
// that is none of these gets the closest of all of them.
Result<std::unique_ptr<vfs::GenerationView>> OpenNamed(vfs::Store& s, const std::string& name) {
  std::vector<std::string> snaps = SnapshotNames(s);
  if (std::find(snaps.begin(), snaps.end(), name) != snaps.end()) return s.OpenSnapshot(name);
  if (name == "latest") return s.OpenGeneration(vfs::kLatest);
  std::vector<std::string> retained;
  for (const auto& g : s.ListGenerations()) retained.push_back(std::to_string(g.generation));
  if (name.rfind("gen:", 0) == 0) {
    char* end = nullptr;
    errno = 0;
    unsigned long long g = std::strtoull(name.c_str() + 4, &end, 10);
    if (end && *end == '\0' && name.size() > 4 && name[4] != '-' && errno == 0) {
      auto v = s.OpenGeneration(g);
      if (v.ok() || !v.status().IsNotFound()) return v;
      return NotFound(fmt::format("generation {} is not retained by store {} (retained: {})", g,
                                  s.path(), retained.empty() ? "none" : fmt::format("{}", fmt::join(retained, ", "))));
    }
  }
  std::vector<std::string> candidates = snaps;
  candidates.push_back("latest");
  for (const auto& g : retained) candidates.push_back("gen:" + g);
  if (!ClosestMatches(name, candidates).empty()) {
    return NotFound(UnknownNameMessage("snapshot", name, candidates));
  }
  auto list = [](const std::vector<std::string>& v, const char* none) {
    if (v.empty()) return std::string(none);
    std::string out;
    for (size_t i = 0; i < v.size() && i < 10; ++i) out += (i ? ", " : "") + v[i];
    return v.size() > 10 ? out + fmt::format(", ... ({} in all)", v.size()) : out;
  };
  return NotFound(fmt::format("unknown snapshot '{}' (snapshots: {}; also accepted: latest, and "
                              "gen:N for a retained generation N: {})",
                              name, list(snaps, "none"), list(retained, "none")));
}

Result<std::unique_ptr<vfs::GenerationView>> OpenView(vfs::Store& s, const Args& a) {
  if (!a.snapshot.empty() && a.generation >= 0) {
    return InvalidArgument("give --snapshot or --generation, not both");
  }
  if (!a.snapshot.empty()) return OpenNamed(s, a.snapshot);
  if (a.generation >= 0) return s.OpenGeneration(static_cast<uint64_t>(a.generation));
  return s.OpenGeneration(vfs::kLatest);
}

Result<vfs::TensorInfo> FindTensorOrSuggest(const vfs::GenerationView& v, const std::string& name) {
  auto t = v.FindTensor(name);
  if (t.ok()) return t;
  if (!t.status().IsNotFound()) return t.status();
  std::vector<std::string> names;
  for (const auto& x : v.tensors()) names.push_back(x.name);
  return NotFound(UnknownNameMessage("tensor", name, names));
}

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

// One chunk-map entry of a commit's index batch: a 26-byte key (prefix,
// tensor, field, chunk, generation) and a 28-byte extent record.
constexpr uint64_t kIndexBytesPerChunk = 26 + 28;

// What one optimizer step writes to the store: a StreamedAdam step rewrites
// every chunk of every field (main, exp_avg, exp_avg_sq) to a fresh extent,
// so its chunk bytes are each field's numel x element size, and its commit
// adds one chunk-map entry per chunk to the index (logical batch bytes;
// RocksDB's log and compactions write a small multiple of them).
struct StepWrites {
  uint64_t params = 0;
  uint64_t chunk_bytes = 0;
  uint64_t chunks = 0;
  uint64_t index_bytes() const { return chunks * kIndexBytesPerChunk; }
  uint64_t bytes() const { return chunk_bytes + index_bytes(); }
};

StepWrites BytesPerStep(const std::vector<vfs::TensorInfo>& tensors, uint64_t chunk_size_bytes) {
  StepWrites w;
  for (const auto& t : tensors) {
    w.params += t.numel;
    for (uint32_t f = 0; f < t.fields.size(); ++f) {
      w.chunk_bytes += t.field_bytes(f);
      w.chunks += t.field_chunk_count(f, chunk_size_bytes);
    }
  }
  return w;
}

// "f32 12 B/param" style summary of the moment dtypes present.
std::string MomentDtypes(const std::vector<vfs::TensorInfo>& tensors) {
  std::vector<std::string> names;
  for (const auto& t : tensors) {
    for (const auto& f : t.fields) {
      if (f.name != "exp_avg" && f.name != "exp_avg_sq") continue;
      std::string n = DTypeName(f.dtype);
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    }
  }
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

int Stat(const Args& a) {
  if (!(a.step_seconds > 0) || !std::isfinite(a.step_seconds)) {
    return FailUsage(kTool, fmt::format("--step-seconds must be a positive number of seconds, not {}",
                                        a.step_seconds));
  }
  auto s = OpenStore(a.store);
  if (!s.ok()) return FailWith(kTool, s.status());
  vfs::Store& store = **s;
  const auto& id = store.identity();
  auto st = store.Stats();
  if (!st.ok()) return FailWith(kTool, st.status());
  auto latest = store.LatestGeneration();
  auto gens = store.ListGenerations();
  auto snaps = store.ListSnapshots();
  auto index_tree = TreeBytes(a.store + "/index");
  uint64_t index_bytes = index_tree.ok() ? *index_tree : 0;
  json out;
  out["store"] = a.store;
  out["identity"] = {{"name", id.name}, {"uuid", id.uuid}, {"format_version", id.format_version},
                     {"chunk_size_bytes", id.chunk_size_bytes}, {"data_dirs", id.data_dirs},
                     {"create_time_unix_ms", id.create_time_unix_ms}};
  out["latest"] = {{"generation", latest.generation}, {"step", latest.step},
                   {"commit_time_unix_ms", latest.commit_time_unix_ms},
                   {"groups", GroupsJson(latest.groups)}};
  out["generations"] = json::array();
  for (const auto& g : gens) {
    out["generations"].push_back({{"generation", g.generation}, {"step", g.step},
                                  {"commit_time_unix_ms", g.commit_time_unix_ms}});
  }
  out["snapshots"] = json::array();
  for (const auto& x : snaps) {
    out["snapshots"].push_back({{"name", x.name}, {"generation", x.generation},
                                {"create_time_unix_ms", x.create_time_unix_ms}});
  }
  // Free space of each data dir's filesystem (statvfs: the bytes an
  // unprivileged writer may still use). The store's own account of free
  // space inside its data files is only known to the writer that holds it.
  json dirs = json::array();
  for (size_t i = 0; i < id.data_dirs.size(); ++i) {
    fs::path dir = id.data_dirs[i];
    if (dir.is_relative()) dir = fs::path(a.store) / dir;
    json d = {{"path", id.data_dirs[i]},
              {"file_bytes", i < st->data_file_bytes.size() ? st->data_file_bytes[i] : 0}};
    struct statvfs sv {};
    if (::statvfs(dir.c_str(), &sv) == 0) {
      d["fs_free_bytes"] = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
      d["fs_size_bytes"] = static_cast<uint64_t>(sv.f_blocks) * sv.f_frsize;
    } else {
      d["fs_error"] = ErrnoStatus(fmt::format("statvfs {}", dir.string()), errno).ToString();
    }
    dirs.push_back(std::move(d));
  }
  out["disk"] = {{"data_dirs", dirs},
                 {"index_bytes", index_bytes},
                 {"live_bytes", st->live_bytes},
                 {"referenced_extent_bytes", st->referenced_extent_bytes},
                 {"pending_bytes", st->pending_bytes}};
  out["lifetime_bytes_written"] = st->lifetime_bytes_written;
  out["generations_retained"] = st->generations_retained;
  out["leases"] = st->leases;
  out["tensors"] = store.ListTensors().size();
  const std::vector<vfs::TensorInfo> tensors = store.ListTensors();
  const StepWrites w = BytesPerStep(tensors, id.chunk_size_bytes);
  const double bytes_per_day = static_cast<double>(w.bytes()) * 86400.0 / a.step_seconds;
  out["per_step"] = {{"params", w.params},
                     {"moment_dtypes", MomentDtypes(tensors)},
                     {"chunks", w.chunks},
                     {"chunk_bytes", w.chunk_bytes},
                     {"index_bytes", w.index_bytes()},
                     {"bytes", w.bytes()},
                     {"chunk_bytes_per_param",
                      w.params ? static_cast<double>(w.chunk_bytes) / static_cast<double>(w.params) : 0.0},
                     {"step_seconds", a.step_seconds},
                     {"bytes_per_day", bytes_per_day},
                     {"tb_per_day", bytes_per_day / 1e12}};
  if (a.json) {
    PrintJson(out);
    return 0;
  }
  std::cout << fmt::format("store      {}\nname       {}\nuuid       {}\nformat     v{}\n"
                           "chunk size {}\ntensors    {}\n",
                           a.store, id.name, id.uuid, id.format_version,
                           FormatBytes(id.chunk_size_bytes), store.ListTensors().size());
  std::cout << fmt::format("latest     generation {}, step {}\n", latest.generation, latest.step);
  for (const auto& g : latest.groups) {
    std::string hyper;
    for (const auto& [k, v] : g.hyper) {
      const bool flag = vfs::IsFlagHyperparameter(k) && (v == 0.0 || v == 1.0);
      hyper += fmt::format(" {}={}", k, flag ? (v == 1.0 ? "true" : "false") : FormatDouble(v, 6));
    }
    std::cout << fmt::format("  group {}: step count {}{}\n", g.id, g.step_count, hyper);
  }
  std::cout << "\ngenerations retained:";
  for (const auto& g : gens) std::cout << fmt::format(" {}(step {})", g.generation, g.step);
  std::cout << "\n";
  std::cout << fmt::format("snapshots: {}\n", snaps.empty() ? "none" : "");
  for (const auto& x : snaps) std::cout << fmt::format("  {} -> generation {}\n", x.name, x.generation);
  std::cout << "\ndisk use:\n";
  Table t({"data dir", "data file", "filesystem free", "filesystem size"}, {false, true, true, true});
  for (const auto& d : dirs) {
    bool have = d.contains("fs_free_bytes");
    t.AddRow({d["path"].get<std::string>(), FormatBytes(d["file_bytes"].get<uint64_t>()),
              have ? FormatBytes(d["fs_free_bytes"].get<uint64_t>()) : "? (" + d["fs_error"].get<std::string>() + ")",
              have ? FormatBytes(d["fs_size_bytes"].get<uint64_t>()) : "?"});
  }
  std::cout << t.Render();
  std::cout << fmt::format(
      "index {}; live {}; referenced extents {}; pending {}\n"
      "bytes written over the store's life: {} (SSD endurance)\nleases: {}\n",
      FormatBytes(index_bytes), FormatBytes(st->live_bytes),
      FormatBytes(st->referenced_extent_bytes), FormatBytes(st->pending_bytes),
      FormatBytes(st->lifetime_bytes_written), st->leases);
  std::cout << fmt::format(
      "\nwrites per step (every chunk of every field to a fresh extent, plus its index entries):\n"
      "  {} params, moments {}: {} in {} chunks ({:.2f} B/param) + index {} = {}\n"
      "  drive writes per day at {} a step: {:.3f} TB (--step-seconds S for another step time)\n",
      w.params, MomentDtypes(tensors), FormatBytes(w.chunk_bytes), w.chunks,
      w.params ? static_cast<double>(w.chunk_bytes) / static_cast<double>(w.params) : 0.0,
      FormatBytes(w.index_bytes()), FormatBytes(w.bytes()), FormatSeconds(a.step_seconds), bytes_per_day / 1e12);
  return 0;
}

// min, max and mean are over the finite values (null when there are none);
// l2 may overflow to "Infinity".
json StatsJson(const FieldStats& s) {
  return {{"count", s.count}, {"min", FiniteOrNull(s.finite() ? s.min : NAN)},
          {"max", FiniteOrNull(s.finite() ? s.max : NAN)}, {"mean", FiniteOrNull(s.mean())},
          {"l2", JsonNumber(s.l2())}, {"nan", s.nan}, {"inf", s.inf}};
}

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

int Verify(const Args& a) {
  auto s = OpenStore(a.store);
  if (!s.ok()) return FailWith(kTool, s.status());
  double t0 = NowSeconds();
  auto rep = (*s)->Verify();
  if (!rep.ok()) return FailWith(kTool, rep.status());
  double secs = NowSeconds() - t0;
  json out = {{"store", a.store}, {"ok", rep->ok()}, {"chunks_checked", rep->chunks_checked},
              {"bytes_checked", rep->bytes_checked}, {"problems", rep->problems},
              {"leaked_slots", rep->leaked_slots}, {"seconds", secs}};
  if (a.json) {
    PrintJson(out);
  } else {
    std::cout << fmt::format("verify {}: {} chunks, {} checked in {}\n", a.store,
                             rep->chunks_checked, FormatBytes(rep->bytes_checked),
                             FormatSeconds(secs));
    for (const auto& p : rep->problems) std::cout << "  problem: " << p << "\n";
    if (rep->leaked_slots) std::cout << fmt::format("  leaked extents: {}\n", rep->leaked_slots);
    std::cout << (rep->ok() ? "OK\n" : fmt::format("FAILED: {} problem(s), {} leaked extent(s)\n",
                                                    rep->problems.size(), rep->leaked_slots));
  }
  return rep->ok() ? 0 : kExitProblems;
}

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
  return 0;
}

}  // namespace
}  // namespace optstate::tools

int main(int argc, char** argv) {
  using optstate::tools::Args;
  Args a;
  CLI::App app{"optstate-inspect: look inside an optstate store (read-only; safe while a trainer "
               "runs and after it died)"};
  app.name(optstate::tools::kTool);
  app.add_option("store", a.store, "store directory (or, for ls, a directory of stores)")->required();
  app.require_subcommand(1, 1);
  auto add_json = [&](CLI::App* c) { c->add_flag("--json", a.json, "print JSON"); };
  auto add_which = [&](CLI::App* c) {
    CLI::Option* snap = c->add_option(
        "--snapshot", a.snapshot, "read this snapshot (or latest, gen:N) instead of the latest generation");
    c->add_option("--generation", a.generation, "read this retained generation")
        ->check(CLI::NonNegativeNumber)
        ->excludes(snap);
  };
  CLI::App* ls = app.add_subcommand("ls", "tensors with dtype, numel, shape, bytes per field (or the stores under a root)");
  add_json(ls);
  add_which(ls);
  CLI::App* stat = app.add_subcommand(
      "stat", "generations, snapshots, step, chunk size, disk use, lifetime bytes written, bytes written per "
              "step and the drive writes per day they make");
  stat->add_option("--step-seconds", a.step_seconds,
                   "step time the drive writes per day are projected at, in seconds (default 1)");
  add_json(stat);
  CLI::App* show = app.add_subcommand("show", "values and statistics of a tensor (min, max, mean, L2, NaN, Inf)");
  show->add_option("tensor", a.tensor, "tensor name")->required();
  show->add_option("--field", a.fields, "field(s) to show (default: all)");
  show->add_option("--range", a.range, "element range A:B (default: all)");
  show->add_option("--values", a.values, "how many values to print (default 8)");
  add_json(show);
  add_which(show);
  CLI::App* verify = app.add_subcommand("verify", "check every checksum and reference, count leaked extents; exit 3 on problems");
  add_json(verify);
  CLI::App* diff = app.add_subcommand("diff", "per tensor and field: max abs difference and norms between two snapshots");
  diff->add_option("snap_a", a.snap_a, "snapshot name (or latest, gen:N)")->required();
  diff->add_option("snap_b", a.snap_b, "snapshot name (or latest, gen:N)")->required();
  add_json(diff);
  // argv: STORE COMMAND ...; a mistyped COMMAND gets a suggestion.
  if (argc > 2 && argv[1][0] != '-' && argv[2][0] != '-') {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    std::string msg = optstate::tools::UnknownCommandMessage(argv[2], names);
    if (!msg.empty()) return optstate::tools::FailUsage(optstate::tools::kTool, msg);
  }
  if (std::optional<int> code = optstate::tools::ParseCommandLine(app, argc, argv, optstate::tools::kTool)) {
    return *code;
  }
  if (*ls) return optstate::tools::Ls(a);
  if (*stat) return optstate::tools::Stat(a);
  if (*show) return optstate::tools::Show(a);
  if (*verify) return optstate::tools::Verify(a);
  if (*diff) return optstate::tools::Diff(a);
  return 1;
}
