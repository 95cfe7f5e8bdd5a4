// Per-node deployment files: the systemd unit passes `systemd-analyze verify`
// (with ExecStart pointed at this build's optstate-mount), and the fstab line
// really mounts a store root through mount.fuse3, as mount(8) would run it;
// tools/multirank.sh runs its ranks, checkpoints and restores end to end and
// finds them equal (and finds a flipped byte).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "tests/common/test_util.h"
#include "tests/tools/tools_test_util.h"

namespace optstate::tools {
namespace {

using testing::TempDir;
using test_util::kHangLimit;
using test_util::WaitFor;

std::string ReadFile(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ReplaceAll(std::string s, const std::string& from, const std::string& to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size())) {
    s.replace(pos, from.size(), to);
  }
  return s;
}

TEST(DeployTest, SystemdUnitVerifies) {
  std::string unit = ReadFile(std::string(OPTSTATE_SOURCE_DIR) + "/tools/optstate-mount.service");
  ASSERT_FALSE(unit.empty());
  // What the unit promises, independent of systemd being installed.
  EXPECT_NE(unit.find("ExecStart=/usr/local/bin/optstate-mount -f --allow-other /var/lib/optstate /mnt/optstate"),
            std::string::npos);
  EXPECT_NE(unit.find("Restart=on-failure"), std::string::npos);
  EXPECT_NE(unit.find("ExecStopPost=-/usr/bin/fusermount3 -u -z /mnt/optstate"), std::string::npos);
  EXPECT_NE(unit.find("WantedBy=multi-user.target"), std::string::npos);
  if (!InPath("systemd-analyze")) GTEST_SKIP() << "systemd-analyze not installed";
  // verify insists that ExecStart's binary exists: point it at this build's.
  TempDir dir;
  std::string copy = dir / "optstate-mount.service";
  std::ofstream(copy) << ReplaceAll(ReplaceAll(unit, "/usr/local/bin/optstate-mount", OPTSTATE_MOUNT_BIN),
                                    "/usr/bin/fusermount3", "/bin/true");
  auto r = RunCommand({"systemd-analyze", "verify", copy});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  if (r->err.find("Failed to ") != std::string::npos && r->err.find("bus") != std::string::npos) {
    GTEST_SKIP() << "systemd-analyze cannot run here: " << r->err;
  }
  EXPECT_EQ(r->exit_code, 0) << r->err << r->out;
  // Unknown keys only warn; treat them as failures.
  EXPECT_EQ(r->err.find("Unknown"), std::string::npos) << r->err;
  EXPECT_EQ(r->err.find("ignoring"), std::string::npos) << r->err;
}

struct FstabEntry {
  std::string source, mountpoint, type, options;
};

FstabEntry ParseFstabExample() {
  std::ifstream in(std::string(OPTSTATE_SOURCE_DIR) + "/tools/fstab.example");
  std::string line;
  FstabEntry e;
  int entries = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string dump, pass;
    ls >> e.source >> e.mountpoint >> e.type >> e.options >> dump >> pass;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
  return e;
}

bool FuseUsable() {
  int fd = open("/dev/fuse", O_RDWR);
  if (fd < 0) return false;
  close(fd);
  return InPath("fusermount3") && access("/sbin/mount.fuse3", X_OK) == 0;
}

TEST(DeployFuseTest, FstabLineMountsThroughMountFuse3) {
  FstabEntry e = ParseFstabExample();
  EXPECT_EQ(e.source, "/var/lib/optstate");
  EXPECT_EQ(e.mountpoint, "/mnt/optstate");
  ASSERT_EQ(e.type, "fuse.optstate-mount");
  if (!FuseUsable()) GTEST_SKIP() << "/dev/fuse, fusermount3 or mount.fuse3 unusable here";
  TempDir dir;
  std::string root = dir / "root", mnt = dir / "mnt";
  std::filesystem::create_directories(root);
  std::filesystem::create_directories(mnt);
  { auto s = testing::MakeSmallStore(root + "/rank0000.dense"); ASSERT_NE(s, nullptr); }
  // mount(8) drops x-* options before running the helper; the daemon's log
  // goes to this test's directory instead of /var/log.
  const std::string log = dir / "mount.log";
  std::string opts, item;
  bool had_log = false;
  std::istringstream os(e.options);
  while (std::getline(os, item, ',')) {
    if (item.rfind("x-", 0) == 0) continue;
    if (item.rfind("log=", 0) == 0) {
      had_log = true;
      item = "log=" + log;
    }
    opts += (opts.empty() ? "" : ",") + item;
  }
  EXPECT_TRUE(had_log) << "fstab.example names no log= for the detached daemon: " << e.options;
  // mount.fuse3 runs the type's program from PATH: put this build's first.
  std::string bin_dir = std::filesystem::path(OPTSTATE_MOUNT_BIN).parent_path().string();
  std::string old_path = getenv("PATH") ? getenv("PATH") : "/usr/bin:/bin";
  setenv("PATH", (bin_dir + ":" + old_path).c_str(), 1);
  auto r = RunCommand({"/sbin/mount.fuse3", root, mnt, "-t", e.type, "-o", opts});
  setenv("PATH", old_path.c_str(), 1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->exit_code, 0) << r->err << r->out;
  const bool mounted = WaitFor([&] { return IsFuseMounted(mnt); }, kHangLimit, std::chrono::milliseconds(50));
  ASSERT_TRUE(mounted) << mnt << " is not a fuse mount after mount.fuse3";
  std::error_code ec;
  bool has_store = std::filesystem::exists(mnt + "/rank0000.dense/snapshots/s1/manifest.json", ec);
  auto u = RunCommand({"fusermount3", "-u", mnt});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->exit_code, 0) << u->err;
  EXPECT_TRUE(has_store) << "the mount does not show rank0000.dense/snapshots/s1/manifest.json";
  WaitFor([&] { return !IsFuseMounted(mnt); }, kHangLimit, std::chrono::milliseconds(50));
  EXPECT_FALSE(IsFuseMounted(mnt));
  // The detached daemon wrote its log where log= said, up to its last line.
  std::string text;
  WaitFor([&] {
    std::ifstream in(log);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    return text.find("unmounted; served") != std::string::npos;
  }, kHangLimit, std::chrono::milliseconds(50));
  EXPECT_NE(text.find("serving " + root + " at " + mnt), std::string::npos) << text;
  EXPECT_NE(text.find("unmounted; served"), std::string::npos) << text;
}

// tools/multirank.sh, small: two ranks step their stores, snapshot them,
// copy the snapshots from the mount, restore the copies and compare each file
// of a copy with the restored store's (the manifest up to its generation,
// uuid and checksum); it exits 0. With one byte of a copy flipped after the
// restore it reports MISMATCH and exits 3.
TEST(DeployFuseTest, MultirankScriptRunsAndCatchesACorruptCopy) {
  if (!FuseUsable()) GTEST_SKIP() << "/dev/fuse, fusermount3 or mount.fuse3 unusable here";
  TempDir dir;
  const std::string script = std::string(OPTSTATE_SOURCE_DIR) + "/tools/multirank.sh";
  for (const bool corrupt : {false, true}) {
    SCOPED_TRACE(corrupt ? "corrupt" : "clean");
    const std::string root = dir / (corrupt ? "corrupt" : "clean");
    std::vector<std::string> cmd = {"bash", script, "--bin", OPTSTATE_TOOLS_DIR, "--root", root, "--ranks", "2",
                                    "--params-per-rank", "200000", "--steps", "2", "--budget", "16M",
                                    "--chunk-size", "2M", "--backend", "host", "--no-fio", "--out", root + "-logs"};
    if (corrupt) cmd.insert(cmd.begin(), {"env", "MULTIRANK_SELFTEST_CORRUPT=1"});
    auto r = RunCommand(cmd);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const std::string all = r->out + r->err;
    if (!corrupt) {
      EXPECT_EQ(r->exit_code, 0) << all;
      EXPECT_NE(all.find("ALL MATCH"), std::string::npos) << all;
      EXPECT_EQ(all.find("MISMATCH"), std::string::npos) << all;
    } else {
      EXPECT_EQ(r->exit_code, 3) << all;
      EXPECT_NE(all.find("MISMATCH"), std::string::npos) << all;
    }
  }
}

}  // namespace
}  // namespace optstate::tools
