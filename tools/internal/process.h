// Subprocesses and paths for the tools: run a command and capture its output,
// start a long-running child (optstate-mount) and stop it, locate the sibling
// executables of this build, temporary directories, mount-table queries.
//
// Thread-safety: free functions are thread-safe; a Child is owned by one thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace optstate::tools {

struct CommandResult {
  int exit_code = -1;      // exit status, or 128+signal when killed
  std::string out;         // captured stdout
  std::string err;         // captured stderr
};

// Runs argv[0] (searched in PATH) with argv, waits, and captures stdout and
// stderr. Fails only when the program cannot be started (names it and errno).
Result<CommandResult> RunCommand(const std::vector<std::string>& argv);

// "a b 'c d'" for messages.
std::string JoinCommand(const std::vector<std::string>& argv);

// The directory holding the running executable (/proc/self/exe).
Result<std::string> SelfDir();

// Finds a tool of this build: next to the running executable, then in
// ../mount and ../tools relative to it, then in PATH. NotFound names where it looked.
Result<std::string> FindTool(const std::string& name);

// True when `name` is in PATH.
bool InPath(const std::string& name);

// mkdtemp under `parent` (default $TMPDIR or /tmp) with the given prefix.
Result<std::string> MakeTempDir(const std::string& prefix, const std::string& parent = "");

// rm -rf (best effort; returns the first error).
Status RemoveTree(const std::string& path);

// True when `path` is a mountpoint of a fuse filesystem (per /proc/self/mountinfo).
bool IsFuseMounted(const std::string& path);

// Sum of the sizes of regular files under `path` (no symlink following).
Result<uint64_t> TreeBytes(const std::string& path);

// The block device under `path` as /proc/diskstats counts it (the partition
// when it is one). ok = false when the path is not on a block device listed
// there (tmpfs, overlay, btrfs subvolumes).
struct DiskCounters {
  bool ok = false;
  std::string device;          // e.g. "vda1"
  uint64_t reads = 0;          // completed read requests
  uint64_t read_sectors = 0;   // 512-byte sectors read
  uint64_t writes = 0;         // completed write requests
  uint64_t write_sectors = 0;  // 512-byte sectors written
  uint64_t io_ticks_ms = 0;    // time with at least one request in flight
  uint64_t queue_ms = 0;       // request-milliseconds in flight (average depth = queue_ms / elapsed ms)
  uint64_t flushes = 0;        // completed flush requests (0 on kernels before 5.5)
};
DiskCounters ReadDiskCounters(const std::string& path);

// The disk's counters summed over the timed intervals of one benchmark phase
// (its rounds), for DescribeDiskUse.
struct DiskPhase {
  DiskCounters sum;
  double seconds = 0;
  // One interval: counters before and after it, and its length.
  void Add(const DiskCounters& before, const DiskCounters& after, double interval_seconds);
  std::string Describe() const;
};

// "disk vda1 busy 97%, 9.8 deep, reads 1.20 MiB x 2048, writes 0.98 MiB x 1024,
// 3 flushes" for `delta`, the counts of an interval of `seconds` (after minus
// before); parts with no requests are left out; empty when not ok or nothing
// was read or written.
std::string DescribeDiskUse(const DiskCounters& delta, double seconds);

// A child process started in the background; its stdout/stderr go to
// log_path (or are inherited when empty). Destructor: Stop().
class Child {
 public:
  static Result<Child> Start(const std::vector<std::string>& argv, const std::string& log_path);
  Child() = default;
  Child(Child&& o) noexcept : pid_(o.pid_), argv_(std::move(o.argv_)), log_path_(std::move(o.log_path_)) { o.pid_ = -1; }
  Child& operator=(Child&& o) noexcept;
  ~Child();
  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  // Non-blocking: true when the child has exited (reaped; exit_code set).
  bool Exited(int* exit_code);
  // SIGTERM, wait up to timeout_ms, then SIGKILL. Returns the exit code.
  int Stop(int timeout_ms = 5000);
  const std::string& log_path() const { return log_path_; }

 private:
  pid_t pid_ = -1;
  std::vector<std::string> argv_;
  std::string log_path_;
};

}  // namespace optstate::tools
