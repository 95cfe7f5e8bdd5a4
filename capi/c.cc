// The C ABI (capi/include/optstate/c.h) over the public C++ headers. Each
// handle owns the C++ object it wraps; every entry point converts a Status
// into a code plus a malloc'ed message here and nowhere else, and no C++
// exception leaves this file.
#include "optstate/c.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/adam.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "vfs/checkpoint.h"
#include "vfs/reshard.h"
#include "base/status.h"
#include "vfs/store.h"

using optstate::DType;
using optstate::InvalidArgument;
using optstate::NotFound;
using optstate::ParseMomentDType;
using optstate::Result;
using optstate::Status;
using optstate::StatusCode;
namespace memmgr = optstate::memmgr;
namespace vfs = optstate::vfs;

struct optstate_store_options_t {
  vfs::StoreOptions rep;
};
struct optstate_store_t {
  std::unique_ptr<vfs::Store> rep;
};
struct optstate_snapshot_list_t {
  std::vector<vfs::SnapshotInfo> rep;
};
struct optstate_mm_options_t {
  memmgr::MemoryManagerOptions rep;
};
struct optstate_mm_t {
  std::unique_ptr<memmgr::MemoryManager> rep;
  // Pins not yet released through optstate_unpin; optstate_mm_destroy
  // releases them first (a PinnedRange must not outlive its manager).
  std::mutex pins_mu;
  std::set<optstate_pin_t*> pins;  // guarded by pins_mu
};
struct optstate_pin_t {
  memmgr::PinnedRange rep;
  optstate_mm_t* mm = nullptr;  // null once the manager was destroyed
  uint64_t count = 0;
  int dtype = OPTSTATE_NONE;
};
struct optstate_adam_options_t {
  memmgr::StreamedAdamOptions rep;
};
struct optstate_adam_t {
  std::unique_ptr<memmgr::StreamedAdam> rep;
  vfs::Store* store = nullptr;
  memmgr::MemoryManager* mm = nullptr;
  // Param ids are indices into names (registration order of this handle).
  std::vector<std::string> names;
  std::unordered_map<std::string, uint32_t> ids;
  // Reused by every step: no allocation per step once the names are copied.
  std::vector<memmgr::ParamGrad> grads;
};

namespace {

int SaveError(char** errptr, const Status& s) {
  if (s.ok()) return OPTSTATE_OK;
  if (errptr != nullptr) {
    std::free(*errptr);
    *errptr = strdup(s.ToString().c_str());
  }
  return static_cast<int>(s.code());
}

// Runs f (returning Status) with every exception turned into kInternal.
template <typename F>
int Guard(char** errptr, const char* what, F&& f) {
  try {
    return SaveError(errptr, f());
  } catch (const std::bad_alloc&) {
    return SaveError(errptr, Status(StatusCode::kResourceExhausted, std::string(what) + ": out of memory"));
  } catch (const std::exception& e) {
    return SaveError(errptr, optstate::Internal(std::string(what) + ": " + e.what()));
  } catch (...) {
    return SaveError(errptr, optstate::Internal(std::string(what) + ": unknown exception"));
  }
}

Status NullArgument(const char* what, const char* arg) {
  return InvalidArgument(std::string(what) + ": " + arg + " is NULL");
}

bool ValidFloatType(int t) {
  return t == OPTSTATE_F32 || t == OPTSTATE_BF16 || t == OPTSTATE_F16;
}

// The DType an optstate_dtype names (its values are DType's), or none for
// OPTSTATE_NONE and any other value.
std::optional<DType> FloatDTypeOrNone(int t) {
  if (!ValidFloatType(t)) return std::nullopt;
  return static_cast<DType>(t);
}

const char* DTypeArgName(int t) {
  switch (t) {
    case OPTSTATE_F32: return "f32";
    case OPTSTATE_BF16: return "bf16";
    case OPTSTATE_F16: return "f16";
    case OPTSTATE_NONE: return "none";
    default: return "unknown";
  }
}

Status ParamId(const optstate_adam_t* adam, uint32_t id, const char* what) {
  if (id >= adam->names.size()) {
    return NotFound(std::string(what) + ": no param with id " + std::to_string(id) + " (" +
                    std::to_string(adam->names.size()) + " registered on store " + adam->store->path() + ")");
  }
  return Status::Ok();
}

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
    *out = new optstate_store_t{std::move(*store)};
    return Status::Ok();
  });
}

}  // namespace

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

int optstate_store_create(const char* path, const optstate_store_options_t* opts, optstate_store_t** out,
                          char** errptr) {
  return OpenStore(true, path, opts, out, errptr);
}
int optstate_store_open(const char* path, const optstate_store_options_t* opts, optstate_store_t** out,
                        char** errptr) {
  return OpenStore(false, path, opts, out, errptr);
}
void optstate_store_close(optstate_store_t* store) { delete store; }

const char* optstate_store_path(const optstate_store_t* store) { return store->rep->path().c_str(); }
const char* optstate_store_name(const optstate_store_t* store) { return store->rep->identity().name.c_str(); }
const char* optstate_store_uuid(const optstate_store_t* store) { return store->rep->identity().uuid.c_str(); }
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
      const uint16_t* h = static_cast<const uint16_t*>(buf.get()) + (lo - c * per_chunk);
      for (uint64_t i = 0; i < hi - lo; ++i) {
        out[lo - first + i] = dtype == DType::kBF16 ? optstate::kernels::Bf16ToFloat(h[i])
                                                         : optstate::kernels::HalfToFloat(h[i]);
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

// ---- checkpoint directories ----

int optstate_checkpoint_export(optstate_store_t* store, const char* snapshot, const char* dest,
                               uint64_t* generation, char** errptr) {
  const char* what = "optstate_checkpoint_export";
  return Guard(errptr, what, [&]() -> Status {
    if (store == nullptr) return NullArgument(what, "store");
    if (dest == nullptr || *dest == '\0') return InvalidArgument(std::string(what) + ": empty destination path");
    vfs::ExportOptions opts;
    if (snapshot != nullptr) opts.snapshot = snapshot;
    auto r = vfs::ExportCheckpoint(store->rep.get(), dest, opts);
    if (!r.ok()) return r.status();
    if (generation != nullptr) *generation = r->generation;
    return Status::Ok();
  });
}

int optstate_checkpoint_restore(optstate_store_t* store, const char* src, uint64_t* generation, char** errptr) {
  const char* what = "optstate_checkpoint_restore";
  return Guard(errptr, what, [&]() -> Status {
    if (store == nullptr) return NullArgument(what, "store");
    if (src == nullptr || *src == '\0') return InvalidArgument(std::string(what) + ": empty checkpoint path");
    auto r = vfs::RestoreCheckpoint(store->rep.get(), src);
    if (!r.ok()) return r.status();
    if (generation != nullptr) *generation = *r;
    return Status::Ok();
  });
}

namespace {
Result<std::vector<std::string>> SourceList(const char* what, const char* const* sources, size_t n) {
  if (sources == nullptr && n > 0) return NullArgument(what, "sources");
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) {
    if (sources[i] == nullptr || *sources[i] == '\0') {
      return InvalidArgument(std::string(what) + ": source " + std::to_string(i) + " is an empty path");
    }
    out.emplace_back(sources[i]);
  }
  return out;
}
}  // namespace

int optstate_checkpoint_reshard(const char* const* sources, size_t num_sources, const char* layout_json,
                                const char* dest, uint32_t* ranks, char** errptr) {
  const char* what = "optstate_checkpoint_reshard";
  return Guard(errptr, what, [&]() -> Status {
    if (layout_json == nullptr) return NullArgument(what, "layout_json");
    if (dest == nullptr || *dest == '\0') return InvalidArgument(std::string(what) + ": empty destination path");
    auto srcs = SourceList(what, sources, num_sources);
    if (!srcs.ok()) return srcs.status();
    auto layout = vfs::ParseTargetLayout(layout_json, "(layout_json argument)");
    if (!layout.ok()) return layout.status();
    auto r = vfs::Reshard(*srcs, *layout, dest);
    if (!r.ok()) return r.status();
    if (ranks != nullptr) *ranks = r->ranks;
    return Status::Ok();
  });
}

int optstate_checkpoint_reshard_layout(const char* const* sources, size_t num_sources, uint32_t ranks,
                                       const char* split, char** layout_json, char** errptr) {
  const char* what = "optstate_checkpoint_reshard_layout";
  return Guard(errptr, what, [&]() -> Status {
    if (layout_json == nullptr) return NullArgument(what, "layout_json");
    if (ranks == 0) return InvalidArgument(std::string(what) + ": ranks must be >= 1");
    const std::string s = split == nullptr ? "rows" : split;
    std::vector<vfs::SplitRule> rules;
    for (size_t pos = 0; pos <= s.size();) {
      const size_t end = std::min(s.find_first_of(",\n", pos), s.size());
      const std::string text = s.substr(pos, end - pos);
      pos = end + 1;
      if (text.empty()) continue;
      auto rule = vfs::ParseSplitRule(text);
      if (!rule.ok()) return rule.status().WithContext(what);
      rules.push_back(std::move(*rule));
    }
    if (rules.empty()) return InvalidArgument(std::string(what) + ": split '" + s + "' holds no rule");
    auto srcs = SourceList(what, sources, num_sources);
    if (!srcs.ok()) return srcs.status();
    auto globals = vfs::GlobalTensorsOf(*srcs);
    if (!globals.ok()) return globals.status();
    auto layout = vfs::MakeRuleLayout(*globals, ranks, rules);
    if (!layout.ok()) return layout.status();
    const std::string json = vfs::SerializeTargetLayout(*layout);
    *layout_json = strdup(json.c_str());
    if (*layout_json == nullptr) return optstate::ResourceExhausted(std::string(what) + ": out of memory");
    return Status::Ok();
  });
}

// ---- memory manager ----

optstate_mm_options_t* optstate_mm_options_create(void) { return new (std::nothrow) optstate_mm_options_t; }
void optstate_mm_options_destroy(optstate_mm_options_t* opts) { delete opts; }
int optstate_mm_options_set_backend(optstate_mm_options_t* opts, const char* backend, char** errptr) {
  const char* what = "optstate_mm_options_set_backend";
  return Guard(errptr, what, [&]() -> Status {
    if (backend == nullptr) return NullArgument(what, "backend");
    auto b = memmgr::ParseBackend(backend);
    if (!b.ok()) return b.status();
    opts->rep.backend = *b;
    return Status::Ok();
  });
}
void optstate_mm_options_set_device_budget_bytes(optstate_mm_options_t* opts, uint64_t bytes) {
  opts->rep.device_budget_bytes = bytes;
}
static_assert(OPTSTATE_HOST_CACHE_AUTO == memmgr::MemoryManagerOptions::kAutoHostCache,
              "the C ABI's automatic host cache size is memmgr's");
void optstate_mm_options_set_host_cache_bytes(optstate_mm_options_t* opts, uint64_t bytes) {
  opts->rep.host_cache_bytes = bytes;
}
void optstate_mm_options_set_read_ahead_chunks(optstate_mm_options_t* opts, uint32_t n) {
  opts->rep.read_ahead_chunks = n;
}
void optstate_mm_options_set_cuda_device(optstate_mm_options_t* opts, int device) {
  opts->rep.cuda_device = device;
}

int optstate_mm_create(optstate_store_t* store, const optstate_mm_options_t* opts, optstate_mm_t** out,
                       char** errptr) {
  const char* what = "optstate_mm_create";
  return Guard(errptr, what, [&]() -> Status {
    if (out == nullptr) return NullArgument(what, "out");
    *out = nullptr;
    if (store == nullptr) return NullArgument(what, "store");
    auto mm = memmgr::MemoryManager::Create(store->rep.get(),
                                            opts == nullptr ? memmgr::MemoryManagerOptions{} : opts->rep);
    if (!mm.ok()) return mm.status();
    auto h = std::make_unique<optstate_mm_t>();
    h->rep = std::move(*mm);
    *out = h.release();
    return Status::Ok();
  });
}
void optstate_mm_destroy(optstate_mm_t* mm) {
  if (mm == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mm->pins_mu);
    for (optstate_pin_t* pin : mm->pins) {
      // Unpin errors are those of scheduling a write-back, which the
      // manager's destruction below drops anyway.
      (void)pin->rep.Unpin();
      pin->mm = nullptr;
    }
    mm->pins.clear();
  }
  delete mm;
}
const char* optstate_mm_backend(const optstate_mm_t* mm) { return memmgr::BackendName(mm->rep->backend()); }
int optstate_mm_release_all(optstate_mm_t* mm, char** errptr) {
  return Guard(errptr, "optstate_mm_release_all", [&] { return mm->rep->ReleaseAll(); });
}

int optstate_mm_flush(optstate_mm_t* mm, char** errptr) {
  return Guard(errptr, "optstate_mm_flush", [&] {
    Status s = mm->rep->Flush();
    return s.ok() ? s : s.WithContext("optstate_mm_flush: store " + mm->rep->store()->path());
  });
}

// ---- pinned ranges ----

int optstate_pin(optstate_mm_t* mm, const char* tensor, const char* field, uint64_t first, uint64_t count,
                 int access, optstate_pin_t** out, char** errptr) {
  const char* what = "optstate_pin";
  return Guard(errptr, what, [&]() -> Status {
    if (out == nullptr) return NullArgument(what, "out");
    *out = nullptr;
    if (mm == nullptr) return NullArgument(what, "mm");
    if (tensor == nullptr) return NullArgument(what, "tensor");
    if (field == nullptr) return NullArgument(what, "field");
    vfs::Store* store = mm->rep->store();
    const std::string where = std::string(what) + ": store " + store->path() + " tensor " + tensor + " field " +
                              field;
    memmgr::Access a;
    switch (access) {
      case OPTSTATE_ACCESS_READ: a = memmgr::Access::kRead; break;
      case OPTSTATE_ACCESS_WRITE: a = memmgr::Access::kWrite; break;
      case OPTSTATE_ACCESS_READ_WRITE: a = memmgr::Access::kReadWrite; break;
      default:
        return InvalidArgument(where + ": access " + std::to_string(access) +
                               " is none of OPTSTATE_ACCESS_READ (0), _WRITE (1), _READ_WRITE (2)");
    }
    auto info = store->FindTensor(tensor);
    if (!info.ok()) return info.status().WithContext(what);
    int dtype = OPTSTATE_NONE;
    for (const vfs::FieldSpec& f : info->fields) {
      if (f.name == field) dtype = static_cast<int>(f.dtype);
    }
    // An unknown field is reported by Pin itself, naming the fields there are.
    auto range = mm->rep->Pin(tensor, field, first, count, a);
    if (!range.ok()) return range.status().WithContext(where);
    auto pin = std::make_unique<optstate_pin_t>();
    pin->rep = std::move(*range);
    pin->mm = mm;
    pin->count = count;
    pin->dtype = dtype;
    std::lock_guard<std::mutex> lock(mm->pins_mu);
    mm->pins.insert(pin.get());
    *out = pin.release();
    return Status::Ok();
  });
}

void* optstate_pin_data(const optstate_pin_t* pin) { return pin->mm == nullptr ? nullptr : pin->rep.data(); }
uint64_t optstate_pin_count(const optstate_pin_t* pin) { return pin->count; }
uint64_t optstate_pin_size_bytes(const optstate_pin_t* pin) { return pin->rep.size_bytes(); }
int optstate_pin_dtype(const optstate_pin_t* pin) { return pin->dtype; }
void* optstate_pin_stream(const optstate_pin_t* pin) { return pin->mm == nullptr ? nullptr : pin->rep.stream(); }

int optstate_unpin(optstate_pin_t* pin, char** errptr) {
  if (pin == nullptr) return OPTSTATE_OK;
  std::unique_ptr<optstate_pin_t> owned(pin);
  return Guard(errptr, "optstate_unpin", [&]() -> Status {
    if (owned->mm == nullptr) return Status::Ok();  // released with its manager
    optstate_mm_t* mm = owned->mm;
    {
      std::lock_guard<std::mutex> lock(mm->pins_mu);
      mm->pins.erase(owned.get());
    }
    Status s = owned->rep.Unpin();
    return s.ok() ? s : s.WithContext("optstate_unpin: store " + mm->rep->store()->path());
  });
}

void optstate_mm_stats(const optstate_mm_t* mm, optstate_mm_stats_t* out) {
  memmgr::MemoryStats s = mm->rep->stats();
  out->resident_bytes = s.resident_bytes;
  out->peak_resident_bytes = s.peak_resident_bytes;
  out->budget_bytes = s.budget_bytes;
  out->nvme_read_bytes = s.nvme_read_bytes;
  out->nvme_write_bytes = s.nvme_write_bytes;
  out->cache_hit_bytes = s.cache_hit_bytes;
  out->cache_bytes = s.cache_bytes;
  out->h2d_bytes = s.h2d_bytes;
  out->d2h_bytes = s.d2h_bytes;
  out->io_stall_seconds = s.io_stall_seconds;
  out->pins = s.pins;
  out->evictions = s.evictions;
}

// ---- streamed Adam ----

optstate_adam_options_t* optstate_adam_options_create(void) { return new (std::nothrow) optstate_adam_options_t; }
void optstate_adam_options_destroy(optstate_adam_options_t* opts) { delete opts; }
void optstate_adam_options_set_grad_scale(optstate_adam_options_t* opts, float grad_scale) {
  opts->rep.grad_scale = grad_scale;
}
void optstate_adam_options_set_cpu_threads(optstate_adam_options_t* opts, int threads) {
  opts->rep.cpu_threads = threads;
}
void optstate_adam_options_set_durable_every_steps(optstate_adam_options_t* opts, uint32_t n) {
  opts->rep.durable_every_steps = n;
}
void optstate_adam_options_set_commit_lag_steps(optstate_adam_options_t* opts, uint32_t n) {
  opts->rep.commit_lag_steps = n;
}
uint32_t optstate_adam_options_commit_lag_steps(const optstate_adam_options_t* opts) {
  return opts->rep.commit_lag_steps;
}
int optstate_adam_options_set_moment_dtype(optstate_adam_options_t* opts, const char* dtype, char** errptr) {
  const char* what = "optstate_adam_options_set_moment_dtype";
  return Guard(errptr, what, [&]() -> Status {
    if (dtype == nullptr) return NullArgument(what, "dtype");
    OPTSTATE_ASSIGN_OR_RETURN(opts->rep.moment_dtype, ParseMomentDType(dtype));
    return Status::Ok();
  });
}

int optstate_adam_create(optstate_store_t* store, optstate_mm_t* mm, const optstate_adam_options_t* opts,
                         optstate_adam_t** out, char** errptr) {
  const char* what = "optstate_adam_create";
  return Guard(errptr, what, [&]() -> Status {
    if (out == nullptr) return NullArgument(what, "out");
    *out = nullptr;
    if (store == nullptr) return NullArgument(what, "store");
    if (mm == nullptr) return NullArgument(what, "mm");
    memmgr::StreamedAdamOptions ao = opts == nullptr ? memmgr::StreamedAdamOptions{} : opts->rep;
    auto adam = memmgr::StreamedAdam::Create(store->rep.get(), mm->rep.get(), ao);
    if (!adam.ok()) return adam.status();
    auto h = std::make_unique<optstate_adam_t>();
    h->rep = std::move(*adam);
    h->store = store->rep.get();
    h->mm = mm->rep.get();
    *out = h.release();
    return Status::Ok();
  });
}
void optstate_adam_destroy(optstate_adam_t* adam) { delete adam; }

int optstate_adam_set_group(optstate_adam_t* adam, uint32_t group, double lr, double beta1, double beta2,
                            double eps, double weight_decay, int adamw, char** errptr) {
  return Guard(errptr, "optstate_adam_set_group", [&] {
    memmgr::ParamGroup g;
    g.id = group;
    g.lr = lr;
    g.beta1 = beta1;
    g.beta2 = beta2;
    g.eps = eps;
    g.weight_decay = weight_decay;
    g.adamw = adamw != 0;
    return adam->rep->SetGroup(g);
  });
}

int optstate_adam_get_group(const optstate_adam_t* adam, uint32_t group, double* lr, double* beta1,
                            double* beta2, double* eps, double* weight_decay, int* adamw, char** errptr) {
  return Guard(errptr, "optstate_adam_get_group", [&]() -> Status {
    auto g = adam->rep->GetGroup(group);
    if (!g.ok()) return g.status();
    if (lr != nullptr) *lr = g->lr;
    if (beta1 != nullptr) *beta1 = g->beta1;
    if (beta2 != nullptr) *beta2 = g->beta2;
    if (eps != nullptr) *eps = g->eps;
    if (weight_decay != nullptr) *weight_decay = g->weight_decay;
    if (adamw != nullptr) *adamw = g->adamw ? 1 : 0;
    return Status::Ok();
  });
}

int optstate_adam_register_param(optstate_adam_t* adam, const char* name, uint64_t numel, uint32_t group,
                                 const void* initial, int initial_dtype, const uint64_t* shape, size_t ndim,
                                 uint32_t* id, int* existed, char** errptr) {
  return optstate_adam_register_shard(adam, name, numel, group, initial, initial_dtype, shape, ndim, nullptr, 0,
                                      nullptr, 0, id, existed, errptr);
}

int optstate_adam_register_shard(optstate_adam_t* adam, const char* name, uint64_t numel, uint32_t group,
                                 const void* initial, int initial_dtype, const uint64_t* shape, size_t ndim,
                                 const uint64_t* global_shape, size_t global_ndim, const uint64_t* shard_offset,
                                 size_t offset_ndim, uint32_t* id, int* existed, char** errptr) {
  const char* what = global_ndim > 0 ? "optstate_adam_register_shard" : "optstate_adam_register_param";
  return Guard(errptr, what, [&]() -> Status {
    if (name == nullptr) return NullArgument(what, "name");
    if (id == nullptr) return NullArgument(what, "id");
    const std::string n(name);
    const std::string where = std::string(what) + " " + n + " (store " + adam->store->path() + ")";
    if (initial != nullptr && !ValidFloatType(initial_dtype)) {
      return InvalidArgument(where + ": initial values dtype " + DTypeArgName(initial_dtype) +
                             " not supported (f32, bf16, f16)");
    }
    memmgr::ShardInfo shard;
    if (ndim > 0) {
      if (shape == nullptr) return NullArgument(what, "shape");
      uint64_t product = 1;
      for (size_t i = 0; i < ndim; ++i) product *= shape[i];
      if (product != numel) {
        return InvalidArgument(where + ": shape has " + std::to_string(product) + " elements, numel is " +
                               std::to_string(numel));
      }
      shard.shape.assign(shape, shape + ndim);
    }
    if (global_ndim > 0) {
      if (global_shape == nullptr) return NullArgument(what, "global_shape");
      if (offset_ndim > 0 && shard_offset == nullptr) return NullArgument(what, "shard_offset");
      shard.global_shape.assign(global_shape, global_shape + global_ndim);
      if (offset_ndim > 0) shard.shard_offset.assign(shard_offset, shard_offset + offset_ndim);
      const std::vector<uint64_t> local = shard.shape.empty() ? std::vector<uint64_t>{numel} : shard.shape;
      const bool flat = local.size() == 1 && offset_ndim == 1 && global_ndim > 1;
      if (!flat && offset_ndim != 0 && (offset_ndim != global_ndim || local.size() != global_ndim)) {
        return InvalidArgument(where + ": shape, global_shape and shard_offset have ranks " +
                               std::to_string(local.size()) + ", " + std::to_string(global_ndim) + " and " +
                               std::to_string(offset_ndim) +
                               " (a box: all the same; a flat range: shape and shard_offset 1)");
      }
      unsigned __int128 global_numel = 1;
      for (uint64_t d : shard.global_shape) global_numel *= d;
      bool inside = true;
      if (flat) {
        inside = static_cast<unsigned __int128>(shard.shard_offset[0]) + numel <= global_numel;
      } else if (local.size() == global_ndim) {
        for (size_t d = 0; d < global_ndim; ++d) {
          const uint64_t off = shard.shard_offset.empty() ? 0 : shard.shard_offset[d];
          inside = inside && off <= global_shape[d] && local[d] <= global_shape[d] - off;
        }
      } else {
        inside = false;
      }
      if (!inside) {
        std::string g, o, l;
        for (uint64_t d : shard.global_shape) g += (g.empty() ? "" : ", ") + std::to_string(d);
        for (uint64_t d : shard.shard_offset) o += (o.empty() ? "" : ", ") + std::to_string(d);
        for (uint64_t d : local) l += (l.empty() ? "" : ", ") + std::to_string(d);
        return InvalidArgument(where + ": the shard of shape [" + l + "] at offset [" + o +
                               "] is not inside the global shape [" + g + "]");
      }
    }
    const bool had = adam->rep->HasParam(n);
    OPTSTATE_RETURN_IF_ERROR(adam->rep->RegisterParam(n, numel, group, initial,
                                                      FloatDTypeOrNone(initial_dtype), shard));
    auto it = adam->ids.find(n);
    if (it == adam->ids.end()) {
      it = adam->ids.emplace(n, static_cast<uint32_t>(adam->names.size())).first;
      adam->names.push_back(n);
    }
    *id = it->second;
    if (existed != nullptr) *existed = had ? 1 : 0;
    return Status::Ok();
  });
}

int optstate_adam_param_numel(const optstate_adam_t* adam, uint32_t id, uint64_t* numel, char** errptr) {
  const char* what = "optstate_adam_param_numel";
  return Guard(errptr, what, [&]() -> Status {
    if (numel == nullptr) return NullArgument(what, "numel");
    OPTSTATE_RETURN_IF_ERROR(ParamId(adam, id, what));
    auto info = adam->store->FindTensor(adam->names[id]);
    if (!info.ok()) return info.status();
    *numel = info->numel;
    return Status::Ok();
  });
}

}  // extern "C"

namespace {

// Both step entry points: builds the ParamGrad list (reused between steps),
// checks what the C side can, and runs one StreamedAdam::Step.
Status AdamStep(const char* what, optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                const int* grad_dtypes, const uint64_t* numels, void* const* params, const int* param_dtypes,
                const float* found_inf, float grad_scale, const float* d_grad_scale) {
  if (n > 0 && (ids == nullptr || grads == nullptr || grad_dtypes == nullptr)) {
    return NullArgument(what, "ids, grads or grad_dtypes");
  }
  if (params != nullptr && param_dtypes == nullptr) return NullArgument(what, "param_dtypes");
  if (!(grad_scale >= 0.0f) || !std::isfinite(grad_scale)) {
    return InvalidArgument(std::string(what) + ": store " + adam->store->path() + ": grad_scale " +
                           std::to_string(grad_scale) + " is not a finite number >= 0");
  }
  auto& pg = adam->grads;
  pg.resize(n);
  for (size_t i = 0; i < n; ++i) {
    OPTSTATE_RETURN_IF_ERROR(ParamId(adam, ids[i], what));
    memmgr::ParamGrad& g = pg[i];
    g.name = adam->names[ids[i]];
    g.d_grad = grads[i];
    g.grad_type = static_cast<DType>(grad_dtypes[i]);
    g.d_param = params == nullptr ? nullptr : params[i];
    if (params != nullptr && param_dtypes[i] != OPTSTATE_NONE) g.param_type = static_cast<DType>(param_dtypes[i]);
    // StreamedAdam checks it against the registered numel before any kernel runs.
    g.numel = numels == nullptr ? 0 : numels[i];
    if (numels != nullptr && numels[i] == 0) {
      return InvalidArgument(std::string(what) + ": param " + g.name + " (store " + adam->store->path() +
                             "): numels[" + std::to_string(i) + "] is 0; a gradient has the param's elements");
    }
    if (!ValidFloatType(grad_dtypes[i])) {
      return InvalidArgument(std::string(what) + ": param " + g.name + ": gradient dtype " +
                             DTypeArgName(grad_dtypes[i]) + " not supported (f32, bf16, f16)");
    }
    if (g.d_param != nullptr && !ValidFloatType(param_dtypes[i])) {
      return InvalidArgument(std::string(what) + ": param " + g.name + ": param dtype " +
                             DTypeArgName(param_dtypes[i]) + " not supported (f32, bf16, f16)");
    }
  }
  if (grad_scale > 0.0f) OPTSTATE_RETURN_IF_ERROR(adam->rep->SetGradScale(grad_scale));
  return adam->rep->Step(std::span<const memmgr::ParamGrad>(pg.data(), n), found_inf, d_grad_scale);
}

}  // namespace

extern "C" {

int optstate_adam_step(optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                       const int* grad_dtypes, void* const* params, const int* param_dtypes,
                       const float* found_inf, float grad_scale, char** errptr) {
  const char* what = "optstate_adam_step";
  return Guard(errptr, what, [&] {
    return AdamStep(what, adam, n, ids, grads, grad_dtypes, nullptr, params, param_dtypes, found_inf, grad_scale,
                    nullptr);
  });
}

int optstate_adam_step2(optstate_adam_t* adam, size_t n, const uint32_t* ids, const void* const* grads,
                        const int* grad_dtypes, const uint64_t* numels, void* const* params,
                        const int* param_dtypes, const float* found_inf, const float* grad_scale,
                        char** errptr) {
  const char* what = "optstate_adam_step2";
  return Guard(errptr, what, [&] {
    return AdamStep(what, adam, n, ids, grads, grad_dtypes, numels, params, param_dtypes, found_inf, 0.0f,
                    grad_scale);
  });
}

int optstate_adam_retire_param(optstate_adam_t* adam, const char* name, char** errptr) {
  const char* what = "optstate_adam_retire_param";
  return Guard(errptr, what, [&]() -> Status {
    if (name == nullptr) return NullArgument(what, "name");
    return adam->rep->RetireParam(name);  // its messages name the store and the param
  });
}

int optstate_adam_last_step_skipped(const optstate_adam_t* adam) { return adam->rep->last_step_skipped() ? 1 : 0; }
double optstate_adam_last_step_seconds(const optstate_adam_t* adam) { return adam->rep->last_step_stats().seconds; }

int optstate_adam_prefetch(optstate_adam_t* adam, char** errptr) {
  return Guard(errptr, "optstate_adam_prefetch", [&]() -> Status { return adam->rep->Prefetch(); });
}

void optstate_adam_last_step_prefetch(const optstate_adam_t* adam, uint64_t* hit_bytes, uint64_t* read_bytes) {
  const memmgr::StreamedAdam::StepStats& st = adam->rep->last_step_stats();
  if (hit_bytes != nullptr) *hit_bytes = st.prefetch_hit_bytes;
  if (read_bytes != nullptr) *read_bytes = st.prefetch_read_bytes;
}

int optstate_adam_load_main(optstate_adam_t* adam, uint32_t id, const void* weights, int dtype, char** errptr) {
  const char* what = "optstate_adam_load_main";
  return Guard(errptr, what, [&]() -> Status {
    OPTSTATE_RETURN_IF_ERROR(ParamId(adam, id, what));
    if (!ValidFloatType(dtype)) {
      return InvalidArgument(std::string(what) + ": param " + adam->names[id] + ": dtype " + DTypeArgName(dtype) +
                             " not supported (f32, bf16, f16)");
    }
    return adam->rep->LoadMainFrom(adam->names[id], weights, static_cast<DType>(dtype));
  });
}

int optstate_adam_make_durable(optstate_adam_t* adam, uint64_t* generation, char** errptr) {
  return Guard(errptr, "optstate_adam_make_durable", [&]() -> Status {
    auto g = adam->rep->MakeDurable();
    if (!g.ok()) return g.status();
    if (generation != nullptr) *generation = *g;
    return Status::Ok();
  });
}

int optstate_adam_commit(optstate_adam_t* adam, uint64_t* generation, char** errptr) {
  const char* what = "optstate_adam_commit";
  return Guard(errptr, what, [&]() -> Status {
    memmgr::StreamedAdam* a = adam->rep.get();
    OPTSTATE_RETURN_IF_ERROR(a->WaitForCommit());  // a step's commit in flight is not "pending" here
    const uint64_t before = a->last_generation();
    // Cached steps, registrations and loaded mains: MakeDurable flushes the
    // manager and publishes pinned writes with them.
    auto g = a->MakeDurable();
    if (!g.ok()) return g.status();
    if (*g == before) {
      OPTSTATE_RETURN_IF_ERROR(adam->mm->Flush());
      auto st = adam->store->Stats();
      if (!st.ok()) return st.status();
      if (st->pending_bytes > 0) {
        // Pinned writes alone: a step over no params flushes and commits them
        // through the optimizer (its generation and counts stay current) with
        // the step counts unchanged; it records the last commit's trainer step.
        const uint64_t step = a->global_step();
        a->set_global_step(step > 0 ? step - 1 : 0);
        Status s = a->Step(std::span<const memmgr::ParamGrad>());
        a->set_global_step(step);
        OPTSTATE_RETURN_IF_ERROR(s);
        // With durable_every_steps > 1 that step may live in the host cache only.
        if (a->last_generation() == before) {
          g = a->MakeDurable();
          if (!g.ok()) return g.status();
        }
      }
    }
    if (generation != nullptr) *generation = a->last_generation();
    return Status::Ok();
  });
}

uint64_t optstate_adam_step_count(const optstate_adam_t* adam, uint32_t group) {
  return adam->rep->step_count(group);
}
uint64_t optstate_adam_last_generation(const optstate_adam_t* adam) { return adam->rep->last_generation(); }
uint64_t optstate_adam_global_step(const optstate_adam_t* adam) { return adam->rep->global_step(); }
void optstate_adam_set_global_step(optstate_adam_t* adam, uint64_t step) { adam->rep->set_global_step(step); }
uint64_t optstate_adam_uncommitted_steps(const optstate_adam_t* adam) { return adam->rep->uncommitted_steps(); }

}  // extern "C"
