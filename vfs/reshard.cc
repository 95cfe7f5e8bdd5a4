// Reshard: validation of box geometry, the layout JSON, and the streaming
// scatter of source chunks into destination rank checkpoints.
#include "vfs/reshard.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "vfs/io_buffer.h"
#include "vfs/internal/new_dir.h"
#include "vfs/io_engine.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::vfs {
namespace {

using Json = nlohmann::json;
using OJson = nlohmann::ordered_json;

constexpr size_t kMaxRank = 16;
// Gap search enumerates the cells between box boundaries; beyond this many
// (cells x boxes) it reports only the count of uncovered elements.
constexpr uint64_t kMaxGapSearchWork = 50'000'000;

std::string Dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// "[a, b) x [c, d)": the element ranges of a box, per dimension.
std::string Ranges(const std::vector<uint64_t>& lo, const std::vector<uint64_t>& hi) {
  std::string out;
  for (size_t d = 0; d < lo.size(); ++d) {
    if (d > 0) out += " x ";
    out += fmt::format("[{}, {})", lo[d], hi[d]);
  }
  return out;
}

std::string BoxRanges(const ShardBox& b) {
  if (b.flat) return fmt::format("flat [{}, {})", b.offset[0], b.offset[0] + b.shape[0]);
  std::vector<uint64_t> hi(b.offset.size());
  for (size_t d = 0; d < hi.size(); ++d) hi[d] = b.offset[d] + b.shape[d];
  return Ranges(b.offset, hi);
}

unsigned __int128 Volume(const std::vector<uint64_t>& shape) {
  unsigned __int128 v = 1;
  for (uint64_t s : shape) v *= s;
  return v;
}

uint32_t ElemSize(DType d) { return DTypeSize(d); }

std::string RandomUuid() {
  std::random_device rd;
  auto r32 = [&] { return static_cast<uint32_t>(rd()); };
  return fmt::format("{:08x}-{:04x}-4{:03x}-{:04x}-{:08x}{:04x}", r32(), r32() & 0xffff, r32() & 0xfff,
                     (r32() & 0x3fff) | 0x8000, r32(), r32() & 0xffff);
}

// Row-major index of a shard's first element (the order the sources are read in).
uint64_t FirstElement(const ShardBox& b, const std::vector<uint64_t>& gshape) {
  if (b.flat || gshape.size() != b.offset.size()) return b.offset.empty() ? 0 : b.offset[0];
  uint64_t at = 0;
  for (size_t d = 0; d < gshape.size(); ++d) at = at * gshape[d] + b.offset[d];
  return at;
}

}  // namespace

// ---- shard geometry -------------------------------------------------------------

ShardBox FlatRange(uint64_t begin, uint64_t end) { return ShardBox{{begin}, {end - begin}, true}; }

ShardBox ShardOf(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& global_shape,
                 const std::vector<uint64_t>& shard_offset) {
  return ShardBox{shard_offset, shape, shape.size() == 1 && global_shape.size() > 1};
}

std::vector<ShardPiece> ShardPieces(const ShardBox& shard, const std::vector<uint64_t>& global_shape) {
  const size_t nd = global_shape.size();
  if (!shard.flat || nd <= 1) return {ShardPiece{ShardBox{shard.offset, shard.shape}, 0}};
  // stride[k]: elements of one index step in dimension k.
  std::vector<uint64_t> stride(nd, 1);
  for (size_t k = nd - 1; k-- > 0;) stride[k] = stride[k + 1] * global_shape[k + 1];
  const uint64_t begin = shard.offset[0], end = begin + shard.shape[0];
  std::vector<ShardPiece> out;
  for (uint64_t at = begin; at < end;) {
    // The coarsest dimension at whose slice boundary `at` lies and of which
    // at least one slice fits: whole slices of it up to the end of the range
    // or of the enclosing slice, finer dimensions whole, coarser ones fixed.
    size_t k = 0;
    while (at % stride[k] != 0 || end - at < stride[k]) ++k;
    ShardPiece p;
    p.first = at - begin;
    p.box.offset.resize(nd);
    p.box.shape.resize(nd);
    for (size_t d = 0; d < nd; ++d) {
      p.box.offset[d] = at / stride[d] % global_shape[d];
      p.box.shape[d] = d < k ? 1 : global_shape[d];
    }
    p.box.shape[k] = std::min((end - at) / stride[k], global_shape[k] - p.box.offset[k]);
    out.push_back(std::move(p));
    at += out.back().box.shape[k] * stride[k];
  }
  return out;
}

// ---- layout JSON --------------------------------------------------------------

Result<TargetLayout> ParseTargetLayout(std::string_view json, std::string_view source) {
  Json j = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  auto err = [&](const std::string& key, const std::string& what) {
    return InvalidArgument(fmt::format("reshard layout {}: key '{}': {}", source, key, what));
  };
  if (j.is_discarded()) return InvalidArgument(fmt::format("reshard layout {}: not valid JSON", source));
  if (!j.is_object()) return err("(root)", "expected an object");
  auto fmt_it = j.find("format");
  if (fmt_it == j.end() || !fmt_it->is_string() || fmt_it->get<std::string>() != kReshardLayoutFormat) {
    return err("format", fmt::format("must be \"{}\"", kReshardLayoutFormat));
  }
  auto ver = j.find("format_version");
  if (ver == j.end() || !ver->is_number_unsigned() || ver->get<uint64_t>() != kReshardLayoutVersion) {
    return err("format_version", fmt::format("must be {} (the version this build reads)", kReshardLayoutVersion));
  }
  auto ranks = j.find("ranks");
  if (ranks == j.end() || !ranks->is_array() || ranks->empty()) {
    return err("ranks", "expected a non-empty array of ranks");
  }
  TargetLayout out;
  auto u64s = [&](const Json& obj, const std::string& key, const char* name,
                  std::vector<uint64_t>* v) -> Status {
    auto it = obj.find(name);
    if (it == obj.end()) return err(key + name, "missing");
    if (!it->is_array() || it->empty() || it->size() > kMaxRank) {
      return err(key + name, fmt::format("expected an array of 1..{} non-negative integers", kMaxRank));
    }
    v->clear();
    for (const Json& x : *it) {
      if (!x.is_number_unsigned()) return err(key + name, "expected non-negative integers");
      v->push_back(x.get<uint64_t>());
    }
    return Status::Ok();
  };
  for (size_t r = 0; r < ranks->size(); ++r) {
    const Json& jr = (*ranks)[r];
    const std::string rkey = fmt::format("ranks[{}]", r);
    if (!jr.is_object()) return err(rkey, "expected an object");
    auto rank = jr.find("rank");
    if (rank == jr.end() || !rank->is_number_unsigned() || rank->get<uint64_t>() != r) {
      return err(rkey + ".rank", fmt::format("must be {} (ranks are listed in order)", r));
    }
    auto tensors = jr.find("tensors");
    if (tensors == jr.end() || !tensors->is_object()) return err(rkey + ".tensors", "expected an object");
    std::map<std::string, ShardBox> boxes;
    for (const auto& [name, jb] : tensors->items()) {
      const std::string bkey = fmt::format("{}.tensors[\"{}\"]", rkey, name);
      if (name.empty() || name.find('\0') != std::string::npos) return err(bkey, "bad tensor name");
      if (!jb.is_object()) return err(bkey, "expected an object with offset and shape, or flat");
      ShardBox b;
      if (jb.contains("flat")) {
        if (jb.contains("offset") || jb.contains("shape")) {
          return err(bkey, "a flat range or a box (offset and shape), not both");
        }
        std::vector<uint64_t> range;
        OPTSTATE_RETURN_IF_ERROR(u64s(jb, bkey + ".", "flat", &range));
        if (range.size() != 2 || range[0] >= range[1]) {
          return err(bkey + ".flat", "expected [begin, end) with begin < end (an empty range: leave the tensor "
                                     "out of this rank instead)");
        }
        boxes.emplace(name, FlatRange(range[0], range[1]));
        continue;
      }
      OPTSTATE_RETURN_IF_ERROR(u64s(jb, bkey + ".", "offset", &b.offset));
      OPTSTATE_RETURN_IF_ERROR(u64s(jb, bkey + ".", "shape", &b.shape));
      if (b.offset.size() != b.shape.size()) {
        return err(bkey, fmt::format("offset {} and shape {} have different ranks", Dims(b.offset), Dims(b.shape)));
      }
      for (size_t d = 0; d < b.shape.size(); ++d) {
        if (b.shape[d] == 0) {
          return err(bkey + ".shape", "an empty box: leave the tensor out of this rank instead");
        }
        if (b.offset[d] + b.shape[d] < b.offset[d]) return err(bkey, "offset + shape overflows");
      }
      boxes.emplace(name, std::move(b));
    }
    out.ranks.push_back(std::move(boxes));
  }
  return out;
}

std::string SerializeTargetLayout(const TargetLayout& layout) {
  OJson j;
  j["format"] = kReshardLayoutFormat;
  j["format_version"] = kReshardLayoutVersion;
  OJson ranks = OJson::array();
  for (size_t r = 0; r < layout.ranks.size(); ++r) {
    OJson tensors = OJson::object();
    for (const auto& [name, b] : layout.ranks[r]) {
      if (b.flat) {
        tensors[name] = OJson{{"flat", {b.offset[0], b.offset[0] + b.shape[0]}}};
      } else {
        tensors[name] = OJson{{"offset", b.offset}, {"shape", b.shape}};
      }
    }
    ranks.push_back(OJson{{"rank", r}, {"tensors", std::move(tensors)}});
  }
  j["ranks"] = std::move(ranks);
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

TargetLayout MakeEvenLayout(const std::vector<GlobalTensor>& tensors, uint32_t ranks, SplitKind split) {
  TargetLayout out;
  out.ranks.resize(std::max<uint32_t>(1, ranks));
  const uint64_t m = out.ranks.size();
  for (const GlobalTensor& t : tensors) {
    const size_t dim = split == SplitKind::kRows ? 0 : t.global_shape.size() - 1;
    const uint64_t e = t.global_shape[dim];
    for (uint64_t r = 0; r < m; ++r) {
      const uint64_t lo = static_cast<uint64_t>(static_cast<unsigned __int128>(e) * r / m);
      const uint64_t hi = static_cast<uint64_t>(static_cast<unsigned __int128>(e) * (r + 1) / m);
      if (hi == lo) continue;
      bool empty = false;
      for (uint64_t s : t.global_shape) empty = empty || s == 0;
      if (empty) continue;
      ShardBox b;
      b.offset.assign(t.global_shape.size(), 0);
      b.shape = t.global_shape;
      b.offset[dim] = lo;
      b.shape[dim] = hi - lo;
      out.ranks[r].emplace(t.name, std::move(b));
    }
  }
  return out;
}

Result<SplitRule> ParseSplitRule(std::string_view text) {
  SplitRule r;
  std::string_view kind = text;
  const size_t eq = text.rfind('=');
  if (eq != std::string_view::npos) {
    r.pattern = std::string(text.substr(0, eq));
    kind = text.substr(eq + 1);
    if (r.pattern.empty()) {
      return InvalidArgument(fmt::format("reshard split rule '{}': empty tensor name pattern", text));
    }
  }
  if (kind == "rows") {
    r.kind = SplitRule::Kind::kDim;
  } else if (kind == "columns") {
    r.kind = SplitRule::Kind::kLastDim;
  } else if (kind == "flat") {
    r.kind = SplitRule::Kind::kFlat;
  } else if (kind.size() > 3 && kind.substr(0, 3) == "dim" &&
             kind.find_first_not_of("0123456789", 3) == std::string_view::npos && kind.size() <= 5) {
    r.kind = SplitRule::Kind::kDim;
    r.dim = static_cast<uint32_t>(std::stoul(std::string(kind.substr(3))));
  } else if (kind == "replicate") {
    return InvalidArgument(fmt::format(
        "reshard split rule '{}': replicate is not a layout: every element's optimizer state is owned by exactly "
        "one rank; give the replicated tensors to one rank's split (e.g. '{}=dim0')",
        text, r.pattern));
  } else {
    return InvalidArgument(fmt::format("reshard split rule '{}': '{}' is not rows, columns, dimN or flat", text,
                                       kind));
  }
  return r;
}

Result<TargetLayout> MakeRuleLayout(const std::vector<GlobalTensor>& tensors, uint32_t ranks,
                                    const std::vector<SplitRule>& rules) {
  if (ranks == 0) return InvalidArgument("reshard split layout: ranks must be >= 1");
  TargetLayout out;
  out.ranks.resize(ranks);
  std::vector<bool> used(rules.size(), false);
  for (const GlobalTensor& t : tensors) {
    size_t i = 0;
    while (i < rules.size() && ::fnmatch(rules[i].pattern.c_str(), t.name.c_str(), 0) != 0) ++i;
    if (i == rules.size()) {
      return InvalidArgument(fmt::format("reshard split layout: no split rule matches tensor '{}' (global shape {})",
                                         t.name, Dims(t.global_shape)));
    }
    used[i] = true;
    const SplitRule& rule = rules[i];
    const unsigned __int128 numel = Volume(t.global_shape);
    if (numel == 0) continue;
    if (rule.kind == SplitRule::Kind::kFlat) {
      for (uint64_t r = 0; r < ranks; ++r) {
        const uint64_t lo = static_cast<uint64_t>(numel * r / ranks);
        const uint64_t hi = static_cast<uint64_t>(numel * (r + 1) / ranks);
        if (hi > lo) out.ranks[r].emplace(t.name, FlatRange(lo, hi));
      }
      continue;
    }
    const size_t last = t.global_shape.size() - 1;
    const size_t dim = rule.kind == SplitRule::Kind::kLastDim ? last : std::min<size_t>(rule.dim, last);
    const uint64_t e = t.global_shape[dim];
    for (uint64_t r = 0; r < ranks; ++r) {
      const uint64_t lo = static_cast<uint64_t>(static_cast<unsigned __int128>(e) * r / ranks);
      const uint64_t hi = static_cast<uint64_t>(static_cast<unsigned __int128>(e) * (r + 1) / ranks);
      if (hi == lo) continue;
      ShardBox b{std::vector<uint64_t>(t.global_shape.size(), 0), t.global_shape};
      b.offset[dim] = lo;
      b.shape[dim] = hi - lo;
      out.ranks[r].emplace(t.name, std::move(b));
    }
  }
  for (size_t i = 0; i < rules.size(); ++i) {
    if (!used[i] && rules[i].pattern != "*") {
      return InvalidArgument(fmt::format("reshard split layout: rule '{}' matches no tensor (first match wins; "
                                         "earlier rules may have taken them)",
                                         rules[i].pattern));
    }
  }
  return out;
}

Result<TargetLayout> MakeBucketLayout(const std::vector<GlobalTensor>& tensors, uint64_t bucket_numel,
                                      uint32_t ranks) {
  if (bucket_numel == 0 || ranks == 0) {
    return InvalidArgument(fmt::format("reshard bucket layout: bucket size {} elements and ranks {} must be >= 1",
                                       bucket_numel, ranks));
  }
  std::vector<uint64_t> numels;
  for (const GlobalTensor& t : tensors) {
    const unsigned __int128 n = Volume(t.global_shape);
    if (n > UINT64_MAX / 2) {
      return InvalidArgument(fmt::format("reshard bucket layout: tensor '{}' of global shape {} is too large",
                                         t.name, Dims(t.global_shape)));
    }
    numels.push_back(static_cast<uint64_t>(n));
  }
  TargetLayout out;
  out.ranks.resize(ranks);
  for (size_t first = 0; first < tensors.size();) {
    // One bucket: whole tensors [first, last) at flat offsets starts[].
    size_t last = first;
    uint64_t size = 0;
    std::vector<uint64_t> starts;
    while (last < tensors.size() && (size < bucket_numel || last == first)) {
      starts.push_back(size);
      size += numels[last];
      ++last;
    }
    const uint64_t per_rank = (size + ranks - 1) / ranks;  // padded to a multiple of ranks
    for (uint32_t r = 0; r < ranks; ++r) {
      const uint64_t lo = r * per_rank, hi = lo + per_rank;
      for (size_t i = first; i < last; ++i) {
        const uint64_t t_lo = starts[i - first], t_hi = t_lo + numels[i];
        const uint64_t a = std::max(lo, t_lo), b = std::min(hi, t_hi);
        if (a < b) out.ranks[r].emplace(tensors[i].name, FlatRange(a - t_lo, b - t_lo));
      }
    }
    first = last;
  }
  return out;
}

// ---- tiling ---------------------------------------------------------------------

Status ValidateTiling(std::string_view what, std::string_view tensor, const std::vector<uint64_t>& global_shape,
                      const std::vector<std::pair<std::string, ShardBox>>& boxes) {
  const size_t nd = global_shape.size();
  auto err = [&](const std::string& msg) {
    return InvalidArgument(fmt::format("{}: tensor '{}' (global shape {}): {}", what, tensor, Dims(global_shape), msg));
  };
  const unsigned __int128 total = Volume(global_shape);
  for (const auto& [label, b] : boxes) {
    if (b.flat) {
      if (b.offset.size() != 1 || b.shape.size() != 1) {
        return err(fmt::format("{} has a flat range with offset {} and shape {} (expected one number each)", label,
                               Dims(b.offset), Dims(b.shape)));
      }
      if (b.offset[0] > total || b.shape[0] > total - b.offset[0]) {
        return err(fmt::format("{} holds {}, past the tensor's {} elements", label, BoxRanges(b),
                               static_cast<uint64_t>(total)));
      }
      continue;
    }
    if (b.offset.size() != nd || b.shape.size() != nd) {
      return err(fmt::format("{} has a box of rank {} (offset {}, shape {}), the tensor has rank {}{}", label,
                             b.shape.size(), Dims(b.offset), Dims(b.shape), nd,
                             b.shape.size() == 1 ? " (a flat range is written {\"flat\": [begin, end]})" : ""));
    }
    for (size_t d = 0; d < nd; ++d) {
      if (b.offset[d] > global_shape[d] || b.shape[d] > global_shape[d] - b.offset[d]) {
        return err(fmt::format("{} holds {}, outside the tensor in dimension {}", label, BoxRanges(b), d));
      }
    }
  }
  // Flat ranges as boxes: the checks below see only boxes, each named by its shard.
  struct Piece {
    size_t shard;
    ShardBox box;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < boxes.size(); ++i) {
    for (ShardPiece& p : ShardPieces(boxes[i].second, global_shape)) pieces.push_back({i, std::move(p.box)});
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ShardBox& a = pieces[i].box;
    if (Volume(a.shape) == 0) continue;
    for (size_t k = i + 1; k < pieces.size(); ++k) {
      if (pieces[k].shard == pieces[i].shard) continue;
      const ShardBox& b = pieces[k].box;
      std::vector<uint64_t> lo(nd), hi(nd);
      bool overlap = Volume(b.shape) != 0;
      for (size_t d = 0; d < nd && overlap; ++d) {
        lo[d] = std::max(a.offset[d], b.offset[d]);
        hi[d] = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
        overlap = lo[d] < hi[d];
      }
      if (overlap) {
        const auto& [la, sa] = boxes[pieces[i].shard];
        const auto& [lb, sb] = boxes[pieces[k].shard];
        return err(fmt::format("{} ({}) and {} ({}) overlap in {}", la, BoxRanges(sa), lb, BoxRanges(sb),
                               Ranges(lo, hi)));
      }
    }
  }
  unsigned __int128 covered = 0;
  for (const Piece& p : pieces) covered += Volume(p.box.shape);
  if (covered == total) return Status::Ok();
  // In bounds and disjoint, so some elements are uncovered: name one region.
  // The boxes' boundaries cut the tensor into cells, each inside or outside
  // every box; the first cell outside all of them is reported.
  std::vector<std::vector<uint64_t>> cuts(nd);
  unsigned __int128 cells = 1;
  for (size_t d = 0; d < nd; ++d) {
    std::set<uint64_t> c{0, global_shape[d]};
    for (const Piece& p : pieces) {
      c.insert(p.box.offset[d]);
      c.insert(p.box.offset[d] + p.box.shape[d]);
    }
    cuts[d].assign(c.begin(), c.end());
    cells *= cuts[d].size() - 1;
  }
  const uint64_t missing = static_cast<uint64_t>(total - covered);
  if (cells * std::max<size_t>(1, pieces.size()) <= kMaxGapSearchWork) {
    std::vector<size_t> idx(nd, 0);
    for (unsigned __int128 c = 0; c < cells; ++c) {
      bool inside = false;
      for (const Piece& p : pieces) {
        const ShardBox& b = p.box;
        bool in = true;
        for (size_t d = 0; d < nd && in; ++d) {
          const uint64_t x = cuts[d][idx[d]];
          in = x >= b.offset[d] && x < b.offset[d] + b.shape[d];
        }
        if (in) {
          inside = true;
          break;
        }
      }
      if (!inside) {
        std::vector<uint64_t> lo(nd), hi(nd);
        for (size_t d = 0; d < nd; ++d) lo[d] = cuts[d][idx[d]], hi[d] = cuts[d][idx[d] + 1];
        return err(fmt::format("{} elements are in no shard, e.g. {} (a rank missing?)", missing, Ranges(lo, hi)));
      }
      for (size_t d = nd; d-- > 0;) {
        if (++idx[d] < cuts[d].size() - 1) break;
        idx[d] = 0;
      }
    }
  }
  return err(fmt::format("{} elements are in no shard (a rank missing?)", missing));
}

// ---- sources --------------------------------------------------------------------

namespace {

struct SourcePart {
  uint32_t source = 0;
  const ManifestTensor* tensor = nullptr;
  ShardBox shard;                 // its box or flat range
  std::vector<ShardPiece> pieces;  // the shard as boxes (once validated)
};

struct GlobalInfo {
  std::string name;
  DType dtype = DType::kF32;
  uint32_t group = 0;
  std::vector<uint64_t> global_shape;
  std::vector<std::pair<std::string, DType>> fields;
  std::vector<SourcePart> parts;  // sorted by their first element (row-major order)
};

struct Sources {
  std::vector<std::string> dirs;
  std::vector<Manifest> manifests;
  std::map<std::string, GlobalInfo> tensors;
};

std::string GroupsText(const std::vector<GroupInfo>& gs) {
  std::string out;
  for (const GroupInfo& g : gs) {
    out += fmt::format("{{id {} step_count {}", g.id, g.step_count);
    for (const auto& [k, v] : g.hyper) out += fmt::format(" {}={}", k, v);
    out += "}";
  }
  return out.empty() ? "none" : out;
}

Result<Sources> LoadSources(const std::vector<std::string>& dirs, uint64_t chunk_size_bytes) {
  if (dirs.empty()) return InvalidArgument("reshard: no source checkpoints given");
  Sources s;
  s.dirs = dirs;
  for (std::string& d : s.dirs) {
    while (d.size() > 1 && d.back() == '/') d.pop_back();
  }
  for (size_t i = 0; i < s.dirs.size(); ++i) {
    for (size_t k = 0; k < i; ++k) {
      if (s.dirs[k] == s.dirs[i]) return InvalidArgument("reshard: source " + s.dirs[i] + " is given twice");
    }
    const std::string path = s.dirs[i] + "/" + kManifestFileName;
    auto text = FileSystem::Default()->ReadFileToString(path);
    if (!text.ok()) return text.status().WithContext("reshard: source " + s.dirs[i]);
    OPTSTATE_ASSIGN_OR_RETURN(Manifest m, ParseManifest(*text, path));
    s.manifests.push_back(std::move(m));
  }
  const Manifest& m0 = s.manifests[0];
  auto source = [&](size_t i) { return fmt::format("source {} ({})", i, s.dirs[i]); };
  for (size_t i = 1; i < s.manifests.size(); ++i) {
    const Manifest& m = s.manifests[i];
    if (m.step != m0.step || m.generation != m0.generation) {
      return InvalidArgument(fmt::format(
          "reshard: the sources are not one checkpoint: {} is step {} generation {}, {} is step {} generation {}; "
          "give the checkpoints of one step of every rank",
          source(0), m0.step, m0.generation, source(i), m.step, m.generation));
    }
    if (GroupsText(m.groups) != GroupsText(m0.groups)) {
      return InvalidArgument(fmt::format("reshard: the sources' optimizer groups differ: {} has {}, {} has {}",
                                         source(0), GroupsText(m0.groups), source(i), GroupsText(m.groups)));
    }
    if (chunk_size_bytes == 0 && m.chunk_size_bytes != m0.chunk_size_bytes) {
      return InvalidArgument(fmt::format(
          "reshard: the sources' chunk sizes differ ({} has {} bytes, {} has {} bytes): give the destination's "
          "chunk size",
          source(0), m0.chunk_size_bytes, source(i), m.chunk_size_bytes));
    }
  }
  // q8 moments are quantized in blocks of 256 elements of each shard: a new
  // shard boundary would cut blocks, and re-blocking requantizes (changes the
  // state), so reshard refuses them rather than change them silently.
  for (size_t i = 0; i < s.manifests.size(); ++i) {
    for (const ManifestTensor& mt : s.manifests[i].tensors) {
      for (const ManifestField& f : mt.fields) {
        if (IsQ8(f.dtype)) {
          return InvalidArgument(fmt::format(
              "reshard: {}: tensor '{}' field '{}' holds 8-bit block-scaled moments ({}), whose blocks of {} "
              "elements a new shard boundary would cut; convert each source to f32 moments first "
              "(optstate-restore SOURCE NEW_STORE --create NAME --moments f32, then export a checkpoint of it), "
              "reshard those, and convert the result back with --moments q8",
              source(i), mt.name, f.name, DTypeName(f.dtype), kQ8BlockElems));
        }
      }
    }
  }
  for (size_t i = 0; i < s.manifests.size(); ++i) {
    for (const ManifestTensor& mt : s.manifests[i].tensors) {
      std::vector<std::pair<std::string, DType>> fields;
      for (const ManifestField& f : mt.fields) fields.emplace_back(f.name, f.dtype);
      auto [it, fresh] = s.tensors.try_emplace(mt.name);
      GlobalInfo& g = it->second;
      if (fresh) {
        g.name = mt.name;
        g.dtype = mt.dtype;
        g.group = mt.group;
        g.global_shape = mt.global_shape;
        g.fields = fields;
      } else {
        const ManifestTensor& first = *g.parts.front().tensor;
        const std::string other = source(g.parts.front().source);
        auto differ = [&](const char* what, const std::string& a, const std::string& b) {
          return InvalidArgument(fmt::format("reshard: tensor '{}': {} {} in {}, {} in {}", mt.name, what, a,
                                             other, b, source(i)));
        };
        if (g.global_shape != mt.global_shape) {
          return differ("global_shape", Dims(g.global_shape), Dims(mt.global_shape));
        }
        if (g.dtype != mt.dtype) return differ("dtype", DTypeName(g.dtype), DTypeName(mt.dtype));
        if (g.group != mt.group) return differ("group", std::to_string(g.group), std::to_string(mt.group));
        if (g.fields != fields) {
          auto text = [](const ManifestTensor& t) {
            std::vector<std::string> v;
            for (const ManifestField& f : t.fields) v.push_back(f.name + ":" + DTypeName(f.dtype));
            return fmt::format("{}", fmt::join(v, ","));
          };
          return differ("fields", text(first), text(mt));
        }
      }
      g.parts.push_back({static_cast<uint32_t>(i), &mt, ShardOf(mt.shape, mt.global_shape, mt.shard_offset), {}});
      // The copy opens a field file only for its chunks: one with none must
      // still be there, or the source is not the checkpoint its manifest says.
      for (const ManifestField& f : mt.fields) {
        if (f.bytes != 0) continue;
        const std::string path = s.dirs[i] + "/" + f.file;
        OPTSTATE_ASSIGN_OR_RETURN(bool there, FileSystem::Default()->Exists(path));
        if (!there) {
          return NotFound(fmt::format("reshard: {}: tensor '{}' field '{}': {} is missing (an empty field has "
                                      "its file too)",
                                      source(i), mt.name, f.name, path));
        }
      }
    }
  }
  for (auto& [name, g] : s.tensors) {
    std::sort(g.parts.begin(), g.parts.end(), [&](const SourcePart& a, const SourcePart& b) {
      return FirstElement(a.shard, g.global_shape) < FirstElement(b.shard, g.global_shape);
    });
    std::vector<std::pair<std::string, ShardBox>> boxes;
    for (const SourcePart& p : g.parts) boxes.emplace_back(source(p.source), p.shard);
    OPTSTATE_RETURN_IF_ERROR(ValidateTiling("reshard: sources", name, g.global_shape, boxes));
    for (SourcePart& p : g.parts) p.pieces = ShardPieces(p.shard, g.global_shape);
  }
  return s;
}

// A tensor without elements that the target does not list goes to rank 0, whole
// (layouts leave out empty parts, and an empty tensor is nothing but that).
TargetLayout WithEmptyTensors(const Sources& s, const TargetLayout& target) {
  TargetLayout out = target;
  if (out.ranks.empty()) return out;
  for (const auto& [name, g] : s.tensors) {
    if (Volume(g.global_shape) != 0) continue;
    bool listed = false;
    for (const auto& r : out.ranks) listed = listed || r.count(name) != 0;
    if (!listed) out.ranks[0].emplace(name, ShardBox{std::vector<uint64_t>(g.global_shape.size(), 0), g.global_shape});
  }
  return out;
}

Status ValidateTarget(const Sources& s, const TargetLayout& target) {
  if (target.ranks.empty()) return InvalidArgument("reshard: target layout has no ranks");
  std::map<std::string, std::vector<std::pair<std::string, ShardBox>>> by_tensor;
  for (size_t r = 0; r < target.ranks.size(); ++r) {
    for (const auto& [name, b] : target.ranks[r]) {
      if (!s.tensors.count(name)) {
        return InvalidArgument(fmt::format(
            "reshard: target layout: rank {} lists tensor '{}', which no source holds", r, name));
      }
      by_tensor[name].emplace_back(fmt::format("rank {}", r), b);
    }
  }
  for (const auto& [name, g] : s.tensors) {
    auto it = by_tensor.find(name);
    if (it == by_tensor.end()) {
      return InvalidArgument(fmt::format("reshard: target layout: tensor '{}' (global shape {}) is on no rank", name,
                                         Dims(g.global_shape)));
    }
    OPTSTATE_RETURN_IF_ERROR(ValidateTiling("reshard: target layout", name, g.global_shape, it->second));
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<GlobalTensor>> GlobalTensorsOf(const std::vector<std::string>& sources) {
  OPTSTATE_ASSIGN_OR_RETURN(Sources s, LoadSources(sources, 0));
  std::vector<GlobalTensor> out;
  for (const auto& [name, g] : s.tensors) out.push_back({name, g.global_shape});
  return out;
}

std::string ReshardRankDirName(uint32_t rank) { return fmt::format("rank-{:05d}", rank); }

// ---- the copy -----------------------------------------------------------------------

namespace {

// An io_uring engine, with `eo`'s registered buffers where they can be pinned
// (RLIMIT_MEMLOCK), else without them, else the synchronous engine.
Result<std::unique_ptr<IoEngine>> NewReshardEngine(IoEngineOptions eo, uint64_t sync_staging_bytes) {
  // Plain fds: the copy submits one request of megabytes at a time, each to a
  // file it then closes, where a registered-file slot saves nothing and its
  // check (fcntl + fstat of the fd, per submission) is the only cost.
  eo.registered_file_slots = 0;
  auto e = IoEngine::NewUring(eo);
  if (!e.ok() && !eo.registered_buffers.empty()) {
    OPTSTATE_LOG_WARN("reshard: {}; going on without registered buffers", e.status().ToString());
    eo.registered_buffers.clear();
    e = IoEngine::NewUring(eo);
  }
  if (e.ok()) return std::move(*e);
  OPTSTATE_LOG_WARN("reshard: io_uring unavailable ({}); using synchronous I/O", e.status().ToString());
  return IoEngine::NewSync(sync_staging_bytes);
}

// Source chunks read ahead in the order the copy consumes them: O_DIRECT
// through the io engine with up to `depth` chunks in flight, so that the disk
// reads while earlier chunks are verified, scattered and written. Item i uses
// buffer i % depth; a buffer is reused once the copy has moved past its chunk.
// A chunk's unaligned tail (the end of a file whose size is no multiple of
// 4096 bytes) is read with a buffered pread when the chunk is consumed.
class SourceReader {
 public:
  struct FieldFile {
    std::string path;
    uint64_t bytes = 0;   // its size per the manifest
    std::string context;  // "tensor 'x' field 'y'"
  };
  struct Item {
    uint32_t file = 0;  // index into files
    uint64_t offset = 0, length = 0;
  };

  SourceReader(std::vector<FieldFile> files, std::vector<Item> items)
      : files_(std::move(files)), items_(std::move(items)), open_(files_.size()), left_(files_.size(), 0) {
    for (const Item& it : items_) ++left_[it.file];
  }
  ~SourceReader() {
    std::vector<IoCompletion> done;
    while (engine_ && engine_->in_flight() > 0) {
      done.clear();
      if (!engine_->Reap(&done, 1).ok()) break;
    }
  }
  SourceReader(const SourceReader&) = delete;
  SourceReader& operator=(const SourceReader&) = delete;

  Status Init(uint32_t depth, uint64_t max_chunk_bytes) {
    depth_ = std::max<uint32_t>(1, depth);
    const uint64_t buf_bytes = (max_chunk_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    for (uint32_t i = 0; i < depth_; ++i) {
      IoBuffer b(buf_bytes);
      if (!b.ok()) {
        return ResourceExhausted(fmt::format("reshard: out of memory for {} read buffers of {} bytes", depth_,
                                             buf_bytes));
      }
      slots_.push_back({std::move(b), false, Status::Ok()});
    }
    IoEngineOptions eo;
    eo.queue_depth = depth_;
    for (Slot& s : slots_) eo.registered_buffers.push_back(s.buf.span());  // pinned once, not per read
    OPTSTATE_ASSIGN_OR_RETURN(engine_, NewReshardEngine(std::move(eo), buf_bytes));
    return Status::Ok();
  }

  // The bytes of the next item (valid until the following call).
  Result<const char*> Next() {
    if (next_ >= items_.size()) return Internal("reshard: read past the last source chunk");
    if (next_ > 0) Release(next_ - 1);
    OPTSTATE_RETURN_IF_ERROR(Fill());
    if (failed_ && failed_item_ == next_) return failed_status_;
    const Item& it = items_[next_];
    Slot& s = slots_[next_ % depth_];
    std::vector<IoCompletion> done;
    while (!s.done) {
      done.clear();
      OPTSTATE_RETURN_IF_ERROR(engine_->Reap(&done, 1));
      for (IoCompletion& c : done) {
        slots_[c.tag].done = true;
        slots_[c.tag].status = std::move(c.status);
      }
    }
    FileState& f = open_[it.file];
    if (!s.status.ok()) return s.status.WithContext("reshard: " + files_[it.file].context);
    const uint64_t aligned = AlignedPart(f, it);
    char* buf = reinterpret_cast<char*>(s.buf.data());
    if (aligned < it.length) {
      if (!f.buffered) {
        OpenOptions oo;
        oo.read_only = true;
        auto file = FileSystem::Default()->Open(files_[it.file].path, oo);
        if (!file.ok()) return file.status().WithContext("reshard: " + files_[it.file].context);
        f.buffered = std::move(*file);
      }
      OPTSTATE_RETURN_IF_ERROR(f.buffered->Pread(it.offset + aligned, buf + aligned, it.length - aligned)
                                   .WithContext("reshard: " + files_[it.file].context));
    }
    ++next_;
    return static_cast<const char*>(buf);
  }

 private:
  static constexpr uint64_t kDirectAlign = 4096;
  struct Slot {
    IoBuffer buf;
    bool done = false;
    Status status;
  };
  struct FileState {
    std::unique_ptr<File> direct;    // O_DIRECT where the file system allows it
    std::unique_ptr<File> buffered;  // for unaligned tails, opened when needed
  };

  uint64_t AlignedPart(const FileState& f, const Item& it) const {
    return f.direct->direct() ? it.length / kDirectAlign * kDirectAlign : it.length;
  }

  // The copy is done with item i: its buffer is free, and its file is closed
  // after its last chunk.
  void Release(size_t i) {
    const uint32_t fi = items_[i].file;
    if (--left_[fi] == 0) open_[fi] = FileState{};
  }

  // Submits reads until `depth_` items are ahead of the copy. An item whose
  // file cannot be opened (or has the wrong size) stops the submission; its
  // error is returned when the copy reaches it.
  Status Fill() {
    while (!failed_ && submitted_ < items_.size() && submitted_ < next_ + depth_) {
      const Item& it = items_[submitted_];
      FileState& f = open_[it.file];
      if (!f.direct) {
        Status st = Open(it.file);
        if (!st.ok()) {
          failed_ = true;
          failed_item_ = submitted_;
          failed_status_ = std::move(st);
          break;
        }
      }
      Slot& s = slots_[submitted_ % depth_];
      s.done = false;
      s.status = Status::Ok();
      const uint64_t aligned = AlignedPart(f, it);
      if (aligned == 0) {
        s.done = true;
      } else {
        IoRequest r;
        r.op = IoRequest::Op::kRead;
        r.file = f.direct.get();
        r.offset = it.offset;
        r.length = aligned;
        r.buf = s.buf.data();
        r.tag = submitted_ % depth_;
        OPTSTATE_RETURN_IF_ERROR(engine_->Submit({&r, 1}));
      }
      ++submitted_;
    }
    return Status::Ok();
  }

  Status Open(uint32_t fi) {
    const FieldFile& ff = files_[fi];
    OpenOptions oo;
    oo.read_only = true;
    oo.direct = true;
    auto file = FileSystem::Default()->Open(ff.path, oo);
    if (!file.ok()) return file.status().WithContext("reshard: " + ff.context);
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, (*file)->Size());
    if (size != ff.bytes) {
      return Corruption(fmt::format("reshard: {}: size {} bytes, its manifest says {} ({}): {}", ff.path, size,
                                    ff.bytes, ff.context, size < ff.bytes ? "truncated" : "too long"));
    }
    open_[fi].direct = std::move(*file);
    return Status::Ok();
  }

  std::vector<FieldFile> files_;
  std::vector<Item> items_;
  std::vector<FileState> open_;
  std::vector<uint32_t> left_;  // per file: items not yet released
  std::vector<Slot> slots_;
  uint32_t depth_ = 1;
  std::unique_ptr<IoEngine> engine_;
  size_t next_ = 0;       // the next item the copy takes
  size_t submitted_ = 0;  // items [0, submitted_) are read or being read
  bool failed_ = false;
  size_t failed_item_ = 0;
  Status failed_status_;
};

// Destination files written front to back with O_DIRECT through one io
// engine, so that the bytes go to the disk without filling the page cache and
// the copy goes on while they are written. A stream's bytes gather in a
// buffer of `buf_bytes` (a multiple of 4096) that is written whole once full;
// its last partial block is written padded with zeros and the file is then
// cut to its size (Truncate after Drain). Buffers, allocated and registered
// with io_uring up front: one per stream plus `depth` being written.
class DirectWriter {
 public:
  struct Stream {
    std::shared_ptr<File> file;  // kept alive by the writes in flight too
    uint64_t pos = 0;      // file offset of the buffer's first byte
    int32_t buf = -1;      // index into buffers_, -1 = none yet
    uint64_t fill = 0;     // bytes in the buffer
  };

  ~DirectWriter() { (void)Drain(); }

  // `streams`: how many streams hold a buffer at once at most.
  Status Init(uint32_t depth, uint64_t buf_bytes, uint32_t streams) {
    depth_ = std::max<uint32_t>(1, depth);
    buf_bytes_ = std::max<uint64_t>(kDirectAlign, (buf_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign);
    for (uint32_t i = 0; i < depth_ + streams; ++i) {
      IoBuffer b(buf_bytes_);
      if (!b.ok()) {
        return ResourceExhausted(
            fmt::format("reshard: out of memory for {} write buffers of {} bytes", depth_ + streams, buf_bytes_));
      }
      buffers_.push_back(std::move(b));
      files_.emplace_back();
      free_.push_back(static_cast<int32_t>(i));
    }
    IoEngineOptions eo;
    eo.queue_depth = depth_;
    for (IoBuffer& b : buffers_) eo.registered_buffers.push_back(b.span());  // pinned once, not per write
    OPTSTATE_ASSIGN_OR_RETURN(engine_, NewReshardEngine(std::move(eo), buf_bytes_));
    return Status::Ok();
  }

  Status Append(Stream& s, const char* p, uint64_t n) {
    while (n > 0) {
      if (s.buf < 0) {
        OPTSTATE_ASSIGN_OR_RETURN(s.buf, Acquire());
      }
      const uint64_t take = std::min(n, buf_bytes_ - s.fill);
      std::memcpy(reinterpret_cast<char*>(buffers_[s.buf].data()) + s.fill, p, take);
      s.fill += take;
      p += take;
      n -= take;
      if (s.fill == buf_bytes_) OPTSTATE_RETURN_IF_ERROR(Submit(s));
    }
    return Status::Ok();
  }

  // Writes what the stream holds, its last block padded with zeros.
  Status Finish(Stream& s) {
    if (s.buf < 0) return Status::Ok();
    const uint64_t padded = (s.fill + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    std::memset(reinterpret_cast<char*>(buffers_[s.buf].data()) + s.fill, 0, padded - s.fill);
    s.fill = padded;
    return Submit(s);
  }

  // Waits for every write; the first failure, if any.
  Status Drain() {
    while (engine_ && engine_->in_flight() > 0) OPTSTATE_RETURN_IF_ERROR(ReapSome());
    return first_error_;
  }

 private:
  static constexpr uint64_t kDirectAlign = 4096;

  Status Submit(Stream& s) {
    if (s.fill == 0) return Status::Ok();
    while (engine_->in_flight() >= depth_) OPTSTATE_RETURN_IF_ERROR(ReapSome());
    IoRequest r;
    r.op = IoRequest::Op::kWrite;
    r.file = s.file.get();
    r.offset = s.pos;
    r.length = s.fill;
    r.buf = buffers_[s.buf].data();
    r.tag = static_cast<uint64_t>(s.buf);
    OPTSTATE_RETURN_IF_ERROR(engine_->Submit({&r, 1}));
    files_[s.buf] = s.file;
    s.pos += s.fill;
    s.fill = 0;
    s.buf = -1;
    return first_error_;
  }

  Result<int32_t> Acquire() {
    while (free_.empty()) {
      if (engine_->in_flight() == 0) return Internal("reshard: more write streams than write buffers");
      OPTSTATE_RETURN_IF_ERROR(ReapSome());
    }
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }

  Status ReapSome() {
    std::vector<IoCompletion> done;
    OPTSTATE_RETURN_IF_ERROR(engine_->Reap(&done, 1));
    for (IoCompletion& c : done) {
      free_.push_back(static_cast<int32_t>(c.tag));
      files_[c.tag].reset();
      if (!c.status.ok() && first_error_.ok()) first_error_ = std::move(c.status);
    }
    return Status::Ok();
  }

  uint32_t depth_ = 1;
  uint64_t buf_bytes_ = 0;
  // Declared before engine_: they outlive its requests.
  std::vector<IoBuffer> buffers_;
  std::vector<std::shared_ptr<File>> files_;  // per buffer: the file it is being written to
  std::unique_ptr<IoEngine> engine_;
  std::vector<int32_t> free_;
  Status first_error_;
};

// One destination rank's checkpoint while it is written.
struct DestRank {
  std::string dir;
  Manifest manifest;
  std::map<std::string, size_t> tensor_index;     // name -> index in manifest.tensors
  std::vector<std::vector<uint64_t>> st_offsets;  // [tensor][field]: file offset in state.safetensors
  std::string st_header;
  std::shared_ptr<File> st;
  // Every field of the rank gets its bytes in file order: its files (and
  // state.safetensors, filled field after field) are written front to back
  // with O_DIRECT. Otherwise they are written buffered, in staged runs.
  bool direct = false;
  DirectWriter::Stream st_stream;
  uint64_t st_bytes = 0;  // size of state.safetensors
};

// A destination field being filled: the part of one rank's box of a tensor.
struct DestField {
  DestRank* rank = nullptr;
  // The rank's shard of the tensor as boxes, each with its row-major strides
  // (elements); the file holds the pieces one after another.
  struct Piece {
    ShardPiece piece;
    std::vector<uint64_t> strides;
  };
  std::vector<Piece> pieces;
  ManifestField* field = nullptr;
  uint64_t st_offset = 0;
  std::shared_ptr<File> file;
  DirectWriter::Stream stream;  // rank->direct
  uint64_t stage_start = 0;  // file offset of stage[0]
  std::vector<char> stage;
  // Chunk hashes computed as the bytes arrive, while they arrive in file
  // order (row and column splits of row-ordered sources do); otherwise the
  // file is read back and hashed at the end.
  bool in_order = true;
  uint64_t hashed = 0;  // bytes [0, hashed) hashed
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash{nullptr, &XXH3_freeState};
};

class Resharder {
 public:
  // Direct writes in flight at once (of staging_bytes_per_rank each).
  static constexpr uint32_t kWriteDepth = 8;
  // Finished field files kept open while their writes complete.
  static constexpr size_t kMaxFilesWritten = 64;

  Resharder(const Sources& s, const TargetLayout& target, const std::string& dir, const ReshardOptions& opts,
            FileSystem* fs)
      : s_(s), target_(target), dir_(dir), opts_(opts), fs_(fs) {}

  Status Run(ReshardResult* result) {
    result_ = result;
    const Manifest& m0 = s_.manifests[0];
    cs_ = opts_.chunk_size_bytes != 0 ? opts_.chunk_size_bytes : m0.chunk_size_bytes;
    uint64_t buf_bytes = cs_;
    for (const Manifest& m : s_.manifests) buf_bytes = std::max(buf_bytes, m.chunk_size_bytes);
    buf_.resize(buf_bytes);
    // Streams at once: each rank's state.safetensors and one field file.
    OPTSTATE_RETURN_IF_ERROR(
        writer_.Init(kWriteDepth, opts_.staging_bytes_per_rank, 2 * static_cast<uint32_t>(target_.ranks.size())));
    OPTSTATE_RETURN_IF_ERROR(Prepare());
    {
      // Every source chunk, in the order CopyField takes them.
      std::vector<SourceReader::FieldFile> files;
      std::vector<SourceReader::Item> items;
      for (const auto& [name, g] : s_.tensors) {
        for (uint32_t f = 0; f < g.fields.size(); ++f) {
          for (const SourcePart& p : g.parts) {
            const ManifestField& sf = p.tensor->fields[f];
            const uint32_t fi = static_cast<uint32_t>(files.size());
            files.push_back({s_.dirs[p.source] + "/" + sf.file, sf.bytes,
                             fmt::format("tensor '{}' field '{}'", g.name, g.fields[f].first)});
            for (const ManifestChunk& c : sf.chunks) items.push_back({fi, c.offset_bytes, c.length_bytes});
          }
        }
      }
      reader_ = std::make_unique<SourceReader>(std::move(files), std::move(items));
      OPTSTATE_RETURN_IF_ERROR(reader_->Init(opts_.read_ahead_chunks, buf_bytes));
    }
    for (const auto& [name, g] : s_.tensors) {
      for (uint32_t f = 0; f < g.fields.size(); ++f) OPTSTATE_RETURN_IF_ERROR(CopyField(g, f));
    }
    for (DestRank& r : ranks_) {
      if (r.direct) OPTSTATE_RETURN_IF_ERROR(writer_.Finish(r.st_stream));
    }
    OPTSTATE_RETURN_IF_ERROR(SyncWritten());
    for (DestRank& r : ranks_) {
      if (r.direct) OPTSTATE_RETURN_IF_ERROR(Truncate(*r.st, r.st_bytes));
      OPTSTATE_RETURN_IF_ERROR(r.st->Fdatasync());
      r.st.reset();
      const std::string json = SerializeManifest(r.manifest);
      OpenOptions oo;
      oo.create = true;
      oo.exclusive = true;
      OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> mf, fs_->Open(r.dir + "/" + kManifestFileName, oo));
      OPTSTATE_RETURN_IF_ERROR(mf->Pwrite(0, json.data(), json.size()));
      OPTSTATE_RETURN_IF_ERROR(mf->Fsync());
      result_->bytes_written += json.size();
      for (const ManifestTensor& t : r.manifest.tensors) {
        OPTSTATE_RETURN_IF_ERROR(fs_->SyncDir(r.dir + "/" + kTensorsDirName + "/" + t.file_name));
      }
      OPTSTATE_RETURN_IF_ERROR(fs_->SyncDir(r.dir + "/" + kTensorsDirName));
      OPTSTATE_RETURN_IF_ERROR(fs_->SyncDir(r.dir));
    }
    result_->ranks = static_cast<uint32_t>(ranks_.size());
    return fs_->SyncDir(dir_);
  }

 private:
  // Directories, manifests without chunk hashes, state.safetensors headers.
  Status Prepare() {
    const Manifest& m0 = s_.manifests[0];
    ranks_.resize(target_.ranks.size());
    for (uint32_t r = 0; r < ranks_.size(); ++r) {
      DestRank& d = ranks_[r];
      d.dir = dir_ + "/" + ReshardRankDirName(r);
      OPTSTATE_RETURN_IF_ERROR(fs_->CreateDir(d.dir));
      OPTSTATE_RETURN_IF_ERROR(fs_->CreateDir(d.dir + "/" + kTensorsDirName));
      Manifest& m = d.manifest;
      m.store_uuid = RandomUuid();
      m.store_name = opts_.store_name.empty() ? m0.store_name : opts_.store_name;
      m.generation = m0.generation;
      m.step = m0.step;
      m.chunk_size_bytes = cs_;
      m.groups = m0.groups;
      for (const auto& [name, box] : target_.ranks[r]) {  // std::map: sorted by name, as manifests are
        const GlobalInfo& g = s_.tensors.at(name);
        ManifestTensor t;
        t.name = name;
        t.file_name = FileNameForName(name);
        t.dtype = g.dtype;
        t.numel = static_cast<uint64_t>(Volume(box.shape));
        t.group = g.group;
        t.shape = box.shape;
        t.global_shape = g.global_shape;
        t.shard_offset = box.offset;
        for (const auto& [fname, fdtype] : g.fields) {
          ManifestField f;
          f.name = fname;
          f.dtype = fdtype;
          f.file = fmt::format("{}/{}/{}", kTensorsDirName, t.file_name, FileNameForName(fname));
          f.bytes = t.numel * ElemSize(fdtype);
          t.fields.push_back(std::move(f));
        }
        OPTSTATE_RETURN_IF_ERROR(fs_->CreateDir(d.dir + "/" + kTensorsDirName + "/" + t.file_name));
        d.tensor_index[name] = m.tensors.size();
        m.tensors.push_back(std::move(t));
      }
      d.st_header = SafetensorsHeader(m);
      uint64_t off = 0;  // in the data section: the fields back to back, in manifest order
      for (const ManifestTensor& t : m.tensors) {
        d.st_offsets.emplace_back();
        for (const ManifestField& f : t.fields) {
          d.st_offsets.back().push_back(d.st_header.size() + off);
          off += f.bytes;
        }
      }
      d.direct = true;
      for (const auto& [name, box] : target_.ranks[r]) d.direct = d.direct && ArrivesInOrder(s_.tensors.at(name), box);
      d.st_bytes = d.st_header.size() + off;
      OPTSTATE_ASSIGN_OR_RETURN(d.st, Create(d.dir + "/" + kSafetensorsFileName, d.direct));
      if (d.direct) {
        d.st_stream.file = d.st;
        OPTSTATE_RETURN_IF_ERROR(writer_.Append(d.st_stream, d.st_header.data(), d.st_header.size()));
      } else {
        OPTSTATE_RETURN_IF_ERROR(d.st->Pwrite(0, d.st_header.data(), d.st_header.size()));
      }
      // Sized up front: the data section is filled out of order.
      if (off > 0) OPTSTATE_RETURN_IF_ERROR(d.st->Fallocate(d.st_header.size(), off));
      result_->bytes_written += d.st_header.size();
    }
    for (const auto& [name, g] : s_.tensors) {
      for (const SourcePart& p : g.parts) {
        for (const ManifestField& f : p.tensor->fields) total_ += f.bytes;
      }
    }
    return Status::Ok();
  }

  Result<std::unique_ptr<File>> Create(const std::string& path, bool direct) {
    OpenOptions oo;
    oo.create = true;
    oo.exclusive = true;
    oo.direct = direct;
    return fs_->Open(path, oo);
  }

  // Whether the copy delivers the bytes of `dest` (a destination shard of g)
  // in file order: the sources are read one after another in g.parts order,
  // each piece of each in its own row-major order, so they are in order when
  // each source piece's part of each destination piece is one contiguous run
  // of the destination file and the runs follow each other. Row and column
  // splits of row-split sources are, and so are flat ranges of them.
  static bool ArrivesInOrder(const GlobalInfo& g, const ShardBox& dest) {
    const std::vector<ShardPiece> dest_pieces = ShardPieces(dest, g.global_shape);
    const size_t nd = g.global_shape.size();
    uint64_t next = 0;  // elements of dest delivered by the pieces before
    for (const SourcePart& p : g.parts) {
      for (const ShardPiece& sp : p.pieces) {
        for (const ShardPiece& dp : dest_pieces) {
          const ShardBox& src = sp.box;
          const ShardBox& dst = dp.box;
          std::vector<uint64_t> lo(nd), ext(nd);
          bool empty = false;
          for (size_t k = 0; k < nd; ++k) {
            lo[k] = std::max(src.offset[k], dst.offset[k]);
            const uint64_t hi = std::min(src.offset[k] + src.shape[k], dst.offset[k] + dst.shape[k]);
            empty = empty || hi <= lo[k];
            ext[k] = empty ? 0 : hi - lo[k];
          }
          if (empty) continue;
          // Contiguous: extents 1 before the last dimension that is partial, full after it.
          size_t last_partial = 0;
          for (size_t k = 0; k < nd; ++k) {
            if (ext[k] != dst.shape[k]) last_partial = k;
          }
          uint64_t start = 0, stride = 1, count = 1;
          for (size_t k = nd; k-- > 0;) {
            if (k < last_partial && ext[k] != 1) return false;
            start += (lo[k] - dst.offset[k]) * stride;
            stride *= dst.shape[k];
            count *= ext[k];
          }
          if (dp.first + start != next) return false;
          next += count;
        }
      }
    }
    return true;
  }

  Status Truncate(File& f, uint64_t bytes) {
    if (::ftruncate(f.fd(), static_cast<off_t>(bytes)) != 0) {
      return ErrnoStatus(fmt::format("reshard: cutting {} to {} bytes", f.path(), bytes), errno);
    }
    return Status::Ok();
  }

  // Waits for the direct writes, cuts the finished field files to their sizes
  // (their last block was written padded) and makes them durable.
  Status SyncWritten() {
    OPTSTATE_RETURN_IF_ERROR(writer_.Drain());
    for (auto& [file, bytes] : written_) {
      OPTSTATE_RETURN_IF_ERROR(Truncate(*file, bytes));
      OPTSTATE_RETURN_IF_ERROR(file->Fdatasync());
    }
    written_.clear();
    return Status::Ok();
  }

  Status Flush(DestField& d) {
    if (d.stage.empty()) return Status::Ok();
    OPTSTATE_RETURN_IF_ERROR(d.file->Pwrite(d.stage_start, d.stage.data(), d.stage.size()));
    OPTSTATE_RETURN_IF_ERROR(d.rank->st->Pwrite(d.st_offset + d.stage_start, d.stage.data(), d.stage.size()));
    // Start the writeback now, so that the disk writes while the next chunks
    // are read and scattered instead of all at the final fdatasync. A hint
    // only: durability still comes from the fdatasync of every file.
    (void)::sync_file_range(d.file->fd(), static_cast<off64_t>(d.stage_start), static_cast<off64_t>(d.stage.size()),
                            SYNC_FILE_RANGE_WRITE);
    (void)::sync_file_range(d.rank->st->fd(), static_cast<off64_t>(d.st_offset + d.stage_start),
                            static_cast<off64_t>(d.stage.size()), SYNC_FILE_RANGE_WRITE);
    result_->bytes_written += 2 * d.stage.size();
    d.stage.clear();
    return Status::Ok();
  }

  // Appends bytes bound for file offset `at` of d, writing out what is staged
  // first when they do not continue it or the stage is full.
  Status Stage(DestField& d, uint64_t at, const char* p, uint64_t n) {
    if (d.rank->direct) {
      const uint64_t st_at = d.rank->st_stream.pos + d.rank->st_stream.fill;
      if (at != d.hashed || st_at != d.st_offset + at) {
        return Internal(fmt::format("reshard: {}: bytes at {} arrived out of order (expected {}; "
                                    "state.safetensors at {}, expected {})",
                                    d.file->path(), at, d.hashed, st_at, d.st_offset + at));
      }
    }
    if (d.in_order && at == d.hashed) {
      for (uint64_t k = 0; k < n;) {
        if (d.hashed % cs_ == 0) XXH3_64bits_reset(d.hash.get());
        const uint64_t take = std::min(n - k, cs_ - d.hashed % cs_);
        XXH3_64bits_update(d.hash.get(), p + k, take);
        k += take;
        d.hashed += take;
        if (d.hashed % cs_ == 0 || d.hashed == d.field->bytes) {
          const uint64_t len = (d.hashed - 1) % cs_ + 1;
          d.field->chunks.push_back({d.hashed - len, len, XXH3_64bits_digest(d.hash.get())});
        }
      }
    } else if (d.in_order) {
      d.in_order = false;
      d.field->chunks.clear();
    }
    if (d.rank->direct) {
      OPTSTATE_RETURN_IF_ERROR(writer_.Append(d.stream, p, n));
      OPTSTATE_RETURN_IF_ERROR(writer_.Append(d.rank->st_stream, p, n));
      result_->bytes_written += 2 * n;
      return Status::Ok();
    }
    if (!d.stage.empty() && (d.stage_start + d.stage.size() != at ||
                             d.stage.size() + n > opts_.staging_bytes_per_rank)) {
      OPTSTATE_RETURN_IF_ERROR(Flush(d));
    }
    if (d.stage.empty()) d.stage_start = at;
    if (n >= opts_.staging_bytes_per_rank) {  // larger than a stage: straight through
      d.stage.assign(p, p + n);
      return Flush(d);
    }
    d.stage.insert(d.stage.end(), p, p + n);
    return Status::Ok();
  }

  // Scatters elements [e0, e1) of source box `src` (their bytes at data) into
  // the destination fields whose pieces they meet. Each row meets at most one
  // piece of a destination (its pieces hold disjoint rows).
  Status Scatter(const ShardBox& src, const char* data, uint64_t e0, uint64_t e1, uint32_t esize,
                 std::vector<DestField*>& dests) {
    const size_t nd = src.shape.size();
    const uint64_t row = src.shape[nd - 1];
    std::vector<uint64_t> g(nd);  // global coordinates of the row's start
    for (uint64_t rho = e0 / row; rho * row < e1; ++rho) {
      uint64_t q = rho;
      for (size_t d = nd - 1; d-- > 0;) {
        g[d] = src.offset[d] + q % src.shape[d];
        q /= src.shape[d];
      }
      const uint64_t c_lo = std::max(e0, rho * row) - rho * row;  // columns of the row in this chunk
      const uint64_t c_hi = std::min(e1, rho * row + row) - rho * row;
      const uint64_t g_lo = src.offset[nd - 1] + c_lo, g_hi = src.offset[nd - 1] + c_hi;
      for (DestField* dp : dests) {
        for (const DestField::Piece& piece : dp->pieces) {
          const ShardBox& b = piece.piece.box;
          bool in = true;
          uint64_t at = piece.piece.first;
          for (size_t d = 0; d + 1 < nd && in; ++d) {
            in = g[d] >= b.offset[d] && g[d] < b.offset[d] + b.shape[d];
            at += (g[d] - b.offset[d]) * piece.strides[d];
          }
          if (!in) continue;
          const uint64_t lo = std::max(g_lo, b.offset[nd - 1]);
          const uint64_t hi = std::min(g_hi, b.offset[nd - 1] + b.shape[nd - 1]);
          if (lo >= hi) continue;
          at += lo - b.offset[nd - 1];
          const uint64_t src_elem = rho * row + (lo - src.offset[nd - 1]);
          OPTSTATE_RETURN_IF_ERROR(Stage(*dp, at * esize, data + (src_elem - e0) * esize, (hi - lo) * esize));
        }
      }
    }
    return Status::Ok();
  }

  Status CopyField(const GlobalInfo& g, uint32_t fi) {
    const std::string& fname = g.fields[fi].first;
    const uint32_t esize = ElemSize(g.fields[fi].second);
    std::vector<DestField> dests;
    for (DestRank& r : ranks_) {
      auto it = r.tensor_index.find(g.name);
      if (it == r.tensor_index.end()) continue;
      ManifestTensor& t = r.manifest.tensors[it->second];
      DestField d;
      d.rank = &r;
      for (ShardPiece& p : ShardPieces(target_.ranks[&r - ranks_.data()].at(g.name), g.global_shape)) {
        DestField::Piece piece{std::move(p), std::vector<uint64_t>(g.global_shape.size(), 1)};
        const std::vector<uint64_t>& shape = piece.piece.box.shape;
        for (size_t k = shape.size() - 1; k-- > 0;) piece.strides[k] = piece.strides[k + 1] * shape[k + 1];
        d.pieces.push_back(std::move(piece));
      }
      d.field = &t.fields[fi];
      d.st_offset = r.st_offsets[it->second][fi];
      d.hash.reset(XXH3_createState());
      if (!d.hash) return ResourceExhausted("reshard: out of memory for a hash state");
      OPTSTATE_ASSIGN_OR_RETURN(d.file, Create(r.dir + "/" + d.field->file, r.direct));
      d.stream.file = d.file;
      if (d.field->bytes > 0) OPTSTATE_RETURN_IF_ERROR(d.file->Fallocate(0, d.field->bytes));
      dests.push_back(std::move(d));
    }
    for (const SourcePart& p : g.parts) {
      const ManifestTensor& st = *p.tensor;
      const ManifestField& sf = st.fields[fi];
      const std::string path = s_.dirs[p.source] + "/" + sf.file;
      std::vector<DestField*> meet;  // destinations whose shard meets this source's
      for (DestField& d : dests) {
        bool overlap = false;
        for (const ShardPiece& sp : p.pieces) {
          for (const DestField::Piece& dp : d.pieces) {
            bool o = true;
            for (size_t k = 0; k < sp.box.shape.size() && o; ++k) {
              o = std::max(sp.box.offset[k], dp.piece.box.offset[k]) <
                  std::min(sp.box.offset[k] + sp.box.shape[k], dp.piece.box.offset[k] + dp.piece.box.shape[k]);
            }
            overlap = overlap || o;
          }
        }
        if (overlap) meet.push_back(&d);
      }
      for (size_t ci = 0; ci < sf.chunks.size(); ++ci) {
        const ManifestChunk& c = sf.chunks[ci];
        OPTSTATE_ASSIGN_OR_RETURN(const char* data, reader_->Next());
        const uint64_t h = XXH3_64bits(data, c.length_bytes);
        if (h != c.xxh3) {
          return Corruption(fmt::format(
              "reshard: {}: chunk {} (bytes {}..{}) has XXH3 {:016x}, its manifest (generation {}) says {:016x} "
              "(tensor '{}' field '{}'): the file is damaged or from another generation; nothing was written",
              path, ci, c.offset_bytes, c.offset_bytes + c.length_bytes, h, s_.manifests[p.source].generation,
              c.xxh3, g.name, fname));
        }
        result_->bytes_read += c.length_bytes;
        const uint64_t c0 = c.offset_bytes / esize, c1 = (c.offset_bytes + c.length_bytes) / esize;
        for (const ShardPiece& sp : p.pieces) {
          const uint64_t first = sp.first, last = first + static_cast<uint64_t>(Volume(sp.box.shape));
          const uint64_t lo = std::max(c0, first), hi = std::min(c1, last);
          if (lo >= hi) continue;
          OPTSTATE_RETURN_IF_ERROR(Scatter(sp.box, data + (lo - c0) * esize, lo - first, hi - first, esize, meet));
        }
        OPTSTATE_TEST_SYNC_POINT("reshard.after_chunk");
      }
      done_ += sf.bytes;
      if (opts_.progress) opts_.progress(done_, total_);
    }
    // Every destination byte is written (the layouts tile). Fields whose
    // bytes came out of order are read back and hashed chunk by chunk.
    for (DestField& d : dests) {
      OPTSTATE_RETURN_IF_ERROR(Flush(d));
      ManifestField& f = *d.field;
      if (d.in_order && d.hashed != f.bytes) {
        return Internal(fmt::format("reshard: tensor '{}' field '{}': {} of {} bytes written on {}", g.name,
                                    fname, d.hashed, f.bytes, d.rank->dir));
      }
      for (uint64_t off = d.in_order ? f.bytes : 0; off < f.bytes; off += cs_) {
        const uint64_t len = std::min(cs_, f.bytes - off);
        OPTSTATE_RETURN_IF_ERROR(d.file->Pread(off, buf_.data(), len));
        f.chunks.push_back({off, len, XXH3_64bits(buf_.data(), len)});
      }
      if (d.rank->direct) {
        OPTSTATE_RETURN_IF_ERROR(writer_.Finish(d.stream));
        written_.emplace_back(std::move(d.file), f.bytes);
      } else {
        OPTSTATE_RETURN_IF_ERROR(d.file->Fdatasync());
      }
    }
    // Field files stay open until their writes are done, a bounded number.
    if (written_.size() >= kMaxFilesWritten) OPTSTATE_RETURN_IF_ERROR(SyncWritten());
    return Status::Ok();
  }

  const Sources& s_;
  const TargetLayout& target_;
  const std::string dir_;
  const ReshardOptions& opts_;
  FileSystem* fs_;
  ReshardResult* result_ = nullptr;
  uint64_t cs_ = 0;
  std::vector<char> buf_;  // one destination chunk while hashing
  std::unique_ptr<SourceReader> reader_;
  DirectWriter writer_;
  std::vector<std::pair<std::shared_ptr<File>, uint64_t>> written_;  // field files and their sizes, writes pending
  std::vector<DestRank> ranks_;
  uint64_t total_ = 0, done_ = 0;
};

}  // namespace

Result<ReshardResult> Reshard(const std::vector<std::string>& sources, const TargetLayout& target_in,
                              const std::string& dest_in, const ReshardOptions& opts) {
  FileSystem* fs = opts.fs != nullptr ? opts.fs : FileSystem::Default();
  std::string dest = dest_in;
  while (dest.size() > 1 && dest.back() == '/') dest.pop_back();
  if (dest.empty()) return InvalidArgument("reshard: empty destination path");
  if (opts.chunk_size_bytes % kChunkAlignBytes != 0) {
    return InvalidArgument(
        fmt::format("reshard: chunk size {} bytes is not a multiple of 2 MiB", opts.chunk_size_bytes));
  }
  if (opts.staging_bytes_per_rank == 0) return InvalidArgument("reshard: staging_bytes_per_rank is 0");
  OPTSTATE_ASSIGN_OR_RETURN(Sources s, LoadSources(sources, opts.chunk_size_bytes));
  const TargetLayout full = WithEmptyTensors(s, target_in);
  const TargetLayout& target = full;
  OPTSTATE_RETURN_IF_ERROR(ValidateTarget(s, target));
  OPTSTATE_RETURN_IF_ERROR(internal::CheckNewDir(fs, dest, "reshard"));
  const std::string where =
      fmt::format("reshard: {} source{} to {} rank{} at {}", s.dirs.size(), s.dirs.size() == 1 ? "" : "s",
                  target.ranks.size(), target.ranks.size() == 1 ? "" : "s", dest);
  ReshardResult result;
  OPTSTATE_RETURN_IF_ERROR(internal::WriteNewDir(
      fs, dest, where, "reshard.before_rename", "the checkpoints are",
      [&](const std::string& partial) { return Resharder(s, target, partial, opts, fs).Run(&result); }));
  OPTSTATE_LOG_INFO("{}: {} bytes read, {} bytes written", where, result.bytes_read, result.bytes_written);
  return result;
}

}  // namespace optstate::vfs
