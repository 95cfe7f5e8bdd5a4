// Reshard: checkpoints of N ranks -> checkpoints of M ranks.
//
// Each source is a checkpoint directory (vfs/checkpoint.h: manifest.json,
// state.safetensors, tensors/...) whose tensors are shards of global tensors:
// boxes (manifest shard_offset + shape inside global_shape) or flat ranges of
// the row-major flattening (a 1-D shard of a tensor of higher rank). A
// TargetLayout gives, per destination rank, the shard each tensor of that
// rank covers; boxes and flat ranges mix freely. Reshard
// checks that the sources tile every global tensor exactly once and agree on
// step, generation, groups, dtypes and fields (and the pieces of a tensor on
// its step count), that the target tiles the same
// global tensors exactly once, and then streams the bytes: every source chunk
// is read once, verified against its manifest XXH3, and scattered into the
// destination field files and state.safetensors (unless
// ReshardOptions::safetensors is false: then the field files alone, and the
// manifests say "state_safetensors": false); the destination manifests get
// the new chunks' XXH3. I/O: sources read ahead with O_DIRECT; a rank
// whose bytes arrive in file order (row and column splits of row-split
// sources) is written with O_DIRECT, any other through the page cache.
// Memory, whatever the state's size: read_ahead_chunks + 1 chunks plus
// (8 + 3 x ranks) x staging_bytes_per_rank (ReshardOptions).
//
// Output is all or nothing: the M rank directories ("rank-00000", ...) are
// written under "<dest>.partial-<8 hex digits>", every file and directory is
// fsynced, and the partial directory is renamed to dest only then. A crash
// leaves at most the partial directory (never dest); an error removes it.
// The layout JSON schema is in docs/RESHARD.md.
//
// Thread-safety: the free functions are thread-safe; Reshard reads only its
// sources and writes only beside dest.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "vfs/checkpoint.h"
#include "vfs/file_system.h"
#include "base/status.h"

namespace optstate::vfs {

inline constexpr const char* kReshardLayoutFormat = "optstate-reshard-layout";
inline constexpr uint32_t kReshardLayoutVersion = 1;

// One shard of a global tensor: the box [offset, offset + shape) of it, or,
// with `flat`, the flat range [offset[0], offset[0] + shape[0]) of its
// row-major flattening (offset and shape 1-D). A flat range of a 1-D tensor is
// the same as its box. A checkpoint records a flat range as a 1-D shard_offset
// and shape of a tensor whose global_shape has a higher rank.
//
// A flat range may lie in a box of the tensor instead (`within_offset`,
// `within_shape`, both empty otherwise): the range [offset[0], offset[0] +
// shape[0]) of that box's own row-major flattening. That is a distributed
// optimizer's shard of a tensor-parallel slice (the slice a box of the
// global tensor, the optimizer's shard a flat range of the slice). A
// checkpoint records it in the slice's coordinates (global_shape = the
// slice's shape) and the slice's place in the global tensor in its
// global-boxes.json (kGlobalBoxesFileName).
//
// `replica` (a target layout's entry only): the rank gets a copy of that part
// of the tensor, whose state another rank's entry owns (a tensor-parallel
// rank's copy of a replicated param's state); replicas are filled as the
// others but are no part of the tiling.
struct ShardBox {
  std::vector<uint64_t> offset;
  std::vector<uint64_t> shape;
  bool flat = false;
  std::vector<uint64_t> within_offset = {};
  std::vector<uint64_t> within_shape = {};
  bool replica = false;
};

// The flat range [begin, end) of a tensor. REQUIRES: begin < end.
ShardBox FlatRange(uint64_t begin, uint64_t end);
// The shard `local` (recorded in the coordinates of a tensor of shape
// local_shape) of a tensor that is the box [box_offset, box_offset +
// local_shape) of a larger one, in the larger one's coordinates: a box moved
// by box_offset, a flat range within that box. REQUIRES: box_offset has
// local_shape's rank.
ShardBox EmbedShard(const ShardBox& local, const std::vector<uint64_t>& local_shape,
                    const std::vector<uint64_t>& box_offset);

// A checkpoint directory's optional record of where its tensors lie in larger
// tensors: {"format": "optstate-global-boxes", "format_version": 1,
// "tensors": {name: {"offset": [...], "global_shape": [...]}}} (the tensor,
// of the global_shape its manifest records, is the box [offset, offset +
// that shape) of a tensor of the given global_shape), or {name: {"replica":
// true}} (a copy of state that another source holds: reshard reads it from
// there). Tensors it does not list are as the manifest says. Reshard reads it
// from every source and writes it beside the manifest of each destination
// rank with a flat range within a box.
inline constexpr const char* kGlobalBoxesFileName = "global-boxes.json";
inline constexpr const char* kGlobalBoxesFormat = "optstate-global-boxes";
struct GlobalBox {
  std::vector<uint64_t> offset;
  std::vector<uint64_t> global_shape;
  bool replica = false;
};
// Strict parse; errors name `source` and the key. Checks only the document's
// shape (the boxes are checked against the manifest by reshard).
Result<std::map<std::string, GlobalBox>> ParseGlobalBoxes(std::string_view json, std::string_view source);
std::string SerializeGlobalBoxes(const std::map<std::string, GlobalBox>& boxes);
// The shard a checkpoint tensor records (flat: 1-D shape of a tensor of
// higher rank).
ShardBox ShardOf(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& global_shape,
                 const std::vector<uint64_t>& shard_offset);
// Whether shard b lies inside a tensor of global_shape: a flat range (offset
// and shape one number each) inside its elements, a box of its rank inside it
// in every dimension. kInvalidArgument saying which is not ("has a box of
// rank 1 ...", "holds [0, 4) x [8, 16), outside the tensor in dimension 1"),
// to be prefixed with the tensor and whoever holds the shard.
Status CheckShardInside(const ShardBox& b, const std::vector<uint64_t>& global_shape);
// The one check of a shard's recorded geometry (a registration, a store's
// tensor, a checkpoint manifest's): shape's product is numel, and the shard
// ShardOf makes of the three lies inside global_shape (CheckShardInside). The
// vectors as recorded, defaults filled in (a whole tensor: global_shape =
// shape, shard_offset zeros). kInvalidArgument as CheckShardInside, to be
// prefixed with the tensor.
Status CheckShardGeometry(uint64_t numel, const std::vector<uint64_t>& shape,
                          const std::vector<uint64_t>& global_shape, const std::vector<uint64_t>& shard_offset);
// A shard as at most 2 x rank - 1 boxes of the global tensor, in row-major
// order, each with the index of its first element in the shard's own
// row-major order (a box: itself at 0; a flat range [b, e): a partial row, a
// partial plane of whole rows, ..., whole blocks of the outermost dimension,
// ..., a partial last row). REQUIRES: the shard lies inside the tensor.
struct ShardPiece {
  ShardBox box;       // never flat
  uint64_t first = 0;  // elements of the shard before it
};
std::vector<ShardPiece> ShardPieces(const ShardBox& shard, const std::vector<uint64_t>& global_shape);

// Per destination rank, per tensor name, its shard. A rank that holds no part
// of a tensor does not list it.
struct TargetLayout {
  std::vector<std::map<std::string, ShardBox>> ranks;
};

// Strict parse of the layout JSON (docs/RESHARD.md); errors name `source` and
// the key. Checks only the shape of the document (the tiling is checked
// against the sources by Reshard / ValidateTiling).
Result<TargetLayout> ParseTargetLayout(std::string_view json, std::string_view source);
// Deterministic JSON, newline-terminated.
std::string SerializeTargetLayout(const TargetLayout& layout);

// A global tensor as the sources describe it.
struct GlobalTensor {
  std::string name;
  std::vector<uint64_t> global_shape;
};

// How MakeEvenLayout splits each tensor.
enum class SplitKind : uint8_t {
  kRows,     // along dimension 0
  kColumns,  // along the last dimension (dimension 0 for 1-D tensors)
};

// Splits every tensor evenly over `ranks` ranks along one dimension: rank r
// gets [E*r/M, E*(r+1)/M) of extent E (sizes differ by at most one; a rank
// whose part is empty does not list the tensor). REQUIRES: ranks >= 1.
TargetLayout MakeEvenLayout(const std::vector<GlobalTensor>& tensors, uint32_t ranks, SplitKind split);

// How one tensor is split over the destination ranks, by its name: the
// sharding rule a model applies per parameter (e.g. column-parallel weights
// along dimension 0, row-parallel ones along dimension 1).
struct SplitRule {
  enum class Kind : uint8_t {
    kDim,      // along dimension `dim` (a tensor of lower rank: along its last)
    kLastDim,  // along the last dimension ("columns")
    kFlat,     // even flat ranges of the tensor's row-major flattening
  };
  std::string pattern = "*";  // fnmatch(3) glob on tensor names, no flags ('*' matches '/')
  Kind kind = Kind::kDim;
  uint32_t dim = 0;
};

// Parses "PATTERN=KIND" or a bare "KIND" (pattern "*"), KIND one of rows
// (dim0), columns (the last dimension), dimN, flat. "replicate" is refused:
// every element must be owned by exactly one rank (a replicated parameter's
// optimizer state is one rank's, e.g. `PATTERN=dim0` over all ranks, or a
// layout that lists it on one rank). InvalidArgument naming the rule.
Result<SplitRule> ParseSplitRule(std::string_view text);

// Splits each tensor evenly over `ranks` ranks by the first rule whose
// pattern matches its name (rank r gets [E*r/M, E*(r+1)/M) of extent E along
// the rule's dimension, or of its numel for kFlat; a rank whose part is empty
// does not list the tensor). InvalidArgument naming the tensor when no rule
// matches it, or naming the rule when it matches no tensor (a typo); ranks 0.
Result<TargetLayout> MakeRuleLayout(const std::vector<GlobalTensor>& tensors, uint32_t ranks,
                                    const std::vector<SplitRule>& rules);

// The layout of a distributed optimizer that shards flat buffers over
// data-parallel ranks: the tensors, in the given order, are packed into
// buckets (a bucket takes whole tensors until it holds at least
// bucket_numel elements), each bucket is padded to a multiple of `ranks`
// elements and split into equal flat ranges, and each rank gets, per
// tensor, the part of its range that the tensor covers: a flat range of the
// tensor's row-major flattening (tensors of any rank). InvalidArgument for
// bucket_numel 0 or ranks 0.
Result<TargetLayout> MakeBucketLayout(const std::vector<GlobalTensor>& tensors, uint64_t bucket_numel,
                                      uint32_t ranks);

// Checks that `boxes` (label such as "rank 2" -> box or flat range) tile a
// tensor of `global_shape` exactly once: every box inside the tensor and of
// its rank, every flat range inside [0, numel), no two overlapping, no
// element uncovered. InvalidArgument naming `what` (e.g. "target layout"),
// the tensor, the labels and the offending ranges.
Status ValidateTiling(std::string_view what, std::string_view tensor,
                      const std::vector<uint64_t>& global_shape,
                      const std::vector<std::pair<std::string, ShardBox>>& boxes);

// The global tensors of a set of source checkpoints (their manifests only);
// the same checks as Reshard's on the sources.
Result<std::vector<GlobalTensor>> GlobalTensorsOf(const std::vector<std::string>& sources);

// The name of rank r's checkpoint directory under Reshard's dest.
std::string ReshardRankDirName(uint32_t rank);

struct ReshardOptions {
  // Bytes of destination data gathered per destination file before it is
  // written (a column split scatters a source chunk into many short runs):
  // the size of one write. Default 4 MiB, a multiple of 4096 bytes for
  // O_DIRECT (rounded up).
  uint64_t staging_bytes_per_rank = 4 * kMiB;
  // Source chunks read ahead (O_DIRECT, in flight at once) while earlier
  // ones are verified and scattered. Default 4: with 8 MiB chunks 32 MiB,
  // enough to keep a disk streaming; at least 1.
  uint32_t read_ahead_chunks = 4;
  // Chunk size of the destination manifests (their XXH3 granularity); 0 =
  // the sources' (they must then all have the same). A multiple of 2 MiB.
  uint64_t chunk_size_bytes = 0;
  // Store name written into the destination manifests; empty = the first
  // source's.
  std::string store_name;
  // Write each rank's state.safetensors, which holds its field files' bytes
  // again (so twice the bytes to write). Default true: each rank's directory
  // is what ExportCheckpoint writes by default. false: manifest.json (marked
  // "state_safetensors": false) and the field files, which RestoreCheckpoint
  // reads alone (ExportOptions::safetensors).
  bool safetensors = true;
  // Called after each source field with (bytes done, total source bytes).
  std::function<void(uint64_t, uint64_t)> progress;
  // Destination file system (tests inject faults); null = FileSystem::Default().
  FileSystem* fs = nullptr;
};

struct ReshardResult {
  uint64_t bytes_read = 0;     // source field bytes read (and verified)
  uint64_t bytes_written = 0;  // destination bytes written, all files
  uint32_t ranks = 0;          // destination ranks written
};

// Reads the source checkpoints (any order), validates them and `target`
// (nothing is written on a validation error), and writes dest/rank-NNNNN/ for
// every rank of target, all or nothing. dest must not exist or be an empty
// directory; its parent must exist.
Result<ReshardResult> Reshard(const std::vector<std::string>& sources, const TargetLayout& target,
                              const std::string& dest, const ReshardOptions& opts = {});

}  // namespace optstate::vfs
