// Reshard's shard geometry: flat ranges and boxes, a flat range as boxes, and
// the check that shards tile a global tensor exactly once.
#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "vfs/internal/reshard_geometry.h"
#include "vfs/reshard.h"

namespace optstate::vfs {
namespace internal {

std::string Dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

unsigned __int128 Volume(const std::vector<uint64_t>& shape) {
  unsigned __int128 v = 1;
  for (uint64_t s : shape) v *= s;
  return v;
}

}  // namespace internal

namespace {

using internal::Dims;
using internal::Volume;

// Gap search enumerates the cells between box boundaries; beyond this many
// (cells x boxes) it reports only the count of uncovered elements.
constexpr uint64_t kMaxGapSearchWork = 50'000'000;

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
  if (b.flat && !b.within_shape.empty() && b.within_offset.size() == b.within_shape.size()) {
    std::vector<uint64_t> hi(b.within_offset.size());
    for (size_t d = 0; d < hi.size(); ++d) hi[d] = b.within_offset[d] + b.within_shape[d];
    return fmt::format("flat [{}, {}) of {}", b.offset[0], b.offset[0] + b.shape[0], Ranges(b.within_offset, hi));
  }
  if (b.flat) return fmt::format("flat [{}, {})", b.offset[0], b.offset[0] + b.shape[0]);
  std::vector<uint64_t> hi(b.offset.size());
  for (size_t d = 0; d < hi.size(); ++d) hi[d] = b.offset[d] + b.shape[d];
  return Ranges(b.offset, hi);
}

}  // namespace

// ---- shard geometry -------------------------------------------------------------

ShardBox FlatRange(uint64_t begin, uint64_t end) { return ShardBox{{begin}, {end - begin}, true}; }

ShardBox ShardOf(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& global_shape,
                 const std::vector<uint64_t>& shard_offset) {
  return ShardBox{shard_offset, shape, shape.size() == 1 && global_shape.size() > 1, {}, {}, false};
}

ShardBox EmbedShard(const ShardBox& local, const std::vector<uint64_t>& local_shape,
                    const std::vector<uint64_t>& box_offset) {
  ShardBox out = local;
  if (local.flat && local_shape.size() > 1) {
    out.within_offset = box_offset;
    out.within_shape = local_shape;
    return out;
  }
  out.flat = false;  // a flat range of a 1-D tensor is its box
  if (out.offset.size() != box_offset.size()) return out;  // CheckShardInside names the mismatch
  for (size_t d = 0; d < box_offset.size(); ++d) out.offset[d] += box_offset[d];
  return out;
}

Status CheckShardInside(const ShardBox& b, const std::vector<uint64_t>& global_shape) {
  const size_t nd = global_shape.size();
  if (b.flat && !b.within_shape.empty()) {
    if (b.offset.size() != 1 || b.shape.size() != 1) {
      return InvalidArgument(fmt::format("has a flat range with offset {} and shape {} (expected one number each)",
                                         Dims(b.offset), Dims(b.shape)));
    }
    if (Status st = CheckShardInside(ShardBox{b.within_offset, b.within_shape}, global_shape); !st.ok()) {
      return InvalidArgument("has a flat range within a box that " + st.message());
    }
    const unsigned __int128 total = Volume(b.within_shape);
    if (b.offset[0] > total || b.shape[0] > total - b.offset[0]) {
      return InvalidArgument(fmt::format("holds {}, past the box's {} elements", BoxRanges(b),
                                         static_cast<uint64_t>(total)));
    }
    return Status::Ok();
  }
  if (b.flat) {
    if (b.offset.size() != 1 || b.shape.size() != 1) {
      return InvalidArgument(fmt::format("has a flat range with offset {} and shape {} (expected one number each)",
                                         Dims(b.offset), Dims(b.shape)));
    }
    const unsigned __int128 total = Volume(global_shape);
    if (b.offset[0] > total || b.shape[0] > total - b.offset[0]) {
      return InvalidArgument(
          fmt::format("holds {}, past the tensor's {} elements", BoxRanges(b), static_cast<uint64_t>(total)));
    }
    return Status::Ok();
  }
  if (b.offset.size() != nd || b.shape.size() != nd) {
    return InvalidArgument(fmt::format("has a box of rank {} (offset {}, shape {}), the tensor has rank {}",
                                       b.shape.size(), Dims(b.offset), Dims(b.shape), nd));
  }
  for (size_t d = 0; d < nd; ++d) {
    if (b.offset[d] > global_shape[d] || b.shape[d] > global_shape[d] - b.offset[d]) {
      return InvalidArgument(fmt::format("holds {}, outside the tensor in dimension {}", BoxRanges(b), d));
    }
  }
  return Status::Ok();
}

Status CheckShardGeometry(uint64_t numel, const std::vector<uint64_t>& shape,
                          const std::vector<uint64_t>& global_shape, const std::vector<uint64_t>& shard_offset) {
  if (Volume(shape) != numel) {
    return InvalidArgument(fmt::format("shape {} has {} elements, numel is {}", Dims(shape),
                                       static_cast<uint64_t>(Volume(shape)), numel));
  }
  Status st = CheckShardInside(ShardOf(shape, global_shape, shard_offset), global_shape);
  if (st.ok()) return st;
  return InvalidArgument(fmt::format("the shard (shape {}, shard_offset {}) of global shape {} {}", Dims(shape),
                                     Dims(shard_offset), Dims(global_shape), st.message()));
}

std::vector<ShardPiece> ShardPieces(const ShardBox& shard, const std::vector<uint64_t>& global_shape) {
  if (shard.flat && !shard.within_shape.empty()) {
    // The range's pieces in the box's own coordinates, moved to the box's place.
    std::vector<ShardPiece> out =
        ShardPieces(ShardBox{shard.offset, shard.shape, true, {}, {}, false}, shard.within_shape);
    for (ShardPiece& p : out) {
      for (size_t d = 0; d < p.box.offset.size(); ++d) p.box.offset[d] += shard.within_offset[d];
    }
    return out;
  }
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

// ---- tiling ---------------------------------------------------------------------

Status ValidateTiling(std::string_view what, std::string_view tensor, const std::vector<uint64_t>& global_shape,
                      const std::vector<std::pair<std::string, ShardBox>>& boxes) {
  const size_t nd = global_shape.size();
  auto err = [&](const std::string& msg) {
    return InvalidArgument(fmt::format("{}: tensor '{}' (global shape {}): {}", what, tensor, Dims(global_shape), msg));
  };
  const unsigned __int128 total = Volume(global_shape);
  for (const auto& [label, b] : boxes) {
    if (Status st = CheckShardInside(b, global_shape); !st.ok()) {
      const bool rank_hint = !b.flat && b.shape.size() == 1 && b.shape.size() != nd;
      return err(fmt::format("{} {}{}", label, st.message(),
                             rank_hint ? " (a flat range is written {\"flat\": [begin, end]})" : ""));
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

}  // namespace optstate::vfs
