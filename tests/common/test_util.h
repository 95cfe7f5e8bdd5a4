// Helpers shared by the test folders (tests/vfs store tests, tests/reliability):
// temp directories, aligned buffers, the deterministic chunk content used as an
// independent reference, and the driver of the crash-loop child processes.
// Header-only; depends on nothing of ours and not on GoogleTest, so child
// binaries (store_crash_child) may include it too.
//
// Namespace optstate::test_util (not "testing": inside namespace optstate a
// nested `testing` would hide GoogleTest's ::testing).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace optstate::test_util {

// How long a wait on something no event signals (another process's state, a
// file or mount appearing, a background thread's counter) may take before the
// test calls it a hang: generous, so that only a hang fails, never a slow or
// loaded machine.
inline constexpr std::chrono::milliseconds kHangLimit{60000};

// Polls `done` every `poll` until it returns true or `limit` has passed;
// returns its last value. A wait on a real condition, never a fixed sleep
// "to let it happen": callers assert on the result (or on the condition).
template <typename Done>
bool WaitFor(Done&& done, std::chrono::milliseconds limit = kHangLimit,
             std::chrono::milliseconds poll = std::chrono::milliseconds(10)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  for (;;) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= end) return done();
    std::this_thread::sleep_for(poll);
  }
}

// $var when set and not empty, else `fallback`: where a test makes its temp dirs.
inline std::string EnvDirOr(const char* var, const std::string& fallback) {
  const char* v = std::getenv(var);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}

// A fresh directory made by mkdtemp(`tmpl` + "XXXXXX"), removed (recursively)
// on destruction. The template picks the disk: /var/tmp is a real disk where
// /tmp may be tmpfs (no O_DIRECT).
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "/tmp/optstate-test-") {
    std::string tmpl = prefix + "XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      std::fprintf(stderr, "TempDir: mkdtemp(%s): %s\n", tmpl.c_str(), std::strerror(errno));
      std::abort();
    }
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& s) const { return path_ + "/" + s; }

 private:
  std::string path_;
};

// 4096-aligned heap buffer of n bytes, filled with 0xAB.
class Buf {
 public:
  explicit Buf(uint64_t n) : n_(n), p_(static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096))) {
    std::memset(p_, 0xAB, n_);
  }
  ~Buf() { std::free(p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  uint8_t* data() { return p_; }
  const uint8_t* data() const { return p_; }
  uint64_t size() const { return n_; }

 private:
  uint64_t n_;
  uint8_t* p_;
};

// splitmix64-based bytes: content = f(seed) for `len` bytes.
inline void FillPattern(void* dst, uint64_t len, uint64_t seed) {
  auto* p = static_cast<uint8_t*>(dst);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, 8);
  }
  for (; i < len; ++i) p[i] = static_cast<uint8_t>(seed + i);
}

// The pattern seed of chunk (tensor, field, chunk) as written by generation gen.
inline uint64_t ChunkSeed(uint64_t gen, uint32_t tensor, uint32_t field, uint64_t chunk) {
  return (gen << 40) ^ (uint64_t{tensor} << 24) ^ (uint64_t{field} << 20) ^ chunk ^ 0x5bd1e995ull;
}

// ---- child processes of the crash loops ----

// `name` in the directory of the running executable (test binaries find their
// child binaries next to themselves); `name` itself if /proc/self/exe is unreadable.
inline std::string SiblingBinary(const std::string& name) {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return name;
  exe[n] = '\0';
  return (std::filesystem::path(exe).parent_path() / name).string();
}

struct ChildOptions {
  std::string exe;                 // path of the binary
  std::vector<std::string> args;   // argv[1..]
  std::string crash_at;            // OPTSTATE_CRASH_AT for the child (tests/common/test_hooks.cc); empty: unset
  int kill_after_ms = -1;          // SIGKILL after this many ms; < 0: only the guard
  int guard_ms = 60000;            // SIGKILL after this many ms anyway; < 0: never
  bool capture_stderr = false;     // stderr into the output too (else inherited)
  // Called for every output line (without '\n') with the child's pid, e.g. to
  // act while the child holds something.
  std::function<void(const std::string& line, pid_t pid)> on_line;
};

struct ChildResult {
  int wait_status = 0;    // from waitpid
  uint64_t last_ack = 0;  // N of the last "ACK N" line
  bool ready = false;     // a line starting with "READY" was printed
  std::string output;     // every line, '\n'-terminated
  std::string error;      // non-empty: the child could not be started (pipe2/fork)
};

// Runs the child with OPTSTATE_LOG_LEVEL=error, reads its output line by line
// until EOF (the child and everything holding its stdout are gone), SIGKILLs
// it at kill_after_ms (or the guard), and reaps it.
inline ChildResult RunChild(const ChildOptions& o) {
  ChildResult r;
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) {
    r.error = std::string("pipe2: ") + std::strerror(errno);
    r.wait_status = -1;
    return r;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    r.error = std::string("fork: ") + std::strerror(errno);
    r.wait_status = -1;
    ::close(pipefd[0]);
    ::close(pipefd[1]);
    return r;
  }
  if (pid == 0) {
    ::dup2(pipefd[1], 1);
    if (o.capture_stderr) ::dup2(pipefd[1], 2);
    if (o.crash_at.empty()) {
      ::unsetenv("OPTSTATE_CRASH_AT");
    } else {
      ::setenv("OPTSTATE_CRASH_AT", o.crash_at.c_str(), 1);
    }
    ::setenv("OPTSTATE_LOG_LEVEL", "error", 1);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(o.exe.c_str()));
    for (const auto& a : o.args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(o.exe.c_str(), argv.data());
    _exit(127);
  }
  ::close(pipefd[1]);
  const auto start = std::chrono::steady_clock::now();
  const int deadline = o.kill_after_ms >= 0 ? o.kill_after_ms : o.guard_ms;  // < 0: none
  std::string pending;
  bool killed = false;
  for (;;) {
    const int elapsed = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count());
    if (!killed && deadline >= 0 && elapsed >= deadline) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    pollfd p{pipefd[0], POLLIN, 0};
    const int timeout = killed ? 1000 : deadline < 0 ? -1 : std::max(1, deadline - elapsed);
    const int pr = ::poll(&p, 1, timeout);
    if (pr > 0) {
      char buf[4096];
      const ssize_t n = ::read(pipefd[0], buf, sizeof(buf));
      if (n <= 0) break;  // EOF: the child is gone
      pending.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = pending.find('\n')) != std::string::npos) {
        std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        r.output += line + "\n";
        if (line.rfind("ACK ", 0) == 0) r.last_ack = std::stoull(line.substr(4));
        if (line.rfind("READY", 0) == 0) r.ready = true;
        if (o.on_line) o.on_line(line, pid);
      }
    }
  }
  r.output += pending;  // an unterminated last line
  ::close(pipefd[0]);
  ::waitpid(pid, &r.wait_status, 0);
  return r;
}

}  // namespace optstate::test_util
