// The connection of a mount to the kernel: /proc/self/mountinfo, the
// connection's read-ahead and abort files under /sys/fs/fuse, the drain of
// page-cache stores at exit, the guardian that aborts the connection of a
// killed daemon, and the sweep of latest/ pins. Internal to mount/.
#pragma once

#define FUSE_USE_VERSION 312
#include <fuse3/fuse_lowlevel.h>

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "mount/store_tree.h"

namespace optstate::mount::internal {

class PushGate;

struct MountEntry {
  std::string dev;     // "MAJOR:MINOR"
  std::string fstype;  // "fuse.optstate"
  std::string source;
};

// A process that outlives an unclean death of this daemon (SIGKILL, a crash)
// to abort its connection. Without it a push that waits in the kernel for the
// pages of a READ keeps the dead daemon a zombie that holds /dev/fuse open:
// no one answers that READ, so the mount hangs instead of failing with
// ENOTCONN, and it cannot be mounted again until someone aborts it by hand
// (seen: SIGTERM during a `cp -r` before exits drained, `kill -9` likewise).
// PR_SET_PDEATHSIG tells it when the thread that forked it (the main
// thread) is gone; a byte on the pipe (GuardianDone) means a clean exit.
struct Guardian {
  int fd = -1;  // the pipe's write end
  pid_t pid = -1;
};

// /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
std::string UnescapeMountinfo(const std::string& s);

std::optional<MountEntry> TopMountAt(const std::string& real_path);

// The device number ("MAJOR:MINOR") of the mount just made at `mountpoint`,
// or "". From mountinfo, not stat(): a stat of the mount would wait for this
// daemon, which does not serve yet.
std::string MountedDevice(const std::string& mountpoint);

// The mount's backing device info (/sys/class/bdi/MAJOR:MINOR) gets
// read_ahead_kb: FUSE_INIT can only lower the kernel's 128 KiB default.
void SetKernelReadahead(const std::string& dev, uint64_t bytes);

// The connection's abort file in fusectl (/sys/fs/fuse/connections/N/abort,
// N the minor of the mount's device `dev`), or "" when there is none: fusectl
// not mounted and not mountable (not root) here.
std::string ConnectionAbortPath(const std::string& dev);

// Async-signal-safe: writes "1" to an abort file (fails every request of the
// connection: waiting readers get ENOTCONN, pushes return).
void AbortConnection(const char* abort_path);

// The loop has ended: answer what the kernel still sends (READs that stores
// in flight wait for) until none is in flight, for up to `wait`; then abort
// the connection if one still waits. True once none is in flight.
bool DrainPushes(struct fuse_session* se, PushGate* gate, const std::string& abort_path,
                 std::chrono::milliseconds wait);

void NoOpSignal(int);

Guardian StartGuardian(struct fuse_session* se, const std::string& abort_path);

// Tells the guardian this exit is clean, and reaps it.
void GuardianDone(const Guardian& g);

// Ends the latest/ pins of processes that exited or went idle
// (StoreTree::SweepPins) once a second, so that a finished copier's
// generation goes back to the writer's GC without waiting for another lookup.
class PinSweeper {
 public:
  explicit PinSweeper(StoreTree* tree) : tree_(tree), thread_([this] { Run(); }) {}
  ~PinSweeper() {
    {
      MutexLock l(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    thread_.join();
  }

 private:
  void Run() EXCLUDES(mu_) {
    MutexLock l(&mu_);
    for (;;) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (!stop_) {
        const auto left = deadline - std::chrono::steady_clock::now();
        if (left <= left.zero()) break;
        cv_.WaitFor(&mu_, left);
      }
      if (stop_) return;
      l.Unlock();
      tree_->SweepPins();
      l.Lock();
    }
  }

  StoreTree* const tree_;
  Mutex mu_;
  CondVar cv_;  // with mu_: stop_ was set
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the members above exist
};


}  // namespace optstate::mount::internal
