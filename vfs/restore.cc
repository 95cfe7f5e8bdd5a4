// Restore: import a checkpoint directory as one new committed generation.
//
// Order: parse + validate the manifest; unless the manifest says the
// checkpoint was written without it, check state.safetensors' header
// against it (same generation and store, one entry per field at its place);
// compare the manifest's layout with the store (all differences listed); then
// for every field, read each chunk from the field file and the same bytes
// from state.safetensors, check both against the manifest's XXH3, and write
// the chunk through ChunkIo at queue depth; one Commit at the end. Any error
// aborts the pending generation, so the store is exactly as before.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "vfs/checkpoint.h"
#include "vfs/io_buffer.h"
#include "base/log.h"
#include "base/sync_point.h"

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
    TensorSpec have_spec = t;
    have_spec.fields = FieldsOf(t);
    const TensorSpec want_spec = TensorSpecOf(mt);
    // name:dtype, plus the element count and chunk bytes where a field has
    // its own (q8 scales).
    auto describe = [&](const TensorSpec& s, std::vector<std::string>* out) {
      for (uint32_t i = 0; i < s.fields.size(); ++i) {
        std::string d = s.fields[i].name + ":" + DTypeName(s.fields[i].dtype);
        if (s.field_numel(i) != s.numel || s.field_chunk_bytes(i, m.chunk_size_bytes) != m.chunk_size_bytes) {
          d += fmt::format("({} elements, {}-byte chunks)", s.field_numel(i),
                           s.field_chunk_bytes(i, m.chunk_size_bytes));
        }
        out->push_back(d);
      }
    };
    std::vector<std::string> a, b;
    describe(want_spec, &a);
    describe(have_spec, &b);
    diff("fields", fmt::format("{}", fmt::join(a, ",")), fmt::format("{}", fmt::join(b, ",")));
  }
  for (const TensorInfo& t : have) {
    if (!seen.count(t.name)) {
      diffs.push_back(fmt::format("tensor '{}': in the store, not in the checkpoint", t.name));
    }
  }
  return diffs;
}

// What a copy of latest/ taken while a trainer commits looks like, and the fix.
constexpr const char* kTornCopyHint =
    "a copy of a mount's latest/ taken while a trainer commits can mix generations; "
    "copy snapshots/<name>/ instead, or copy latest/ again";

// Where each field lies in state.safetensors, once its header was checked
// against the manifest. present == false: the checkpoint has no
// state.safetensors, or its manifest says it was written without one (the
// field files alone hold all of the data).
struct SafetensorsPlan {
  bool present = false;
  std::string path;
  uint64_t data_start = 0;                          // 8 + header length
  std::vector<std::vector<uint64_t>> field_offsets;  // [tensor][field], in the data section
};

const char* SafetensorsDtype(DType d) {
  switch (d) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kQ8S:
    case DType::kQ8U: return "U8";
  }
  return "?";
}

// Checks state.safetensors' header against the manifest: the generation and
// store in __metadata__ (checkpoints written before the store uuid was
// recorded there have only the generation), one entry per manifest field with
// its dtype, shape and data_offsets in manifest order, and the file's size.
// A generation or store that differs is reported as such: the files were
// copied from different generations, which is not damage to either.
Result<SafetensorsPlan> CheckSafetensors(const Manifest& m, const std::string& dir) {
  FileSystem* fs = FileSystem::Default();
  SafetensorsPlan plan;
  plan.path = dir + "/" + kSafetensorsFileName;
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, fs->Exists(plan.path));
  if (!m.has_safetensors) {
    // Written without it on purpose: the field files are the checkpoint. A
    // state.safetensors beside them is none of its files (nothing vouches for
    // its bytes) and is not read; it does not stop a restore that every chunk's
    // XXH3 in the manifest checks.
    if (exists) {
      OPTSTATE_LOG_WARN("restore: {} is ignored: {}/{} says the checkpoint has no {} (\"{}\": false); "
                        "restoring from the field files under {}/{}",
                        plan.path, dir, kManifestFileName, kSafetensorsFileName, kManifestSafetensorsKey, dir,
                        kTensorsDirName);
    }
    return plan;
  }
  if (!exists) {
    OPTSTATE_LOG_WARN("restore: {} is missing; restoring from the field files under {}/{}",
                      plan.path, dir, kTensorsDirName);
    return plan;
  }
  plan.present = true;
  const std::string& path = plan.path;
  auto bad = [&](const std::string& what) {
    return Corruption(fmt::format("restore: {}: {}", path, what));
  };
  OpenOptions oo;
  oo.read_only = true;
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> file, fs->Open(path, oo));
  OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, file->Size());
  if (size < 8) return bad(fmt::format("{} bytes: too short for a safetensors header", size));
  unsigned char len_bytes[8];
  OPTSTATE_RETURN_IF_ERROR(file->Pread(0, len_bytes, 8));
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | len_bytes[i];
  constexpr uint64_t kMaxHeaderBytes = 1ull << 30;
  if (hlen > size - 8 || hlen > kMaxHeaderBytes) {
    return bad(fmt::format("header length {} does not fit the file's {} bytes (truncated or "
                           "not a safetensors file)",
                           hlen, size));
  }
  std::string text(hlen, '\0');
  OPTSTATE_RETURN_IF_ERROR(file->Pread(8, text.data(), hlen));
  nlohmann::json h = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded() || !h.is_object()) return bad("the header is not a JSON object");

  // Generation and store first: a torn copy is named as one before any
  // entry or byte is compared.
  auto meta = h.find("__metadata__");
  if (meta != h.end() && meta->is_object()) {
    auto str = [&](const char* key) -> std::optional<std::string> {
      auto it = meta->find(key);
      if (it == meta->end() || !it->is_string()) return std::nullopt;
      return it->get<std::string>();
    };
    if (auto uuid = str(kSafetensorsStoreUuidKey); uuid && *uuid != m.store_uuid) {
      return Corruption(fmt::format(
          "restore: checkpoint {}: its files come from different stores: manifest.json is of "
          "store {} ('{}'), state.safetensors of store {} ('{}')",
          dir, m.store_uuid, m.store_name, *uuid, str(kSafetensorsStoreKey).value_or("?")));
    }
    if (auto gen = str(kSafetensorsGenerationKey)) {
      char* end = nullptr;
      errno = 0;
      unsigned long long g = std::strtoull(gen->c_str(), &end, 10);
      if (gen->empty() || *end != '\0' || errno == ERANGE) {
        return bad(fmt::format("__metadata__ {} '{}' is not a generation number",
                               kSafetensorsGenerationKey, *gen));
      }
      if (g != m.generation) {
        return Corruption(fmt::format(
            "restore: checkpoint {}: its files come from different generations: manifest.json "
            "is of generation {}, state.safetensors of generation {} (store '{}'; {})",
            dir, m.generation, g, m.store_name, kTornCopyHint));
      }
    }
  }

  plan.data_start = 8 + hlen;
  uint64_t off = 0, entries = 0;
  plan.field_offsets.resize(m.tensors.size());
  for (size_t ti = 0; ti < m.tensors.size(); ++ti) {
    const ManifestTensor& mt = m.tensors[ti];
    for (const ManifestField& f : mt.fields) {
      const std::string key = mt.name + "/" + f.name;
      auto it = h.find(key);
      if (it == h.end()) {
        return bad(fmt::format("no entry '{}' (tensor '{}' field '{}' of the manifest)", key,
                               mt.name, f.name));
      }
      ++entries;
      const nlohmann::json& e = *it;
      const nlohmann::json want_offsets = {off, off + f.bytes};
      if (!e.is_object() || e.value("dtype", nlohmann::json()) != SafetensorsDtype(f.dtype) ||
          e.value("shape", nlohmann::json()) != nlohmann::json(FieldShape(mt, f)) ||
          e.value("data_offsets", nlohmann::json()) != want_offsets) {
        return bad(fmt::format(
            "entry '{}' is {}, the manifest says dtype {}, shape {}, data_offsets {} (tensor "
            "'{}' field '{}')",
            key, e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
            SafetensorsDtype(f.dtype), nlohmann::json(FieldShape(mt, f)).dump(), want_offsets.dump(),
            mt.name, f.name));
      }
      plan.field_offsets[ti].push_back(off);
      off += f.bytes;
    }
  }
  const uint64_t in_header = h.size() - (meta != h.end() ? 1 : 0);
  if (in_header != entries) {
    for (const auto& [k, v] : h.items()) {
      (void)v;
      if (k == "__metadata__") continue;
      bool known = false;
      for (const ManifestTensor& mt : m.tensors) {
        for (const ManifestField& f : mt.fields) known = known || (mt.name + "/" + f.name == k);
      }
      if (!known) return bad(fmt::format("entry '{}' is not a field of the manifest", k));
    }
  }
  if (size != plan.data_start + off) {
    return bad(fmt::format("size {} bytes, its header and the manifest say {}: {}", size,
                           plan.data_start + off,
                           size < plan.data_start + off ? "truncated" : "too long"));
  }
  return plan;
}

// The import proper. REQUIRES: layout matches (checked by the caller).
Result<uint64_t> Import(Store* store, const Manifest& m, const SafetensorsPlan& st_plan,
                        const std::string& dir, const RestoreOptions& opts,
                        bool skip_zero_chunks) {
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
  // state.safetensors holds the same bytes as the field files: each chunk is
  // read from it too and checked against the manifest.
  std::unique_ptr<File> st_file;
  IoBuffer st_buf;
  if (st_plan.present) {
    OpenOptions oo;
    oo.read_only = true;
    OPTSTATE_ASSIGN_OR_RETURN(st_file, fs->Open(st_plan.path, oo));
    st_buf = IoBuffer(buf_bytes);
    if (!st_buf.ok()) return ResourceExhausted("restore: out of memory for a chunk buffer");
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

  for (size_t ti = 0; ti < m.tensors.size(); ++ti) {
    const ManifestTensor& mt = m.tensors[ti];
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
              "restore: {}: chunk {} (bytes {}..{}) has XXH3 {:016x}, generation {} of the "
              "manifest says {:016x} (tensor '{}' field '{}'): the file is damaged, or it was "
              "copied from another generation than manifest.json ({})",
              path, ci, c.offset_bytes, c.offset_bytes + c.length_bytes, h, m.generation,
              c.xxh3, mt.name, f.name, kTornCopyHint));
        }
        if (st_file) {
          const uint64_t at = st_plan.data_start + st_plan.field_offsets[ti][fi] + c.offset_bytes;
          char* q = st_buf.as<char>();
          st = st_file->Pread(at, q, c.length_bytes);
          if (!st.ok()) {
            drain();
            return st.WithContext(fmt::format("restore: tensor '{}' field '{}' chunk {}",
                                              mt.name, f.name, ci));
          }
          uint64_t hs = XXH3_64bits(q, c.length_bytes);
          if (hs != c.xxh3) {
            drain();
            return Corruption(fmt::format(
                "restore: {}: bytes {}..{} (tensor '{}' field '{}' chunk {}) have XXH3 {:016x}, "
                "generation {} of the manifest says {:016x}: the file is damaged, or it was "
                "copied from another generation than manifest.json ({})",
                st_plan.path, at, at + c.length_bytes, mt.name, f.name, ci, hs, m.generation,
                c.xxh3, kTornCopyHint));
          }
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
  OPTSTATE_ASSIGN_OR_RETURN(ci.tensor_steps, TensorStepsOf(store, m));
  return store->Commit(ci);
}

// --create makes the store directory itself: say what is in the way.
Status CheckCreatePath(const std::string& store_path) {
  std::error_code ec;
  const std::filesystem::file_status fst = std::filesystem::symlink_status(store_path, ec);
  if (ec || !std::filesystem::exists(fst)) return Status();  // Store::Create reports the rest
  if (std::filesystem::is_directory(fst)) {
    if (std::filesystem::exists(std::filesystem::path(store_path) / "IDENTITY", ec)) {
      return AlreadyExists(fmt::format(
          "restore --create: {} is already a store; to restore into it, run without --create "
          "(its layout must match the checkpoint), or give a new path",
          store_path));
    }
    const bool empty = std::filesystem::is_empty(store_path, ec);
    return AlreadyExists(fmt::format(
        "restore --create: {} is an existing {}directory; --create makes the store directory "
        "itself: give a path that does not exist yet (e.g. {}/<name>){}",
        store_path, empty ? "empty " : "", store_path,
        empty ? ", or remove the empty directory first" : ""));
  }
  return AlreadyExists(fmt::format(
      "restore --create: {} is a {}, not a directory; --create makes a new store directory: "
      "give a path that does not exist yet",
      store_path, std::filesystem::is_regular_file(fst) ? "regular file" : "file of another type"));
}

Result<Manifest> LoadManifest(const std::string& dir) {
  auto m = ReadManifestFile(dir + "/" + kManifestFileName);
  if (!m.ok() && m.status().code() != StatusCode::kCorruption && m.status().code() != StatusCode::kInvalidArgument) {
    return m.status().WithContext("restore: reading the manifest");
  }
  return m;
}

// A snapshot name no snapshot of `store` has: pre-restore-<generation>-<ms>,
// with -<n> appended while taken.
std::string PreRestoreSnapshotName(const Store& store, uint64_t generation) {
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  std::set<std::string> taken;
  for (const SnapshotInfo& s : store.ListSnapshots()) taken.insert(s.name);
  const std::string base = fmt::format("pre-restore-{}-{}", generation, ms);
  std::string name = base;
  for (int n = 2; taken.count(name); ++n) name = fmt::format("{}-{}", base, n);
  return name;
}

// Directories of restores into new stores (CreateStoreFilled) that a killed
// process left next to store_path.
std::string RestoringPrefix(const std::string& base) { return "." + base + ".restoring-"; }

// Removes a half-built store directory and its data files in data dirs
// outside it (read from its IDENTITY; a directory that has none yet has no
// data files outside it either, since Store::Create writes IDENTITY into the
// directory only after their data files).
void RemoveHalfBuiltStore(FileSystem* fs, const std::string& dir) {
  auto text = fs->ReadFileToString(dir + "/IDENTITY");
  if (text.ok()) {
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("uuid") && j["uuid"].is_string() && j.contains("data_dirs") &&
        j["data_dirs"].is_array()) {
      const std::string uuid = j["uuid"].get<std::string>();
      for (const auto& d : j["data_dirs"]) {
        if (!d.is_string()) continue;
        const std::string dd = d.get<std::string>();
        if (!dd.starts_with("/")) continue;  // inside dir: removed with it
        (void)fs->Remove(dd + "/" + uuid + ".chunks");
        (void)fs->Remove(dd + "/" + uuid + ".owner");
      }
    }
  }
  Status st = fs->RemoveAll(dir);
  if (!st.ok()) OPTSTATE_LOG_ERROR("removing the half-built store {}: {}", dir, st.ToString());
}

// Removes the directories of restores into new stores at store_path whose
// process is gone (a SIGKILL or power loss mid-restore): the restore's own
// directory, and the one Store::Create was building it in when it died there
// (".<restoring dir>.creating-<pid>", the same pid).
void CleanStaleRestores(FileSystem* fs, const std::string& parent, const std::string& base) {
  auto names = fs->ListDir(parent);
  if (!names.ok()) return;
  const std::string prefix = RestoringPrefix(base);
  for (const std::string& n : *names) {
    const size_t skip = n.starts_with(prefix) ? prefix.size() : n.starts_with("." + prefix) ? prefix.size() + 1 : 0;
    if (skip == 0) continue;
    const long pid = std::strtol(n.c_str() + skip, nullptr, 10);
    if (pid > 0 && pid != getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      OPTSTATE_LOG_INFO("removing {}: a restore into a new store {}/{} that did not finish", parent + "/" + n,
                        parent, base);
      RemoveHalfBuiltStore(fs, parent + "/" + n);
    }
  }
}

}  // namespace

Result<RestoreResult> RestoreCheckpointInto(Store* store, const std::string& dir, const RestoreOptions& opts) {
  if (store->read_only()) {
    return FailedPrecondition("restore: store " + store->path() + " is open read-only");
  }
  OPTSTATE_ASSIGN_OR_RETURN(Manifest m, LoadManifest(dir));
  OPTSTATE_ASSIGN_OR_RETURN(SafetensorsPlan st_plan, CheckSafetensors(m, dir));
  std::vector<std::string> diffs = LayoutDifferences(*store, m);
  if (!diffs.empty()) {
    std::string msg = fmt::format(
        "restore: checkpoint {} does not match the layout of store {} ({} difference{}):", dir,
        store->path(), diffs.size(), diffs.size() == 1 ? "" : "s");
    for (size_t i = 0; i < diffs.size() && i < 20; ++i) msg += "\n  " + diffs[i];
    if (diffs.size() > 20) msg += fmt::format("\n  ... and {} more", diffs.size() - 20);
    return InvalidArgument(msg);
  }
  const GenerationInfo head = store->LatestGeneration();
  // A head that has taken steps is training state: another store's checkpoint
  // replaces it only when asked to, and it is kept as a snapshot either way.
  const bool trained = head.generation > 0 && head.step > 0;
  const StoreIdentity& id = store->identity();
  // A checkpoint of the same job (a store made from its checkpoints, a
  // reshard of its ranks) is that job's own state, not another's.
  const bool same_job = !m.job.empty() && m.job == id.job;
  if (trained && m.store_uuid != id.uuid && !same_job && !opts.force) {
    return FailedPrecondition(fmt::format(
        "restore: checkpoint {} is of another store: store {} ('{}', job {}), step {} generation {}; store {} "
        "is {} ('{}', job {}) at step {} generation {}. Restoring would replace its training state with the other "
        "store's; to do so anyway, pass --force (optstate-restore), OPTSTATE_RESTORE_FORCE (C) or force=True "
        "(Python): its current head is then kept as a snapshot",
        dir, m.store_uuid, m.store_name, m.job.empty() ? "unknown" : m.job, m.step, m.generation, store->path(),
        id.uuid, id.name, id.job.empty() ? "unknown" : id.job, head.step, head.generation));
  }
  RestoreResult result;
  if (trained) {
    const std::string name = PreRestoreSnapshotName(*store, head.generation);
    auto snap = store->CreateSnapshot(name);
    if (!snap.ok()) {
      return snap.status().WithContext(fmt::format(
          "restore: keeping generation {} of store {} as snapshot {} before the restore replaces it",
          head.generation, store->path(), name));
    }
    result.kept_snapshot = name;
  }
  auto gen = Import(store, m, st_plan, dir, opts, /*skip_zero_chunks=*/false);
  if (!gen.ok()) {
    Status ab = store->AbortPending();
    if (!ab.ok()) OPTSTATE_LOG_ERROR("restore: AbortPending after a failed restore: {}", ab.ToString());
    if (!result.kept_snapshot.empty()) {
      Status rs = store->ReleaseSnapshot(result.kept_snapshot);
      if (!rs.ok()) OPTSTATE_LOG_ERROR("restore: releasing snapshot {} after a failed restore: {}",
                                       result.kept_snapshot, rs.ToString());
    }
    return gen.status();
  }
  result.generation = *gen;
  OPTSTATE_LOG_INFO("restored {} (generation {} step {}) into store {} as generation {}{}", dir, m.generation,
                    m.step, store->path(), *gen,
                    result.kept_snapshot.empty()
                        ? std::string()
                        : fmt::format("; the generation {} it replaced is kept as snapshot {}", head.generation,
                                      result.kept_snapshot));
  return result;
}

Result<uint64_t> RestoreCheckpoint(Store* store, const std::string& dir, const RestoreOptions& opts) {
  OPTSTATE_ASSIGN_OR_RETURN(RestoreResult r, RestoreCheckpointInto(store, dir, opts));
  return r.generation;
}

Result<std::unique_ptr<Store>> CreateStoreFilled(const std::string& store_path_in, StoreOptions opts,
                                                 const std::function<Status(Store*)>& fill) {
  FileSystem* fs = opts.fs ? opts.fs : FileSystem::Default();
  std::string store_path = std::filesystem::absolute(store_path_in).lexically_normal().string();
  while (store_path.size() > 1 && store_path.back() == '/') store_path.pop_back();
  const std::filesystem::path p(store_path);
  const std::string parent = p.parent_path().string();
  const std::string base = p.filename().string();
  if (base.empty() || base == "." || base == "..") {
    return InvalidArgument("restore --create: store path '" + store_path_in + "' has no name");
  }
  OPTSTATE_RETURN_IF_ERROR(CheckCreatePath(store_path));
  OPTSTATE_ASSIGN_OR_RETURN(bool parent_exists, fs->Exists(parent));
  if (!parent_exists) {
    return NotFound("restore --create: store " + store_path + ": parent directory " + parent + " does not exist");
  }
  CleanStaleRestores(fs, parent, base);
  const std::string tmp = parent + "/" + RestoringPrefix(base) + std::to_string(getpid());
  OPTSTATE_ASSIGN_OR_RETURN(bool tmp_exists, fs->Exists(tmp));
  if (tmp_exists) RemoveHalfBuiltStore(fs, tmp);  // this process's own, from an earlier failed call
  if (opts.name.empty()) opts.name = base;
  // Data dirs inside store_path are built inside the temporary directory.
  for (std::string& d : opts.data_dirs) {
    const std::string a = std::filesystem::absolute(d).lexically_normal().string();
    if (a == store_path || a.starts_with(store_path + "/")) d = tmp + a.substr(store_path.size());
  }
  auto cleanup = [&](const Status& st) -> Status {
    RemoveHalfBuiltStore(fs, tmp);
    return st.WithContext("restore --create: store " + store_path + " not created");
  };
  {
    OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Create(tmp, opts));
    OPTSTATE_TEST_SYNC_POINT("restore.create.created");
    Status st = fill(store.get());
    if (!st.ok()) {
      (void)store->AbortPending();
      store.reset();
      return cleanup(st);
    }
    OPTSTATE_TEST_SYNC_POINT("restore.create.committed");
  }  // closed: its index and LOCK are released before the directory moves
  Status st = fs->Rename(tmp, store_path);
  if (!st.ok()) return cleanup(st);
  OPTSTATE_TEST_SYNC_POINT("restore.create.renamed");
  st = fs->SyncDir(parent);
  if (!st.ok()) {
    return st.WithContext("restore --create: store " + store_path +
                          " complete, but its name in " + parent + " may not survive a power loss");
  }
  // Open rewrites the data files' owner records for the directory's new name
  // (same inode: a move, vfs/store.h "Copies and moves").
  return Store::Open(store_path, opts);
}

Result<std::unique_ptr<Store>> CreateStoreFromCheckpoint(const std::string& dir,
                                                         const std::string& store_path,
                                                         StoreOptions opts,
                                                         const RestoreOptions& ropts) {
  OPTSTATE_ASSIGN_OR_RETURN(Manifest m, LoadManifest(dir));
  OPTSTATE_ASSIGN_OR_RETURN(SafetensorsPlan st_plan, CheckSafetensors(m, dir));
  opts.chunk_size_bytes = m.chunk_size_bytes;
  if (opts.job.empty()) opts.job = m.job;
  return CreateStoreFilled(store_path, opts, [&](Store* store) -> Status {
    for (const ManifestTensor& mt : m.tensors) {
      auto t = store->CreateTensor(TensorSpecOf(mt));
      if (!t.ok()) return t.status();
    }
    auto gen = Import(store, m, st_plan, dir, ropts, /*skip_zero_chunks=*/true);
    return gen.ok() ? Status() : gen.status();
  });
}

Result<uint64_t> Store::Restore(const std::string& checkpoint_dir) {
  return RestoreCheckpoint(this, checkpoint_dir);
}

}  // namespace optstate::vfs
