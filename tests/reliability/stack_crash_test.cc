// Full-stack kill-point crash loop: a child process
// (reliability_stack_child) trains with StreamedAdam (host backend, small
// budget, deterministic gradients) and commits one generation per step, while
// a live optstate-mount serves the store and a reader thread copies the
// newest of generations/<g>/ over and over. The child is SIGKILLed at random instants and at the named
// sync points (OPTSTATE_CRASH_AT, tests/common/test_hooks.cc: extent write before/after, commit
// before sync/batch and after batch, GC before/after its batch, snapshot
// create/release, store creation). After each kill the parent reopens the
// store and checks:
//   - the group's step count k >= the last step the child acknowledged, or
//     the one before it when the child was killed: the child runs with the
//     default commit_lag_steps 1, so the step it acknowledged last (its
//     Step returned) may still have had its commit in flight; and k <= that
//     step + 1 (the next step's commit may have completed before its ACK);
//   - main, exp_avg and exp_avg_sq of every param equal an INDEPENDENT fp64
//     AdamW reference after k steps, within tolerances that separate step k
//     from k +- 1 (stack_workload.h, docs/RELIABILITY.md);
//   - Verify() is clean and, after GC, no extent is leaked;
//   - a store killed during creation is absent or opens cleanly, and can be
//     created again;
//   - a copy of the store (cp -a, then moved) trains on from the step it was
//     copied at, matching the reference, and leaves the original exact.
// The reader checks every copied field file against the XXH3 of each chunk in
// the manifest it read; any mismatch is a failure (wrong bytes served). It
// reads generations/<g>/, not latest/: latest/ stays on one generation for the
// life of a process (mount/store_tree.h), and this reader is a thread of the
// test process.
//
// OPTSTATE_REL_KILLS overrides the number of kills (default 200; the slow
// binary reliability_stack_slow_test is built with 2000).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "tests/common/test_util.h"
#include "tests/reliability/stack_check.h"
#include "tests/reliability/stack_workload.h"
#include "vfs/checkpoint.h"
#include "vfs/store.h"

namespace optstate::reliability {
namespace {

namespace fs = std::filesystem;

using test_util::ChildResult;

// Runs reliability_stack_child (stdout and stderr captured); SIGKILL after
// kill_after_ms (< 0: only the 120 s guard).
ChildResult RunChild(const std::vector<std::string>& args, const std::string& crash_at, int kill_after_ms) {
  test_util::ChildOptions o;
  o.exe = test_util::SiblingBinary("reliability_stack_child");
  o.args = args;
  o.crash_at = crash_at;
  o.kill_after_ms = kill_after_ms;
  o.guard_ms = 120000;
  o.capture_stderr = true;
  ChildResult r = test_util::RunChild(o);
  EXPECT_EQ(r.error, "");
  return r;
}

std::string ReadWholeFile(const std::string& p, bool* ok) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    *ok = false;
    return {};
  }
  std::stringstream ss;
  ss << in.rdbuf();
  *ok = !in.bad();
  return ss.str();
}

// A reader copying <mnt>/<store>/latest/ over and over, checking every chunk
// of every field file against the manifest it read.
class MountReader {
 public:
  // store_dir: MOUNTPOINT/<store>.
  explicit MountReader(std::string store_dir) : store_dir_(std::move(store_dir)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~MountReader() { Stop(); }
  // Asks the loop to end after its current copy (a read blocked in a hung
  // mount only returns once the daemon is gone: see MountGuard).
  void RequestStop() { stop_ = true; }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  uint64_t copies() const { return copies_; }
  uint64_t bytes() const { return bytes_; }
  uint64_t errors() const { return errors_; }
  uint64_t raced() const { return raced_; }
  const std::vector<std::string>& wrong() const { return wrong_; }

 private:
  void Loop() {
    while (!stop_) {
      bool ok = true;
      const std::string latest_ = NewestGeneration();
      const std::string m1 = latest_.empty() ? std::string() : ReadWholeFile(latest_ + "/manifest.json", &ok);
      if (!ok || m1.empty()) {
        ++errors_;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      auto man = vfs::ParseManifest(m1, "mount manifest");
      if (!man.ok()) {
        wrong_.push_back("unparseable manifest served: " + man.status().ToString());
        continue;
      }
      std::vector<std::string> bad;
      uint64_t copied = 0;
      bool io_error = false;
      for (const auto& t : man->tensors) {
        for (const auto& f : t.fields) {
          const std::string data = ReadWholeFile(latest_ + "/" + f.file, &ok);
          if (!ok) {
            io_error = true;
            continue;
          }
          if (data.size() != f.bytes) {
            bad.push_back(f.file + ": size " + std::to_string(data.size()) + " != " + std::to_string(f.bytes));
            continue;
          }
          for (const auto& c : f.chunks) {
            if (vfs::ChunkChecksum(data.data() + c.offset_bytes, c.length_bytes) != c.xxh3) {
              bad.push_back(f.file + " chunk at " + std::to_string(c.offset_bytes));
            }
          }
          copied += data.size();
        }
      }
      const std::string m2 = ReadWholeFile(latest_ + "/manifest.json", &ok);
      if (io_error) ++errors_;
      if (!bad.empty()) {
        if (ok && m2 == m1) {
          wrong_.push_back(latest_ + " served wrong bytes: " + bad[0]);
        } else {
          ++raced_;  // the generation went away during the copy (its files fail instead)
        }
      } else if (!io_error) {
        ++copies_;
        bytes_ += copied;
      }
    }
  }

  // MOUNTPOINT/<store>/generations/<newest g>, or "" when none is listed.
  std::string NewestGeneration() const {
    std::error_code ec;
    uint64_t newest = 0;
    bool any = false;
    for (const auto& e : std::filesystem::directory_iterator(store_dir_ + "/generations", ec)) {
      const std::string n = e.path().filename().string();
      if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) continue;
      const uint64_t g = std::stoull(n);
      if (!any || g > newest) newest = g;
      any = true;
    }
    return any && !ec ? store_dir_ + "/generations/" + std::to_string(newest) : std::string();
  }

  std::string store_dir_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> copies_{0}, bytes_{0}, errors_{0}, raced_{0};
  std::vector<std::string> wrong_;
  std::thread thread_;
};

const char* const kStepPoints[] = {
    "extent.before_write", "extent.after_write", "commit.before_sync", "commit.before_batch", "commit.after_batch",
    "gc.before_batch",     "gc.after_batch",     "snapshot.create",    "snapshot.release",
};
const char* const kCreatePoints[] = {"store.create.begin", "store.create.identity", "store.create.index",
                                     "store.create.renamed"};

bool CanMount() {
  return ::geteuid() == 0 && ::access("/dev/fuse", R_OK | W_OK) == 0 && ::access(OPTSTATE_REL_MOUNT_BINARY, X_OK) == 0 &&
         std::system("command -v fusermount3 >/dev/null 2>&1") == 0;
}

TEST(StackCrashTest, KillLoopWithLiveMountMatchesFp64Reference) {
  const char* env = std::getenv("OPTSTATE_REL_KILLS");
  const uint64_t kills = env ? std::strtoull(env, nullptr, 10) : OPTSTATE_REL_KILLS_DEFAULT;
  const char* seed_env = std::getenv("OPTSTATE_REL_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 20261130;
  char tmpl[] = "/var/tmp/optstate-rel-XXXXXX";  // a real disk: O_DIRECT works
  const std::string root = ::mkdtemp(tmpl);
  const std::string stores = root + "/stores", mnt = root + "/mnt", scratch = root + "/scratch";
  fs::create_directories(stores);
  fs::create_directories(mnt);
  fs::create_directories(scratch);
  const std::string path = stores + "/train";
  StackReference ref;
  uint64_t bytes = 0;
  // The first run creates the store and commits a step (no kill).
  {
    ChildResult r = RunChild({path, "1"}, "", -1);
    ASSERT_TRUE(WIFEXITED(r.wait_status) && WEXITSTATUS(r.wait_status) == 0) << r.output;
    ASSERT_EQ(r.last_ack, 1u) << r.output;
    CheckStore(path, 1, &ref, &bytes, "first run");
    ASSERT_FALSE(::testing::Test::HasFailure());
  }
  pid_t daemon = -1;
  std::unique_ptr<MountReader> reader;
  // Unmounts and stops the daemon on every exit path (ASSERTs return early).
  struct MountGuard {
    pid_t* daemon;
    std::unique_ptr<MountReader>* reader;
    std::string mnt;
    std::string daemon_end;  // how the daemon ended, if it did so by itself
    ~MountGuard() { Release(); }
    // Whether the daemon died during the run (reaps it if so).
    bool DaemonDied() {
      if (*daemon <= 0) return !daemon_end.empty();
      int st = 0;
      if (::waitpid(*daemon, &st, WNOHANG) != *daemon) return false;
      daemon_end = WIFSIGNALED(st) ? "killed by signal " + std::to_string(WTERMSIG(st))
                                   : "exited with status " + std::to_string(WEXITSTATUS(st));
      *daemon = -1;
      return true;
    }
    // The daemon goes first (SIGTERM, SIGKILL after 5 s if it hangs), so that
    // a reader blocked in the mount gets ENOTCONN instead of hanging the join.
    void Release() {
      if (*reader) (*reader)->RequestStop();
      DaemonDied();
      if (*daemon > 0) {
        std::system(("fusermount3 -u -z " + mnt + " 2>/dev/null").c_str());
        ::kill(*daemon, SIGTERM);
        int st = 0;
        for (int i = 0; i < 100 && ::waitpid(*daemon, &st, WNOHANG) != *daemon; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          if (i == 99) {
            std::printf("mount daemon ignored SIGTERM for 5 s: SIGKILL\n");
            ::kill(*daemon, SIGKILL);
            ::waitpid(*daemon, &st, 0);
          }
        }
        *daemon = -1;
      }
      std::system(("fusermount3 -u -z " + mnt + " 2>/dev/null").c_str());
      if (*reader) (*reader)->Stop();
    }
  } guard{&daemon, &reader, mnt, ""};
  if (CanMount()) {
    daemon = ::fork();
    if (daemon == 0) {
      const int fd = ::open((root + "/daemon.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execl(OPTSTATE_REL_MOUNT_BINARY, OPTSTATE_REL_MOUNT_BINARY, stores.c_str(), mnt.c_str(), "-f",
              "--readahead-chunks", "2",
              // The reader walks a new generations/<g>/ each copy: hold each
              // for 1 s after its last use, not the default 60 s, so the
              // writer's GC keeps few of them.
              "--latest-pin-s", "1", static_cast<char*>(nullptr));
      _exit(127);
    }
    for (int i = 0; i < 200 && ::access((mnt + "/train/latest/manifest.json").c_str(), R_OK) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_EQ(::access((mnt + "/train/latest/manifest.json").c_str(), R_OK), 0) << "mount did not come up";
    reader = std::make_unique<MountReader>(mnt + "/train");
  } else {
    std::printf("no live mount (needs root, /dev/fuse, fusermount3 and optstate-mount): readers not run\n");
  }
  std::mt19937_64 rng(seed);
  // The highest step that must be in the store: the last ACK of a child that
  // exited (its destructor waited for the commit), the one before the last
  // ACK of a killed child (its last step's commit may have been in flight).
  auto durable = [](const ChildResult& r) {
    const bool exited = WIFEXITED(r.wait_status) && WEXITSTATUS(r.wait_status) == 0;
    return exited || r.last_ack == 0 ? r.last_ack : r.last_ack - 1;
  };
  uint64_t max_ack = 1, random_kills = 0, point_kills = 0, create_kills = 0, finished = 0, creates_absent = 0;
  uint64_t copies = 0;
  std::map<std::string, uint64_t> per_point;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < kills && !::testing::Test::HasFailure(); ++i) {
    const uint64_t kind = rng() % 100;
    if (kind < 6) {
      // Store creation: absent or complete, and creatable again.
      const std::string cpath = scratch + "/c" + std::to_string(i);
      const std::string point = kCreatePoints[rng() % 4];
      ChildResult r = RunChild({cpath, "1"}, point, -1);
      const std::string what = "kill " + std::to_string(i) + " at " + point;
      ASSERT_TRUE(WIFSIGNALED(r.wait_status) && WTERMSIG(r.wait_status) == SIGKILL) << what << "\n" << r.output;
      ++create_kills;
      ++per_point[point];
      if (::access(cpath.c_str(), F_OK) == 0) {
        auto s = vfs::Store::Open(cpath, StackStoreOptions());
        ASSERT_TRUE(s.ok()) << what << ": half-created store: " << s.status().ToString();
        EXPECT_EQ((*s)->LatestGeneration().generation, 0u) << what;
      } else {
        ++creates_absent;
        ChildResult again = RunChild({cpath, "1"}, "", -1);
        ASSERT_TRUE(WIFEXITED(again.wait_status) && WEXITSTATUS(again.wait_status) == 0)
            << what << ": create after the crash failed\n" << again.output;
      }
      fs::remove_all(cpath);
      continue;
    }
    if (kind < 10) {
      // A copy of the store (cp -a, as a user backs one up), then moved, then
      // trained on, then the original trained on: each must follow the
      // reference from the step it was copied at (each writes its own data
      // file, never the other's).
      const std::string copy = scratch + "/copy" + std::to_string(i), moved = copy + ".moved";
      const std::string what = "copy " + std::to_string(i) + " of the store at step " + std::to_string(ref.step());
      // A live mount's reader leases (leases/<pid>.flock) come and go while
      // cp walks the store: a lease that vanished under cp is no error of the
      // copy (the copy needs none), anything else is.
      const std::string cp_err = scratch + "/cp.err";
      if (std::system(("cp -a " + path + " " + copy + " 2>" + cp_err).c_str()) != 0) {
        bool read = false;
        std::istringstream errs(ReadWholeFile(cp_err, &read));
        for (std::string line; std::getline(errs, line);) {
          ASSERT_TRUE(line.find("/leases/") != std::string::npos && line.find("No such file") != std::string::npos)
              << what << ": cp -a: " << line;
        }
      }
      fs::rename(copy, moved);
      StackReference copy_ref = ref;
      uint64_t copy_bytes = 0;
      const uint64_t from = CheckStore(moved, max_ack, &copy_ref, &copy_bytes, what + " (before training it)");
      ChildResult r = RunChild({moved, "2"}, "", -1);
      ASSERT_TRUE(WIFEXITED(r.wait_status) && WEXITSTATUS(r.wait_status) == 0) << what << "\n" << r.output;
      CheckStore(moved, from + 2, &copy_ref, &copy_bytes, what + " (after 2 steps on the copy)");
      // The original trains on too; then both must still be exact (a shared
      // data file would have the second writer overwrite the first's extents).
      ChildResult o = RunChild({path, "2"}, "", -1);
      ASSERT_TRUE(WIFEXITED(o.wait_status) && WEXITSTATUS(o.wait_status) == 0) << what << "\n" << o.output;
      max_ack = std::max(max_ack, durable(o));
      CheckStore(path, max_ack, &ref, &bytes, what + ": the original, trained after the copy");
      CheckStore(moved, from + 2, &copy_ref, &copy_bytes, what + ": the copy, after the original trained");
      fs::remove_all(moved);
      ++copies;
      continue;
    }
    ChildResult r;
    std::string what;
    if (kind < 36) {
      std::string point = kStepPoints[rng() % (sizeof(kStepPoints) / sizeof(kStepPoints[0]))];
      point += ":" + std::to_string(1 + rng() % 4);
      what = "kill " + std::to_string(i) + " at " + point;
      r = RunChild({path, "6"}, point, -1);
      per_point[point.substr(0, point.find(':'))]++;
      ++point_kills;
    } else {
      const int ms = 20 + static_cast<int>(rng() % 900);
      what = "kill " + std::to_string(i) + " after " + std::to_string(ms) + " ms";
      r = RunChild({path, "1000"}, "", ms);
      ++random_kills;
    }
    const bool killed = WIFSIGNALED(r.wait_status) && WTERMSIG(r.wait_status) == SIGKILL;
    const bool done = WIFEXITED(r.wait_status) && WEXITSTATUS(r.wait_status) == 0;
    ASSERT_TRUE(killed || done) << what << ": child failed ("
                                << (WIFSIGNALED(r.wait_status) ? "signal " + std::to_string(WTERMSIG(r.wait_status))
                                                               : "exit " + std::to_string(WEXITSTATUS(r.wait_status)))
                                << ")\n" << r.output;
    finished += done;
    max_ack = std::max(max_ack, durable(r));
    const uint64_t k = CheckStore(path, max_ack, &ref, &bytes, what + " (last ACK " + std::to_string(r.last_ack) + ")");
    if (r.last_ack > 0) {
      EXPECT_LE(k, r.last_ack + 1) << what << ": the store is ahead of the child's last ACK by more than one step";
    }
    if ((i + 1) % 100 == 0) {  // progress of long runs
      if (reader) {
        const bool died = guard.DaemonDied();
        std::printf("progress: mount daemon %s; reader: %llu copies verified, %llu raced, %llu I/O errors, %zu wrong\n",
                    died ? ("DEAD (" + guard.daemon_end + ")").c_str() : "alive",
                    static_cast<unsigned long long>(reader->copies()), static_cast<unsigned long long>(reader->raced()),
                    static_cast<unsigned long long>(reader->errors()), reader->wrong().size());
      }
      std::printf("progress: %llu of %llu iterations checked (%s), step %llu, %llu state bytes compared, %.0f s\n",
                  static_cast<unsigned long long>(i + 1), static_cast<unsigned long long>(kills),
                  ::testing::Test::HasFailure() ? "with FAILURES" : "all verified",
                  static_cast<unsigned long long>(ref.step()), static_cast<unsigned long long>(bytes),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      std::fflush(stdout);
    }
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool daemon_died = guard.DaemonDied();
  guard.Release();
  std::string points;
  for (const auto& [p, n] : per_point) points += p + "=" + std::to_string(n) + " ";
  std::printf("stack crash loop: %llu kills in %.1f s (random instants %llu, crash points %llu, store creation %llu "
              "[absent afterwards %llu]; runs that ended before their point %llu); final step %llu; "
              "%llu state bytes compared with the fp64 reference; %llu copies of the store (cp -a, moved) trained "
              "and checked\npoints: %s\n",
              static_cast<unsigned long long>(random_kills + point_kills + create_kills), secs,
              static_cast<unsigned long long>(random_kills), static_cast<unsigned long long>(point_kills),
              static_cast<unsigned long long>(create_kills), static_cast<unsigned long long>(creates_absent),
              static_cast<unsigned long long>(finished), static_cast<unsigned long long>(ref.step()),
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(copies), points.c_str());
  if (reader) {
    std::printf("mount reader: %llu full copies of generations/<g>/ verified (%llu bytes), %llu raced with a commit, "
                "%llu with an I/O error, %zu wrong\n",
                static_cast<unsigned long long>(reader->copies()), static_cast<unsigned long long>(reader->bytes()),
                static_cast<unsigned long long>(reader->raced()), static_cast<unsigned long long>(reader->errors()),
                reader->wrong().size());
    EXPECT_FALSE(daemon_died) << "optstate-mount died during the run: " << guard.daemon_end << " (log: " << root
                              << "/daemon.log)";
    EXPECT_TRUE(reader->wrong().empty()) << reader->wrong()[0];
    EXPECT_GT(reader->copies(), 0u) << "the reader never completed a copy";
  }
  guard.Release();
  std::error_code ec;
  if (!::testing::Test::HasFailure()) fs::remove_all(root, ec);
}

}  // namespace
}  // namespace optstate::reliability
