// optstate-inspect STORE stat: identity, generations, snapshots, disk use,
// and the bytes a step writes with the drive writes per day they make.
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tools/inspect/common.h"
#include "tools/internal/cli.h"
#include "tools/internal/process.h"
#include "tools/internal/store_read.h"
#include "vfs/checkpoint.h"

namespace optstate::tools::inspect {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

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

// One chunk-map entry of a commit's index batch: a 26-byte key (prefix,
// tensor, field, chunk, generation) and a 28-byte extent record.
constexpr uint64_t kIndexBytesPerChunk = 26 + 28;

// What one optimizer step writes to the store: a StreamedAdam step rewrites
// every chunk of every field (main, exp_avg, exp_avg_sq) to a fresh extent:
// its chunk bytes are each field's numel x element size, the disk space of
// those versions is what the store allocates for them (a short chunk takes a
// whole piece of at least 4 KiB), and its commit adds one chunk-map entry per
// chunk to the index (logical batch bytes; RocksDB's log and compactions
// write a small multiple of them).
struct StepWrites {
  FullWrite chunks;
  uint64_t index_bytes() const { return chunks.chunks * kIndexBytesPerChunk; }
  uint64_t bytes() const { return chunks.allocated_bytes + index_bytes(); }
};

double PerParam(uint64_t bytes, uint64_t params) {
  return params ? static_cast<double>(bytes) / static_cast<double>(params) : 0.0;
}

// "f32 12 B/param" style summary of the moment dtypes present: the state
// fields beside main (AdamW's exp_avg and exp_avg_sq, Lion's exp_avg, SGD's
// momentum_buffer), without q8's block scales ("<field>.absmax").
std::string MomentDtypes(const std::vector<vfs::TensorInfo>& tensors) {
  std::vector<std::string> names;
  for (const auto& t : tensors) {
    for (const auto& f : t.fields) {
      if (f.name == "main" || f.name.find('.') != std::string::npos) continue;
      std::string n = DTypeName(f.dtype);
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    }
  }
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace

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
  const StepWrites w{WriteOfEveryChunk(tensors, id.chunk_size_bytes)};
  const double bytes_per_day = static_cast<double>(w.bytes()) * 86400.0 / a.step_seconds;
  out["per_step"] = {{"params", w.chunks.params},
                     {"moment_dtypes", MomentDtypes(tensors)},
                     {"chunks", w.chunks.chunks},
                     {"chunk_bytes", w.chunks.logical_bytes},
                     {"allocated_bytes", w.chunks.allocated_bytes},
                     {"index_bytes", w.index_bytes()},
                     {"bytes", w.bytes()},
                     {"chunk_bytes_per_param", PerParam(w.chunks.logical_bytes, w.chunks.params)},
                     {"allocated_bytes_per_param", PerParam(w.chunks.allocated_bytes, w.chunks.params)},
                     {"step_seconds", a.step_seconds},
                     {"bytes_per_day", bytes_per_day},
                     {"tb_per_day", bytes_per_day / 1e12}};
  // The store counts the logical bytes of what it wrote; the disk space of
  // those writes follows from this store's chunks when, as a step does, every
  // chunk was written alike (registrations write main alone: an estimate).
  out["lifetime_allocated_bytes_estimate"] =
      w.chunks.logical_bytes == 0
          ? st->lifetime_bytes_written
          : static_cast<uint64_t>(static_cast<double>(st->lifetime_bytes_written) *
                                  static_cast<double>(w.chunks.allocated_bytes) /
                                  static_cast<double>(w.chunks.logical_bytes));
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
      "bytes written over the store's life (SSD endurance): {} of chunks (logical, the store's count); "
      "on disk, pieces and slots as allocated: about {}\nleases: {}\n",
      FormatBytes(index_bytes), FormatBytes(st->live_bytes),
      FormatBytes(st->referenced_extent_bytes), FormatBytes(st->pending_bytes),
      FormatBytes(st->lifetime_bytes_written), FormatBytes(out["lifetime_allocated_bytes_estimate"].get<uint64_t>()),
      st->leases);
  std::cout << fmt::format(
      "\nwrites per step (every chunk of every field to a fresh extent, plus its index entries):\n"
      "  {} params, moments {}: {} in {} chunks ({:.2f} B/param logical); on disk, pieces and slots as "
      "allocated: {} ({:.2f} B/param)\n"
      "  + index {} = {}; drive writes per day at {} a step: {:.3f} TB (--step-seconds S for another step "
      "time)\n",
      w.chunks.params, MomentDtypes(tensors), FormatBytes(w.chunks.logical_bytes), w.chunks.chunks,
      PerParam(w.chunks.logical_bytes, w.chunks.params), FormatBytes(w.chunks.allocated_bytes),
      PerParam(w.chunks.allocated_bytes, w.chunks.params), FormatBytes(w.index_bytes()), FormatBytes(w.bytes()),
      FormatSeconds(a.step_seconds), bytes_per_day / 1e12);
  return 0;
}

}  // namespace optstate::tools::inspect
