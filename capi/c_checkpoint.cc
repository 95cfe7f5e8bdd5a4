// The C ABI's checkpoint directories (optstate/c.h "checkpoint directories"):
// export, restore and reshard over vfs/checkpoint.h and vfs/reshard.h.
#include "optstate/c.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "capi/internal/c_types.h"
#include "base/status.h"
#include "vfs/checkpoint.h"
#include "vfs/reshard.h"

using optstate::InvalidArgument;
using optstate::Result;
using optstate::Status;
using optstate::capi::internal::Guard;
using optstate::capi::internal::NullArgument;
using optstate::capi::internal::WaitForCommits;
namespace vfs = optstate::vfs;

namespace {
// The fields optstate_checkpoint_export_args_t had when it was added (ABI
// version 5): what struct_size must at least cover.
constexpr size_t kExportArgsV5Bytes = offsetof(optstate_checkpoint_export_args_t, flags) + sizeof(uint64_t);
// optstate_checkpoint_reshard_args_t's fields of ABI version 6.
constexpr size_t kReshardArgsV6Bytes = offsetof(optstate_checkpoint_reshard_args_t, flags) + sizeof(uint64_t);

// *out = the caller's args struct (NULL: all zero, the defaults); fields
// appended after the caller's version read as zero. INVALID_ARGUMENT when
// its struct_size does not cover the first version's min_bytes.
template <typename Args>
Status ReadArgs(const Args* args, size_t min_bytes, const char* what, const char* type, Args* out) {
  *out = Args{};
  if (args == nullptr) return Status::Ok();
  if (args->struct_size < min_bytes) {
    return InvalidArgument(std::string(what) + ": args->struct_size " + std::to_string(args->struct_size) +
                           " is less than the " + std::to_string(min_bytes) + " bytes of " + type +
                           " (set it to sizeof(" + type + "))");
  }
  std::memcpy(out, args, std::min(args->struct_size, sizeof *out));
  return Status::Ok();
}

// The export calls; `what` names the one the caller made in its errors.
int Export(optstate_store_t* store, const char* dest, const optstate_checkpoint_export_args_t* args,
           vfs::ExportResult* result, char** errptr, const char* what);
}  // namespace

extern "C" {

// ---- checkpoint directories ----

int optstate_checkpoint_export(optstate_store_t* store, const char* snapshot, const char* dest,
                               uint64_t* generation, char** errptr) {
  optstate_checkpoint_export_args_t args{};
  args.struct_size = sizeof args;
  args.snapshot = snapshot;
  vfs::ExportResult r;
  const int rc = Export(store, dest, &args, &r, errptr, "optstate_checkpoint_export");
  if (rc == OPTSTATE_OK && generation != nullptr) *generation = r.generation;
  return rc;
}

int optstate_checkpoint_export_with(optstate_store_t* store, const char* dest,
                                    const optstate_checkpoint_export_args_t* args, uint64_t* generation,
                                    char** errptr) {
  vfs::ExportResult r;
  const int rc = Export(store, dest, args, &r, errptr, "optstate_checkpoint_export_with");
  if (rc == OPTSTATE_OK && generation != nullptr) *generation = r.generation;
  return rc;
}

int optstate_checkpoint_export2(optstate_store_t* store, const char* dest,
                                const optstate_checkpoint_export_args_t* args,
                                optstate_checkpoint_export_result_t* result, char** errptr) {
  const char* what = "optstate_checkpoint_export2";
  if (result != nullptr && result->struct_size < sizeof(size_t)) {
    return Guard(errptr, what, [&]() -> Status {
      return InvalidArgument(std::string(what) + ": result->struct_size " + std::to_string(result->struct_size) +
                             " is too small (set it to sizeof(optstate_checkpoint_export_result_t))");
    });
  }
  vfs::ExportResult r;
  const int rc = Export(store, dest, args, &r, errptr, what);
  if (rc != OPTSTATE_OK || result == nullptr) return rc;
  // Only the fields the caller's struct has.
  optstate_checkpoint_export_result_t out{};
  out.struct_size = std::min(result->struct_size, sizeof out);
  out.generation = r.generation;
  out.files = r.files;
  out.bytes = r.bytes;
  out.ram_chunks = r.source_chunks;
  out.ram_bytes = r.source_bytes;
  out.disk_chunks = r.disk_chunks;
  out.disk_bytes = r.disk_bytes;
  out.ram_mismatch_chunks = r.source_mismatches;
  std::memcpy(result, &out, out.struct_size);
  return rc;
}

}  // extern "C"

namespace {
int Export(optstate_store_t* store, const char* dest, const optstate_checkpoint_export_args_t* args,
           vfs::ExportResult* result, char** errptr, const char* what) {
  return Guard(errptr, what, [&]() -> Status {
    if (store == nullptr) return NullArgument(what, "store");
    if (dest == nullptr || *dest == '\0') return InvalidArgument(std::string(what) + ": empty destination path");
    optstate_checkpoint_export_args_t a;
    OPTSTATE_RETURN_IF_ERROR(ReadArgs(args, kExportArgsV5Bytes, what, "optstate_checkpoint_export_args_t", &a));
    if ((a.flags & ~uint64_t{OPTSTATE_EXPORT_NO_SAFETENSORS}) != 0) {
      return InvalidArgument(std::string(what) + ": unknown flags " + std::to_string(a.flags));
    }
    vfs::ExportOptions opts;
    opts.safetensors = (a.flags & OPTSTATE_EXPORT_NO_SAFETENSORS) == 0;
    if (a.snapshot != nullptr) {
      opts.snapshot = a.snapshot;
    } else {
      // The newest state includes the last step, whose commit may still run.
      if (Status st = WaitForCommits(store, what); !st.ok()) return st;
    }
    if (a.optimizer != nullptr && a.optimizer->store != store->rep.get()) {
      return InvalidArgument(std::string(what) + ": args->optimizer is open on store " +
                             (a.optimizer->store != nullptr ? a.optimizer->store->path() : std::string("(none)")) +
                             ", not on " + store->rep->path());
    }
    auto r = a.optimizer != nullptr && a.optimizer->mm != nullptr
                 ? a.optimizer->mm->ExportCheckpoint(dest, opts)
                 : vfs::ExportCheckpoint(store->rep.get(), dest, opts);
    if (!r.ok()) return r.status();
    *result = *r;
    return Status::Ok();
  });
}
}  // namespace

extern "C" {

namespace {
// Their caches and step counts would be stale: the next step would mix the
// restored moments with the counts they hold.
Status NoneOpen(optstate_store_t* store, const char* what, const char* change) {
  optstate::MutexLock lock(&store->open_mu);
  if (!store->open_mms.empty() || !store->open_adams.empty()) {
    return optstate::FailedPrecondition(
        std::string(what) + ": store " + store->rep->path() + " has " + std::to_string(store->open_adams.size()) +
        " optimizer(s) and " + std::to_string(store->open_mms.size()) + " memory manager(s) open: destroy them before the " +
        change + " (an optimizer created again resumes from the new head)");
  }
  return Status::Ok();
}
}  // namespace

int optstate_store_revert(optstate_store_t* store, const char* snapshot, uint64_t* generation, char** kept_snapshot,
                          char** errptr) {
  const char* what = "optstate_store_revert";
  if (kept_snapshot != nullptr) *kept_snapshot = nullptr;
  return Guard(errptr, what, [&]() -> Status {
    if (store == nullptr) return NullArgument(what, "store");
    if (snapshot == nullptr || *snapshot == '\0') return InvalidArgument(std::string(what) + ": empty snapshot name");
    OPTSTATE_RETURN_IF_ERROR(NoneOpen(store, what, "revert"));
    auto r = store->rep->RevertToSnapshot(snapshot);
    if (!r.ok()) return r.status();
    if (generation != nullptr) *generation = r->generation;
    if (kept_snapshot != nullptr && !r->kept_snapshot.empty()) {
      *kept_snapshot = strdup(r->kept_snapshot.c_str());
      if (*kept_snapshot == nullptr) return optstate::ResourceExhausted(std::string(what) + ": out of memory");
    }
    return Status::Ok();
  });
}

int optstate_checkpoint_restore(optstate_store_t* store, const char* src, uint64_t* generation, char** errptr) {
  return optstate_checkpoint_restore2(store, src, 0, generation, nullptr, errptr);
}

int optstate_checkpoint_restore2(optstate_store_t* store, const char* src, uint32_t flags, uint64_t* generation,
                                 char** kept_snapshot, char** errptr) {
  const char* what = "optstate_checkpoint_restore";
  if (kept_snapshot != nullptr) *kept_snapshot = nullptr;
  return Guard(errptr, what, [&]() -> Status {
    if (store == nullptr) return NullArgument(what, "store");
    if (src == nullptr || *src == '\0') return InvalidArgument(std::string(what) + ": empty checkpoint path");
    if ((flags & ~uint32_t{OPTSTATE_RESTORE_FORCE}) != 0) {
      return InvalidArgument(std::string(what) + ": unknown flags " + std::to_string(flags));
    }
    {
      // Their caches and step counts would be stale: the next step would mix
      // the restored moments with the counts they hold.
      optstate::MutexLock lock(&store->open_mu);
      if (!store->open_mms.empty() || !store->open_adams.empty()) {
        return optstate::FailedPrecondition(
            std::string(what) + ": store " + store->rep->path() + " has " + std::to_string(store->open_adams.size()) +
            " optimizer(s) and " + std::to_string(store->open_mms.size()) +
            " memory manager(s) open: destroy them before the restore (an optimizer created again resumes from "
            "the restored generation)");
      }
    }
    vfs::RestoreOptions opts;
    opts.force = (flags & OPTSTATE_RESTORE_FORCE) != 0;
    auto r = vfs::RestoreCheckpointInto(store->rep.get(), src, opts);
    if (!r.ok()) return r.status();
    if (generation != nullptr) *generation = r->generation;
    if (kept_snapshot != nullptr && !r->kept_snapshot.empty()) {
      *kept_snapshot = strdup(r->kept_snapshot.c_str());
      if (*kept_snapshot == nullptr) return optstate::ResourceExhausted(std::string(what) + ": out of memory");
    }
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

// Both reshard calls; `what` names the one the caller made in its errors.
int Reshard(const char* const* sources, size_t num_sources, const char* layout_json, const char* dest,
            const optstate_checkpoint_reshard_args_t* args, uint32_t* ranks, char** errptr, const char* what) {
  return Guard(errptr, what, [&]() -> Status {
    if (layout_json == nullptr) return NullArgument(what, "layout_json");
    if (dest == nullptr || *dest == '\0') return InvalidArgument(std::string(what) + ": empty destination path");
    optstate_checkpoint_reshard_args_t a;
    OPTSTATE_RETURN_IF_ERROR(ReadArgs(args, kReshardArgsV6Bytes, what, "optstate_checkpoint_reshard_args_t", &a));
    if ((a.flags & ~uint64_t{OPTSTATE_RESHARD_NO_SAFETENSORS}) != 0) {
      return InvalidArgument(std::string(what) + ": unknown flags " + std::to_string(a.flags));
    }
    auto srcs = SourceList(what, sources, num_sources);
    if (!srcs.ok()) return srcs.status();
    auto layout = vfs::ParseTargetLayout(layout_json, "(layout_json argument)");
    if (!layout.ok()) return layout.status();
    vfs::ReshardOptions opts;
    opts.safetensors = (a.flags & OPTSTATE_RESHARD_NO_SAFETENSORS) == 0;
    auto r = vfs::Reshard(*srcs, *layout, dest, opts);
    if (!r.ok()) return r.status();
    if (ranks != nullptr) *ranks = r->ranks;
    return Status::Ok();
  });
}
}  // namespace

int optstate_checkpoint_reshard(const char* const* sources, size_t num_sources, const char* layout_json,
                                const char* dest, uint32_t* ranks, char** errptr) {
  return Reshard(sources, num_sources, layout_json, dest, nullptr, ranks, errptr, "optstate_checkpoint_reshard");
}

int optstate_checkpoint_reshard_with(const char* const* sources, size_t num_sources, const char* layout_json,
                                     const char* dest, const optstate_checkpoint_reshard_args_t* args,
                                     uint32_t* ranks, char** errptr) {
  return Reshard(sources, num_sources, layout_json, dest, args, ranks, errptr, "optstate_checkpoint_reshard_with");
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

}  // extern "C"
