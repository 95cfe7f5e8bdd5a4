// Reshard: the driver. Sources and target are checked, then every source chunk
// is scattered into the destination rank checkpoints under a new directory.
#include "vfs/reshard.h"

#include <fcntl.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>

#include <fmt/format.h>

#include "vfs/internal/new_dir.h"
#include "vfs/internal/reshard_geometry.h"
#include "vfs/internal/reshard_io.h"
#include "vfs/internal/reshard_sources.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::vfs {
namespace {

using internal::DirectWriter;
using internal::GlobalInfo;
using internal::LoadSources;
using internal::SourcePart;
using internal::SourceReader;
using internal::Sources;
using internal::ValidateTarget;
using internal::Volume;
using internal::WithEmptyTensors;

uint32_t ElemSize(DType d) { return DTypeSize(d); }

std::string RandomUuid() {
  std::random_device rd;
  auto r32 = [&] { return static_cast<uint32_t>(rd()); };
  return fmt::format("{:08x}-{:04x}-4{:03x}-{:04x}-{:08x}{:04x}", r32(), r32() & 0xffff, r32() & 0xfff,
                     (r32() & 0x3fff) | 0x8000, r32(), r32() & 0xffff);
}

// One destination rank's checkpoint while it is written.
struct DestRank {
  std::string dir;
  Manifest manifest;
  std::map<std::string, size_t> tensor_index;     // name -> index in manifest.tensors
  std::vector<std::vector<uint64_t>> st_offsets;  // [tensor][field]: file offset in state.safetensors
  std::string st_header;
  std::shared_ptr<File> st;  // null without state.safetensors (ReshardOptions::safetensors)
  // Every field of the rank gets its bytes in file order: its files (and
  // state.safetensors, filled field after field) are written front to back
  // with O_DIRECT. Otherwise they are written buffered, in staged runs.
  bool direct = false;
  DirectWriter::Stream st_stream;
  uint64_t st_bytes = 0;  // size of state.safetensors
  std::map<std::string, GlobalBox> global_boxes;  // its global-boxes.json; none when empty
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
    const uint32_t streams_per_rank = opts_.safetensors ? 2 : 1;
    OPTSTATE_RETURN_IF_ERROR(writer_.Init(kWriteDepth, opts_.staging_bytes_per_rank,
                                          streams_per_rank * static_cast<uint32_t>(target_.ranks.size())));
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
      if (r.direct && r.st) OPTSTATE_RETURN_IF_ERROR(writer_.Finish(r.st_stream));
    }
    OPTSTATE_RETURN_IF_ERROR(SyncWritten());
    for (DestRank& r : ranks_) {
      if (r.st) {
        if (r.direct) OPTSTATE_RETURN_IF_ERROR(Truncate(*r.st, r.st_bytes));
        OPTSTATE_RETURN_IF_ERROR(r.st->Fdatasync());
        r.st.reset();
      }
      const std::string json = SerializeManifest(r.manifest);
      OpenOptions oo;
      oo.create = true;
      oo.exclusive = true;
      OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> mf, fs_->Open(r.dir + "/" + kManifestFileName, oo));
      OPTSTATE_RETURN_IF_ERROR(mf->Pwrite(0, json.data(), json.size()));
      OPTSTATE_RETURN_IF_ERROR(mf->Fsync());
      result_->bytes_written += json.size();
      if (!r.global_boxes.empty()) {
        const std::string boxes = SerializeGlobalBoxes(r.global_boxes);
        OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> bf, fs_->Open(r.dir + "/" + kGlobalBoxesFileName, oo));
        OPTSTATE_RETURN_IF_ERROR(bf->Pwrite(0, boxes.data(), boxes.size()));
        OPTSTATE_RETURN_IF_ERROR(bf->Fsync());
        result_->bytes_written += boxes.size();
      }
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
  // Directories, manifests without chunk hashes, state.safetensors headers
  // (with opts_.safetensors).
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
      m.job = m0.job;  // the sources' one job (LoadSources checks)
      m.generation = m0.generation;
      m.step = m0.step;
      m.chunk_size_bytes = cs_;
      m.groups = m0.groups;
      m.has_safetensors = opts_.safetensors;
      for (const auto& [name, box] : target_.ranks[r]) {  // std::map: sorted by name, as manifests are
        const GlobalInfo& g = s_.tensors.at(name);
        ManifestTensor t;
        t.name = name;
        t.file_name = FileNameForName(name);
        t.dtype = g.dtype;
        t.numel = static_cast<uint64_t>(Volume(box.shape));
        t.group = g.group;
        t.step_count = g.step_count;
        t.shape = box.shape;
        t.global_shape = g.global_shape;
        t.shard_offset = box.offset;
        if (box.flat && !box.within_shape.empty()) {
          // Recorded in the slice's coordinates, as the rank's store registers it; the slice's place
          // goes into the rank's global-boxes.json.
          t.global_shape = box.within_shape;
          d.global_boxes[name] = GlobalBox{box.within_offset, g.global_shape, false};
        }
        // A copy: marked, so that this rank's checkpoint, resharded again, does not hold it twice.
        if (box.replica) d.global_boxes[name] = GlobalBox{{}, {}, true};
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
      d.direct = true;
      for (const auto& [name, box] : target_.ranks[r]) d.direct = d.direct && ArrivesInOrder(s_.tensors.at(name), box);
      if (!opts_.safetensors) continue;
      d.st_header = SafetensorsHeader(m);
      uint64_t off = 0;  // in the data section: the fields back to back, in manifest order
      for (const ManifestTensor& t : m.tensors) {
        d.st_offsets.emplace_back();
        for (const ManifestField& f : t.fields) {
          d.st_offsets.back().push_back(d.st_header.size() + off);
          off += f.bytes;
        }
      }
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
    // Start the writeback now, so that the disk writes while the next chunks
    // are read and scattered instead of all at the final fdatasync. A hint
    // only: durability still comes from the fdatasync of every file.
    (void)::sync_file_range(d.file->fd(), static_cast<off64_t>(d.stage_start), static_cast<off64_t>(d.stage.size()),
                            SYNC_FILE_RANGE_WRITE);
    result_->bytes_written += d.stage.size();
    if (d.rank->st) {
      OPTSTATE_RETURN_IF_ERROR(d.rank->st->Pwrite(d.st_offset + d.stage_start, d.stage.data(), d.stage.size()));
      (void)::sync_file_range(d.rank->st->fd(), static_cast<off64_t>(d.st_offset + d.stage_start),
                              static_cast<off64_t>(d.stage.size()), SYNC_FILE_RANGE_WRITE);
      result_->bytes_written += d.stage.size();
    }
    d.stage.clear();
    return Status::Ok();
  }

  // Appends bytes bound for file offset `at` of d, writing out what is staged
  // first when they do not continue it or the stage is full.
  Status Stage(DestField& d, uint64_t at, const char* p, uint64_t n) {
    if (d.rank->direct) {
      const uint64_t st_at = d.rank->st ? d.rank->st_stream.pos + d.rank->st_stream.fill : d.st_offset + at;
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
      result_->bytes_written += n;
      if (d.rank->st) {
        OPTSTATE_RETURN_IF_ERROR(writer_.Append(d.rank->st_stream, p, n));
        result_->bytes_written += n;
      }
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
      if (r.st) d.st_offset = r.st_offsets[it->second][fi];
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
