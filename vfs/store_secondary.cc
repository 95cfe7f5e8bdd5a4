// Read-only stores (Core, vfs/internal/store_core.h): the RocksDB secondary
// instance of the index, catch-up with the writer, and the checks that keep a
// reader from ever showing an older state than one it showed or was acknowledged.
#include "vfs/internal/store_core.h"
#include "vfs/internal/store_open.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>

namespace optstate::vfs::internal {
namespace {

// Removes <root>/<base> and its reopened instances <base>-r<N>.
void RemoveSecondaryBase(const std::string& root, const std::string& base) {
  namespace sfs = std::filesystem;
  std::error_code ec;
  std::vector<sfs::path> doomed;
  for (sfs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name == base || name.rfind(base + "-r", 0) == 0) doomed.push_back(it->path());
  }
  for (const auto& p : doomed) sfs::remove_all(p, ec);
}

}  // namespace

Status Core::LoadIndexChecked(uint64_t acked) {
  auto saved = std::make_tuple(std::move(tensors_), std::move(names_), std::move(dropped_), next_tensor_id_, latest_,
                               std::move(generations_), std::move(snapshots_), std::move(versions_), std::move(packs_),
                               lifetime_bytes_);
  Status s = LoadIndex();
  const uint64_t floor = std::max(acked, max_latest_loaded_);
  if (s.ok() && latest_.generation < floor) {
    s = Busy("store " + path_ + ": this reader's copy of the index shows generation " +
             std::to_string(latest_.generation) + " as latest, but generation " + std::to_string(floor) +
             (floor == acked ? " was acknowledged (COMMITTED)" : " was latest before") +
             ": the RocksDB secondary instance lags the writer" +
             (floor == acked ? " (if this persists while no writer runs, the index lost acknowledged "
                               "generations: the store is damaged; run `optstate-inspect " +
                                   path_ + " verify`)"
                             : ""));
  }
  if (s.ok()) s = CheckIndexOf(latest_.generation);
  if (!s.ok()) {
    std::tie(tensors_, names_, dropped_, next_tensor_id_, latest_, generations_, snapshots_, versions_, packs_,
             lifetime_bytes_) =
        std::move(saved);
    loaded_seq_.reset();
    return s;
  }
  max_latest_loaded_ = latest_.generation;
  loaded_seq_ = db_->GetLatestSequenceNumber();
  return s;
}

Result<std::unique_ptr<rocksdb::DB>> Core::OpenSecondary(const std::string& dir, const std::string& what) {
  OPTSTATE_RETURN_IF_ERROR(fs_->CreateDir(dir));
  rocksdb::Options o = IndexOptions(this);
  // Each catch-up that brings a new version opens its table files through a
  // pool of this many threads, created and ended every time (default 16:
  // the mount's daemon created thousands of threads in a `cp -r`); the
  // index has few table files.
  o.max_file_opening_threads = 1;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status rs = rocksdb::DB::OpenAsSecondary(o, JoinPath(path_, "index"), dir, &raw);
  if (!rs.ok()) {
    (void)fs_->RemoveAll(dir);
    return RocksStatus("store " + path_ + what, rs);
  }
  return std::unique_ptr<rocksdb::DB>(raw);
}

Status Core::ReopenSecondary() {
  const std::string dir = secondary_base_ + "-r" + std::to_string(++secondary_reopens_);
  OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<rocksdb::DB> db, OpenSecondary(dir, ": reopen of the index (secondary)"));
  std::unique_ptr<rocksdb::DB> old;
  std::string old_dir;
  {
    MutexLock l(&mu_);
    old = std::exchange(db_, std::move(db));
    old_dir = std::exchange(secondary_dir_, dir);
  }
  old.reset();
  (void)fs_->RemoveAll(old_dir);
  return Status();
}

Status Core::CatchUpChecked(bool reopen_first) {
  MutexLock cl(&catchup_mu_);
  const uint64_t acked = ReadAckedGeneration();  // before the catch-up: a floor for it
  Status s;
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5 * attempt));
    if (attempt == 0 && !reopen_first) {
      s = RocksStatus("store " + path_ + ": catch up with the writer", db_->TryCatchUpWithPrimary());
      if (s.ok() && loaded_seq_.has_value() && *loaded_seq_ == db_->GetLatestSequenceNumber()) {
        MutexLock l(&mu_);
        if (acked <= latest_.generation) return s;
      }
    } else {
      s = ReopenSecondary();
    }
    if (s.ok()) {
      MutexLock l(&mu_);
      s = LoadIndexChecked(acked);
    }
    if (s.ok()) return s;
    OPTSTATE_LOG_INFO("store {}: catch-up try {} failed ({}); reopening the index", path_, attempt + 1,
                      s.ToString());
  }
  return s;
}

int LockSecondaryBase(const std::string& base) {
  int fd = ::open((base + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return -1;  // the directory then only ages out by its pid
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::string SecondaryRoot() {
  // $TMPDIR as every Unix tool reads it; a relative one would move with the
  // process's working directory, so it does not count.
  const char* t = std::getenv("TMPDIR");
  if (t != nullptr && t[0] == '/') return std::string(t);
  return "/tmp";
}

void RemoveStaleSecondaryDirs(const std::string& root) {
  namespace sfs = std::filesystem;
  std::error_code ec;
  std::map<std::string, bool> bases;  // base -> has a lock file
  const size_t prefix = std::strlen(kSecondaryPrefix);
  for (sfs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kSecondaryPrefix, 0) != 0) continue;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".lock") == 0) {
      bases[name.substr(0, name.size() - 5)] = true;
      continue;
    }
    const auto r = name.find("-r", prefix);
    bases.emplace(r == std::string::npos ? name : name.substr(0, r), false);
  }
  for (const auto& [base, has_lock] : bases) {
    const std::string lock_path = root + "/" + base + ".lock";
    if (has_lock) {
      const int fd = ::open(lock_path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {  // its reader is gone
        RemoveSecondaryBase(root, base);
        (void)::unlink(lock_path.c_str());
      }
      ::close(fd);
      continue;
    }
    const char* digits = base.c_str() + prefix;
    char* end = nullptr;
    const long pid = std::strtol(digits, &end, 10);
    if (end == digits || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    RemoveSecondaryBase(root, base);
  }
}

}  // namespace optstate::vfs::internal
