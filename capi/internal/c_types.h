// What the files of the C ABI (capi/c_*.cc) share: the definitions of the
// opaque handles of optstate/c.h and the error plumbing every entry point
// goes through. Internal to capi.
//
// Contract of every entry point that can fail (see optstate/c.h, "Errors"):
// its body runs inside Guard(errptr, "<entry point name>", ...), which returns
// OPTSTATE_OK and leaves *errptr alone on success; on failure it frees a
// message already in *errptr, stores a malloc'ed one (the caller frees it with
// optstate_free) and returns the StatusCode as an int. errptr may be NULL.
// SaveError is the one place a Status becomes a code plus a message, and no
// C++ exception leaves an entry point: Guard turns std::bad_alloc into
// kResourceExhausted and any other exception into kInternal, each message
// prefixed with the entry point's name.
//
// Ownership: each handle owns the C++ object it wraps (rep); the destroy or
// close call of optstate/c.h deletes the handle and so that object.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "optstate/c.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "base/mutex.h"
#include "base/status.h"
#include "base/thread_annotations.h"
#include "vfs/store.h"

struct optstate_store_options_t {
  optstate::vfs::StoreOptions rep;
};
struct optstate_mm_t;
struct optstate_adam_t;
struct optstate_store_t {
  std::unique_ptr<optstate::vfs::Store> rep;
  // The managers and optimizers open on this store (registered by their
  // create calls, removed by their destroy calls): a restore refuses while
  // any is open, and calls that name the newest state (export, snapshot) wait
  // for the optimizers' in-flight commits first.
  // optstate_store_close with any of them open only sets close_requested:
  // the store is deleted when the last of them is destroyed (a garbage
  // collector may finalise the handles in any order).
  optstate::Mutex open_mu;
  std::set<optstate_mm_t*> open_mms GUARDED_BY(open_mu);
  std::set<optstate_adam_t*> open_adams GUARDED_BY(open_mu);
  int adams_destroying GUARDED_BY(open_mu) = 0;  // out of open_adams, not yet deleted
  bool close_requested GUARDED_BY(open_mu) = false;
  // Whether a manager or an optimizer is still open on it.
  bool HasOpenHandles() const REQUIRES(open_mu) {
    return !open_mms.empty() || !open_adams.empty() || adams_destroying > 0;
  }
};
struct optstate_snapshot_list_t {
  std::vector<optstate::vfs::SnapshotInfo> rep;
};
struct optstate_mm_options_t {
  optstate::memmgr::MemoryManagerOptions rep;
};
struct optstate_mm_t {
  std::unique_ptr<optstate::memmgr::MemoryManager> rep;
  optstate_store_t* store = nullptr;  // the handle it was created on (open_mms)
  // optstate_mm_destroy while an optimizer made with it is open only sets
  // this: the manager is destroyed with the last such optimizer.
  bool destroy_requested GUARDED_BY(store->open_mu) = false;
  int adams GUARDED_BY(store->open_mu) = 0;  // optimizer handles made with it, not yet deleted
  // Pins not yet released through optstate_unpin; optstate_mm_destroy
  // releases them first (a PinnedRange must not outlive its manager).
  optstate::Mutex pins_mu;
  std::set<optstate_pin_t*> pins GUARDED_BY(pins_mu);
};
struct optstate_pin_t {
  optstate::memmgr::PinnedRange rep;
  optstate_mm_t* mm = nullptr;  // null once the manager was destroyed
  uint64_t count = 0;
  int dtype = OPTSTATE_NONE;
};
struct optstate_adam_options_t {
  optstate::memmgr::StreamedAdamOptions rep;
  std::string rule = "adamw";  // optstate_adam_options_set_rule
  // optstate_adam_options_add_rule, in order (the rule indices); when any,
  // they replace `rule`. nullopt: rep.moment_dtype.
  std::vector<std::pair<std::string, std::optional<optstate::MomentDType>>> rules;
};
struct optstate_adam_t {
  std::unique_ptr<optstate::memmgr::StreamedAdam> rep;
  optstate::vfs::Store* store = nullptr;
  optstate_mm_t* mm_handle = nullptr;  // the manager handle it was created with (its store's open_adams)
  optstate::memmgr::MemoryManager* mm = nullptr;
  // The update rules' fields, each once, "main" first (optstate_adam_fields).
  std::vector<std::string> fields;
  // The rules' names by index ("adamw", "muon", ...).
  std::vector<std::string> rule_names;
  // The same as the rules name themselves in messages ("AdamW", "Lion").
  std::vector<std::string> rule_titles;
  // Param ids are indices into names (registration order of this handle).
  std::vector<std::string> names;
  std::unordered_map<std::string, uint32_t> ids;
  // Reused by every step: no allocation per step once the names are copied.
  std::vector<optstate::memmgr::ParamGrad> grads;
};

namespace optstate::capi::internal {

// OPTSTATE_OK for an ok s; else s's code, with s.ToString() malloc'ed into
// *errptr (a message already there freed first) unless errptr is NULL.
int SaveError(char** errptr, const Status& s);

// Runs f (returning Status); an exception becomes a Status as the contract
// above says (std::bad_alloc kResourceExhausted, any other kInternal).
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

// kInvalidArgument "<what>: <arg> is NULL".
Status NullArgument(const char* what, const char* arg);

// Destroys a manager handle now (its pins released, its store closed when
// that close was requested and this was the last handle open on it).
// REQUIRES: no optimizer made with it is open; open_mu not held.
void DestroyManager(optstate_mm_t* mm);
// Deletes the store when its close was requested and no manager or
// optimizer is open on it any more. REQUIRES: open_mu not held.
void CloseStoreIfRequested(optstate_store_t* store);

// Waits for the in-flight commit of every optimizer open on store, so that
// "the newest committed generation" includes the last step. Its error if a
// commit failed.
Status WaitForCommits(optstate_store_t* store, const char* what);

}  // namespace optstate::capi::internal
