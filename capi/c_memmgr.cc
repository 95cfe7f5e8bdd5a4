// The C ABI's memory manager and pinned ranges (optstate/c.h "memory
// manager" and "pinned ranges") over memmgr/memory_manager.h. A manager handle
// tracks the pins made through it so that optstate_mm_destroy can release them.
#include "optstate/c.h"

#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "capi/internal/c_types.h"
#include "memmgr/memory_manager.h"
#include "base/status.h"
#include "vfs/store.h"

using optstate::InvalidArgument;
using optstate::Status;
using optstate::capi::internal::Guard;
using optstate::capi::internal::NullArgument;
namespace memmgr = optstate::memmgr;
namespace vfs = optstate::vfs;

namespace optstate::capi::internal {

void DestroyManager(optstate_mm_t* mm) {
  {
    optstate::MutexLock lock(&mm->pins_mu);
    for (optstate_pin_t* pin : mm->pins) {
      // Unpin errors are those of scheduling a write-back, which the
      // manager's destruction below drops anyway.
      (void)pin->rep.Unpin();
      pin->mm = nullptr;
    }
    mm->pins.clear();
  }
  optstate_store_t* store = mm->store;
  {
    optstate::MutexLock lock(&store->open_mu);
    store->open_mms.erase(mm);
  }
  delete mm;
  CloseStoreIfRequested(store);
}

}  // namespace optstate::capi::internal

extern "C" {

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
    h->store = store;
    {
      optstate::MutexLock lock(&store->open_mu);
      store->open_mms.insert(h.get());
    }
    *out = h.release();
    return Status::Ok();
  });
}
void optstate_mm_destroy(optstate_mm_t* mm) {
  if (mm == nullptr) return;
  {
    optstate::MutexLock lock(&mm->store->open_mu);
    if (mm->adams > 0) {
      mm->destroy_requested = true;  // optstate_adam_destroy of the last one finishes it
      return;
    }
  }
  optstate::capi::internal::DestroyManager(mm);
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
    optstate::MutexLock lock(&mm->pins_mu);
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
      optstate::MutexLock lock(&mm->pins_mu);
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

}  // extern "C"
