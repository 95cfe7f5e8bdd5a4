// Reshard's sources: their manifests loaded and checked to be one checkpoint
// that tiles every global tensor, and the target checked against them.
#include <algorithm>

#include <fmt/format.h>

#include "vfs/internal/reshard_geometry.h"
#include "vfs/internal/reshard_sources.h"
#include "vfs/reshard.h"
#include "base/log.h"

namespace optstate::vfs {
namespace {

using internal::Dims;
using internal::LoadSources;
using internal::Sources;
using internal::Volume;

// Row-major index of a shard's first element (the order the sources are read in).
uint64_t FirstElement(const ShardBox& b, const std::vector<uint64_t>& gshape) {
  if (b.flat && !b.within_shape.empty() && b.within_shape.size() == gshape.size() &&
      b.within_offset.size() == gshape.size() && Volume(b.within_shape) != 0) {
    // The range's first element in the box's coordinates, then in the tensor's.
    std::vector<uint64_t> at(gshape.size());
    uint64_t q = b.offset[0];
    for (size_t d = gshape.size(); d-- > 0;) {
      at[d] = b.within_offset[d] + q % b.within_shape[d];
      q /= b.within_shape[d];
    }
    return FirstElement(ShardBox{at, std::vector<uint64_t>(gshape.size(), 1)}, gshape);
  }
  if (b.flat || gshape.size() != b.offset.size()) return b.offset.empty() ? 0 : b.offset[0];
  uint64_t at = 0;
  for (size_t d = 0; d < gshape.size(); ++d) at = at * gshape[d] + b.offset[d];
  return at;
}

std::string GroupsText(const std::vector<GroupInfo>& gs) {
  std::string out;
  for (const GroupInfo& g : gs) {
    out += fmt::format("{{id {} step_count {}", g.id, g.step_count);
    for (const auto& [k, v] : g.hyper) out += fmt::format(" {}={}", k, v);
    out += "}";
  }
  return out.empty() ? "none" : out;
}

}  // namespace

namespace internal {

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
    auto m = ReadManifestFile(path);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kCorruption || m.status().code() == StatusCode::kInvalidArgument) {
        return m.status().WithContext("reshard");
      }
      return m.status().WithContext("reshard: source " + s.dirs[i]);
    }
    s.manifests.push_back(std::move(*m));
    // Where its tensors lie in larger ones (tensor-parallel slices), when the source records it.
    const std::string boxes_path = s.dirs[i] + "/" + kGlobalBoxesFileName;
    OPTSTATE_ASSIGN_OR_RETURN(bool has_boxes, FileSystem::Default()->Exists(boxes_path));
    s.global_boxes.emplace_back();
    if (has_boxes) {
      OPTSTATE_ASSIGN_OR_RETURN(std::string text, FileSystem::Default()->ReadFileToString(boxes_path));
      OPTSTATE_ASSIGN_OR_RETURN(s.global_boxes.back(), ParseGlobalBoxes(text, "reshard: " + boxes_path));
      for (const auto& [name, gb] : s.global_boxes.back()) {
        const ManifestTensor* mt = nullptr;
        for (const ManifestTensor& t : s.manifests.back().tensors) {
          if (t.name == name) mt = &t;
        }
        if (mt == nullptr) {
          return InvalidArgument(fmt::format("reshard: {} lists tensor '{}', which its manifest does not hold",
                                             boxes_path, name));
        }
        if (!gb.replica && gb.global_shape.size() != mt->global_shape.size()) {
          return InvalidArgument(fmt::format(
              "reshard: {}: tensor '{}': global_shape {} has another rank than the manifest's {}", boxes_path, name,
              Dims(gb.global_shape), Dims(mt->global_shape)));
        }
      }
    }
  }
  const Manifest& m0 = s.manifests[0];
  auto source = [&](size_t i) { return fmt::format("source {} ({})", i, s.dirs[i]); };
  // One job's ranks only: two jobs' checkpoints can agree on step and
  // generation, and merging them would mix their states.
  size_t with_job = 0;
  for (const Manifest& m : s.manifests) with_job += m.job.empty() ? 0 : 1;
  if (with_job != 0 && with_job != s.manifests.size()) {
    size_t known = 0, unknown = 0;  // a source with a job and one without
    for (size_t i = 0; i < s.manifests.size(); ++i) (s.manifests[i].job.empty() ? unknown : known) = i;
    return InvalidArgument(fmt::format(
        "reshard: the sources are not of one job: {} is of job {}, {} records no job (written by a version "
        "before manifests named their job); give the checkpoints of one job's ranks",
        source(known), s.manifests[known].job, source(unknown)));
  }
  if (with_job == 0) {
    OPTSTATE_LOG_INFO("reshard: the sources' manifests record no job (written before manifests named it): "
                      "that they are ranks of one job is not checked");
  }
  for (size_t i = 1; i < s.manifests.size(); ++i) {
    if (s.manifests[i].job != m0.job) {
      return InvalidArgument(fmt::format(
          "reshard: the sources are not of one job: {} is of job {}, {} of job {}; the ranks of two training "
          "jobs never merge into one checkpoint (give the checkpoints of one job's ranks)",
          source(0), m0.job, source(i), s.manifests[i].job));
    }
  }
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
      // A tensor-parallel slice: its shard in the global tensor's coordinates; a replica: skipped.
      auto embedded = s.global_boxes[i].find(mt.name);
      if (embedded != s.global_boxes[i].end() && embedded->second.replica) continue;
      ShardBox shard = ShardOf(mt.shape, mt.global_shape, mt.shard_offset);
      std::vector<uint64_t> global_shape = mt.global_shape;
      if (embedded != s.global_boxes[i].end()) {
        const GlobalBox& gb = embedded->second;
        if (Status st = CheckShardInside(ShardBox{gb.offset, mt.global_shape}, gb.global_shape); !st.ok()) {
          return InvalidArgument(fmt::format("reshard: {}: tensor '{}' (a slice of global shape {}) {}", source(i),
                                             mt.name, Dims(gb.global_shape), st.message()));
        }
        shard = EmbedShard(shard, mt.global_shape, gb.offset);
        global_shape = gb.global_shape;
      }
      std::vector<std::pair<std::string, DType>> fields;
      for (const ManifestField& f : mt.fields) fields.emplace_back(f.name, f.dtype);
      auto [it, fresh] = s.tensors.try_emplace(mt.name);
      GlobalInfo& g = it->second;
      if (fresh) {
        g.name = mt.name;
        g.dtype = mt.dtype;
        g.group = mt.group;
        g.step_count = mt.step_count;
        g.global_shape = global_shape;
        g.fields = fields;
      } else {
        const ManifestTensor& first = *g.parts.front().tensor;
        const std::string other = source(g.parts.front().source);
        auto differ = [&](const char* what, const std::string& a, const std::string& b) {
          return InvalidArgument(fmt::format("reshard: tensor '{}': {} {} in {}, {} in {}", mt.name, what, a,
                                             other, b, source(i)));
        };
        if (g.global_shape != global_shape) {
          return differ("global_shape", Dims(g.global_shape), Dims(global_shape));
        }
        if (g.dtype != mt.dtype) return differ("dtype", DTypeName(g.dtype), DTypeName(mt.dtype));
        if (g.group != mt.group) return differ("group", std::to_string(g.group), std::to_string(mt.group));
        // Adam's bias correction is per tensor: pieces of one tensor that
        // took different numbers of steps cannot be one tensor's state.
        if (g.step_count != mt.step_count) {
          return differ("step_count", std::to_string(g.step_count), std::to_string(mt.step_count));
        }
        if (g.fields != fields) {
          auto text = [](const ManifestTensor& t) {
            std::vector<std::string> v;
            for (const ManifestField& f : t.fields) v.push_back(f.name + ":" + DTypeName(f.dtype));
            return fmt::format("{}", fmt::join(v, ","));
          };
          return differ("fields", text(first), text(mt));
        }
      }
      g.parts.push_back({static_cast<uint32_t>(i), &mt, std::move(shard), {}});
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
      auto it = s.tensors.find(name);
      if (it == s.tensors.end()) {
        return InvalidArgument(fmt::format(
            "reshard: target layout: rank {} lists tensor '{}', which no source holds", r, name));
      }
      if (b.replica) {  // a copy: inside the tensor, no part of the tiling
        if (Status st = CheckShardInside(b, it->second.global_shape); !st.ok()) {
          return InvalidArgument(fmt::format("reshard: target layout: tensor '{}' (global shape {}): rank {} "
                                             "(a replica) {}", name, Dims(it->second.global_shape), r,
                                             st.message()));
        }
        continue;
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

}  // namespace internal

Result<std::vector<GlobalTensor>> GlobalTensorsOf(const std::vector<std::string>& sources) {
  OPTSTATE_ASSIGN_OR_RETURN(Sources s, LoadSources(sources, 0));
  std::vector<GlobalTensor> out;
  for (const auto& [name, g] : s.tensors) out.push_back({name, g.global_shape});
  return out;
}

std::string ReshardRankDirName(uint32_t rank) { return fmt::format("rank-{:05d}", rank); }

}  // namespace optstate::vfs
