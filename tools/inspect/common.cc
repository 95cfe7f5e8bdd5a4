// optstate-inspect: opening a store and the generation a command reads.
#include "tools/inspect/common.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "tools/internal/cli.h"

namespace optstate::tools::inspect {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> SnapshotNames(const vfs::Store& s) {
  std::vector<std::string> names;
  for (const auto& x : s.ListSnapshots()) names.push_back(x.name);
  return names;
}

}  // namespace

bool IsStoreDir(const std::string& p) { return fs::exists(fs::path(p) / "IDENTITY"); }

std::string Shape(const std::vector<uint64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

std::vector<uint64_t> EffectiveShape(const vfs::TensorInfo& t) {
  return t.shape.empty() ? std::vector<uint64_t>{t.numel} : t.shape;
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

}  // namespace optstate::tools::inspect
