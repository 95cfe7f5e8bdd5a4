// Opening a store (vfs/store.h Store::Create, Open, OpenReadOnly): the steps
// in order, each in the file of its idea; a failed step leaves the store as
// it was (creation builds in a temporary directory renamed into place).
#include "vfs/store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "vfs/internal/rocks_util.h"
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_open.h"
#include "vfs/internal/store_format.h"
#include "base/log.h"
#include "base/sync_point.h"

namespace optstate::vfs::internal {
namespace {

// Forwards RocksDB's warnings and errors to our log instead of a LOG file
// (also keeps RocksDB's background logging out of fault-injection op counts).
class RocksLogger : public rocksdb::Logger {
 public:
  RocksLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char buf[1024];
    vsnprintf(buf, sizeof(buf), format, ap);
    OPTSTATE_LOG_WARN("rocksdb: {}", buf);
  }
};

}  // namespace

rocksdb::Options IndexOptions(Core* core) {
  rocksdb::Options o;
  o.env = core->env_ ? core->env_.get() : rocksdb::Env::Default();
  core->logger_ = std::make_shared<RocksLogger>();
  o.info_log = core->logger_;
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  o.max_open_files = -1;       // required for secondary instances
  o.paranoid_checks = true;
  o.keep_log_file_num = 2;
  o.write_buffer_size = 16 << 20;
  // RocksDB keeps its preallocation of the log (1.1 x the write buffer) and
  // the manifest (4 MiB) while open: it is what lets a commit's index write
  // succeed on a disk the data file has filled. Released at close.
  return o;
}

namespace {

Status ValidateOptions(const StoreOptions& opts) {
  if (opts.chunk_size_bytes == 0 || opts.chunk_size_bytes % kChunkAlignBytes != 0) {
    return InvalidArgument("chunk_size_bytes " + std::to_string(opts.chunk_size_bytes) +
                           " is not a positive multiple of 2 MiB");
  }
  if (opts.retained_generations == 0) return InvalidArgument("retained_generations must be >= 1");
  if (opts.job.size() > 256) return InvalidArgument("job id is longer than 256 bytes");
  for (char ch : opts.job) {
    if (static_cast<unsigned char>(ch) < 0x20) return InvalidArgument("job id '" + opts.job + "' holds a control character");
  }
  return Status();
}

Result<StoreIdentity> ReadIdentity(FileSystem* fs, const std::string& path) {
  auto exists = fs->Exists(path);
  if (!exists.ok()) return exists.status().WithContext("store " + path);
  if (!*exists) return NotFound("store " + path + " does not exist");
  auto text = fs->ReadFileToString(JoinPath(path, "IDENTITY"));
  if (!text.ok()) {
    return Corruption("store " + path + " is missing or damaged: cannot read IDENTITY: " +
                      text.status().ToString());
  }
  return internal::DecodeIdentity(*text, "store " + path + ": IDENTITY");
}

Status CleanStaleCreations(FileSystem* fs, const std::string& parent, const std::string& base) {
  auto names = fs->ListDir(parent);
  if (!names.ok()) return names.status();
  const std::string prefix = "." + base + ".creating-";
  for (const auto& n : *names) {
    if (!n.starts_with(prefix)) continue;
    const long pid = std::strtol(n.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && pid != getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      OPTSTATE_LOG_INFO("removing half-created store {}", JoinPath(parent, n));
      (void)fs->RemoveAll(JoinPath(parent, n));
    }
  }
  return Status();
}

Status CheckEmptyStoreDir(FileSystem* fs, const std::string& path, const std::string& parent) {
  auto names = fs->ListDir(path);
  if (!names.ok() || !names->empty()) return AlreadyExists("store " + path + " already exists");
  // A mount point cannot be renamed over: its store is to be a directory inside it.
  struct stat st, parent_st;
  if (::stat(path.c_str(), &st) == 0 && ::stat(parent.c_str(), &parent_st) == 0 && st.st_dev != parent_st.st_dev) {
    return InvalidArgument("store " + path + " is an empty mount point; give a directory inside it (e.g. " +
                           JoinPath(path, "store") + ")");
  }
  return Status();
}

Result<std::shared_ptr<Core>> NewCore(const std::string& path, const StoreOptions& opts, bool read_only) {
  return std::make_shared<Core>(path, opts, read_only);
}

}  // namespace

Core::Core(const std::string& path, const StoreOptions& opts, bool read_only) {
  path_ = AbsPath(path);
  opts_ = opts;
  fs_ = opts.fs ? opts.fs : FileSystem::Default();
  read_only_ = read_only;
  leases_dir_ = JoinPath(path_, "leases");
  if (fs_->hooks() != nullptr) env_ = internal::NewHookedEnv(fs_->hooks());
}
}  // namespace optstate::vfs::internal

namespace optstate::vfs {

using internal::AbsPath;
using internal::CheckReferencedFiles;
using internal::ClaimDataFiles;
using internal::CheckEmptyStoreDir;
using internal::CleanStaleCreations;
using internal::Core;
using internal::IndexOptions;
using internal::JoinPath;
using internal::kSecondaryPrefix;
using internal::SecondaryRoot;
using internal::LockSecondaryBase;
using internal::NewCore;
using internal::NewStore;
using internal::NowUnixMs;
using internal::OpenCommittedMark;
using internal::OpenDataFiles;
using internal::OpenLeaseLock;
using internal::OpenReaderLeaseLock;
using internal::ReadIdentity;
using internal::RemoveStaleSecondaryDirs;
using internal::ResolveDataDirs;
using internal::RocksStatus;
using internal::ValidateOptions;

Result<std::unique_ptr<Store>> Store::Create(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  FileSystem* fs = opts.fs ? opts.fs : FileSystem::Default();
  const std::string path = AbsPath(path_in);
  const std::filesystem::path p(path);
  const std::string parent = p.parent_path().string();
  const std::string base = p.filename().string();
  if (base.empty() || base == "." || base == "..") return InvalidArgument("store path '" + path_in + "' has no name");
  OPTSTATE_ASSIGN_OR_RETURN(bool exists, fs->Exists(path));
  OPTSTATE_ASSIGN_OR_RETURN(bool parent_exists, fs->Exists(parent));
  if (!parent_exists) return NotFound("store " + path + ": parent directory " + parent + " does not exist");
  // An existing empty directory (made by a job script or by hand) becomes the store: it is still built
  // in a sibling, and the final rename(2) replaces the empty directory atomically (a directory that
  // gained an entry meanwhile makes it fail with ENOTEMPTY, and nothing is replaced).
  if (exists) OPTSTATE_RETURN_IF_ERROR(CheckEmptyStoreDir(fs, path, parent));
  OPTSTATE_RETURN_IF_ERROR(CleanStaleCreations(fs, parent, base));

  const std::string tmp = JoinPath(parent, "." + base + ".creating-" + std::to_string(getpid()));
  OPTSTATE_ASSIGN_OR_RETURN(bool tmp_exists, fs->Exists(tmp));
  if (tmp_exists) OPTSTATE_RETURN_IF_ERROR(fs->RemoveAll(tmp));
  OPTSTATE_RETURN_IF_ERROR(fs->CreateDir(tmp));
  OPTSTATE_TEST_SYNC_POINT("store.create.begin");

  StoreIdentity id;
  id.name = opts.name.empty() ? base : opts.name;
  id.uuid = internal::NewUuid();
  id.job = opts.job.empty() ? internal::NewUuid() : opts.job;
  id.chunk_size_bytes = opts.chunk_size_bytes;
  id.create_time_unix_ms = NowUnixMs();
  // Tests make a store of format version 1 (as older builds wrote it) here.
  bool format_v1 = false;
  OPTSTATE_TEST_SYNC_POINT_CALLBACK("store.create.format_v1", &format_v1);
  if (format_v1) id.format_version = 1;
  std::vector<std::string> real_dirs;  // where the dirs are while building
  if (opts.data_dirs.empty()) {
    id.data_dirs = {JoinPath(path, "data")};
    real_dirs = {JoinPath(tmp, "data")};
  } else {
    for (const auto& d : opts.data_dirs) {
      const std::string a = AbsPath(d);
      id.data_dirs.push_back(a);
      real_dirs.push_back(a == path || a.starts_with(path + "/") ? tmp + a.substr(path.size()) : a);
    }
  }
  auto fail = [&](const Status& s) {
    (void)fs->RemoveAll(tmp);
    return s.WithContext("create store " + path);
  };
  for (size_t d = 0; d < real_dirs.size(); ++d) {
    Status s = fs->CreateDir(real_dirs[d]);
    if (!s.ok()) return fail(s);
    OpenOptions oo;
    oo.create = true;
    oo.exclusive = true;
    auto f = fs->Open(JoinPath(real_dirs[d], id.uuid + ".chunks"), oo);
    if (!f.ok()) return fail(f.status());
    s = (*f)->Fsync();
    if (s.ok()) s = fs->SyncDir(real_dirs[d]);
    if (!s.ok()) return fail(s);
  }
  {
    Status s = fs->WriteFileAtomic(JoinPath(tmp, "IDENTITY"), internal::EncodeIdentity(id, path));
    if (!s.ok()) return fail(s);
  }
  OPTSTATE_TEST_SYNC_POINT("store.create.identity");
  {
    auto core = NewCore(tmp, opts, false);
    if (!core.ok()) return fail(core.status());
    Status s = fs->CreateDir(JoinPath(tmp, "index"));
    if (!s.ok()) return fail(s);
    rocksdb::Options o = IndexOptions(core->get());
    o.create_if_missing = true;
    o.error_if_exists = true;
    rocksdb::DB* raw = nullptr;
    s = RocksStatus("create index", rocksdb::DB::Open(o, JoinPath(tmp, "index"), &raw));
    if (!s.ok()) return fail(s);
    (*core)->db_.reset(raw);
    GenerationInfo g0;
    g0.commit_time_unix_ms = id.create_time_unix_ms;
    rocksdb::WriteBatch b;
    b.Put(internal::kIdentityKey, internal::EncodeIdentity(id, path));
    b.Put(internal::kLatestKey, internal::EncodeU64(0));
    b.Put(internal::kNextTensorIdKey, internal::EncodeU64(0));
    b.Put(internal::kLifetimeKey, internal::EncodeU64(0));
    b.Put(internal::GenerationKey(0), internal::EncodeGeneration(g0));
    s = (*core)->WriteSynced(&b, "initial index");
    if (!s.ok()) return fail(s);
  }
  OPTSTATE_TEST_SYNC_POINT("store.create.index");
  {
    Status s = fs->CreateDir(JoinPath(tmp, "leases"));
    if (s.ok()) s = fs->SyncDir(tmp);
    if (s.ok()) s = fs->Rename(tmp, path);
    if (!s.ok()) return fail(s);
    s = fs->SyncDir(parent);
    if (!s.ok()) return s.WithContext("create store " + path);
  }
  OPTSTATE_TEST_SYNC_POINT("store.create.renamed");
  return Open(path, opts);
}

Result<std::unique_ptr<Store>> Store::Open(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  OPTSTATE_ASSIGN_OR_RETURN(auto core, NewCore(path_in, opts, false));
  const std::string& path = core->path_;
  FileSystem* fs = core->fs_;
  OPTSTATE_ASSIGN_OR_RETURN(core->identity_, ReadIdentity(fs, path));
  OPTSTATE_RETURN_IF_ERROR(ResolveDataDirs(core.get()));

  // LOCK: one writer per store; the holder's pid inside for the error message.
  {
    OpenOptions oo;
    oo.create = true;
    const std::string lock_path = JoinPath(path, "LOCK");
    auto f = fs->Open(lock_path, oo);
    if (!f.ok()) return f.status().WithContext("store " + path + ": LOCK");
    if (::flock((*f)->fd(), LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e == EWOULDBLOCK) {
        auto text = fs->ReadFileToString(lock_path);
        std::string pid = text.ok() ? std::to_string(std::strtoll(text->c_str(), nullptr, 10)) : "unknown";
        return Status(StatusCode::kBusy, "store " + path + " is in use by pid " + pid, e);
      }
      return ErrnoStatus("store " + path + ": flock LOCK", e);
    }
    char pid[32];
    snprintf(pid, sizeof(pid), "%-23d\n", static_cast<int>(getpid()));
    OPTSTATE_RETURN_IF_ERROR((*f)->Pwrite(0, pid, 24).WithContext("store " + path + ": LOCK"));
    core->lock_file_ = std::move(*f);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenLeaseLock(core.get()));

  {
    const std::string index = JoinPath(path, "index");
    OPTSTATE_ASSIGN_OR_RETURN(bool has_index, fs->Exists(index));
    if (!has_index) return Corruption("store " + path + " is damaged: index/ is missing");
    rocksdb::Options o = IndexOptions(core.get());
    o.create_if_missing = false;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status rs = rocksdb::DB::Open(o, index, &raw);
    if (!rs.ok()) {
      Status s = RocksStatus("store " + path + " is damaged or unreadable: index", rs);
      if (s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound) {
        return Corruption(s.message());
      }
      return s;
    }
    core->db_.reset(raw);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/false));
  OPTSTATE_RETURN_IF_ERROR(ClaimDataFiles(core.get()));
  {
    MutexLock l(&core->mu_);
    OPTSTATE_RETURN_IF_ERROR(core->LoadIndex());
    OPTSTATE_RETURN_IF_ERROR(CheckReferencedFiles(core.get()));
    OPTSTATE_RETURN_IF_ERROR(core->DropUncommittedTensors());
  }
  OPTSTATE_RETURN_IF_ERROR(OpenCommittedMark(core.get()));
  {
    OpenOptions oo;
    oo.create = true;
    auto f = fs->Open(JoinPath(path, "RETAINED"), oo);  // written by the GC below
    if (!f.ok()) return f.status().WithContext("store " + path + ": RETAINED");
    core->retained_file_ = std::move(*f);
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/true));
  OPTSTATE_RETURN_IF_ERROR(ClaimDataFiles(core.get()));
  if (core->identity_needs_rewrite_) {
    // Data dirs inside the store directory recorded relative to it from now on.
    OPTSTATE_RETURN_IF_ERROR(fs->WriteFileAtomic(JoinPath(path, "IDENTITY"),
                                                 internal::EncodeIdentity(core->identity_, path))
                                 .WithContext("store " + path + ": rewrite of IDENTITY"));
  }
  {
    MutexLock l(&core->mu_);
    OPTSTATE_RETURN_IF_ERROR(core->BuildFreeLists());
  }
  OPTSTATE_RETURN_IF_ERROR(core->CollectGarbage().WithContext("store " + path + ": garbage collection at open"));
  return NewStore(std::move(core));
}

Result<std::unique_ptr<Store>> Store::OpenReadOnly(const std::string& path_in, const StoreOptions& opts) {
  OPTSTATE_RETURN_IF_ERROR(ValidateOptions(opts));
  OPTSTATE_ASSIGN_OR_RETURN(auto core, NewCore(path_in, opts, true));
  const std::string& path = core->path_;
  FileSystem* fs = core->fs_;
  OPTSTATE_ASSIGN_OR_RETURN(core->identity_, ReadIdentity(fs, path));
  OPTSTATE_RETURN_IF_ERROR(ResolveDataDirs(core.get()));
  OPTSTATE_RETURN_IF_ERROR(OpenReaderLeaseLock(core.get()));
  static std::atomic<uint64_t> counter{0};
  const std::string secondary_root = SecondaryRoot();
  RemoveStaleSecondaryDirs(secondary_root);
  core->secondary_base_ = secondary_root + "/" + kSecondaryPrefix + std::to_string(getpid()) + "-" +
                          std::to_string(counter++) + "-" + std::to_string(std::random_device{}());
  core->secondary_dir_ = core->secondary_base_;
  core->secondary_lock_fd_ = LockSecondaryBase(core->secondary_base_);
  {
    OPTSTATE_ASSIGN_OR_RETURN(bool has_index, fs->Exists(JoinPath(path, "index")));
    if (!has_index) return Corruption("store " + path + " is damaged: index/ is missing");
    OPTSTATE_ASSIGN_OR_RETURN(core->db_,
                              core->OpenSecondary(core->secondary_dir_, " is damaged or unreadable: index (secondary)"));
  }
  OPTSTATE_RETURN_IF_ERROR(OpenDataFiles(core.get(), /*create_missing=*/false));
  Status loaded;
  {
    // Not shared yet: the locks are for the analysis (and cost nothing).
    MutexLock cl(&core->catchup_mu_);
    MutexLock l(&core->mu_);
    loaded = core->LoadIndexChecked(core->ReadAckedGeneration());
  }
  if (!loaded.ok()) OPTSTATE_RETURN_IF_ERROR(core->CatchUpChecked(/*reopen_first=*/true));
  MutexLock l(&core->mu_);
  OPTSTATE_RETURN_IF_ERROR(CheckReferencedFiles(core.get()));
  core->space_.assign(core->data_files_.size(), {});  // slot counts only: no allocation here
  for (uint32_t d = 0; d < core->data_files_.size(); ++d) {
    if (!core->data_files_[d]) continue;
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, core->data_files_[d]->Size());
    core->space_[d].slots = size / core->SlotBytes();
  }
  return NewStore(std::move(core));
}

}  // namespace optstate::vfs
