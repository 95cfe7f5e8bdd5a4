// Export: one committed generation as a checkpoint directory, without the mount.
//
// The files are CheckpointLayout's (the mount serves the same object, so the
// bytes are the same). manifest.json and the safetensors header come from the
// layout's memory; every field chunk is read once through a ChunkIo (verified
// against its checksum) and written twice: into its field file and at its
// place in state.safetensors (once, without state.safetensors: then the
// manifest is the layout's re-serialised with has_safetensors = false).
// A chunk that ExportOptions::chunk_source fills with the generation's bytes
// (checked against its checksum) is written from there and not read.
// Buffers: queue_depth chunks, whatever the state's size. Writes are
// buffered; the kernel is asked to start writing each chunk back as soon as
// it is written (sync_file_range), and the field files are fdatasynced
// together once every chunk is written, so that the reads and writes do not
// wait behind a sync (and its journal commit) per file: a GPT-2 774M state
// has 1308 field files. Everything goes into a .partial sibling directory
// that is fsynced and renamed to dest only when complete.
#include <fcntl.h>

#include <cstring>
#include <map>
#include <memory>

#include <fmt/format.h>

#include "vfs/checkpoint.h"
#include "vfs/internal/new_dir.h"
#include "vfs/io_buffer.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::vfs {
namespace {

class Exporter {
 public:
  Exporter(FileSystem* fs, const CheckpointLayout& layout, const std::string& dir, const ExportOptions& opts)
      : fs_(fs), layout_(layout), dir_(dir), opts_(opts) {}

  Status Run(ExportResult* result) {
    const auto& files = layout_.files();
    // Directories first: tensors/ and one per tensor.
    OPTSTATE_RETURN_IF_ERROR(fs_->CreateDir(dir_ + "/" + kTensorsDirName));
    for (const ManifestTensor& t : layout_.manifest().tensors) {
      OPTSTATE_RETURN_IF_ERROR(fs_->CreateDir(dir_ + "/" + kTensorsDirName + "/" + t.file_name));
    }
    const CheckpointFile* st_file = nullptr;
    for (const CheckpointFile& f : files) {
      if (f.kind == CheckpointFileKind::kManifest) {
        std::string without_st;
        if (!opts_.safetensors) {
          Manifest m = layout_.manifest();
          m.has_safetensors = false;
          without_st = SerializeManifest(m);
        }
        const std::string& json = opts_.safetensors ? layout_.manifest_json() : without_st;
        OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> out, Create(f.path));
        OPTSTATE_RETURN_IF_ERROR(out->Pwrite(0, json.data(), json.size()));
        OPTSTATE_RETURN_IF_ERROR(out->Fsync());
        result->bytes += json.size();
        ++result->files;
      } else if (f.kind == CheckpointFileKind::kSafetensors && opts_.safetensors) {
        st_file = &f;
      }
    }
    if (st_file != nullptr) {
      OPTSTATE_ASSIGN_OR_RETURN(st_, Create(st_file->path));
      const std::string& header = layout_.safetensors_header();
      OPTSTATE_RETURN_IF_ERROR(st_->Pwrite(0, header.data(), header.size()));
      result->bytes += header.size();
      ++result->files;
    }
    OPTSTATE_RETURN_IF_ERROR(CopyFields(result));
    if (st_ != nullptr) OPTSTATE_RETURN_IF_ERROR(st_->Fsync());
    st_.reset();
    for (const ManifestTensor& t : layout_.manifest().tensors) {
      OPTSTATE_RETURN_IF_ERROR(fs_->SyncDir(dir_ + "/" + kTensorsDirName + "/" + t.file_name));
    }
    OPTSTATE_RETURN_IF_ERROR(fs_->SyncDir(dir_ + "/" + kTensorsDirName));
    return fs_->SyncDir(dir_);
  }

 private:
  struct Open {
    std::unique_ptr<File> file;
    uint64_t chunks_left = 0;  // chunks not yet written
    uint64_t st_offset = 0;    // where the field's bytes start in state.safetensors
  };
  struct Slot {
    size_t file_index = 0;
    uint64_t seq = 0;
  };

  Result<std::unique_ptr<File>> Create(const std::string& rel) {
    OpenOptions oo;
    oo.create = true;
    oo.exclusive = true;
    return fs_->Open(dir_ + "/" + rel, oo);
  }

  // Field files in layout order; reads at queue depth across file boundaries,
  // so a store of many small tensors keeps the disk as busy as one large one.
  Status CopyFields(ExportResult* result) {
    const auto& files = layout_.files();
    const GenerationView& view = layout_.view();
    const uint64_t cs = view.identity().chunk_size_bytes;
    const uint32_t depth = std::max<uint32_t>(1, opts_.queue_depth);
    ChunkIoOptions io_opts;
    io_opts.queue_depth = depth;
    OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<ChunkIo> io, view.NewChunkIo(io_opts));
    std::vector<IoBuffer> bufs;
    std::vector<Slot> slots(depth);
    std::vector<size_t> free_bufs;
    for (uint32_t i = 0; i < depth; ++i) {
      bufs.emplace_back(cs);
      if (!bufs.back().ok()) {
        return ResourceExhausted(fmt::format("export: out of memory for {} chunk buffers of {} bytes", depth, cs));
      }
      free_bufs.push_back(i);
    }
    uint64_t total = 0, done = 0;
    for (const CheckpointFile& f : files) {
      if (f.kind == CheckpointFileKind::kField) total += f.size_bytes;
    }
    std::map<size_t, Open> open;  // field files with chunks not yet written, by index in files
    std::vector<ChunkCompletion> comps;
    Status failed;  // the first error; later completions only free their buffers
    // Field files with every chunk written, closed, not yet synced.
    std::vector<std::string> unsynced;
    // Writes one completed chunk to its field file and state.safetensors;
    // closes a field file once its last chunk is written.
    auto complete = [&](const ChunkCompletion& c) -> Status {
      const size_t b = static_cast<size_t>(c.tag);
      free_bufs.push_back(b);
      const Slot s = slots[b];
      const CheckpointFile& f = files[s.file_index];
      if (!c.status.ok()) {
        const TensorInfo& t = view.tensors()[f.tensor_index];
        return c.status.WithContext(fmt::format("export: {} (tensor '{}' field '{}' chunk {})", f.path, t.name,
                                                f.field < t.fields.size() ? t.fields[f.field].name : "?", s.seq));
      }
      Open& o = open.at(s.file_index);
      const uint64_t len = layout_.ChunkLengthAt(f, s.seq);
      const char* p = bufs[b].as<char>();
      const uint64_t at = s.seq * f.chunk_bytes;
      OPTSTATE_RETURN_IF_ERROR(o.file->Pwrite(at, p, len));
      StartWriteback(*o.file, at, len);
      if (st_ != nullptr) {
        OPTSTATE_RETURN_IF_ERROR(st_->Pwrite(o.st_offset + at, p, len));
        StartWriteback(*st_, o.st_offset + at, len);
      }
      result->bytes += len * (st_ != nullptr ? 2 : 1);
      done += len;
      OPTSTATE_TEST_SYNC_POINT("export.after_chunk");
      if (--o.chunks_left == 0) {
        unsynced.push_back(f.path);
        open.erase(s.file_index);
        if (opts_.progress) opts_.progress(done, total);
      }
      return Status::Ok();
    };
    // Hands out completions; after the first failure only frees their buffers.
    auto reap = [&](size_t min) -> Status {
      comps.clear();
      OPTSTATE_RETURN_IF_ERROR(io->Reap(&comps, min));
      for (const ChunkCompletion& c : comps) {
        if (failed.ok()) {
          failed = complete(c);
        } else {
          free_bufs.push_back(static_cast<size_t>(c.tag));
        }
      }
      return Status::Ok();
    };
    for (size_t i = 0; i < files.size() && failed.ok(); ++i) {
      const CheckpointFile& f = files[i];
      if (f.kind != CheckpointFileKind::kField) continue;
      auto file = Create(f.path);
      if (!file.ok()) {
        failed = file.status();
        break;
      }
      ++result->files;
      const uint64_t n = layout_.ChunkSequenceLength(f);
      if (n == 0) {
        unsynced.push_back(f.path);
        continue;
      }
      Open& o = open[i];
      o.file = std::move(*file);
      o.chunks_left = n;
      o.st_offset = layout_.SafetensorsOffsetOf(f).value_or(0);
      for (uint64_t seq = 0; seq < n && failed.ok(); ++seq) {
        while (free_bufs.empty() && failed.ok()) {
          Status st = reap(1);
          if (!st.ok()) failed = st;
        }
        if (!failed.ok()) break;
        const size_t b = free_bufs.back();
        free_bufs.pop_back();
        slots[b] = Slot{i, seq};
        const ChunkRef ref = layout_.ChunkAt(f, seq);
        const uint64_t len = layout_.ChunkLengthAt(f, seq);
        auto info = view.Chunk(ref);
        const bool written = !info.ok() || !info->zero;  // an error: the disk read reports it
        if (written && info.ok() && FromSource(ref, *info, len, bufs[b].as<char>(), result)) {
          ChunkCompletion c;
          c.tag = b;
          failed = complete(c);  // frees b
          continue;
        }
        if (written) {
          ++result->disk_chunks;
          result->disk_bytes += len;
        }
        Status st = io->SubmitRead(ref, bufs[b].as<char>(), b);
        if (!st.ok()) {
          free_bufs.push_back(b);
          failed = st.WithContext(fmt::format("export: {} chunk {}", f.path, seq));
        }
      }
    }
    // Drain: buffers must not be freed under reads in flight.
    while (io->in_flight() > 0) {
      Status st = reap(io->in_flight());
      if (!st.ok()) {
        if (failed.ok()) failed = st;
        break;  // the engine failed: nothing more will complete
      }
    }
    if (!failed.ok()) return failed;
    // Their writeback began as they were written: the first sync commits the
    // journal for all of them, and each waits only for its own last pages.
    for (const std::string& rel : unsynced) {
      OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> file, fs_->Open(dir_ + "/" + rel, OpenOptions{}));
      OPTSTATE_RETURN_IF_ERROR(file->Fdatasync());
    }
    return Status::Ok();
  }

  // Asks the kernel to start writing [offset, offset + len) of a buffered
  // file back now, so that the final syncs find little left to write; a
  // hint: where the file system does not take it, the syncs write it all.
  static void StartWriteback(const File& file, uint64_t offset, uint64_t len) {
    if (file.fd() >= 0 && !file.direct()) {
      (void)::sync_file_range(file.fd(), static_cast<off64_t>(offset), static_cast<off64_t>(len),
                              SYNC_FILE_RANGE_WRITE);
    }
  }

  // Fills buf with the chunk from opts_.chunk_source when the source holds
  // the generation's bytes of it (its checksum), as a disk read would.
  bool FromSource(const ChunkRef& ref, const ChunkInfo& info, uint64_t len, char* buf, ExportResult* result) {
    if (opts_.chunk_source == nullptr || info.length_bytes != len) return false;
    if (!opts_.chunk_source->Fill(ref, buf, len)) return false;
    if (ChunkChecksum(buf, len) != info.checksum) {
      ++result->source_mismatches;
      return false;
    }
    ++result->source_chunks;
    result->source_bytes += len;
    return true;
  }

  FileSystem* fs_;
  const CheckpointLayout& layout_;
  const std::string dir_;
  const ExportOptions& opts_;
  std::unique_ptr<File> st_;  // state.safetensors while it is written
};

}  // namespace

Result<ExportResult> ExportCheckpoint(Store* store, const std::string& dest_in, const ExportOptions& opts) {
  FileSystem* fs = opts.fs != nullptr ? opts.fs : FileSystem::Default();
  std::string dest = dest_in;
  while (dest.size() > 1 && dest.back() == '/') dest.pop_back();
  if (dest.empty()) return InvalidArgument("export: empty destination path");
  OPTSTATE_RETURN_IF_ERROR(internal::CheckNewDir(fs, dest, "export"));
  // The view's lease keeps every extent of the generation until the export ends.
  auto view = opts.snapshot.empty() ? store->OpenGeneration(opts.generation) : store->OpenSnapshot(opts.snapshot);
  if (!view.ok()) return view.status().WithContext("export: store " + store->path());
  const uint64_t gen = (*view)->info().generation;
  const std::string where =
      opts.snapshot.empty()
          ? fmt::format("export: store {} generation {} to {}", store->path(), gen, dest)
          : fmt::format("export: store {} snapshot '{}' (generation {}) to {}", store->path(), opts.snapshot, gen,
                        dest);
  auto layout = CheckpointLayout::Build(view->get());
  if (!layout.ok()) return layout.status().WithContext(where);

  ExportResult result;
  result.generation = gen;
  OPTSTATE_RETURN_IF_ERROR(internal::WriteNewDir(
      fs, dest, where, "export.before_rename", "the checkpoint is",
      [&](const std::string& partial) { return Exporter(fs, **layout, partial, opts).Run(&result); }));
  if (opts.chunk_source != nullptr) {
    OPTSTATE_LOG_INFO(
        "exported store {} generation {} to {} ({} files, {} bytes; chunks: {} ({} bytes) from memory, {} ({} bytes) "
        "from disk, {} in memory not of the generation)",
        store->path(), gen, dest, result.files, result.bytes, result.source_chunks, result.source_bytes,
        result.disk_chunks, result.disk_bytes, result.source_mismatches);
  } else {
    OPTSTATE_LOG_INFO("exported store {} generation {} to {} ({} files, {} bytes)", store->path(), gen, dest,
                      result.files, result.bytes);
  }
  return result;
}

}  // namespace optstate::vfs
