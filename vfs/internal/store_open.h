// The steps that open a store, each defined in the file of its idea, and the
// read-only stores' secondary directories. Core (store_core.h) names the open
// steps its friends. Internal to vfs/.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "vfs/internal/store_core.h"
#include "vfs/store.h"

namespace optstate::vfs::internal {

// Opens the data file of every data dir that has one (all, creating the
// missing ones, if create_missing). store_data_files.cc.
Status OpenDataFiles(Core* core, bool create_missing);

// Turns the data dirs recorded in IDENTITY into absolute paths for this store
// directory and marks which lie inside it. store_data_files.cc.
Status ResolveDataDirs(Core* c);

// Writer: makes each open data file this store directory's (flock and owner
// record), or refuses. store_data_files.cc.
Status ClaimDataFiles(Core* c);

// Corruption when a committed version references a data file that is not
// open. mu_ held. store_data_files.cc.
Status CheckReferencedFiles(Core* core);

// Opens (creating if absent) COMMITTED and refuses an index older than the
// generation it records. store_marks.cc.
Status OpenCommittedMark(Core* c);

// Writer: creates leases/ and opens leases/.lock. store_leases.cc.
Status OpenLeaseLock(Core* c);
// Reader: opens leases/.lock (creating it if a store made before leases/
// existed has none), or, where the store's whole filesystem is read-only,
// none (vfs/store.h: "A store on a read-only filesystem"). store_leases.cc.
Status OpenReaderLeaseLock(Core* c);

// Read-only stores keep a RocksDB secondary instance in a directory of their
// own under /tmp (its info log; the instance holds no data). A reader killed
// by SIGKILL or a power loss leaves it behind, so each reader flocks
// <dir>.lock while it lives, and every read-only open removes the directories
// whose lock nobody holds: the kernel drops a flock when its process ends,
// however it ends, in any pid namespace. Directories of readers that predate
// the lock file are removed when their pid (the name's first number) is gone.
// They live in $TMPDIR when it names an absolute path, else /tmp
// (SecondaryRoot, store_secondary.cc).
std::string SecondaryRoot();
inline constexpr const char* kSecondaryPrefix = "optstate-secondary-";
// The flock'ed descriptor of <base>.lock, or -1 (the directory then only ages
// out by its pid).
int LockSecondaryBase(const std::string& base);
void RemoveStaleSecondaryDirs(const std::string& root);

// The Store over an opened core (store.cc).
std::unique_ptr<Store> NewStore(std::shared_ptr<Core> core);

// Store::Verify (store_verify.cc).
Result<VerifyReport> VerifyStore(const std::shared_ptr<Core>& core);

}  // namespace optstate::vfs::internal
