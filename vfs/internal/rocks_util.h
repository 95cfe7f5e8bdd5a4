// RocksDB glue for the store: the one conversion of rocksdb::Status to our
// Status, and an Env whose files go through the store's FaultHooks so that
// tests can fail the Nth RocksDB write or sync (OpClass::kIndexWrite /
// kIndexSync) exactly like the store's own file operations.
// Thread-safety: the Env is thread-safe (RocksDB calls it from its threads).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <rocksdb/env.h>
#include <rocksdb/status.h>

#include "vfs/file_system.h"
#include "base/status.h"

namespace optstate::vfs::internal {

// "<what>: <rocksdb message>"; Corruption -> kCorruption, NoSpace -> kNoSpace,
// Busy/TryAgain -> kBusy, NotFound -> kNotFound, IOError -> kIoError.
Status RocksStatus(std::string_view what, const rocksdb::Status& s);

// An Env over RocksDB's default file system that asks `hooks` before every
// write/append (kIndexWrite) and sync (kIndexSync) of a RocksDB file and
// reports them (AfterWrite/AfterSync). hooks: not owned, must outlive the Env.
std::unique_ptr<rocksdb::Env> NewHookedEnv(FaultHooks* hooks);

}  // namespace optstate::vfs::internal
