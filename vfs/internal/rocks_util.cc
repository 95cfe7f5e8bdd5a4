#include "vfs/internal/rocks_util.h"

#include <atomic>

#include <rocksdb/file_system.h>
#include <rocksdb/io_status.h>

namespace optstate::vfs::internal {

Status RocksStatus(std::string_view what, const rocksdb::Status& s) {
  if (s.ok()) return Status();
  std::string msg = std::string(what) + ": rocksdb: " + s.ToString();
  if (s.IsCorruption()) return Corruption(std::move(msg));
  if (s.IsNoSpace()) return Status(StatusCode::kNoSpace, std::move(msg), ENOSPC);
  if (s.IsBusy() || s.IsTryAgain()) return Busy(std::move(msg));
  if (s.IsNotFound()) return NotFound(std::move(msg));
  if (s.IsInvalidArgument()) return InvalidArgument(std::move(msg));
  if (s.IsIOError()) return IoError(std::move(msg));
  return IoError(std::move(msg));
}

namespace {

rocksdb::IOStatus ToIoStatus(const Status& s) {
  if (s.ok()) return rocksdb::IOStatus::OK();
  if (s.code() == StatusCode::kNoSpace) return rocksdb::IOStatus::NoSpace(s.ToString());
  return rocksdb::IOStatus::IOError(s.ToString());
}

class HookedWritableFile : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  HookedWritableFile(std::unique_ptr<rocksdb::FSWritableFile> f, std::string path, FaultHooks* hooks)
      : FSWritableFileOwnerWrapper(std::move(f)), path_(std::move(path)), hooks_(hooks) {}

  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           rocksdb::IODebugContext* dbg) override {
    uint64_t off = written_;
    auto s = Before(rocksdb::Slice(data), off);
    if (!s.ok()) return s;
    s = FSWritableFileOwnerWrapper::Append(data, o, dbg);
    if (s.ok()) After(off, data.size());
    return s;
  }
  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           const rocksdb::DataVerificationInfo& v,
                           rocksdb::IODebugContext* dbg) override {
    uint64_t off = written_;
    auto s = Before(data, off);
    if (!s.ok()) return s;
    s = FSWritableFileOwnerWrapper::Append(data, o, v, dbg);
    if (s.ok()) After(off, data.size());
    return s;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     rocksdb::IODebugContext* dbg) override {
    auto s = Before(data, offset);
    if (!s.ok()) return s;
    s = FSWritableFileOwnerWrapper::PositionedAppend(data, offset, o, dbg);
    if (s.ok()) After(offset, data.size());
    return s;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     const rocksdb::DataVerificationInfo& v,
                                     rocksdb::IODebugContext* dbg) override {
    auto s = Before(data, offset);
    if (!s.ok()) return s;
    s = FSWritableFileOwnerWrapper::PositionedAppend(data, offset, o, v, dbg);
    if (s.ok()) After(offset, data.size());
    return s;
  }
  rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    return SyncVia([&] { return FSWritableFileOwnerWrapper::Sync(o, dbg); });
  }
  rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    return SyncVia([&] { return FSWritableFileOwnerWrapper::Fsync(o, dbg); });
  }
  rocksdb::IOStatus RangeSync(uint64_t off, uint64_t n, const rocksdb::IOOptions& o,
                              rocksdb::IODebugContext* dbg) override {
    return SyncVia([&] { return FSWritableFileOwnerWrapper::RangeSync(off, n, o, dbg); });
  }

 private:
  rocksdb::IOStatus Before(const rocksdb::Slice& data, uint64_t offset) {
    uint64_t short_len = data.size();
    Status s = hooks_->BeforeOp(OpClass::kIndexWrite, path_, offset, data.size(), &short_len);
    if (!s.ok()) return ToIoStatus(s);
    // A short transfer of an append is reported as a failure: RocksDB's
    // writer has no partial-append contract.
    if (short_len < data.size()) {
      return rocksdb::IOStatus::IOError("injected short write of " + path_);
    }
    return rocksdb::IOStatus::OK();
  }
  void After(uint64_t offset, uint64_t len) {
    written_ = std::max<uint64_t>(written_, offset + len);
    hooks_->AfterWrite(path_, offset, len);
  }
  template <typename F>
  rocksdb::IOStatus SyncVia(F&& f) {
    uint64_t short_len = 0;
    Status s = hooks_->BeforeOp(OpClass::kIndexSync, path_, 0, 0, &short_len);
    if (!s.ok()) return ToIoStatus(s);
    auto r = f();
    if (r.ok()) hooks_->AfterSync(path_);
    return r;
  }

  std::string path_;
  FaultHooks* hooks_;
  std::atomic<uint64_t> written_{0};
};

// Reports directory syncs, so that a power-loss simulation knows which of
// RocksDB's file creations are durable.
class HookedDirectory : public rocksdb::FSDirectoryWrapper {
 public:
  HookedDirectory(std::unique_ptr<rocksdb::FSDirectory> d, std::string path, FaultHooks* hooks)
      : FSDirectoryWrapper(std::move(d)), path_(std::move(path)), hooks_(hooks) {}
  rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    return Sync([&] { return FSDirectoryWrapper::Fsync(o, dbg); });
  }
  rocksdb::IOStatus FsyncWithDirOptions(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg,
                                        const rocksdb::DirFsyncOptions& d) override {
    return Sync([&] { return FSDirectoryWrapper::FsyncWithDirOptions(o, dbg, d); });
  }

 private:
  template <typename F>
  rocksdb::IOStatus Sync(F&& f) {
    uint64_t short_len = 0;
    Status s = hooks_->BeforeOp(OpClass::kIndexSync, path_, 0, 0, &short_len);
    if (!s.ok()) return ToIoStatus(s);
    auto r = f();
    if (r.ok()) hooks_->AfterDirSync(path_);
    return r;
  }
  std::string path_;
  FaultHooks* hooks_;
};

class HookedFileSystem : public rocksdb::FileSystemWrapper {
 public:
  HookedFileSystem(const std::shared_ptr<rocksdb::FileSystem>& base, FaultHooks* hooks)
      : FileSystemWrapper(base), hooks_(hooks) {}
  const char* Name() const override { return "OptstateHookedFileSystem"; }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& fo,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    uint64_t short_len = 0;
    Status s = hooks_->BeforeOp(OpClass::kOpen, f, 0, 0, &short_len);
    if (!s.ok()) return ToIoStatus(s);
    std::unique_ptr<rocksdb::FSWritableFile> base;
    auto st = FileSystemWrapper::NewWritableFile(f, fo, &base, dbg);
    if (!st.ok()) return st;
    hooks_->AfterCreate(f);
    *r = std::make_unique<HookedWritableFile>(std::move(base), f, hooks_);
    return st;
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& fo,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* dbg) override {
    std::unique_ptr<rocksdb::FSWritableFile> base;
    auto st = FileSystemWrapper::ReopenWritableFile(f, fo, &base, dbg);
    if (!st.ok()) return st;
    *r = std::make_unique<HookedWritableFile>(std::move(base), f, hooks_);
    return st;
  }
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old,
                                      const rocksdb::FileOptions& fo,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    std::unique_ptr<rocksdb::FSWritableFile> base;
    auto st = FileSystemWrapper::ReuseWritableFile(f, old, fo, &base, dbg);
    if (!st.ok()) return st;
    *r = std::make_unique<HookedWritableFile>(std::move(base), f, hooks_);
    return st;
  }
  // RocksDB installs CURRENT (and OPTIONS-*, IDENTITY) by writing a temp file
  // and renaming it over the old one; reported so that a power-loss model can
  // revert a rename whose directory was not synced yet.
  rocksdb::IOStatus RenameFile(const std::string& from, const std::string& to, const rocksdb::IOOptions& io,
                               rocksdb::IODebugContext* dbg) override {
    Status s = hooks_->BeforeRename(from, to);
    if (!s.ok()) return ToIoStatus(s);
    auto st = FileSystemWrapper::RenameFile(from, to, io, dbg);
    if (st.ok()) hooks_->AfterRename(from, to);
    return st;
  }
  rocksdb::IOStatus NewDirectory(const std::string& name, const rocksdb::IOOptions& io,
                                 std::unique_ptr<rocksdb::FSDirectory>* r,
                                 rocksdb::IODebugContext* dbg) override {
    std::unique_ptr<rocksdb::FSDirectory> base;
    auto st = FileSystemWrapper::NewDirectory(name, io, &base, dbg);
    if (!st.ok()) return st;
    *r = std::make_unique<HookedDirectory>(std::move(base), name, hooks_);
    return st;
  }

 private:
  FaultHooks* hooks_;
};

}  // namespace

std::unique_ptr<rocksdb::Env> NewHookedEnv(FaultHooks* hooks) {
  auto fs = std::make_shared<HookedFileSystem>(rocksdb::FileSystem::Default(), hooks);
  return rocksdb::NewCompositeEnv(fs);
}

}  // namespace optstate::vfs::internal
