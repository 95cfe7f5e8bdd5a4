// FileSystem: the one door through which the store touches files.
//
// Everything the store does to a file or directory goes through this interface
// so that tests can wrap the real implementation (vfs/fault_injection.h) and
// fail the Nth operation, shorten transfers, report ENOSPC, or drop data that
// was not synced (simulated power loss). Modelled on leveldb's Env and rocksdb's
// FileSystem. Data-path reads and writes of chunk extents go through an
// IoEngine (vfs/io_engine.h) on the File's fd; the engine consults the same
// FaultHooks so injected faults cover io_uring too.
//
// Thread-safety: FileSystem and File methods are safe to call concurrently.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"

namespace optstate::vfs {

enum class OpClass : uint8_t {
  kRead, kWrite, kSync, kOpen, kFallocate, kMetadata,
  // RocksDB's own files (the store's index), seen through the store's
  // rocksdb::FileSystem wrapper: appends/writes and syncs of WAL, SST, MANIFEST.
  kIndexWrite, kIndexSync,
};
const char* OpClassName(OpClass c);

// Consulted before every operation of a class and told about every completed
// write and sync. The real file system has none; FaultInjectionFileSystem
// installs one. Implementations must be thread-safe.
class FaultHooks {
 public:
  virtual ~FaultHooks() = default;
  // Returns a non-OK status to fail the operation (with that errno), or sets
  // *short_len < len to make a read/write transfer fewer bytes than asked.
  // Called for every read, write, sync, open, fallocate, rename/remove/mkdir.
  virtual Status BeforeOp(OpClass op, const std::string& path, uint64_t offset, uint64_t len,
                          uint64_t* short_len) = 0;
  // Records that [offset, offset+len) of path was written (not yet durable).
  virtual void AfterWrite(const std::string& path, uint64_t offset, uint64_t len) = 0;
  // Records that path's data is durable (fdatasync/fsync returned 0).
  virtual void AfterSync(const std::string& path) = 0;
  // Records that a directory entry in dir was created/renamed and that the
  // directory has been synced, for "files created since the last dir sync".
  virtual void AfterCreate(const std::string& path) = 0;
  virtual void AfterDirSync(const std::string& dir) = 0;
  // A rename made outside FileSystem::Rename (RocksDB installing CURRENT,
  // OPTIONS-*, IDENTITY through the store's rocksdb::FileSystem): BeforeRename
  // just before rename(2), so that a power-loss model can save what `to` held;
  // AfterRename once it succeeded (durable after AfterDirSync of to's
  // directory). Not an operation of any class (no BeforeOp, not counted); a
  // non-OK status fails the rename (a simulated crash: the file system is
  // inactive). Default: nothing.
  virtual Status BeforeRename(const std::string& from, const std::string& to) {
    (void)from;
    (void)to;
    return Status::Ok();
  }
  virtual void AfterRename(const std::string& from, const std::string& to) {
    (void)from;
    (void)to;
  }
};

struct OpenOptions {
  bool read_only = false;
  bool create = false;      // O_CREAT
  bool exclusive = false;   // O_EXCL (with create)
  bool direct = false;      // O_DIRECT; falls back to buffered with one warning
                            // per process where the filesystem refuses it (tmpfs)
};

class File {
 public:
  virtual ~File() = default;
  virtual const std::string& path() const = 0;
  // The kernel file descriptor, for io_uring. Valid until the File is destroyed.
  virtual int fd() const = 0;
  // True when the file really is open with O_DIRECT (false after a fallback).
  virtual bool direct() const = 0;
  // Full-length positional I/O: loops over short transfers and EINTR/EAGAIN;
  // a read past EOF is an error naming path, offset and length.
  virtual Status Pread(uint64_t offset, void* buf, uint64_t len) const = 0;
  virtual Status Pwrite(uint64_t offset, const void* buf, uint64_t len) = 0;
  virtual Status Fdatasync() = 0;
  virtual Status Fsync() = 0;
  // fallocate(mode 0): reserves [offset, offset+len), extending the size.
  virtual Status Fallocate(uint64_t offset, uint64_t len) = 0;
  virtual Result<uint64_t> Size() const = 0;
  virtual FaultHooks* hooks() const = 0;  // nullptr on the real file system
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // The process-wide real (POSIX) file system. Never null, never deleted.
  static FileSystem* Default();

  virtual Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& opts) = 0;
  virtual Status CreateDir(const std::string& path) = 0;   // OK if it exists
  virtual Status SyncDir(const std::string& path) = 0;     // fsync of a directory
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  virtual Status Remove(const std::string& path) = 0;      // a file
  virtual Status RemoveAll(const std::string& path) = 0;   // a tree (tests, cleanup)
  virtual Result<bool> Exists(const std::string& path) = 0;
  virtual Result<std::vector<std::string>> ListDir(const std::string& path) = 0;  // names, sorted
  virtual Result<std::string> ReadFileToString(const std::string& path) = 0;
  // Writes a small file durably and atomically: tmp + fsync + rename + dir sync.
  virtual Status WriteFileAtomic(const std::string& path, const std::string& contents) = 0;
  virtual FaultHooks* hooks() const = 0;  // nullptr on the real file system
};

}  // namespace optstate::vfs
