// Restore: import a checkpoint directory as one new committed generation.
//
// Order: parse + validate the manifest; compare its layout with the store (all
// differences listed); then for every field, read each chunk from the field
// file, check it against the manifest's XXH3, and write it through ChunkIo at
// queue depth; one Commit at the end. Any error aborts the pending generation,
// so the store is exactly as before.
#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>
#include <xxhash.h>

#include "vfs/checkpoint.h"
#include "vfs/io_buffer.h"
#include "vfs/log.h"

namespace optstate::vfs {
namespace {

std::vector<FieldSpec> FieldsOf(const TensorInfo& t) { return t.fields.empty() ? AdamFields() : t.fields; }

std::string Dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// Lists every way the store's tensors differ from the manifest's.
std::vector<std::string> LayoutDifferences(const Store& store, const Manifest& m) {
  std::vector<std::string> diffs;
  std::vector<TensorInfo> have = store.ListTensors();
  std::map<std::string, const TensorInfo*> by_name;
  for (const TensorInfo& t : have) by_name[t.name] = &t;
  if (m.chunk_size_bytes != store.chunk_size_bytes()) {
    diffs.push_back(fmt::format("chunk size: checkpoint {} bytes, store {} bytes", m.chunk_size_bytes,
                                store.chunk_size_bytes()));
  }
  std::set<std::string> seen;
  for (const ManifestTensor& mt : m.tensors) {
    seen.insert(mt.name);
    auto it = by_name.find(mt.name);
    if (it == by_name.end()) {
      diffs.push_back(fmt::format("tensor '{}': in the checkpoint, not in the store", mt.name));
      continue;
    }
    const TensorInfo& t = *it->second;
    std::vector<uint64_t> shape = t.shape.empty() ? std::vector<uint64_t>{t.numel} : t.shape;
    std::vector<uint64_t> gshape = t.global_shape.empty() ? shape : t.global_shape;
    std::vector<uint64_t> off =
        t.shard_offset.empty() ? std::vector<uint64_t>(gshape.size(), 0) : t.shard_offset;
    auto diff = [&](const char* what, const std::string& a, const std::string& b) {
      if (a != b) {
        diffs.push_back(
            fmt::format("tensor '{}': {} checkpoint {} vs store {}", mt.name, what, a, b));
      }
    };
    diff("numel", std::to_string(mt.numel), std::to_string(t.numel));
    diff("dtype", DTypeName(mt.dtype), DTypeName(t.dtype));
    diff("group", std::to_string(mt.group), std::to_string(t.group));
    diff("shape", Dims(mt.shape), Dims(shape));
    diff("global_shape (shard)", Dims(mt.global_shape), Dims(gshape));
    diff("shard_offset (shard)", Dims(mt.shard_offset), Dims(off));
    std::vector<FieldSpec> fields = FieldsOf(t);
    std::vector<std::string> a, b;
    for (const ManifestField& f : mt.fields) a.push_back(f.name + ":" + DTypeName(f.dtype));
    for (const FieldSpec& f : fields) b.push_back(f.name + ":" + DTypeName(f.dtype));
    diff("fields", fmt::format("{}", fmt::join(a, ",")), fmt::format("{}", fmt::join(b, ",")));
  }
  for (const TensorInfo& t : have) {
    if (!seen.count(t.name)) {
      diffs.push_back(fmt::format("tensor '{}': in the store, not in the checkpoint", t.name));
    }
  }
  return diffs;
}

// The import proper. REQUIRES: layout matches (checked by the caller).
Result<uint64_t> Import(Store* store, const Manifest& m, const std::string& dir,
                        const RestoreOptions& opts, bool skip_zero_chunks) {
  FileSystem* fs = FileSystem::Default();
  const uint64_t cs = store->chunk_size_bytes();
  const uint64_t buf_bytes = (cs + 4095) / 4096 * 4096;
  const uint32_t depth = std::max<uint32_t>(1, opts.queue_depth);
  uint64_t total = 0, done = 0;
  for (const ManifestTensor& mt : m.tensors) {
    for (const ManifestField& f : mt.fields) total += f.bytes;
  }

  ChunkIoOptions io_opts;
  io_opts.queue_depth = depth;
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<ChunkIo> io, store->NewChunkIo(io_opts));
  std::vector<IoBuffer> bufs;
  std::vector<size_t> free_bufs;
  for (uint32_t i = 0; i < depth; ++i) {
    bufs.emplace_back(buf_bytes);
    if (!bufs.back().ok()) return ResourceExhausted("restore: out of memory for chunk buffers");
    free_bufs.push_back(i);
  }
  std::vector<ChunkCompletion> comps;
  auto reap = [&](size_t min) -> Status {
    comps.clear();
    OPTSTATE_RETURN_IF_ERROR(io->Reap(&comps, min));
    for (const ChunkCompletion& c : comps) {
      free_bufs.push_back(static_cast<size_t>(c.tag));
      if (!c.status.ok()) return c.status.WithContext("restore: chunk write");
    }
    return Status();
  };
  auto drain = [&]() {
    while (io->in_flight() > 0) {
      comps.clear();
      if (!io->Reap(&comps, io->in_flight()).ok()) break;
    }
  };

  for (const ManifestTensor& mt : m.tensors) {
    OPTSTATE_ASSIGN_OR_RETURN(TensorInfo t, store->FindTensor(mt.name));
    for (uint32_t fi = 0; fi < mt.fields.size(); ++fi) {
      const ManifestField& f = mt.fields[fi];
      const std::string path = dir + "/" + f.file;
      OpenOptions oo;
      oo.read_only = true;
      auto file = fs->Open(path, oo);
      if (!file.ok()) {
        drain();
        return file.status().WithContext(
            fmt::format("restore: tensor '{}' field '{}'", mt.name, f.name));
      }
      auto size = (*file)->Size();
      if (!size.ok()) {
        drain();
        return size.status();
      }
      if (*size != f.bytes) {
        drain();
        return Corruption(fmt::format(
            "restore: {}: size {} bytes, manifest says {} (tensor '{}' field '{}'): {}", path,
            *size, f.bytes, mt.name, f.name, *size < f.bytes ? "truncated" : "too long"));
      }
      for (uint64_t ci = 0; ci < f.chunks.size(); ++ci) {
        const ManifestChunk& c = f.chunks[ci];
        if (free_bufs.empty()) {
          Status st = reap(1);
          if (!st.ok()) {
            drain();
            return st;
          }
        }
        size_t b = free_bufs.back();
        char* p = bufs[b].as<char>();
        Status st = (*file)->Pread(c.offset_bytes, p, c.length_bytes);
        if (!st.ok()) {
          drain();
          return st.WithContext(fmt::format("restore: tensor '{}' field '{}' chunk {}", mt.name,
                                            f.name, ci));
        }
        uint64_t h = XXH3_64bits(p, c.length_bytes);
        if (h != c.xxh3) {
          drain();
          return Corruption(fmt::format(
              "restore: {}: chunk {} (bytes {}..{}) has XXH3 {:016x}, manifest says {:016x} "
              "(tensor '{}' field '{}'): the file was altered or damaged",
              path, ci, c.offset_bytes, c.offset_bytes + c.length_bytes, h, c.xxh3, mt.name,
              f.name));
        }
        if (skip_zero_chunks) {
          bool zero = true;
          for (uint64_t i = 0; i < c.length_bytes && zero; i += 8) {
            uint64_t w = 0;
            std::memcpy(&w, p + i, std::min<uint64_t>(8, c.length_bytes - i));
            zero = (w == 0);
          }
          if (zero) continue;  // a fresh store reads never-written chunks as zeros
        }
        std::memset(p + c.length_bytes, 0, buf_bytes - c.length_bytes);
        free_bufs.pop_back();
        st = io->SubmitWrite(ChunkRef{t.id, fi, ci}, p, b);
        if (!st.ok()) {
          free_bufs.push_back(b);
          drain();
          return st.WithContext(fmt::format("restore: tensor '{}' field '{}' chunk {}", mt.name,
                                            f.name, ci));
        }
        done += c.length_bytes;
      }
      if (opts.progress) opts.progress(done, total);
    }
  }
  while (io->in_flight() > 0) {
    Status st = reap(io->in_flight());
    if (!st.ok()) {
      drain();
      return st;
    }
  }
  io.reset();
  CommitInfo ci;
  ci.step = m.step;
  ci.groups = m.groups;
  return store->Commit(ci);
}

Result<Manifest> LoadManifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifestFileName;
  auto text = FileSystem::Default()->ReadFileToString(path);
  if (!text.ok()) return text.status().WithContext("restore: reading the manifest");
  return ParseManifest(*text, path);
}

}  // namespace

Result<uint64_t> RestoreCheckpoint(Store* store, const std::string& dir, const RestoreOptions& opts) {
  if (store->read_only()) {
    return FailedPrecondition("restore: store " + store->path() + " is open read-only");
  }
  OPTSTATE_ASSIGN_OR_RETURN(Manifest m, LoadManifest(dir));
  std::vector<std::string> diffs = LayoutDifferences(*store, m);
  if (!diffs.empty()) {
    std::string msg = fmt::format(
        "restore: checkpoint {} does not match the layout of store {} ({} difference{}):", dir,
        store->path(), diffs.size(), diffs.size() == 1 ? "" : "s");
    for (size_t i = 0; i < diffs.size() && i < 20; ++i) msg += "\n  " + diffs[i];
    if (diffs.size() > 20) msg += fmt::format("\n  ... and {} more", diffs.size() - 20);
    return InvalidArgument(msg);
  }
  auto gen = Import(store, m, dir, opts, /*skip_zero_chunks=*/false);
  if (!gen.ok()) {
    Status ab = store->AbortPending();
    if (!ab.ok()) OPTSTATE_LOG_ERROR("restore: AbortPending after a failed restore: {}", ab.ToString());
    return gen.status();
  }
  OPTSTATE_LOG_INFO("restored {} (generation {} step {}) into store {} as generation {}", dir,
                    m.generation, m.step, store->path(), *gen);
  return gen;
}

Result<std::unique_ptr<Store>> CreateStoreFromCheckpoint(const std::string& dir,
                                                         const std::string& store_path,
                                                         StoreOptions opts,
                                                         const RestoreOptions& ropts) {
  OPTSTATE_ASSIGN_OR_RETURN(Manifest m, LoadManifest(dir));
  opts.chunk_size_bytes = m.chunk_size_bytes;
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Create(store_path, opts));
  auto cleanup = [&](const Status& st) -> Status {
    StoreIdentity id = store->identity();
    store.reset();
    FileSystem* fs = FileSystem::Default();
    for (const std::string& d : id.data_dirs) (void)fs->Remove(d + "/" + id.uuid + ".chunks");
    (void)fs->RemoveAll(store_path);
    return st.WithContext("restore --create: store " + store_path + " removed again");
  };
  for (const ManifestTensor& mt : m.tensors) {
    TensorSpec spec;
    spec.name = mt.name;
    spec.dtype = mt.dtype;
    spec.numel = mt.numel;
    spec.group = mt.group;
    spec.shape = mt.shape;
    spec.global_shape = mt.global_shape;
    spec.shard_offset = mt.shard_offset;
    for (const ManifestField& f : mt.fields) spec.fields.push_back({f.name, f.dtype});
    auto t = store->CreateTensor(spec);
    if (!t.ok()) return cleanup(t.status());
  }
  auto gen = Import(store.get(), m, dir, ropts, /*skip_zero_chunks=*/true);
  if (!gen.ok()) {
    (void)store->AbortPending();
    return cleanup(gen.status());
  }
  return store;
}

Result<uint64_t> Store::Restore(const std::string& checkpoint_dir) {
  return RestoreCheckpoint(this, checkpoint_dir);
}

}  // namespace optstate::vfs
