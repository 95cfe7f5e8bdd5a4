// The real file system: POSIX calls, errors converted by ErrnoStatus with the
// path, offset and length of the operation in the message.
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "vfs/file_system.h"
#include "vfs/internal/posix_file.h"
#include "base/log.h"
#include "base/status.h"

namespace optstate::vfs {

const char* OpClassName(OpClass c) {
  switch (c) {
    case OpClass::kRead: return "read";
    case OpClass::kWrite: return "write";
    case OpClass::kSync: return "sync";
    case OpClass::kOpen: return "open";
    case OpClass::kFallocate: return "fallocate";
    case OpClass::kMetadata: return "metadata";
    case OpClass::kIndexWrite: return "index_write";
    case OpClass::kIndexSync: return "index_sync";
  }
  return "unknown";
}

namespace internal {
namespace {
std::atomic<bool> g_direct_refused_for_testing{false};
std::atomic<uint64_t> g_direct_fallback_warnings{0};
std::atomic<uint64_t> g_direct_fallbacks{0};
std::atomic<bool> g_direct_fallback_warned{false};
}  // namespace

void SetDirectRefusedForTesting(bool refused) { g_direct_refused_for_testing = refused; }
uint64_t DirectFallbackWarningCount() { return g_direct_fallback_warnings.load(); }
uint64_t DirectFallbackCount() { return g_direct_fallbacks.load(); }
}  // namespace internal

namespace {

// A transfer that returns EAGAIN this many times in a row (or 0 bytes on a
// write) is reported as an error rather than retried forever.
constexpr int kMaxNoProgressRetries = 1000;

std::string OpWhat(const char* op, const std::string& path, uint64_t offset, uint64_t len) {
  std::string s(op);
  s += ' ';
  s += path;
  s += " offset ";
  s += std::to_string(offset);
  s += " length ";
  s += std::to_string(len);
  return s;
}

std::string DirName(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

class PosixFile final : public File {
 public:
  PosixFile(std::string path, int fd, bool direct) : path_(std::move(path)), fd_(fd), direct_(direct) {}
  ~PosixFile() override {
    if (fd_ >= 0 && ::close(fd_) != 0) {
      OPTSTATE_LOG_WARN("close {}: {}", path_, std::strerror(errno));
    }
  }

  const std::string& path() const override { return path_; }
  int fd() const override { return fd_; }
  bool direct() const override { return direct_; }

  Status Pread(uint64_t offset, void* buf, uint64_t len) const override {
    auto* p = static_cast<char*>(buf);
    uint64_t done = 0;
    int no_progress = 0;
    while (done < len) {
      ssize_t n = ::pread(fd_, p + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        int err = errno;
        if ((err == EINTR || err == EAGAIN) && ++no_progress < kMaxNoProgressRetries) continue;
        return ErrnoStatus(OpWhat("pread", path_, offset, len), err);
      }
      if (n == 0) {
        return IoError(OpWhat("pread", path_, offset, len) + ": unexpected end of file after " +
                       std::to_string(done) + " bytes (file is shorter than the range read)");
      }
      no_progress = 0;
      done += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  Status Pwrite(uint64_t offset, const void* buf, uint64_t len) override {
    const auto* p = static_cast<const char*>(buf);
    uint64_t done = 0;
    int no_progress = 0;
    while (done < len) {
      ssize_t n = ::pwrite(fd_, p + done, len - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        int err = errno;
        if ((err == EINTR || err == EAGAIN) && ++no_progress < kMaxNoProgressRetries) continue;
        return ErrnoStatus(OpWhat("pwrite", path_, offset, len), err);
      }
      if (n == 0) {
        if (++no_progress < kMaxNoProgressRetries) continue;
        return IoError(OpWhat("pwrite", path_, offset, len) + ": no progress after " +
                       std::to_string(done) + " bytes");
      }
      no_progress = 0;
      done += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  Status Fdatasync() override {
    if (::fdatasync(fd_) != 0) return ErrnoStatus("fdatasync " + path_, errno);
    return Status::Ok();
  }
  Status Fsync() override {
    if (::fsync(fd_) != 0) return ErrnoStatus("fsync " + path_, errno);
    return Status::Ok();
  }
  Status Fallocate(uint64_t offset, uint64_t len) override {
    int rc;
    do {
      rc = ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(len));
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return ErrnoStatus(OpWhat("fallocate", path_, offset, len), errno);
    return Status::Ok();
  }
  Result<uint64_t> Size() const override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoStatus("fstat " + path_, errno);
    return static_cast<uint64_t>(st.st_size);
  }
  FaultHooks* hooks() const override { return nullptr; }

 private:
  const std::string path_;
  const int fd_;
  const bool direct_;
};

int OpenRetryingEintr(const char* path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

class PosixFileSystem final : public FileSystem {
 public:
  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& opts) override {
    int flags = O_CLOEXEC | (opts.read_only ? O_RDONLY : O_RDWR);
    if (opts.create) flags |= O_CREAT;
    if (opts.create && opts.exclusive) flags |= O_EXCL;
    bool direct = opts.direct;
    int fd = -1;
    if (direct) {
      if (internal::g_direct_refused_for_testing.load()) {
        fd = -1;
        errno = EINVAL;
      } else {
        fd = OpenRetryingEintr(path.c_str(), flags | O_DIRECT, 0644);
      }
      if (fd < 0 && errno == EINVAL) {
        // The filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE
        // filesystems): buffered I/O is correct, only slower and page-cached.
        direct = false;
        internal::g_direct_fallbacks.fetch_add(1);
        if (!internal::g_direct_fallback_warned.exchange(true)) {
          internal::g_direct_fallback_warnings.fetch_add(1);
          OPTSTATE_LOG_WARN(
              "open {}: the filesystem refuses O_DIRECT (EINVAL); falling back to buffered I/O "
              "(warned once per process; data goes through the page cache)",
              path);
        }
        fd = OpenRetryingEintr(path.c_str(), flags, 0644);
        // Old tmpfs created the file before refusing O_DIRECT; an exclusive
        // create must not then fail on the file the first attempt made.
        if (fd < 0 && errno == EEXIST && (flags & O_EXCL) != 0) {
          fd = OpenRetryingEintr(path.c_str(), flags & ~O_EXCL, 0644);
        }
      } else if (fd < 0) {
        return ErrnoStatus("open " + path + " (O_DIRECT)", errno);
      }
    } else {
      fd = OpenRetryingEintr(path.c_str(), flags, 0644);
    }
    if (fd < 0) return ErrnoStatus("open " + path, errno);
    return std::unique_ptr<File>(std::make_unique<PosixFile>(path, fd, direct));
  }

  Status CreateDir(const std::string& path) override {
    if (path.empty()) return InvalidArgument("CreateDir: empty path");
    // mkdir -p: create each missing component.
    for (size_t pos = 1; pos <= path.size(); ++pos) {
      if (pos != path.size() && path[pos] != '/') continue;
      std::string prefix = path.substr(0, pos);
      if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
        return ErrnoStatus("mkdir " + prefix, errno);
      }
    }
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return ErrnoStatus("stat " + path, errno);
    if (!S_ISDIR(st.st_mode)) return ErrnoStatus("mkdir " + path, ENOTDIR);
    return Status::Ok();
  }

  Status SyncDir(const std::string& path) override {
    int fd = OpenRetryingEintr(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (fd < 0) return ErrnoStatus("open directory " + path, errno);
    int rc = ::fsync(fd);
    int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus("fsync directory " + path, err);
    return Status::Ok();
  }

  Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoStatus("rename " + from + " to " + to, errno);
    }
    return Status::Ok();
  }

  Status Remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return ErrnoStatus("unlink " + path, errno);
    return Status::Ok();
  }

  Status RemoveAll(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return Status::Ok();
      return ErrnoStatus("lstat " + path, errno);
    }
    if (!S_ISDIR(st.st_mode)) return Remove(path);
    static thread_local int tl_err;
    static thread_local std::string* tl_failed;
    std::string failed;
    tl_err = 0;
    tl_failed = &failed;
    int rc = ::nftw(
        path.c_str(),
        [](const char* p, const struct stat*, int type, struct FTW*) -> int {
          int r = (type == FTW_DP) ? ::rmdir(p) : ::unlink(p);
          if (r != 0 && errno != ENOENT) {
            tl_err = errno;
            *tl_failed = p;
            return 1;
          }
          return 0;
        },
        64, FTW_DEPTH | FTW_PHYS);
    if (rc != 0) {
      if (tl_err != 0) return ErrnoStatus("remove " + failed + " (removing tree " + path + ")", tl_err);
      return ErrnoStatus("walk tree " + path, errno);
    }
    return Status::Ok();
  }

  Result<bool> Exists(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) return true;
    if (errno == ENOENT || errno == ENOTDIR) return false;
    return ErrnoStatus("stat " + path, errno);
  }

  Result<std::vector<std::string>> ListDir(const std::string& path) override {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) return ErrnoStatus("opendir " + path, errno);
    std::vector<std::string> names;
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      std::string name(e->d_name);
      if (name != "." && name != "..") names.push_back(std::move(name));
      errno = 0;
    }
    int err = errno;
    ::closedir(d);
    if (err != 0) return ErrnoStatus("readdir " + path, err);
    std::sort(names.begin(), names.end());
    return names;
  }

  Result<std::string> ReadFileToString(const std::string& path) override {
    OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> f, Open(path, OpenOptions{.read_only = true}));
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t size, f->Size());
    std::string out(size, '\0');
    OPTSTATE_RETURN_IF_ERROR(f->Pread(0, out.data(), size));
    return out;
  }

  Status WriteFileAtomic(const std::string& path, const std::string& contents) override {
    static std::atomic<uint64_t> counter{0};
    std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    Status s = [&]() -> Status {
      OPTSTATE_ASSIGN_OR_RETURN(std::unique_ptr<File> f,
                                Open(tmp, OpenOptions{.create = true, .exclusive = true}));
      OPTSTATE_RETURN_IF_ERROR(f->Pwrite(0, contents.data(), contents.size()));
      OPTSTATE_RETURN_IF_ERROR(f->Fsync());
      return Status::Ok();
    }();
    if (s.ok()) s = Rename(tmp, path);
    if (!s.ok()) {
      ::unlink(tmp.c_str());
      return s.WithContext("write " + path + " atomically");
    }
    return SyncDir(DirName(path)).WithContext("write " + path + " atomically");
  }

  FaultHooks* hooks() const override { return nullptr; }
};

}  // namespace

FileSystem* FileSystem::Default() {
  static FileSystem* fs = new PosixFileSystem();  // never deleted: used until exit
  return fs;
}

}  // namespace optstate::vfs
