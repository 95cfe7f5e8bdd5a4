// A directory written all or nothing (checkpoint export, reshard): the
// content goes into a fresh `<dest>.partial-XXXXXXXX` sibling, which is
// renamed to dest only when complete and its parent then fsynced; on any
// error the partial directory is removed. dest must not exist or be an empty
// directory, and its parent must exist.
#ifndef OPTSTATE_VFS_INTERNAL_NEW_DIR_H_
#define OPTSTATE_VFS_INTERNAL_NEW_DIR_H_

#include <functional>
#include <string>
#include <string_view>

#include "vfs/file_system.h"
#include "base/status.h"

namespace optstate::vfs::internal {

// "." for a bare name, "/" for a top-level path.
std::string ParentDir(const std::string& path);

// NotFound when dest's parent is missing; AlreadyExists when dest is a file
// or a non-empty directory. `tool` starts each message ("export", "reshard").
Status CheckNewDir(FileSystem* fs, const std::string& dest, std::string_view tool);

// Runs fill(partial) and publishes its directory as dest. `where` prefixes
// errors; `sync_point` is the test sync point passed before the rename;
// `what` names the content in the power-loss warning ("the checkpoint is",
// "the checkpoints are").
Status WriteNewDir(FileSystem* fs, const std::string& dest, const std::string& where, const char* sync_point,
                   std::string_view what, const std::function<Status(const std::string& partial)>& fill);

}  // namespace optstate::vfs::internal

#endif  // OPTSTATE_VFS_INTERNAL_NEW_DIR_H_
