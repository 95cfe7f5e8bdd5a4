// FaultInjectionFileSystem: a FileSystem wrapper for tests that fails chosen
// operations and simulates power loss.
//
// It wraps another FileSystem (usually FileSystem::Default()) and installs its
// FaultHooks on every File it opens, so the same rules reach File calls and the
// IoEngines (io_uring and sync consult File::hooks() per request). What it
// offers (after rocksdb utilities/fault_injection_fs.h and leveldb
// db/fault_injection_test.cc):
//  - rules: fail the Nth operation of a class (once, or persistently from N
//    on) with a chosen errno (EIO by default, ENOSPC for a full disk), or make
//    the Nth read/write transfer fewer bytes (a short transfer);
//  - counters of operations per class, so a test can run a workload once to
//    count its operations, then rerun it failing N = 1..count;
//  - DropUnsyncedData: simulated power loss. Every range written since its
//    file's last successful fsync/fdatasync is overwritten with zeros (all of
//    them, or a seeded random subset of 4 KiB blocks); files and directories
//    created since their directory's last SyncDir are removed; a file replaced
//    by an unsynced rename gets its old contents back (when it was <= 16 MiB),
//    whether renamed through this wrapper or reported through
//    FaultHooks::BeforeRename/AfterRename (RocksDB installing CURRENT through
//    the store's rocksdb::FileSystem, vfs/internal/rocks_util.cc);
//  - SetFilesystemActive(false): every later operation fails (the "crashed"
//    process can no longer touch the disk), like rocksdb's FaultInjectionTestFS.
// Not modelled: unsynced removes (a removed file stays removed), unsynced size
// changes (fallocate, writes past the end: the file keeps its size and the
// unsynced bytes read as zeros), the source of an unsynced rename coming back
// (a durable `from` renamed to a new name disappears from both names at power
// loss; RocksDB does this only for its informational LOG -> LOG.old.*), and
// replaced files larger than 16 MiB (kept with their new contents).
//
// Paths are compared after lexical normalisation (no "//", ".", trailing "/").
// Ownership: does not own `base`, which must outlive it and every File opened
// through it. Thread-safety: all methods are thread-safe (one mutex).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "vfs/file_system.h"
#include "base/status.h"

namespace optstate::vfs {

struct FaultRule {
  OpClass op = OpClass::kWrite;  // the class whose operations count
  bool any_class = false;        // true: every operation of every class counts
  // Only operations on paths containing this substring count ("" = all).
  std::string path_contains;
  // The rule fires on the nth counted operation (1-based) after it was added.
  uint64_t nth = 1;
  bool persistent = false;  // false: only the nth; true: the nth and all later
  int err = EIO;            // errno of the injected failure (ENOSPC: disk full)
  // Set: instead of failing, a read/write transfers at most this many bytes
  // first (the caller must handle the short transfer); ignored for other ops.
  std::optional<uint64_t> short_len;

  static FaultRule FailNth(OpClass op, uint64_t nth, bool persistent = false, int err = EIO) {
    FaultRule r;
    r.op = op;
    r.nth = nth;
    r.persistent = persistent;
    r.err = err;
    return r;
  }
  static FaultRule FailNthAny(uint64_t nth, bool persistent = false, int err = EIO) {
    FaultRule r;
    r.any_class = true;
    r.nth = nth;
    r.persistent = persistent;
    r.err = err;
    return r;
  }
  static FaultRule ShortNth(OpClass op, uint64_t nth, uint64_t short_len, bool persistent = false) {
    FaultRule r;
    r.op = op;
    r.nth = nth;
    r.persistent = persistent;
    r.short_len = short_len;
    return r;
  }
};

enum class DropMode : uint8_t {
  kAll,           // every unsynced byte is lost
  kRandomSubset,  // each unsynced 4 KiB block is lost with probability 1/2 (seeded)
};

class FaultInjectionFileSystem final : public FileSystem {
 public:
  // REQUIRES: base outlives this object and the files opened through it.
  explicit FaultInjectionFileSystem(FileSystem* base);
  ~FaultInjectionFileSystem() override;

  // ---- rules and counters ----
  void AddRule(const FaultRule& rule);
  void ClearRules();
  // Operations seen per class (and in all) since construction or the last
  // ResetCounters, including failed ones; not counted while inactive.
  uint64_t OpCount(OpClass op) const;
  uint64_t TotalOpCount() const;
  // Faults injected (failures and short transfers) since the last ResetCounters.
  uint64_t InjectedCount() const;
  void ResetCounters();

  // ---- crash simulation ----
  // false: every later operation fails with EIO ("filesystem inactive").
  void SetFilesystemActive(bool active);
  bool filesystem_active() const;
  // Simulated power loss (see the header comment). Call it with no file open
  // for writing (after the "crash"); it uses `base` directly, makes its own
  // changes durable, and forgets all tracking. Works while inactive.
  Status DropUnsyncedData(DropMode mode, uint64_t seed = 0);
  // Forgets what is unsynced, as if everything had been made durable.
  void MarkAllSynced();
  // Bytes written and not yet synced (sum over files of the tracked ranges).
  uint64_t UnsyncedBytes() const;
  // Files created since their directory's last SyncDir.
  std::vector<std::string> UnsyncedCreations() const;
  // Files replaced by a rename since their directory's last SyncDir (whose
  // old contents a power loss restores), renamed through this wrapper or
  // reported by FaultHooks::BeforeRename/AfterRename (RocksDB's CURRENT).
  std::vector<std::string> UnsyncedReplacements() const;

  // ---- FileSystem ----
  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& opts) override;
  Status CreateDir(const std::string& path) override;
  Status SyncDir(const std::string& path) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status Remove(const std::string& path) override;
  Status RemoveAll(const std::string& path) override;
  Result<bool> Exists(const std::string& path) override;
  Result<std::vector<std::string>> ListDir(const std::string& path) override;
  Result<std::string> ReadFileToString(const std::string& path) override;
  Status WriteFileAtomic(const std::string& path, const std::string& contents) override;
  FaultHooks* hooks() const override;

 private:
  class Hooks;
  FileSystem* const base_;
  std::unique_ptr<Hooks> hooks_;
};

}  // namespace optstate::vfs
