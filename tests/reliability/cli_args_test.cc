// Malformed command lines for optstate-inspect, optstate-restore and
// optstate-mount: every one must exit non-zero (not by a signal), print a
// message on stderr/stdout, and never touch a path it was not given.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

struct Result {
  int status = 0;
  std::string out;
};

Result RunTool(const std::string& exe, const std::vector<std::string>& args) {
  int p[2];
  EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(p[1], 1);
    ::dup2(p[1], 2);
    const int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, 0);
    std::vector<char*> argv{const_cast<char*>(exe.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::alarm(30);  // a hang is a failure too (SIGALRM)
    ::execv(exe.c_str(), argv.data());
    _exit(127);
  }
  ::close(p[1]);
  Result r;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof(buf))) > 0) r.out.append(buf, static_cast<size_t>(n));
  ::close(p[0]);
  ::waitpid(pid, &r.status, 0);
  return r;
}

// `common_convention`: the tool follows docs/CLI.md's error convention:
// "<tool>: error: " first, exit 1 (an error) or 2 (a malformed command line).
void ExpectRejected(const std::string& exe, const std::vector<std::string>& args,
                    bool common_convention = false) {
  const std::string tool = std::filesystem::path(exe).filename().string();
  std::string line = tool;
  for (const auto& a : args) line += " '" + a.substr(0, 40) + (a.size() > 40 ? "...'" : "'");
  Result r = RunTool(exe, args);
  ASSERT_TRUE(WIFEXITED(r.status)) << line << ": killed by signal " << WTERMSIG(r.status) << "\n" << r.out;
  EXPECT_NE(WEXITSTATUS(r.status), 0) << line << ": accepted\n" << r.out;
  EXPECT_FALSE(r.out.empty()) << line << ": no message";
  if (common_convention) {
    EXPECT_TRUE(WEXITSTATUS(r.status) == 1 || WEXITSTATUS(r.status) == 2)
        << line << ": exit " << WEXITSTATUS(r.status) << "\n" << r.out;
    EXPECT_NE(r.out.find(tool + ": error: "), std::string::npos) << line << "\n" << r.out;
  }
}

// An option no tool has: exit 2 and the option named as unknown, whatever
// else is missing.
void ExpectUnknownOptionNamed(const std::string& exe, const std::vector<std::string>& args) {
  Result r = RunTool(exe, args);
  ASSERT_TRUE(WIFEXITED(r.status)) << r.out;
  EXPECT_EQ(WEXITSTATUS(r.status), 2) << r.out;
  EXPECT_NE(r.out.find("unknown option '--frobnicate'"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("is required"), std::string::npos) << r.out;
}

const std::string kMissing = "/nonexistent/optstate-rel-missing";
const std::string kLong(5000, 'a');

std::vector<std::vector<std::string>> Common() {
  return {{},
          {"--no-such-flag"},
          {"-"},
          {""},
          {kMissing},
          {std::string("bad\xff\xfe utf8")},
          {kLong},
          {"--", "--"},
          {"-o"},
          {"--store"},
          {"--store", ""},
          {"--store", kMissing},
          {"--generation", "-1"},
          {"--generation", "99999999999999999999999"},
          {"--threads", "0"},
          {"--readahead-chunks", "abc"},
          {"/", "/", "/", "/", "/"}};
}

TEST(CliArgsTest, InspectRejectsMalformedArguments) {
  for (const auto& a : Common()) ExpectRejected(OPTSTATE_REL_INSPECT, a, true);
  ExpectRejected(OPTSTATE_REL_INSPECT, {"ls", kMissing}, true);
  ExpectRejected(OPTSTATE_REL_INSPECT, {"cat", kMissing, "x"}, true);
  ExpectRejected(OPTSTATE_REL_INSPECT, {"verify", "/proc"}, true);
  ExpectUnknownOptionNamed(OPTSTATE_REL_INSPECT, {"--frobnicate"});
  ExpectUnknownOptionNamed(OPTSTATE_REL_INSPECT, {"/tmp", "stat", "--frobnicate"});
}

TEST(CliArgsTest, RestoreRejectsMalformedArguments) {
  for (const auto& a : Common()) ExpectRejected(OPTSTATE_REL_RESTORE, a, true);
  ExpectRejected(OPTSTATE_REL_RESTORE, {kMissing, kMissing + "2"}, true);
  ExpectRejected(OPTSTATE_REL_RESTORE, {"/proc", "/proc/self"}, true);
  ExpectRejected(OPTSTATE_REL_RESTORE, {"/etc", kMissing}, true);
  ExpectUnknownOptionNamed(OPTSTATE_REL_RESTORE, {"--frobnicate"});
  ExpectUnknownOptionNamed(OPTSTATE_REL_RESTORE, {"/tmp", "--frobnicate"});
}

// Never a real directory as the mountpoint: a mistakenly accepted command
// line must not mount anything (the mountpoint is always missing).
TEST(CliArgsTest, MountRejectsMalformedArguments) {
  for (const auto& a : Common()) {
    if (a.size() > 1 && a[0] == "/") continue;  // would name "/" as a mountpoint
    ExpectRejected(OPTSTATE_REL_MOUNT, a);
  }
  const std::string m = kMissing + "-mnt";
  ExpectRejected(OPTSTATE_REL_MOUNT, {kMissing, m, "-f"});
  ExpectRejected(OPTSTATE_REL_MOUNT, {"/tmp", m, "-f"});
  ExpectRejected(OPTSTATE_REL_MOUNT, {"/tmp", m, "--threads", "0", "-f"});
  ExpectRejected(OPTSTATE_REL_MOUNT, {"/tmp", m, "--readahead-chunks", "-5", "-f"});
  ExpectRejected(OPTSTATE_REL_MOUNT, {"/tmp", m, "--readahead-chunks", "99999999999", "-f"});
  ExpectRejected(OPTSTATE_REL_MOUNT, {"/tmp", m, "-o", "", "-f"});
  ExpectRejected(OPTSTATE_REL_MOUNT, {"/tmp", m, m + "2", "-f"});
  ExpectRejected(OPTSTATE_REL_MOUNT, {"/tmp", m, "--threads", "-f"});
}

}  // namespace
