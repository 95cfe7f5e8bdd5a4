// The connection of a mount to the kernel (mount/internal/fuse_connection.h),
// and the checks of a mountpoint before mounting (mount/fuse_mount.h).
#include "mount/internal/fuse_connection.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "mount/fuse_mount.h"
#include "mount/internal/push_gate.h"
#include "base/log.h"
#include "vfs/store.h"

namespace optstate::mount::internal {

std::string UnescapeMountinfo(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      out.push_back(static_cast<char>(std::strtol(s.substr(i + 1, 3).c_str(), nullptr, 8)));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// The mount on top at `real_path` (a realpath), per /proc/self/mountinfo.
std::optional<MountEntry> TopMountAt(const std::string& real_path) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  std::optional<MountEntry> top;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string id, parent, dev, root, mp;
    ls >> id >> parent >> dev >> root >> mp;
    if (UnescapeMountinfo(mp) != real_path) continue;
    MountEntry e;
    e.dev = dev;
    std::string tok;
    while (ls >> tok && tok != "-") {
    }
    ls >> e.fstype >> e.source;
    top = std::move(e);  // later lines are mounted over earlier ones
  }
  return top;
}

std::string MountedDevice(const std::string& mountpoint) {
  char real[PATH_MAX];
  if (::realpath(mountpoint.c_str(), real) == nullptr) return "";
  const std::optional<MountEntry> m = TopMountAt(real);
  return m ? m->dev : std::string();
}

void SetKernelReadahead(const std::string& dev, uint64_t bytes) {
  if (dev.empty()) return;
  const std::string path = "/sys/class/bdi/" + dev + "/read_ahead_kb";
  std::ofstream out(path);
  out << (bytes >> 10) << "\n";
  out.close();
  if (!out) {
    OPTSTATE_LOG_WARN("optstate-mount: cannot set {} to {} (kernel read-ahead stays at its default): {}", path,
                      bytes >> 10, std::strerror(errno));
  }
}

std::string ConnectionAbortPath(const std::string& dev) {
  if (dev.rfind("0:", 0) != 0) return "";
  constexpr const char* kFusectl = "/sys/fs/fuse/connections";
  const std::string path = std::string(kFusectl) + "/" + dev.substr(2) + "/abort";
  if (::access(path.c_str(), W_OK) != 0 && ::access(kFusectl, F_OK) == 0) {
    // systemd mounts fusectl; a bare system or a container may not have.
    (void)::mount("fusectl", kFusectl, "fusectl", 0, nullptr);
  }
  return ::access(path.c_str(), W_OK) == 0 ? path : "";
}

void AbortConnection(const char* abort_path) {
  if (abort_path == nullptr || abort_path[0] == '\0') return;
  int fd = ::open(abort_path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)!::write(fd, "1", 1);
  ::close(fd);
}

bool DrainPushes(struct fuse_session* se, PushGate* gate, const std::string& abort_path,
                 std::chrono::milliseconds wait) {
  gate->Refuse();
  const auto deadline = std::chrono::steady_clock::now() + wait;
  struct fuse_buf buf;
  std::memset(&buf, 0, sizeof(buf));
  // Stores in flight, and asks whose answers libfuse has yet to process (it
  // frees an ask's record then; the kernel answers while still mounted).
  while ((gate->InFlight() > 0 || gate->Unanswered() > 0) && std::chrono::steady_clock::now() < deadline) {
    struct pollfd p = {fuse_session_fd(se), POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    const int n = fuse_session_receive_buf(se, &buf);
    if (n > 0) {
      fuse_session_process_buf(se, &buf);
    } else if (n != -EINTR && n != -EAGAIN) {
      break;  // the connection is gone: its requests failed, the stores return
    }
  }
  std::free(buf.mem);
  if (gate->InFlight() == 0) return true;
  OPTSTATE_LOG_WARN("optstate-mount: a page-cache push still waits for the kernel; aborting the connection ({})",
                    abort_path.empty() ? "no fusectl: cannot" : abort_path);
  AbortConnection(abort_path.c_str());
  for (int i = 0; i < 100 && gate->InFlight() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return gate->InFlight() == 0;
}

void NoOpSignal(int) {}


Guardian StartGuardian(struct fuse_session* se, const std::string& abort_path) {
  if (abort_path.empty()) return {};
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return {};
  const pid_t parent = ::getpid();
  const pid_t g = ::fork();
  if (g < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return {};
  }
  if (g == 0) {
    // The child: async-signal-safe calls only. No descriptor but the pipe's
    // read end: a copy of /dev/fuse here would keep the connection alive.
    int keep = fds[0];
    ::close(fuse_session_fd(se));
    if (keep != 3) {
      ::dup2(keep, 3);
      keep = 3;
    }
    if (::close_range(4, ~0u, 0) != 0) {
      for (int fd = 4; fd < 65536; ++fd) ::close(fd);
    }
    // SIGUSR1 comes only as the parent-death signal (no SA_RESTART: the read
    // below returns EINTR). The stop signals are the daemon's business (a
    // service manager sends them to the whole group): ignored. getppid()
    // does not tell: the main thread's children go to another thread of the
    // same process, the one stuck in the kernel.
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = NoOpSignal;
    ::sigaction(SIGUSR1, &sa, nullptr);
    sa.sa_handler = SIG_IGN;
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGHUP, &sa, nullptr);
    ::prctl(PR_SET_PDEATHSIG, SIGUSR1);
    char b = 0;
    ssize_t n = -1;
    if (::getppid() == parent) {  // else it died before the prctl
      do {
        n = ::read(keep, &b, 1);
      } while (n < 0 && errno != EINTR);
    }
    if (n == 1) ::_exit(0);  // a clean exit: nothing to abort
    if (n < 0) {
      // The main thread is gone; a clean exit's byte may be there already.
      const int fl = ::fcntl(keep, F_GETFL);
      ::fcntl(keep, F_SETFL, fl | O_NONBLOCK);
      if (::read(keep, &b, 1) == 1) ::_exit(0);
    }
    AbortConnection(abort_path.c_str());
    ::_exit(0);
  }
  ::close(fds[0]);
  return {fds[1], g};
}

void GuardianDone(const Guardian& g) {
  if (g.fd < 0) return;
  (void)!::write(g.fd, "1", 1);
  ::close(g.fd);
  int st;
  (void)::waitpid(g.pid, &st, 0);
}

}  // namespace optstate::mount::internal

namespace optstate::mount {

using internal::MountEntry;
using internal::TopMountAt;

Status CheckMountpoint(const std::string& mountpoint) {
  auto dead = [&] {
    return Busy(fmt::format(
        "mountpoint {} is a dead FUSE mount (its daemon exited); run `fusermount3 -u {}` and mount again",
        mountpoint, mountpoint));
  };
  struct stat st;
  if (::stat(mountpoint.c_str(), &st) != 0) {
    int e = errno;
    if (e == ENOTCONN) return dead();
    return ErrnoStatus("mountpoint " + mountpoint, e);
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument("mountpoint " + mountpoint + " is not a directory");
  char real[PATH_MAX];
  if (::realpath(mountpoint.c_str(), real) == nullptr) return ErrnoStatus("realpath " + mountpoint, errno);
  const std::optional<MountEntry> m = TopMountAt(real);
  if (!m) return Status();
  // A dead FUSE daemon's mount can still answer stat from the kernel's
  // attribute cache (the root's attributes are cached for a second); statfs
  // always goes to the daemon.
  struct statvfs sv;
  if (::statvfs(mountpoint.c_str(), &sv) != 0 && errno == ENOTCONN) return dead();
  return Busy(fmt::format(
      "mountpoint {} is busy: {} is mounted there (source {}); unmount it first (`fusermount3 -u {}`)",
      mountpoint, m->fstype, m->source, mountpoint));
}

Status CheckStoreRoot(const std::string& store_root) {
  struct stat rs;
  if (::stat(store_root.c_str(), &rs) != 0 || !S_ISDIR(rs.st_mode)) {
    return InvalidArgument(fmt::format("STORE_ROOT {} is not a directory", store_root));
  }
  struct stat id;
  if (::stat((store_root + "/IDENTITY").c_str(), &id) == 0 && S_ISREG(id.st_mode)) {
    const size_t slash = store_root.find_last_of('/');
    const std::string parent = slash == std::string::npos || slash == 0 ? "/" : store_root.substr(0, slash);
    return InvalidArgument(fmt::format(
        "{} is a store; mount its parent ({}), which serves every store in it as MOUNTPOINT/<store>/", store_root,
        parent));
  }
  // On a read-only bind mount every store would fail to open: say so now.
  return vfs::CheckReaderFilesystem(store_root);
}

std::optional<std::string> HiddenByMountWarning(const std::string& mountpoint) {
  DIR* d = ::opendir(mountpoint.c_str());
  if (d == nullptr) return std::nullopt;
  size_t n = 0;
  std::string first;
  while (dirent* de = ::readdir(d)) {
    const std::string name = de->d_name;
    if (name == "." || name == "..") continue;
    if (n++ == 0) first = name;
  }
  ::closedir(d);
  if (n == 0) return std::nullopt;
  return fmt::format("mountpoint {} is not empty ({} entr{}, e.g. '{}'): hidden while the mount is up", mountpoint,
                     n, n == 1 ? "y" : "ies", first);
}

}  // namespace optstate::mount
