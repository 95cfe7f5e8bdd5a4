#include "tools/internal/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

extern char** environ;

namespace optstate::tools {

namespace fs = std::filesystem;

namespace {

std::vector<char*> CArgv(const std::vector<std::string>& argv) {
  std::vector<char*> out;
  for (const auto& a : argv) out.push_back(const_cast<char*>(a.c_str()));
  out.push_back(nullptr);
  return out;
}

int DecodeWait(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

std::string JoinCommand(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    if (!out.empty()) out += ' ';
    bool plain = !a.empty() && a.find_first_of(" \t'\"\\$") == std::string::npos;
    out += plain ? a : "'" + a + "'";
  }
  return out;
}

Result<CommandResult> RunCommand(const std::vector<std::string>& argv) {
  if (argv.empty()) return InvalidArgument("RunCommand: empty argv");
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) return ErrnoStatus("pipe", errno);
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    int e = errno;
    close(out_pipe[0]);
    close(out_pipe[1]);
    return ErrnoStatus("pipe", e);
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, err_pipe[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  pid_t pid;
  auto cargv = CArgv(argv);
  int rc = posix_spawnp(&pid, argv[0].c_str(), &fa, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (rc != 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    return ErrnoStatus(fmt::format("cannot run '{}'", JoinCommand(argv)), rc);
  }
  CommandResult res;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    int n = poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t r = read(fds[i].fd, buf, sizeof(buf));
      if (r > 0) {
        (i == 0 ? res.out : res.err).append(buf, static_cast<size_t>(r));
      } else if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  res.exit_code = DecodeWait(status);
  return res;
}

Result<std::string> SelfDir() {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return ErrnoStatus("readlink /proc/self/exe", ec.value());
  return p.parent_path().string();
}

bool InPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (!dir.empty() && access((dir + "/" + name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

Result<std::string> FindTool(const std::string& name) {
  std::vector<std::string> tried;
  auto self = SelfDir();
  if (self.ok()) {
    for (const char* rel : {"", "/../mount", "/../tools"}) {
      std::string cand = *self + rel + "/" + name;
      tried.push_back(cand);
      if (access(cand.c_str(), X_OK) == 0) {
        std::error_code ec;
        fs::path canon = fs::weakly_canonical(cand, ec);
        return ec ? cand : canon.string();
      }
    }
  }
  if (InPath(name)) return name;
  std::string where;
  for (const auto& t : tried) where += " " + t;
  return NotFound(fmt::format("cannot find '{}' (looked at{} and in PATH); build it with "
                              "`cmake --build --preset default`",
                              name, where));
}

Result<std::string> MakeTempDir(const std::string& prefix, const std::string& parent) {
  std::string base = parent;
  if (base.empty()) {
    const char* t = std::getenv("TMPDIR");
    base = (t && *t) ? t : "/tmp";
  }
  std::string tmpl = base + "/" + prefix + "XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return ErrnoStatus(fmt::format("mkdtemp {}", tmpl), errno);
  return std::string(buf.data());
}

Status RemoveTree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return ErrnoStatus(fmt::format("remove {}", path), ec.value());
  return Status::Ok();
}

bool IsFuseMounted(const std::string& path) {
  std::error_code ec;
  fs::path canon = fs::weakly_canonical(path, ec);
  std::string want = ec ? path : canon.string();
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    // id parent major:minor root mountpoint opts... - fstype source superopts
    std::istringstream ls(line);
    std::string id, parent, dev, root, mnt;
    ls >> id >> parent >> dev >> root >> mnt;
    size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream rest(line.substr(dash + 3));
    std::string fstype;
    rest >> fstype;
    // mountinfo escapes spaces as \040; our paths have none in practice.
    if (mnt == want && fstype.rfind("fuse", 0) == 0) return true;
  }
  return false;
}

Result<uint64_t> TreeBytes(const std::string& path) {
  std::error_code ec;
  uint64_t total = 0;
  auto it = fs::recursive_directory_iterator(path, ec);
  if (ec) return ErrnoStatus(fmt::format("list {}", path), ec.value());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) return ErrnoStatus(fmt::format("list {}", path), ec.value());
    if (it->is_regular_file(ec) && !it->is_symlink(ec)) total += it->file_size(ec);
  }
  return total;
}

DiskCounters ReadDiskCounters(const std::string& path) {
  DiskCounters c;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return c;
  std::ifstream in("/proc/diskstats");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    unsigned maj = 0, min = 0;
    std::string name;
    if (!(ls >> maj >> min >> name)) continue;
    if (maj != major(st.st_dev) || min != minor(st.st_dev)) continue;
    // reads merged sectors ms writes merged sectors ms in_flight io_ticks
    // queue_ms [discards merged sectors ms [flushes ms]] (Documentation/admin-guide/iostats.rst)
    std::vector<uint64_t> f;
    for (uint64_t v; ls >> v;) f.push_back(v);
    if (f.size() < 11) return c;
    c.ok = true;
    c.device = name;
    c.reads = f[0];
    c.read_sectors = f[2];
    c.writes = f[4];
    c.write_sectors = f[6];
    c.io_ticks_ms = f[9];
    c.queue_ms = f[10];
    c.flushes = f.size() >= 17 ? f[15] : 0;
    return c;
  }
  return c;
}

void DiskPhase::Add(const DiskCounters& before, const DiskCounters& after, double interval_seconds) {
  if (!before.ok || !after.ok) return;
  sum.ok = true;
  sum.device = after.device;
  sum.reads += after.reads - before.reads;
  sum.read_sectors += after.read_sectors - before.read_sectors;
  sum.writes += after.writes - before.writes;
  sum.write_sectors += after.write_sectors - before.write_sectors;
  sum.io_ticks_ms += after.io_ticks_ms - before.io_ticks_ms;
  sum.queue_ms += after.queue_ms - before.queue_ms;
  sum.flushes += after.flushes - before.flushes;
  seconds += interval_seconds;
}

std::string DiskPhase::Describe() const { return DescribeDiskUse(sum, seconds); }

std::string DescribeDiskUse(const DiskCounters& delta, double seconds) {
  if (!delta.ok || seconds <= 0 || (delta.reads == 0 && delta.writes == 0)) return "";
  const double ms = seconds * 1e3;
  std::string out = fmt::format("disk {} busy {:.0f}%, {:.1f} deep", delta.device,
                                std::min(static_cast<double>(delta.io_ticks_ms) / ms, 1.0) * 100,
                                static_cast<double>(delta.queue_ms) / ms);
  auto part = [&](const char* what, uint64_t n, uint64_t sectors) {
    if (n == 0) return;
    out += fmt::format(", {} {:.2f} MiB x {}", what,
                       static_cast<double>(sectors) * 512.0 / static_cast<double>(n) / (1 << 20), n);
  };
  part("reads", delta.reads, delta.read_sectors);
  part("writes", delta.writes, delta.write_sectors);
  if (delta.flushes > 0) out += fmt::format(", {} flushes", delta.flushes);
  return out;
}

Result<Child> Child::Start(const std::vector<std::string>& argv, const std::string& log_path) {
  if (argv.empty()) return InvalidArgument("Child::Start: empty argv");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  if (!log_path.empty()) {
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  }
  pid_t pid;
  auto cargv = CArgv(argv);
  int rc = posix_spawnp(&pid, argv[0].c_str(), &fa, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return ErrnoStatus(fmt::format("cannot start '{}'", JoinCommand(argv)), rc);
  Child c;
  c.pid_ = pid;
  c.argv_ = argv;
  c.log_path_ = log_path;
  return c;
}

Child& Child::operator=(Child&& o) noexcept {
  if (this != &o) {
    Stop();
    pid_ = o.pid_;
    argv_ = std::move(o.argv_);
    log_path_ = std::move(o.log_path_);
    o.pid_ = -1;
  }
  return *this;
}

Child::~Child() { Stop(); }

bool Child::Exited(int* exit_code) {
  if (pid_ <= 0) return true;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    if (exit_code) *exit_code = DecodeWait(status);
    pid_ = -1;
    return true;
  }
  return false;
}

int Child::Stop(int timeout_ms) {
  if (pid_ <= 0) return 0;
  int code = -1;
  if (Exited(&code)) return code;
  kill(pid_, SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Exited(&code)) return code;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  return DecodeWait(status);
}

}  // namespace optstate::tools
