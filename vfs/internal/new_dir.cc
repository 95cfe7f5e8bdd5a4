#include "vfs/internal/new_dir.h"

#include <random>

#include <fmt/format.h>

#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::vfs::internal {

std::string ParentDir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status CheckNewDir(FileSystem* fs, const std::string& dest, std::string_view tool) {
  OPTSTATE_ASSIGN_OR_RETURN(bool parent_exists, fs->Exists(ParentDir(dest)));
  if (!parent_exists) {
    return NotFound(fmt::format("{}: the parent directory {} of {} does not exist", tool, ParentDir(dest), dest));
  }
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, fs->Exists(dest));
  if (!exists) return Status::Ok();
  auto names = fs->ListDir(dest);
  if (!names.ok()) {
    return AlreadyExists(fmt::format("{}: {} exists and is not a directory ({}); give a new path", tool, dest,
                                     names.status().ToString()));
  }
  if (!names->empty()) {
    return AlreadyExists(fmt::format("{}: {} exists and is not empty ({} entries, e.g. '{}'); a checkpoint is "
                                     "never written over another: give a new path or remove it",
                                     tool, dest, names->size(), names->front()));
  }
  return Status::Ok();
}

Status WriteNewDir(FileSystem* fs, const std::string& dest, const std::string& where,
                   [[maybe_unused]] const char* sync_point, std::string_view what,
                   const std::function<Status(const std::string& partial)>& fill) {
  std::string partial;
  std::random_device rd;
  for (int attempt = 0;; ++attempt) {
    partial = fmt::format("{}.partial-{:08x}", dest, static_cast<uint32_t>(rd()));
    OPTSTATE_ASSIGN_OR_RETURN(bool taken, fs->Exists(partial));
    if (!taken) break;
    if (attempt == 16) return AlreadyExists(where + ": no free name for the partial directory, e.g. " + partial);
  }
  if (Status st = fs->CreateDir(partial); !st.ok()) return st.WithContext(where);
  Status st = fill(partial);
  if (st.ok()) {
    OPTSTATE_TEST_SYNC_POINT(sync_point);
    st = fs->Rename(partial, dest);
  }
  if (!st.ok()) {
    Status rm = fs->RemoveAll(partial);
    if (!rm.ok()) OPTSTATE_LOG_ERROR("{}: removing {} after a failure: {}", where, partial, rm.ToString());
    return st.WithContext(where);
  }
  st = fs->SyncDir(ParentDir(dest));
  if (!st.ok()) {
    return st.WithContext(fmt::format("{}: {} complete, but the name in {} may not survive a power loss", where,
                                      what, ParentDir(dest)));
  }
  return Status::Ok();
}

}  // namespace optstate::vfs::internal
