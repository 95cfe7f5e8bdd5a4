// The store's on-disk encodings: RocksDB keys (prefix-scannable), binary
// extent values and the JSON records (IDENTITY, tensors, generations,
// snapshots). Pure functions, no I/O; thread-safe.
//
// Keys:
//   "I"                                   identity (same JSON as IDENTITY)
//   "T/<name>"                            tensor record (JSON)
//   "D/<be32 tensor>"                     record of a dropped tensor (JSON, as "T/",
//                                         plus dropped_generation), kept while a
//                                         retained generation holds it
//   "G/<be64 gen>"                        generation record (JSON)
//   "S/<name>"                            snapshot record (JSON)
//   "C/<be32 tensor><be32 field><be64 chunk><be64 ~gen>"
//                                         chunk version -> extent (binary, 28 bytes);
//                                         ~gen sorts the newest version first.
//                                         Format version 1 only (see "P/")
//   "P/<be64 gen><be32 pack>"             chunk-map pack (format version 2): the
//                                         chunk versions that generation gen
//                                         published, up to kPackVersions per
//                                         record (EncodePack); pack = 1, 2, ...
//   "M/latest", "M/next_tensor_id", "M/lifetime_bytes_written"   be64 counters
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "vfs/store.h"

namespace optstate::vfs::internal {

inline constexpr std::string_view kIdentityKey = "I";
inline constexpr std::string_view kTensorPrefix = "T/";
inline constexpr std::string_view kDroppedPrefix = "D/";
inline constexpr std::string_view kGenerationPrefix = "G/";
inline constexpr std::string_view kSnapshotPrefix = "S/";
inline constexpr std::string_view kChunkPrefix = "C/";
inline constexpr std::string_view kPackPrefix = "P/";
inline constexpr std::string_view kLatestKey = "M/latest";
inline constexpr std::string_view kNextTensorIdKey = "M/next_tensor_id";
inline constexpr std::string_view kLifetimeKey = "M/lifetime_bytes_written";

// Where one version of one chunk lives.
struct Extent {
  uint32_t dir = 0;
  uint64_t file_offset = 0;
  uint64_t length = 0;     // logical bytes
  uint64_t checksum = 0;   // XXH3-64 of the logical bytes
};

std::string EncodeU64(uint64_t v);                    // big-endian, 8 bytes
Result<uint64_t> DecodeU64(std::string_view s, std::string_view what);

std::string TensorKey(std::string_view name);
std::string DroppedKey(uint32_t tensor);
std::string GenerationKey(uint64_t gen);
std::string SnapshotKey(std::string_view name);
std::string ChunkKey(uint32_t tensor, uint32_t field, uint64_t chunk, uint64_t gen);
struct ChunkKeyParts {
  uint32_t tensor = 0;
  uint32_t field = 0;
  uint64_t chunk = 0;
  uint64_t gen = 0;
};
Result<ChunkKeyParts> ParseChunkKey(std::string_view key);
Result<uint64_t> ParseGenerationKey(std::string_view key);

std::string EncodeExtent(const Extent& e);
Result<Extent> DecodeExtent(std::string_view v);

// Chunk-map packs. A commit of format version 2 publishes its chunk versions
// in records of up to kPackVersions each, one RocksDB key per record instead
// of one per chunk version: a step of thousands of small tensors changes a
// few index entries, not tens of thousands. GC rewrites a record with the
// versions still alive, or deletes it once none is.
inline constexpr size_t kPackVersions = 2048;
struct PackedVersion {
  uint32_t tensor = 0;
  uint32_t field = 0;
  uint64_t chunk = 0;
  Extent ext;
};
std::string PackKey(uint64_t gen, uint32_t pack);
struct PackKeyParts {
  uint64_t gen = 0;
  uint32_t pack = 0;
};
Result<PackKeyParts> ParsePackKey(std::string_view key);
// "OSPK", count (LE32), per version: tensor (LE32), field (LE32), chunk
// (LE64), its extent as EncodeExtent; then the XXH3-64 (LE) of all before it.
std::string EncodePack(const std::vector<PackedVersion>& versions);
// kCorruption naming `where` for a record of the wrong size or checksum.
Result<std::vector<PackedVersion>> DecodePack(std::string_view v, std::string_view where);

// IDENTITY's JSON. Data dirs at or under `store_path` are written relative to
// it ("data"), so a copied or moved store directory finds its own data files;
// others stay absolute. DecodeIdentity returns the dirs as recorded (relative
// or absolute; a relative one may not leave the store directory).
std::string EncodeIdentity(const StoreIdentity& id, std::string_view store_path);
// A random (version 4) uuid: a store's uuid, and a job id where none is given.
std::string NewUuid();
Result<StoreIdentity> DecodeIdentity(std::string_view json, std::string_view where);
// `dir` relative to `store_path` when it lies at or under it ("" for the store
// directory itself), else nullopt. Both absolute and normalised.
std::optional<std::string> RelativeToStore(std::string_view dir, std::string_view store_path);
// <data_dir>/<uuid>.owner: which store directory owns (writes) the data file
// <uuid>.chunks next to it. A copy of a store directory keeps the uuid, so
// the directory itself is named: its path and its inode (dev, ino), which a
// copy or a restore from a backup does not keep and a rename does.
struct DataFileOwner {
  std::string uuid;
  std::string store_path;
  uint64_t store_dev = 0;
  uint64_t store_ino = 0;
  // The data file's own identity: (dev, ino, birth time) are the same for a
  // store that shares the file and differ for a copy of it (a copy is a new
  // file; the birth time tells a new file that reused a freed inode number).
  uint64_t data_dev = 0;
  uint64_t data_ino = 0;
  uint64_t data_btime_ns = 0;   // 0: the file system does not report it
};
std::string EncodeDataFileOwner(const DataFileOwner& o);
Result<DataFileOwner> DecodeDataFileOwner(std::string_view json, std::string_view where);

std::string EncodeTensor(const TensorInfo& t);
Result<TensorInfo> DecodeTensor(std::string_view json);
std::string EncodeGeneration(const GenerationInfo& g);
Result<GenerationInfo> DecodeGeneration(std::string_view json);
std::string EncodeSnapshot(const SnapshotInfo& s);
Result<SnapshotInfo> DecodeSnapshot(std::string_view name, std::string_view json);

}  // namespace optstate::vfs::internal
