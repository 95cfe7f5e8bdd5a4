// Reshard's target layouts: the layout JSON (parse, serialize) and the
// layouts made from even splits, split rules and buckets.
#include <fnmatch.h>

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "vfs/internal/reshard_geometry.h"
#include "vfs/reshard.h"

namespace optstate::vfs {
namespace {

using internal::Dims;
using internal::Volume;

using Json = nlohmann::json;
using OJson = nlohmann::ordered_json;

constexpr size_t kMaxRank = 16;

}  // namespace

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
      bool replica = false;
      if (auto rep = jb.find("replica"); rep != jb.end()) {
        if (!rep->is_boolean()) return err(bkey + ".replica", "expected true or false");
        replica = rep->get<bool>();
      }
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
        b = FlatRange(range[0], range[1]);
        if (auto within = jb.find("within"); within != jb.end()) {
          if (!within->is_object()) return err(bkey + ".within", "expected an object with offset and shape");
          OPTSTATE_RETURN_IF_ERROR(u64s(*within, bkey + ".within.", "offset", &b.within_offset));
          OPTSTATE_RETURN_IF_ERROR(u64s(*within, bkey + ".within.", "shape", &b.within_shape));
          if (b.within_offset.size() != b.within_shape.size()) {
            return err(bkey + ".within", fmt::format("offset {} and shape {} have different ranks",
                                                     Dims(b.within_offset), Dims(b.within_shape)));
          }
          for (size_t d = 0; d < b.within_shape.size(); ++d) {
            if (b.within_shape[d] == 0) return err(bkey + ".within.shape", "an empty box");
            if (b.within_offset[d] + b.within_shape[d] < b.within_offset[d]) {
              return err(bkey + ".within", "offset + shape overflows");
            }
          }
        }
        b.replica = replica;
        boxes.emplace(name, std::move(b));
        continue;
      }
      b.replica = replica;
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
        if (!b.within_shape.empty()) {
          tensors[name]["within"] = OJson{{"offset", b.within_offset}, {"shape", b.within_shape}};
        }
      } else {
        tensors[name] = OJson{{"offset", b.offset}, {"shape", b.shape}};
      }
      if (b.replica) tensors[name]["replica"] = true;
    }
    ranks.push_back(OJson{{"rank", r}, {"tensors", std::move(tensors)}});
  }
  j["ranks"] = std::move(ranks);
  return j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// ---- global-boxes.json ----------------------------------------------------------

Result<std::map<std::string, GlobalBox>> ParseGlobalBoxes(std::string_view json, std::string_view source) {
  Json j = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  auto err = [&](const std::string& key, const std::string& what) {
    return InvalidArgument(fmt::format("{}: key '{}': {}", source, key, what));
  };
  if (j.is_discarded()) return InvalidArgument(fmt::format("{}: not valid JSON", source));
  if (!j.is_object()) return err("(root)", "expected an object");
  auto fmt_it = j.find("format");
  if (fmt_it == j.end() || !fmt_it->is_string() || fmt_it->get<std::string>() != kGlobalBoxesFormat) {
    return err("format", fmt::format("must be \"{}\"", kGlobalBoxesFormat));
  }
  auto ver = j.find("format_version");
  if (ver == j.end() || !ver->is_number_unsigned() || ver->get<uint64_t>() != 1) {
    return err("format_version", "must be 1 (the version this build reads)");
  }
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_object()) return err("tensors", "expected an object");
  std::map<std::string, GlobalBox> out;
  for (const auto& [name, jb] : tensors->items()) {
    const std::string key = fmt::format("tensors[\"{}\"]", name);
    if (!jb.is_object()) return err(key, "expected an object");
    GlobalBox b;
    if (auto rep = jb.find("replica"); rep != jb.end()) {
      if (!rep->is_boolean()) return err(key + ".replica", "expected true or false");
      b.replica = rep->get<bool>();
    }
    if (!b.replica) {
      for (auto [field, v] : {std::pair{"offset", &b.offset}, std::pair{"global_shape", &b.global_shape}}) {
        auto it = jb.find(field);
        if (it == jb.end() || !it->is_array() || it->empty() || it->size() > kMaxRank) {
          return err(key + "." + field, fmt::format("expected an array of 1..{} non-negative integers", kMaxRank));
        }
        for (const Json& x : *it) {
          if (!x.is_number_unsigned()) return err(key + "." + field, "expected non-negative integers");
          v->push_back(x.get<uint64_t>());
        }
      }
      if (b.offset.size() != b.global_shape.size()) {
        return err(key, fmt::format("offset {} and global_shape {} have different ranks", Dims(b.offset),
                                    Dims(b.global_shape)));
      }
    }
    out.emplace(name, std::move(b));
  }
  return out;
}

std::string SerializeGlobalBoxes(const std::map<std::string, GlobalBox>& boxes) {
  OJson j;
  j["format"] = kGlobalBoxesFormat;
  j["format_version"] = 1;
  OJson tensors = OJson::object();
  for (const auto& [name, b] : boxes) {
    tensors[name] = b.replica ? OJson{{"replica", true}} : OJson{{"offset", b.offset}, {"global_shape", b.global_shape}};
  }
  j["tensors"] = std::move(tensors);
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

}  // namespace optstate::vfs
