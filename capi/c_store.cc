// The C ABI's library calls, store handles, field reads and snapshots
// (optstate/c.h "library" and "store") over vfs/store.h.
#include "optstate/c.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "capi/internal/c_types.h"
#include "base/log.h"
#include "kernels/adam.h"
#include "base/status.h"
#include "vfs/store.h"

using optstate::DType;
using optstate::InvalidArgument;
using optstate::NotFound;
using optstate::Status;
using optstate::StatusCode;
using optstate::capi::internal::Guard;
using optstate::capi::internal::NullArgument;
namespace vfs = optstate::vfs;

namespace {

int OpenStore(bool create, const char* path, const optstate_store_options_t* opts,
                     optstate_store_t** out, char** errptr) {
  const char* what = create ? "optstate_store_create" : "optstate_store_open";
  return Guard(errptr, what, [&]() -> Status {
    if (out == nullptr) return NullArgument(what, "out");
    *out = nullptr;
    if (path == nullptr || *path == '\0') return InvalidArgument(std::string(what) + ": empty store path");
    vfs::StoreOptions so = opts == nullptr ? vfs::StoreOptions{} : opts->rep;
    auto store = create ? vfs::Store::Create(path, so) : vfs::Store::Open(path, so);
    if (!store.ok()) return store.status();
    *out = new optstate_store_t;
    (*out)->rep = std::move(*store);
    return Status::Ok();
  });
}

}  // namespace

namespace optstate::capi::internal {

void CloseStoreIfRequested(optstate_store_t* store) {
  {
    optstate::MutexLock lock(&store->open_mu);
    if (!store->close_requested || store->HasOpenHandles()) return;
  }
  delete store;
}

}  // namespace optstate::capi::internal

extern "C" {

// ---- library ----

const char* optstate_version(void) { return OPTSTATE_VERSION_STRING; }
int optstate_abi_version(void) { return OPTSTATE_C_ABI_VERSION; }

const char* optstate_code_name(int code) {
  if (code < 0 || code > static_cast<int>(StatusCode::kInternal)) return "Unknown";
  // StatusCodeName returns views of string literals (NUL-terminated).
  return optstate::StatusCodeName(static_cast<StatusCode>(code)).data();
}

void optstate_free(void* ptr) { std::free(ptr); }

int optstate_set_log_level(const char* level, char** errptr) {
  const char* what = "optstate_set_log_level";
  return Guard(errptr, what, [&]() -> Status {
    if (level == nullptr) return NullArgument(what, "level");
    const std::string name(level);
    for (const char* known : {"trace", "debug", "info", "warn", "error", "off"}) {
      if (name == known) {
        optstate::Logger().set_level(spdlog::level::from_str(name));
        return Status::Ok();
      }
    }
    return InvalidArgument(std::string(what) + ": log level '" + name +
                           "' is none of trace, debug, info, warn, error, off");
  });
}

// ---- store ----

optstate_store_options_t* optstate_store_options_create(void) {
  return new (std::nothrow) optstate_store_options_t;
}
void optstate_store_options_destroy(optstate_store_options_t* opts) { delete opts; }
void optstate_store_options_set_name(optstate_store_options_t* opts, const char* name) {
  opts->rep.name = name == nullptr ? "" : name;
}
void optstate_store_options_set_chunk_size_bytes(optstate_store_options_t* opts, uint64_t bytes) {
  opts->rep.chunk_size_bytes = bytes;
}
void optstate_store_options_add_data_dir(optstate_store_options_t* opts, const char* dir) {
  if (dir != nullptr) opts->rep.data_dirs.emplace_back(dir);
}
void optstate_store_options_set_retained_generations(optstate_store_options_t* opts, uint32_t n) {
  opts->rep.retained_generations = n;
}
void optstate_store_options_set_direct_io(optstate_store_options_t* opts, int on) {
  opts->rep.direct_io = on != 0;
}
void optstate_store_options_set_job(optstate_store_options_t* opts, const char* job) {
  opts->rep.job = job == nullptr ? "" : job;
}

int optstate_store_create(const char* path, const optstate_store_options_t* opts, optstate_store_t** out,
                          char** errptr) {
  return OpenStore(true, path, opts, out, errptr);
}
int optstate_store_open(const char* path, const optstate_store_options_t* opts, optstate_store_t** out,
                        char** errptr) {
  return OpenStore(false, path, opts, out, errptr);
}
void optstate_store_close(optstate_store_t* store) {
  if (store == nullptr) return;
  {
    optstate::MutexLock lock(&store->open_mu);
    if (store->HasOpenHandles()) {
      store->close_requested = true;  // the last handle's destroy call closes it
      return;
    }
  }
  delete store;
}

const char* optstate_store_path(const optstate_store_t* store) { return store->rep->path().c_str(); }
const char* optstate_store_name(const optstate_store_t* store) { return store->rep->identity().name.c_str(); }
const char* optstate_store_uuid(const optstate_store_t* store) { return store->rep->identity().uuid.c_str(); }
const char* optstate_store_job(const optstate_store_t* store) { return store->rep->identity().job.c_str(); }
uint64_t optstate_store_chunk_size_bytes(const optstate_store_t* store) { return store->rep->chunk_size_bytes(); }

void optstate_store_latest_generation(const optstate_store_t* store, uint64_t* generation, uint64_t* step) {
  vfs::GenerationInfo g = store->rep->LatestGeneration();
  if (generation != nullptr) *generation = g.generation;
  if (step != nullptr) *step = g.step;
}

uint64_t optstate_store_group_step_count(const optstate_store_t* store, uint32_t group) {
  for (const vfs::GroupInfo& g : store->rep->LatestGeneration().groups) {
    if (g.id == group) return g.step_count;
  }
  return 0;
}

int optstate_store_read_field(optstate_store_t* store, const char* tensor, const char* field, uint64_t first,
                              uint64_t count, float* out, char** errptr) {
  const char* what = "optstate_store_read_field";
  return Guard(errptr, what, [&]() -> Status {
    if (tensor == nullptr) return NullArgument(what, "tensor");
    if (field == nullptr) return NullArgument(what, "field");
    if (out == nullptr && count > 0) return NullArgument(what, "out");
    vfs::Store* s = store->rep.get();
    auto view = s->OpenGeneration(vfs::kLatest);
    if (!view.ok()) return view.status();
    auto info = (*view)->FindTensor(tensor);
    if (!info.ok()) return info.status();
    const std::string where = std::string(what) + ": store " + s->path() + " tensor " + tensor;
    uint32_t f = 0;
    while (f < info->fields.size() && info->fields[f].name != field) ++f;
    if (f == info->fields.size()) {
      std::string names;
      for (const auto& spec : info->fields) names += (names.empty() ? "" : ", ") + spec.name;
      return NotFound(where + ": no field '" + field + "' (has " + names + ")");
    }
    const DType dtype = info->fields[f].dtype;
    const uint64_t numel = info->field_numel(f);
    if (first > numel || count > numel - first) {
      return InvalidArgument(where + " field " + field + ": range [" + std::to_string(first) + ", " +
                             std::to_string(first + count) + ") outside its " + std::to_string(numel) +
                             " elements");
    }
    if (count == 0) return Status::Ok();
    // q8 codes decode with the scales chunk of the same index (it covers the
    // same elements).
    int scales = -1;
    if (IsQ8(dtype)) {
      scales = info->FieldIndexOf(vfs::Q8ScalesField(info->fields[f].name));
      if (scales < 0) return optstate::Corruption(where + " field " + field + ": its scales field is missing");
    }
    const uint64_t chunk_bytes = s->chunk_size_bytes();
    const uint64_t stride = info->field_chunk_bytes(f, chunk_bytes);
    const uint64_t elem_bytes = DTypeSize(dtype);
    const uint64_t per_chunk = stride / elem_bytes;
    std::unique_ptr<void, decltype(&std::free)> buf(std::aligned_alloc(4096, chunk_bytes), &std::free);
    std::unique_ptr<void, decltype(&std::free)> sbuf(
        scales >= 0 ? std::aligned_alloc(4096, chunk_bytes) : nullptr, &std::free);
    if (buf == nullptr || (scales >= 0 && sbuf == nullptr)) {
      return optstate::ResourceExhausted(where + ": cannot allocate a chunk buffer");
    }
    const uint64_t end = first + count;
    for (uint64_t c = first / per_chunk; c * per_chunk < end; ++c) {
      vfs::ChunkRef ref{.tensor_id = info->id, .field = f, .index = c};
      OPTSTATE_RETURN_IF_ERROR((*view)->ReadChunk(ref, buf.get()));
      const uint64_t lo = std::max(first, c * per_chunk);
      const uint64_t hi = std::min(end, (c + 1) * per_chunk);
      if (dtype == DType::kF32) {
        std::memcpy(out + (lo - first), static_cast<const float*>(buf.get()) + (lo - c * per_chunk),
                    (hi - lo) * sizeof(float));
        continue;
      }
      if (scales >= 0) {
        // 8-bit codes: map[code] x the absmax of their block, as the step decodes them.
        vfs::ChunkRef sref{.tensor_id = info->id, .field = static_cast<uint32_t>(scales), .index = c};
        OPTSTATE_RETURN_IF_ERROR((*view)->ReadChunk(sref, sbuf.get()));
        const uint8_t* codes = static_cast<const uint8_t*>(buf.get());
        const float* absmax = static_cast<const float*>(sbuf.get());
        const bool is_signed = dtype == DType::kQ8S;
        for (uint64_t i = lo; i < hi; ++i) {
          const uint64_t in = i - c * per_chunk;
          out[i - first] = optstate::kernels::Q8MapValue(is_signed, codes[in]) *
                           absmax[in / optstate::kernels::kQ8BlockElems];
        }
        continue;
      }
      // 16-bit fields (bf16 moments, f16): decoded to fp32, exactly.
      for (uint64_t i = lo; i < hi; ++i) {
        out[i - first] = optstate::kernels::ElementAsFloat(dtype, buf.get(), i - c * per_chunk);
      }
    }
    return Status::Ok();
  });
}

int optstate_store_tensor_numel(const optstate_store_t* store, const char* tensor, uint64_t* numel,
                                char** errptr) {
  const char* what = "optstate_store_tensor_numel";
  return Guard(errptr, what, [&]() -> Status {
    if (tensor == nullptr) return NullArgument(what, "tensor");
    if (numel == nullptr) return NullArgument(what, "numel");
    auto info = store->rep->FindTensor(tensor);
    if (!info.ok()) return info.status();
    *numel = info->numel;
    return Status::Ok();
  });
}

int optstate_store_snapshot_create(optstate_store_t* store, const char* name, uint64_t* generation,
                                   char** errptr) {
  const char* what = "optstate_store_snapshot_create";
  return Guard(errptr, what, [&]() -> Status {
    if (name == nullptr) return NullArgument(what, "name");
    // The newest state includes the last step, whose commit may still run.
    if (Status st = optstate::capi::internal::WaitForCommits(store, what); !st.ok()) return st;
    auto snap = store->rep->CreateSnapshot(name);
    if (!snap.ok()) return snap.status();
    if (generation != nullptr) *generation = snap->generation;
    return Status::Ok();
  });
}

int optstate_store_snapshot_release(optstate_store_t* store, const char* name, char** errptr) {
  const char* what = "optstate_store_snapshot_release";
  return Guard(errptr, what, [&]() -> Status {
    if (name == nullptr) return NullArgument(what, "name");
    return store->rep->ReleaseSnapshot(name);
  });
}

int optstate_store_tensor_names(const optstate_store_t* store, char** names, size_t* size_bytes, char** errptr) {
  const char* what = "optstate_store_tensor_names";
  return Guard(errptr, what, [&]() -> Status {
    if (names == nullptr) return NullArgument(what, "names");
    if (size_bytes == nullptr) return NullArgument(what, "size_bytes");
    std::string all;
    for (const auto& t : store->rep->ListTensors()) {
      all += t.name;
      all.push_back('\0');
    }
    *names = nullptr;
    *size_bytes = all.size();
    if (all.empty()) return Status::Ok();
    *names = static_cast<char*>(std::malloc(all.size()));
    if (*names == nullptr) return Status(StatusCode::kResourceExhausted, "out of memory for tensor names");
    std::memcpy(*names, all.data(), all.size());
    return Status::Ok();
  });
}

int optstate_store_snapshot_list(const optstate_store_t* store, optstate_snapshot_list_t** out, char** errptr) {
  const char* what = "optstate_store_snapshot_list";
  return Guard(errptr, what, [&]() -> Status {
    if (out == nullptr) return NullArgument(what, "out");
    *out = new optstate_snapshot_list_t{store->rep->ListSnapshots()};
    return Status::Ok();
  });
}
size_t optstate_snapshot_list_count(const optstate_snapshot_list_t* list) { return list->rep.size(); }
const char* optstate_snapshot_list_name(const optstate_snapshot_list_t* list, size_t i) {
  return list->rep[i].name.c_str();
}
uint64_t optstate_snapshot_list_generation(const optstate_snapshot_list_t* list, size_t i) {
  return list->rep[i].generation;
}
void optstate_snapshot_list_destroy(optstate_snapshot_list_t* list) { delete list; }

int optstate_store_stats(const optstate_store_t* store, optstate_store_stats_t* out, char** errptr) {
  const char* what = "optstate_store_stats";
  return Guard(errptr, what, [&]() -> Status {
    if (out == nullptr) return NullArgument(what, "out");
    auto st = store->rep->Stats();
    if (!st.ok()) return st.status();
    out->latest_generation = st->latest_generation;
    out->live_bytes = st->live_bytes;
    out->referenced_extent_bytes = st->referenced_extent_bytes;
    out->pending_bytes = st->pending_bytes;
    out->lifetime_bytes_written = st->lifetime_bytes_written;
    out->generations_retained = st->generations_retained;
    out->snapshots = st->snapshots;
    out->leases = st->leases;
    return Status::Ok();
  });
}

}  // extern "C"
