// Checkpoint format: how one committed generation looks as files.
//
// A checkpoint directory (what optstate-mount shows for latest/ and each
// snapshot, and what `cp -r` copies) holds
//   manifest.json                   this file's Manifest, as deterministic JSON
//   state.safetensors               every field as "<tensor>/<field>" (safetensors)
//   tensors/<tensor file>/<field>   one raw little-endian array per tensor field
// state.safetensors holds the field files' bytes again; an export may leave
// it out (ExportOptions::safetensors), and its manifest then says so
// (Manifest::has_safetensors).
// The schema is documented in docs/CHECKPOINT.md.
//
// CheckpointLayout is the virtual-file view of one GenerationView: the list of
// files with exact sizes in a stable order, and a mapping from a file byte
// range to chunk ranges (MapRange) or straight to bytes (Read). The mount, the
// tools and the tests share it. RestoreCheckpoint / CreateStoreFromCheckpoint
// go the other way: they parse and validate a manifest strictly, verify every
// chunk of every field file against the manifest's XXH3, and commit the data as
// one new generation (or nothing: on any error the pending writes are aborted).
//
// ExportCheckpoint writes such a directory from a committed generation of a
// store without the mount (fsynced, renamed into place when complete).
//
// Thread-safety: a CheckpointLayout is immutable after Build and may be shared
// between threads; Read() uses the view's thread-safe ReadChunk. The free
// functions are thread-safe. RestoreCheckpoint needs exclusive use of the
// writable Store for its duration (nothing else may write or commit).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vfs/file_system.h"
#include "base/status.h"
#include "vfs/store.h"

namespace optstate::vfs {

inline constexpr uint32_t kCheckpointFormatVersion = 1;
inline constexpr const char* kManifestFileName = "manifest.json";
inline constexpr const char* kSafetensorsFileName = "state.safetensors";
inline constexpr const char* kTensorsDirName = "tensors";
// state.safetensors' __metadata__ keys (string values).
inline constexpr const char* kSafetensorsStoreKey = "optstate.store";
inline constexpr const char* kSafetensorsStoreUuidKey = "optstate.store_uuid";
inline constexpr const char* kSafetensorsGenerationKey = "optstate.generation";
inline constexpr const char* kSafetensorsStepKey = "optstate.step";
// Escaped names longer than this are shortened: a prefix + "~" + 16 hex digits
// of the XXH3 of the name (file systems cap a name at 255 bytes). The manifest
// maps each file name back to the tensor name.
inline constexpr size_t kMaxFileNameBytes = 200;

// Reversible escaping of a name into one path component: every byte outside
// [A-Za-z0-9._-] (and '%' itself) becomes %XX (upper-case hex); "." and ".."
// become "%2E" and "%2E%2E"; the empty name becomes "%".
std::string EscapeName(std::string_view name);
// Inverse of EscapeName; InvalidArgument on a malformed escape.
Result<std::string> UnescapeName(std::string_view escaped);
// EscapeName, shortened to kMaxFileNameBytes when longer (not reversible on
// its own; the manifest records the mapping).
std::string FileNameForName(std::string_view name);

// ---- manifest ------------------------------------------------------------

struct ManifestChunk {
  uint64_t offset_bytes = 0;   // within the field file
  uint64_t length_bytes = 0;
  uint64_t xxh3 = 0;           // ChunkChecksum of those bytes
};

struct ManifestField {
  std::string name;            // "main", ...
  DType dtype = DType::kF32;
  std::string file;            // relative: "tensors/<tensor file>/<field file>"
  uint64_t bytes = 0;          // numel * dtype size
  // Elements of the field; 0 = the tensor's numel ("numel", written only
  // where it differs).
  uint64_t numel = 0;
  // Bytes per chunk; 0 = the manifest's chunk_size_bytes ("chunk_bytes",
  // written only where it differs).
  uint64_t chunk_bytes = 0;
  // q8s/q8u codes only: the field holding their fp32 scales ("scales") and
  // the elements per scale ("block_size", 256): element i decodes to
  // map[code] x scales[i / block_size].
  std::string scales;
  uint64_t block_size = 0;
  std::vector<ManifestChunk> chunks;
};

struct ManifestTensor {
  std::string name;
  std::string file_name;       // the directory name under tensors/
  DType dtype = DType::kF32;
  uint64_t numel = 0;
  uint32_t group = 0;
  // The tensor's own Adam step count (TensorStepCount): a param that got no
  // gradient in a step keeps its count. Absent in manifests written before
  // it existed: the group's step_count.
  uint64_t step_count = 0;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> global_shape;
  std::vector<uint64_t> shard_offset;
  std::vector<ManifestField> fields;
};

// The store tensor a manifest tensor describes: its geometry and its fields
// with their dtypes, element counts and chunk bytes.
TensorSpec TensorSpecOf(const ManifestTensor& mt);

// The safetensors shape of field f of mt: the tensor's shape, or {f.numel}
// for a field with its own element count (q8 scales).
inline std::vector<uint64_t> FieldShape(const ManifestTensor& mt, const ManifestField& f) {
  return f.numel != 0 && f.numel != mt.numel ? std::vector<uint64_t>{f.numel} : mt.shape;
}

struct Manifest {
  uint32_t format_version = kCheckpointFormatVersion;
  std::string store_uuid;
  std::string store_name;
  // The job (lineage) of the state (StoreIdentity::job); empty: unknown (a
  // manifest written before manifests recorded it, or of such a store).
  std::string job;
  uint64_t generation = 0;
  uint64_t step = 0;
  uint64_t chunk_size_bytes = 0;
  // Whether the checkpoint directory holds state.safetensors. false: written
  // without it on purpose (ExportOptions::safetensors = false); the manifest
  // then carries "state_safetensors": false. true (the key absent, as in every
  // manifest written before the key existed, and in what the mount serves):
  // it does.
  bool has_safetensors = true;
  std::vector<GroupInfo> groups;       // sorted by id
  std::vector<ManifestTensor> tensors; // sorted by name
};

// Hyperparameters that are flags ("adamw": AdamW's decoupled decay vs Adam's
// L2 term; SGD's "nesterov" and "maximize"). The manifest writes them as JSON booleans; the parser also reads
// the 0/1 numbers that manifests written before held.
bool IsFlagHyperparameter(std::string_view name);
// Range check of a group's known hyperparameters (those present; unknown
// names only need to be finite), by name whichever update rule wrote them:
// lr >= 0, weight_decay >= 0, momentum >= 0, 0 <= beta1 < 1, 0 <= beta2 < 1,
// eps > 0, all finite; flags 0 or 1; nesterov true only with momentum > 0
// and dampening 0. InvalidArgument naming the group, the name and the value.
Status ValidateHyperparameters(const GroupInfo& g);

// Builds the manifest of a generation (reads chunk metadata only, no data).
Result<Manifest> ManifestFromView(const GenerationView& view);
// Deterministic JSON (same Manifest -> same bytes), newline-terminated. It
// carries its own checksum: the top-level "manifest_xxh3" holds 16 hex digits
// of the ChunkChecksum (XXH3-64) of the whole file's bytes as written with
// that value replaced by 16 zeros (docs/CHECKPOINT.md).
std::string SerializeManifest(const Manifest& m);
// The top-level key of the manifest's own checksum.
inline constexpr const char* kManifestChecksumKey = "manifest_xxh3";
// The top-level key that says the checkpoint has no state.safetensors
// (Manifest::has_safetensors); written only as false.
inline constexpr const char* kManifestSafetensorsKey = "state_safetensors";
// Checks the manifest's own checksum over its bytes (any JSON layout: only
// the value of "manifest_xxh3" is replaced by zeros before hashing). A
// mismatch, or a malformed or repeated key, is kCorruption naming `source`
// and both checksums. A manifest without the key (written before manifests
// carried one) passes, with a logged notice.
Status VerifyManifestChecksum(std::string_view bytes, std::string_view source);
// Reads `path` through fs (null: FileSystem::Default()), verifies its
// checksum (VerifyManifestChecksum) and parses it (ParseManifest): what
// every reader of a checkpoint directory's manifest.json calls.
Result<Manifest> ReadManifestFile(const std::string& path, FileSystem* fs = nullptr);
// Strict parse + validation: every key present and typed, ranges checked
// (hyperparameters by ValidateHyperparameters; a group's and a tensor's
// step_count at most the manifest's step), every tensor's group listed in groups[] (unless
// groups[] is empty: a store that records no optimizer groups), chunks
// contiguous and covering each field, file names consistent, no
// duplicates. Errors are kInvalidArgument/kCorruption naming `source` (the
// manifest path) and the JSON key. Never throws, never crashes on any input
// (fuzzed: tests/vfs/fuzz/manifest_fuzz.cc).
Result<Manifest> ParseManifest(std::string_view json, std::string_view source);

// The per-tensor step counts of m for a CommitInfo: store tensor id (found
// by name in `store`) -> the manifest tensor's step_count.
Result<std::map<uint32_t, uint64_t>> TensorStepsOf(Store* store, const Manifest& m);

// ---- the virtual files of a generation -----------------------------------

enum class CheckpointFileKind : uint8_t { kManifest, kSafetensors, kField };

struct CheckpointFile {
  std::string path;            // relative, '/'-separated
  CheckpointFileKind kind = CheckpointFileKind::kField;
  uint64_t size_bytes = 0;
  uint32_t tensor_index = 0;   // kField: index into view.tensors()
  uint32_t field = 0;          // kField: field index
  uint64_t chunk_bytes = 0;    // kField: bytes per chunk of the field (its chunk c starts at c x chunk_bytes)
};

// One piece of a file byte range: either bytes held by the layout (manifest,
// safetensors header) or a range of one chunk.
struct CheckpointSegment {
  uint64_t dst_offset = 0;     // offset in the caller's buffer
  uint64_t length_bytes = 0;
  const char* memory = nullptr;  // non-null: copy from here
  ChunkRef chunk;              // memory == nullptr: this chunk ...
  uint64_t chunk_offset = 0;   // ... from this offset within it
  uint64_t chunk_seq = 0;      // position of the chunk in the file's chunk sequence
};

class CheckpointLayout {
 public:
  // REQUIRES: view outlives the layout (the mount keeps both in one entry).
  static Result<std::unique_ptr<CheckpointLayout>> Build(const GenerationView* view);

  const GenerationView& view() const { return *view_; }
  const Manifest& manifest() const { return manifest_; }
  const std::string& manifest_json() const { return manifest_json_; }
  // The 8-byte length + JSON header of state.safetensors. Its __metadata__
  // names the generation and the store (kSafetensorsGenerationKey,
  // kSafetensorsStoreUuidKey), so that restore can tell a state.safetensors
  // copied from another generation than manifest.json. The header is space
  // padded to a multiple of kSafetensorsDataAlignBytes, so that the data section starts
  // on a page: a field whose bytes are a whole number of pages then lies on
  // whole pages of state.safetensors as it does in its own file, and the
  // mount can fill one file's page cache from the other's
  // (mount/internal/safetensors_fill.h).
  static constexpr uint64_t kSafetensorsDataAlignBytes = 4096;
  const std::string& safetensors_header() const { return st_header_; }
  // Where byte 0 of field file f lies in state.safetensors; nullopt unless f
  // is one of this layout's field files.
  std::optional<uint64_t> SafetensorsOffsetOf(const CheckpointFile& f) const;

  // Files in a stable order: manifest.json, state.safetensors, then fields by
  // tensor name and field order.
  const std::vector<CheckpointFile>& files() const { return files_; }
  const CheckpointFile* FindFile(std::string_view path) const;
  // True for "", "tensors" and "tensors/<tensor file>".
  bool IsDir(std::string_view path) const;
  // Sorted child names of a directory; NotFound if it is not one.
  Result<std::vector<std::string>> ListDir(std::string_view path) const;

  // Number of chunks a file reads from, in file order (0 for manifest.json).
  uint64_t ChunkSequenceLength(const CheckpointFile& f) const;
  // The i-th chunk of a file's chunk sequence. REQUIRES: i < length.
  ChunkRef ChunkAt(const CheckpointFile& f, uint64_t seq) const;
  // The bytes of f that the i-th chunk of its sequence holds (its logical
  // length: < chunk size for a field's last chunk). REQUIRES: i < length.
  uint64_t ChunkLengthAt(const CheckpointFile& f, uint64_t seq) const;
  // Splits [offset, offset+len) of f (clipped at EOF) into segments in order.
  std::vector<CheckpointSegment> MapRange(const CheckpointFile& f, uint64_t offset,
                                          uint64_t len) const;
  // Synchronous read through view().ReadChunk (one bounce buffer per call).
  // Returns the bytes read (short only at EOF).
  Result<uint64_t> Read(const CheckpointFile& f, uint64_t offset, void* buf, uint64_t len) const;

 private:
  CheckpointLayout() = default;
  struct FieldSpan {            // a field's place in the safetensors data section
    uint32_t tensor_index;
    uint32_t field;
    uint64_t data_offset;       // from the start of the data section
    uint64_t bytes;
    uint64_t first_seq;         // its first chunk in the safetensors chunk sequence
    uint64_t chunk_bytes;       // bytes per chunk of the field
  };
  // Safetensors: the span holding chunk seq of the file's sequence.
  const FieldSpan& SpanOfSeq(uint64_t seq) const;
  const GenerationView* view_ = nullptr;
  Manifest manifest_;
  std::string manifest_json_;
  std::string st_header_;
  std::vector<CheckpointFile> files_;
  // Name lookups in O(log n): a trainer's store has thousands of tensors, and
  // the mount resolves a path on every open and lookup (a scan per call made
  // a `cp -r` quadratic in the number of files).
  std::map<std::string, uint32_t, std::less<>> file_index_;  // path -> index in files_
  std::map<std::string, uint32_t, std::less<>> tensor_dirs_;  // tensor file_name -> index in manifest_.tensors
  std::vector<FieldSpan> spans_;
  uint64_t st_chunks_ = 0;
  uint64_t chunk_size_ = 0;
};

// state.safetensors' header for a manifest: the 8-byte little-endian length
// and the JSON (__metadata__: format "pt", the store name and uuid, the
// generation and step; per field, in manifest order, "<tensor>/<field>" with
// its dtype, shape and data_offsets, the fields back to back), space padded so
// that the data section starts at a multiple of
// CheckpointLayout::kSafetensorsDataAlignBytes. What CheckpointLayout serves
// and what the reshard writes.
std::string SafetensorsHeader(const Manifest& m);

// ---- restore -------------------------------------------------------------

struct RestoreOptions {
  // Called after each field file is verified/imported with (bytes done, total).
  std::function<void(uint64_t, uint64_t)> progress;
  // ChunkIo queue depth for the import writes. Default 16.
  uint32_t queue_depth = 16;
  // Take a checkpoint of another store of another job (its manifest's store
  // uuid and job differ from the store's) into a store whose newest
  // generation has taken steps. Default false:
  // refused (kFailedPrecondition), since it replaces that store's training
  // state with another's.
  bool force = false;
};

struct RestoreResult {
  uint64_t generation = 0;     // the new generation
  // The snapshot that keeps the head the restore replaced (a store that had
  // taken steps): "pre-restore-<generation>-<unix ms>[-<n>]". Empty: none made.
  std::string kept_snapshot;
};

// Reads and validates dir/manifest.json (its own checksum first), checks its
// layout against `store` (every tensor present with the same numel, dtype,
// group, shapes, shard offset, fields; differences are listed in the error),
// refuses a checkpoint of another store into a store whose newest generation
// has taken steps (step > 0) unless opts.force, verifies every chunk of every
// field file (size and XXH3) and, where the checkpoint has one, the same bytes
// of state.safetensors (a missing one is logged as a warning, unless the
// manifest says it was written without one: then none is read, and one that
// is there is ignored), writes all chunks and commits one generation with
// the manifest's step, groups and per-tensor step counts. Before the import, a store whose newest
// generation has taken steps keeps that generation as a snapshot
// (RestoreResult::kept_snapshot; O(1)), so a restore never drops the state it
// replaces. On error nothing is committed (AbortPending), that snapshot is
// released again and the store is unchanged.
// REQUIRES: store is writable, no writes pending, no other writer.
Result<RestoreResult> RestoreCheckpointInto(Store* store, const std::string& dir,
                                            const RestoreOptions& opts = {});
// RestoreCheckpointInto, returning the new generation.
Result<uint64_t> RestoreCheckpoint(Store* store, const std::string& dir,
                                   const RestoreOptions& opts = {});
// Creates a store at store_path whose tensors are the manifest's (name from
// opts.name, else the manifest's store name; job from opts.job, else the
// manifest's; chunk size from the manifest) and restores into it, all or
// nothing: the store is built and committed in a hidden sibling directory
// "<parent>/.<base>.restoring-<pid>" that is renamed to store_path only then,
// so store_path never shows a store without the restored generation. On error
// (and at the next call after a crash, for directories of processes that are
// gone) the sibling and its data files in external data dirs are removed.
Result<std::unique_ptr<Store>> CreateStoreFromCheckpoint(const std::string& dir,
                                                         const std::string& store_path,
                                                         StoreOptions opts,
                                                         const RestoreOptions& ropts = {});
// The all-or-nothing creation CreateStoreFromCheckpoint uses, for any filler:
// creates the store (name from opts.name, else store_path's base name) in the
// hidden sibling directory, calls fill (which must commit what it writes),
// closes it, renames it to store_path and opens it there. store_path must not
// exist (kAlreadyExists, saying what is in the way); its parent must. An
// error from fill removes the sibling and is returned.
Result<std::unique_ptr<Store>> CreateStoreFilled(const std::string& store_path, StoreOptions opts,
                                                 const std::function<Status(Store*)>& fill);

// ---- export --------------------------------------------------------------

// Where an export may take a chunk's bytes from instead of the store's data
// files: e.g. an optimizer's copies of its state in RAM. The exporter asks it
// before reading each written chunk from the disk; bytes it fills are checked
// against the chunk's checksum in the exported generation like a disk read,
// and a chunk it does not fill, or fills with other bytes (a newer version, a
// chunk being rewritten), is read from the disk instead. Called from the
// exporting thread only.
class ChunkSource {
 public:
  virtual ~ChunkSource() = default;
  // Copies the chunk's len logical bytes into dst (4096-aligned, at least
  // len bytes) and returns true, or returns false leaving dst's contents
  // unspecified.
  virtual bool Fill(const ChunkRef& ref, void* dst, uint64_t len) = 0;
};

struct ExportOptions {
  // The committed generation to export; kLatest (default) = the newest.
  // Ignored when snapshot is set.
  uint64_t generation = kLatest;
  // Export this snapshot's generation instead. Default: empty (none).
  std::string snapshot;
  // Chunk reads in flight; each holds one chunk-size buffer, so the export's
  // memory is queue_depth x chunk size whatever the state's size. Default 8.
  uint32_t queue_depth = 8;
  // Called after each field file with (bytes done, total bytes of the fields).
  std::function<void(uint64_t, uint64_t)> progress;
  // The destination's file system (tests inject faults); null = FileSystem::Default().
  FileSystem* fs = nullptr;
  // Write state.safetensors, which holds every field file's bytes again (the
  // checkpoint is then twice the state). Default true: the mount's layout,
  // byte for byte. false: manifest.json and the field files only, the
  // manifest marked "state_safetensors": false (restore reads the field
  // files either way, each chunk checked against the manifest's XXH3).
  bool safetensors = true;
  // Asked first for each written chunk (ChunkSource); null (default): every
  // chunk is read from the store's data files. Not owned; must outlive the call.
  ChunkSource* chunk_source = nullptr;
};

struct ExportResult {
  uint64_t generation = 0;     // the generation written
  uint64_t files = 0;          // files written
  uint64_t bytes = 0;          // bytes written, all files
  // Chunks of the fields (and their logical bytes) taken from
  // ExportOptions::chunk_source, with the checksum of the generation.
  uint64_t source_chunks = 0;
  uint64_t source_bytes = 0;
  // Chunks the source filled with bytes whose checksum is not the
  // generation's: read from the disk instead.
  uint64_t source_mismatches = 0;
  // Chunks (and logical bytes) read from the store's data files; chunks never
  // written (zeros) are neither these nor the source's.
  uint64_t disk_chunks = 0;
  uint64_t disk_bytes = 0;
};

// Writes one committed generation of `store` as a checkpoint directory at
// dest: byte for byte what optstate-mount shows for it (CheckpointLayout:
// manifest.json, state.safetensors, tensors/...), so RestoreCheckpoint and
// optstate-restore take it. With opts.safetensors false: the same field
// files, no state.safetensors, and a manifest that differs from the mount's
// only by "state_safetensors": false (and so its own checksum). The
// generation is read under the lease of a
// GenerationView (GC keeps its extents until the export ends) through a
// ChunkIo at opts.queue_depth (less what opts.chunk_source fills); every
// chunk's checksum is verified as it is read or filled. The files are written into a sibling directory
// "<dest>.partial-<8 hex digits>", each file and directory is fsynced, and
// only then is it renamed to dest (and dest's parent synced): dest appears
// complete or not at all. A crash can leave the .partial directory behind
// (never dest); an error removes it. dest must not exist, or be an empty
// directory (kAlreadyExists otherwise, naming it); its parent must exist.
// Thread-safe (reads only committed data; may run while a trainer steps).
Result<ExportResult> ExportCheckpoint(Store* store, const std::string& dest, const ExportOptions& opts = {});

}  // namespace optstate::vfs
