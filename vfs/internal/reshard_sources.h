// Reshard's sources as the copy sees them: every source manifest and, per
// global tensor, its parts in row-major order, checked to tile it exactly once.
// Internal to vfs: the reshard_*.cc files share it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "vfs/checkpoint.h"
#include "vfs/reshard.h"
#include "base/status.h"

namespace optstate::vfs::internal {

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
  uint64_t step_count = 0;        // every part's (they must agree)
  std::vector<uint64_t> global_shape;
  std::vector<std::pair<std::string, DType>> fields;
  std::vector<SourcePart> parts;  // sorted by their first element (row-major order)
};

struct Sources {
  std::vector<std::string> dirs;
  std::vector<Manifest> manifests;
  std::vector<std::map<std::string, GlobalBox>> global_boxes;  // per source: its global-boxes.json
  std::map<std::string, GlobalInfo> tensors;
};

// The sources' manifests, checked to be one checkpoint (step, generation,
// groups, chunk size unless `chunk_size_bytes` overrides it) whose parts tile
// every global tensor exactly once and agree on its step count.
Result<Sources> LoadSources(const std::vector<std::string>& dirs, uint64_t chunk_size_bytes);

// A tensor without elements that the target does not list goes to rank 0, whole
// (layouts leave out empty parts, and an empty tensor is nothing but that).
TargetLayout WithEmptyTensors(const Sources& s, const TargetLayout& target);

// OK when every rank lists only tensors the sources hold and the target tiles
// every global tensor exactly once.
Status ValidateTarget(const Sources& s, const TargetLayout& target);

}  // namespace optstate::vfs::internal
