// Store directories copied, moved and shared; readers that die; verify while
// a writer runs; damaged COMMITTED and RETAINED. Every test compares chunk
// contents with the deterministic pattern each generation wrote
// (test_util::FillPattern), an independent reference.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "tests/vfs/store_test_util.h"
#include "vfs/store.h"

extern "C" char** environ;

namespace optstate::vfs {
namespace {

namespace fs = std::filesystem;
using store_testing::Buf;
using store_testing::ChunkSeed;
using store_testing::FillPattern;
using store_testing::kTestChunk;
using store_testing::TempDir;
using store_testing::TestOptions;
using store_testing::Unwrap;

// 2 full chunks and a 12-byte tail per field.
constexpr uint64_t kNumel = 2 * kTestChunk / 4 + 3;

std::string ReadFile(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void WriteFile(const std::string& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}
int Shell(const std::string& cmd) { return std::system(cmd.c_str()); }

// Writes every chunk of tensor "w" with the pattern of `seed_gen` and commits.
void Step(Store* s, uint64_t seed_gen) {
  auto t = s->FindTensor("w");
  if (!t.ok()) {
    TensorSpec spec;
    spec.name = "w";
    spec.numel = kNumel;
    t = s->CreateTensor(spec);
  }
  ASSERT_OK(t.status());
  Buf buf(kTestChunk);
  for (uint32_t f = 0; f < t->fields.size(); ++f) {
    for (uint64_t c = 0; c < s->ChunkCount(*t, f); ++c) {
      FillPattern(buf.data(), kTestChunk, ChunkSeed(seed_gen, t->id, f, c));
      ASSERT_OK(s->WriteChunk(ChunkRef{t->id, f, c}, buf.data()));
    }
  }
  ASSERT_OK(s->Commit(CommitInfo{seed_gen, {}}).status());
}

// Every chunk of "w" in the latest generation of the store at `path` (opened
// read-only) holds the pattern of `seed_gen`, and Verify finds nothing.
void ExpectStoreHolds(const std::string& path, uint64_t seed_gen) {
  auto s = Store::OpenReadOnly(path, TestOptions());
  ASSERT_OK(s.status());
  auto view = Unwrap((*s)->OpenGeneration(kLatest));
  auto t = Unwrap(view->FindTensor("w"));
  Buf buf(kTestChunk), want(kTestChunk);
  for (uint32_t f = 0; f < t.fields.size(); ++f) {
    const uint64_t bytes = t.field_bytes(f);
    for (uint64_t c = 0; c < view->ChunkCount(t, f); ++c) {
      const uint64_t len = std::min(kTestChunk, bytes - c * kTestChunk);
      ASSERT_OK(view->ReadChunk(ChunkRef{t.id, f, c}, buf.data()));
      FillPattern(want.data(), kTestChunk, ChunkSeed(seed_gen, t.id, f, c));
      ASSERT_EQ(0, std::memcmp(buf.data(), want.data(), len)) << path << " field " << f << " chunk " << c;
    }
  }
  auto rep = Unwrap((*s)->Verify());
  EXPECT_TRUE(rep.ok()) << path << ": " << (rep.problems.empty() ? "leaks" : rep.problems[0]);
}

void ExpectMessageHas(const Status& s, const std::vector<std::string>& parts) {
  for (const auto& p : parts) EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' in " << s.ToString();
}

// ---------------------------------------------------------------------------
// Copies and moves.

TEST(StoreCopyTest, CopiedStoreIsIndependentOfTheOriginal) {
  TempDir dir;
  const std::string orig = dir / "orig", backup = dir / "backup";
  {
    auto s = Unwrap(Store::Create(orig, TestOptions()));
    Step(s.get(), 1);
    Step(s.get(), 2);
  }
  EXPECT_NE(ReadFile(orig + "/IDENTITY").find("\"data\""), std::string::npos) << ReadFile(orig + "/IDENTITY");
  ASSERT_EQ(Shell("cp -a " + orig + " " + backup), 0);
  {
    auto s = Unwrap(Store::Open(backup, TestOptions()));
    EXPECT_EQ(s->identity().data_dirs[0], backup + "/data");
    Step(s.get(), 103);
  }
  {
    auto s = Unwrap(Store::Open(orig, TestOptions()));
    Step(s.get(), 203);
  }
  ExpectStoreHolds(backup, 103);
  ExpectStoreHolds(orig, 203);
  // Both open for writing at once: separate data files.
  auto a = Unwrap(Store::Open(orig, TestOptions()));
  auto b = Unwrap(Store::Open(backup, TestOptions()));
  Step(a.get(), 204);
  Step(b.get(), 104);
  a.reset();
  b.reset();
  ExpectStoreHolds(backup, 104);
  ExpectStoreHolds(orig, 204);
}

TEST(StoreCopyTest, MovedStoreKeepsWorking) {
  TempDir dir;
  {
    auto s = Unwrap(Store::Create(dir / "a", TestOptions()));
    Step(s.get(), 1);
  }
  fs::rename(dir / "a", dir / "b");
  {
    auto s = Unwrap(Store::Open(dir / "b", TestOptions()));
    Step(s.get(), 2);
  }
  ExpectStoreHolds(dir / "b", 2);
}

// A store written by an older version records its data dir as an absolute
// path: its copy uses its own copy of the data dir, a moved one finds it.
TEST(StoreCopyTest, StoreWithAbsoluteDataDirFromAnOlderVersionCopiesAndMoves) {
  TempDir dir;
  const std::string orig = dir / "orig";
  std::string uuid;
  {
    auto s = Unwrap(Store::Create(orig, TestOptions()));
    uuid = s->identity().uuid;
    Step(s.get(), 1);
  }
  auto make_old = [&](const std::string& store, const std::string& recorded) {
    std::string id = ReadFile(store + "/IDENTITY");
    const size_t at = id.find("\"data\"");
    ASSERT_NE(at, std::string::npos) << id;
    id.replace(at, 6, "\"" + recorded + "\"");
    WriteFile(store + "/IDENTITY", id);
    fs::remove(store + "/data/" + uuid + ".owner");
  };
  make_old(orig, orig + "/data");
  ASSERT_EQ(Shell("cp -a " + orig + " " + dir / "backup"), 0);
  {
    auto s = Unwrap(Store::Open(dir / "backup", TestOptions()));
    EXPECT_EQ(s->identity().data_dirs[0], dir / "backup/data");
    Step(s.get(), 102);
  }
  EXPECT_NE(ReadFile(dir / "backup/IDENTITY").find("\"data\""), std::string::npos) << "rewritten relative";
  {
    auto s = Unwrap(Store::Open(orig, TestOptions()));
    Step(s.get(), 202);
  }
  ExpectStoreHolds(dir / "backup", 102);
  ExpectStoreHolds(orig, 202);

  make_old(orig, orig + "/data");
  fs::rename(orig, dir / "moved");
  {
    auto s = Unwrap(Store::Open(dir / "moved", TestOptions()));
    Step(s.get(), 203);
  }
  ExpectStoreHolds(dir / "moved", 203);

  // A copy without the data dir would use the original's data file: refused.
  make_old(dir / "moved", dir / "moved/data");
  ASSERT_EQ(Shell("cp -a " + dir / "moved " + dir / "nodata"), 0);
  fs::remove_all(dir / "nodata/data");
  auto r = Store::Open(dir / "nodata", TestOptions());
  ASSERT_FALSE(r.ok());
  ExpectMessageHas(r.status(), {dir / "nodata", dir / "moved", "cp -a", "optstate-restore"});
  ExpectStoreHolds(dir / "moved", 203);
}

// External data dirs stay absolute: a copy of the store directory would share
// the data file, so it is refused, whether or not the original is open.
TEST(StoreCopyTest, CopyOfStoreWithExternalDataDirIsRefused) {
  TempDir dir;
  const std::string orig = dir / "orig", copy = dir / "copy", ext = dir / "nvme1";
  StoreOptions o = TestOptions();
  o.data_dirs = {ext};
  fs::create_directories(ext);
  std::string uuid;
  {
    auto s = Unwrap(Store::Create(orig, o));
    uuid = s->identity().uuid;
    Step(s.get(), 1);
  }
  EXPECT_NE(ReadFile(orig + "/IDENTITY").find("\"" + ext + "\""), std::string::npos);
  ASSERT_EQ(Shell("cp -a " + orig + " " + copy), 0);
  auto r = Store::Open(copy, TestOptions());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  ExpectMessageHas(r.status(), {copy, orig, ext + "/" + uuid + ".chunks", "optstate-restore", ".owner"});
  {
    // The original open for writing: the copy finds the data file locked.
    auto w = Unwrap(Store::Open(orig, TestOptions()));
    auto busy = Store::Open(copy, TestOptions());
    EXPECT_EQ(busy.status().code(), StatusCode::kBusy) << busy.status().ToString();
    ExpectMessageHas(busy.status(), {copy, orig, ext + "/" + uuid + ".chunks"});
    Step(w.get(), 2);
  }
  ExpectStoreHolds(orig, 2);
  // A hard-linked copy shares the data file's inode: refused too.
  ASSERT_EQ(Shell("cp -al " + ext + " " + dir / "linked"), 0);
  r = Store::Open(orig, TestOptions());
  EXPECT_FALSE(r.ok());
  ExpectMessageHas(r.status(), {"hard links", ext + "/" + uuid + ".chunks"});
  fs::remove_all(dir / "linked");
  // Moving the store directory keeps it.
  fs::rename(orig, dir / "moved");
  {
    auto s = Unwrap(Store::Open(dir / "moved", TestOptions()));
    Step(s.get(), 3);
  }
  ExpectStoreHolds(dir / "moved", 3);
  // The copy replaces the original once the user says so (the original is gone).
  fs::remove_all(dir / "moved");
  fs::remove(ext + "/" + uuid + ".owner");
  {
    auto s = Unwrap(Store::Open(copy, TestOptions()));
    Step(s.get(), 4);
  }
  ExpectStoreHolds(copy, 4);
}

// ---------------------------------------------------------------------------
// Verify while a writer runs.

TEST(StoreVerifyTest, ReadOnlyVerifyWhileTheWriterCommitsNeverReportsDamage) {
  TempDir dir;
  const std::string path = dir / "s";
  auto w = Unwrap(Store::Create(path, TestOptions()));
  Step(w.get(), 1);
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable cv;
  uint64_t committed = 1;
  Status writer_status;
  std::thread writer([&] {
    for (uint64_t g = 2; !stop.load(); ++g) {
      Step(w.get(), g);
      if (::testing::Test::HasFatalFailure()) {
        writer_status = Internal("writer step failed");
        break;
      }
      std::lock_guard l(mu);
      committed = g;
      cv.notify_all();
    }
    std::lock_guard l(mu);
    committed = UINT64_MAX;
    cv.notify_all();
  });
  for (int i = 0; i < 40; ++i) {
    auto ro = Unwrap(Store::OpenReadOnly(path, TestOptions()));
    if (i % 2 == 0) {
      // Let the writer commit twice after this reader loaded its index: the
      // generations it shows have been collected and their extents reused.
      std::unique_lock l(mu);
      const uint64_t seen = committed;
      cv.wait(l, [&] { return committed >= seen + 2; });
    }
    auto rep = ro->Verify();
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    ASSERT_TRUE(rep->ok()) << "iteration " << i << ": " << (rep->problems.empty() ? "leaks" : rep->problems[0]);
    EXPECT_GE(rep->generations_checked, 1u);
    EXPECT_GT(rep->chunks_checked, 0u);
  }
  stop = true;
  writer.join();
  ASSERT_OK(writer_status);
  auto rep = Unwrap(w->Verify());
  EXPECT_TRUE(rep.ok()) << (rep.problems.empty() ? "leaks" : rep.problems[0]);
}

// ---------------------------------------------------------------------------
// Leases of readers that die.

constexpr const char* kLeaseChildEnv = "OPTSTATE_LEASE_CHILD_STORE";

// The child: for every line on stdin, leases the latest generation and prints
// "LEASED <generation>"; holds every lease until killed.
TEST(StoreLeaseChild, DISABLED_Run) {
  const char* path = std::getenv(kLeaseChildEnv);
  if (path == nullptr) GTEST_SKIP() << "only run as a lease test's child";
  auto ro = Unwrap(Store::OpenReadOnly(path, TestOptions()));
  std::vector<std::unique_ptr<GenerationView>> views;
  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    views.push_back(Unwrap(ro->OpenGeneration(kLatest)));
    std::printf("LEASED %llu\n", static_cast<unsigned long long>(views.back()->info().generation));
    std::fflush(stdout);
  }
  for (;;) ::pause();
}

// A lease-taking child process (this binary, the test above), talked to
// through pipes; killed and reaped only when asked.
class LeaseChild {
 public:
  explicit LeaseChild(const std::string& store) {
    int in[2], out[2];
    EXPECT_EQ(::pipe2(in, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
    // Everything the child needs is built before fork: only async-signal-safe
    // calls between fork and exec (the parent has RocksDB threads).
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    env_strings.push_back(std::string(kLeaseChildEnv) + "=" + store);
    env_strings.push_back("OPTSTATE_LOG_LEVEL=error");
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    const char* argv[] = {"/proc/self/exe", "--gtest_filter=StoreLeaseChild.DISABLED_Run",
                          "--gtest_also_run_disabled_tests", nullptr};
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::execve("/proc/self/exe", const_cast<char**>(argv), envp.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    to_ = ::fdopen(in[1], "w");
    from_ = ::fdopen(out[0], "r");
  }
  ~LeaseChild() {
    Kill();
    Reap();
    if (to_) std::fclose(to_);
    if (from_) std::fclose(from_);
  }
  // Asks for a lease on the latest generation; returns its generation.
  uint64_t Lease() {
    std::fputs("lease\n", to_);
    std::fflush(to_);
    char line[256];
    while (std::fgets(line, sizeof(line), from_) != nullptr) {
      unsigned long long g = 0;
      if (std::sscanf(line, "LEASED %llu", &g) == 1) return g;
    }
    ADD_FAILURE() << "lease child ended without a lease";
    return UINT64_MAX;
  }
  void Kill() {
    if (pid_ > 0 && !killed_) ::kill(pid_, SIGKILL);
    killed_ = true;
  }
  // Waits until the killed child is a zombie, without reaping it.
  void WaitZombie() {
    siginfo_t si{};
    ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(pid_), &si, WEXITED | WNOWAIT), 0);
  }
  pid_t pid() const { return pid_; }
  void Reap() {
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  bool killed_ = false;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

uint64_t OneGenerationBytes() { return 3 * (2 * kTestChunk + 4096); }

TEST(StoreLeaseTest, LeaseOfAKilledReaderIsReclaimedEvenWhileItIsAZombie) {
  TempDir dir;
  const std::string path = dir / "s";
  auto w = Unwrap(Store::Create(path, TestOptions()));
  Step(w.get(), 1);
  LeaseChild child(path);
  ASSERT_EQ(child.Lease(), 1u);
  Step(w.get(), 2);
  Step(w.get(), 3);
  auto gens = w->ListGenerations();
  ASSERT_FALSE(gens.empty());
  EXPECT_EQ(gens.front().generation, 1u) << "a live reader's lease keeps its generation";
  EXPECT_EQ(Unwrap(w->Stats()).leases, 1u);
  child.Kill();
  child.WaitZombie();  // dead, not reaped: its pid still answers kill(pid, 0)
  Step(w.get(), 4);
  gens = w->ListGenerations();
  ASSERT_EQ(gens.size(), 1u);
  EXPECT_EQ(gens[0].generation, 4u) << "a dead reader's lease must not keep generation 1";
  auto st = Unwrap(w->Stats());
  EXPECT_EQ(st.leases, 0u);
  EXPECT_EQ(st.referenced_extent_bytes, OneGenerationBytes());
  child.Reap();
  w.reset();
  ExpectStoreHolds(path, 4);
}

// The entries a reader process keeps in $TMPDIR (else /tmp): its RocksDB
// secondary directories and their lock file.
std::vector<std::string> SecondaryEntriesOf(pid_t pid) {
  std::vector<std::string> out;
  const std::string prefix = "optstate-secondary-" + std::to_string(pid) + "-";
  const char* tmp = std::getenv("TMPDIR");
  for (const auto& e : std::filesystem::directory_iterator(tmp != nullptr ? tmp : "/tmp")) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(name);
  }
  return out;
}

// In a $TMPDIR of its own: any process's read-only open cleans /tmp, so in
// a shared /tmp a test running beside this one could remove the killed
// reader's entries before this test's own open does.
TEST(StoreLeaseTest, SecondaryDirsOfKilledReadersAreRemovedAtTheNextReadOnlyOpen) {
  TempDir dir;
  const std::string path = dir / "s";
  const std::string tmp = dir / "tmp";
  std::filesystem::create_directories(tmp);
  ASSERT_EQ(setenv("TMPDIR", tmp.c_str(), 1), 0);  // the child reader inherits it
  auto w = Unwrap(Store::Create(path, TestOptions()));
  Step(w.get(), 1);
  LeaseChild child(path);
  ASSERT_EQ(child.Lease(), 1u);
  const pid_t child_pid = child.pid();
  ASSERT_EQ(SecondaryEntriesOf(child_pid).size(), 2u) << "a reader's secondary dir and its lock file";
  auto live = Unwrap(Store::OpenReadOnly(path, TestOptions()));
  ASSERT_EQ(SecondaryEntriesOf(::getpid()).size(), 2u);
  child.Kill();
  child.Reap();
  ASSERT_EQ(SecondaryEntriesOf(child_pid).size(), 2u) << "SIGKILL leaves them behind";
  auto next = Unwrap(Store::OpenReadOnly(path, TestOptions()));
  EXPECT_TRUE(SecondaryEntriesOf(child_pid).empty()) << "the next read-only open removes a dead reader's";
  EXPECT_EQ(SecondaryEntriesOf(::getpid()).size(), 4u) << "and keeps those of live readers";
  EXPECT_EQ(Unwrap(next->OpenGeneration(kLatest))->info().generation, 1u);
  live.reset();
  next.reset();
  EXPECT_TRUE(SecondaryEntriesOf(::getpid()).empty()) << "a closed reader removes its own";
  unsetenv("TMPDIR");
}

TEST(StoreLeaseTest, SpaceOfDeadReadersIsReclaimedAtOpenWithoutACommit) {
  TempDir dir;
  const std::string path = dir / "s";
  LeaseChild* child = nullptr;
  {
    auto w = Unwrap(Store::Create(path, TestOptions()));
    child = new LeaseChild(path);
    for (uint64_t g = 1; g <= 4; ++g) {
      Step(w.get(), g);
      ASSERT_EQ(child->Lease(), g);
    }
    EXPECT_EQ(Unwrap(w->Stats()).referenced_extent_bytes, 4 * OneGenerationBytes());
  }  // the writer exits while the reader is active
  child->Kill();
  child->WaitZombie();
  {
    auto w = Unwrap(Store::Open(path, TestOptions()));
    auto st = Unwrap(w->Stats());
    EXPECT_EQ(st.referenced_extent_bytes, OneGenerationBytes()) << "space of dead readers' leases kept after open";
    EXPECT_EQ(st.leases, 0u);
    EXPECT_EQ(w->ListGenerations().size(), 1u);
  }
  delete child;
  ExpectStoreHolds(path, 4);
}

// ---------------------------------------------------------------------------
// Damaged COMMITTED and RETAINED.

struct Damage {
  const char* name;
  std::function<void(const std::string& committed)> apply;
  const char* says;
};

class StoreCommittedTest : public ::testing::TestWithParam<int> {};

const Damage kDamages[] = {
    {"truncated", [](const std::string& p) { fs::resize_file(p, 20); }, "truncated to 20 bytes"},
    {"truncated_to_one_slot", [](const std::string& p) { fs::resize_file(p, 4096); }, "truncated to 4096 bytes"},
    {"empty", [](const std::string& p) { fs::resize_file(p, 0); }, "empty"},
    {"deleted", [](const std::string& p) { fs::remove(p); }, "missing"},
};

TEST_P(StoreCommittedTest, DamagedCommittedIsReportedAndRefusedWithWhatToDo) {
  const Damage& d = kDamages[GetParam()];
  TempDir dir;
  const std::string path = dir / "s";
  {
    auto w = Unwrap(Store::Create(path, TestOptions()));
    Step(w.get(), 1);
    Step(w.get(), 2);
  }
  d.apply(path + "/COMMITTED");
  {
    auto ro = Unwrap(Store::OpenReadOnly(path, TestOptions()));
    auto rep = Unwrap(ro->Verify());
    ASSERT_FALSE(rep.ok()) << d.name << ": verify must report a damaged COMMITTED";
    bool found = false;
    for (const auto& p : rep.problems) {
      if (p.find("COMMITTED") != std::string::npos && p.find(d.says) != std::string::npos &&
          p.find("optstate-restore") != std::string::npos) {
        found = true;
      }
    }
    EXPECT_TRUE(found) << d.name << ": " << rep.problems[0];
  }
  auto r = Store::Open(path, TestOptions());
  ASSERT_FALSE(r.ok()) << d.name << ": the writer must refuse a damaged COMMITTED";
  EXPECT_TRUE(r.status().IsCorruption()) << r.status().ToString();
  ExpectMessageHas(r.status(), {path, "COMMITTED", d.says, "generations up to 2", "optstate-restore",
                                "COMMITTED.accept-index"});
  // The user accepts the index as it is.
  WriteFile(path + "/COMMITTED.accept-index", "");
  {
    auto w = Unwrap(Store::Open(path, TestOptions()));
    EXPECT_EQ(w->LatestGeneration().generation, 2u);
    Step(w.get(), 3);
  }
  EXPECT_FALSE(fs::exists(path + "/COMMITTED.accept-index"));
  ExpectStoreHolds(path, 3);
  auto w = Unwrap(Store::Open(path, TestOptions()));
  EXPECT_EQ(w->LatestGeneration().generation, 3u);
}

INSTANTIATE_TEST_SUITE_P(Damages, StoreCommittedTest, ::testing::Range(0, static_cast<int>(std::size(kDamages))),
                         [](const ::testing::TestParamInfo<int>& i) { return std::string(kDamages[i.param].name); });

TEST(StoreDamageTest, StoreWithoutCommitsOpensWithoutCommitted) {
  TempDir dir;
  const std::string path = dir / "s";
  { auto w = Unwrap(Store::Create(path, TestOptions())); }
  fs::remove(path + "/COMMITTED");
  {
    auto w = Unwrap(Store::Open(path, TestOptions()));
    EXPECT_EQ(w->LatestGeneration().generation, 0u);
    Step(w.get(), 1);
  }
  ExpectStoreHolds(path, 1);
}

TEST(StoreDamageTest, VerifyReportsDamagedRetained) {
  TempDir dir;
  const std::string path = dir / "s";
  {
    auto w = Unwrap(Store::Create(path, TestOptions()));
    Step(w.get(), 1);
  }
  WriteFile(path + "/RETAINED", "garbage");
  auto ro = Unwrap(Store::OpenReadOnly(path, TestOptions()));
  auto rep = Unwrap(ro->Verify());
  ASSERT_FALSE(rep.ok());
  EXPECT_NE(rep.problems[0].find("RETAINED"), std::string::npos) << rep.problems[0];
  EXPECT_NE(rep.problems[0].find("read-write"), std::string::npos) << rep.problems[0];
  { auto w = Unwrap(Store::Open(path, TestOptions())); }  // rewrites it
  ExpectStoreHolds(path, 1);
}

}  // namespace
}  // namespace optstate::vfs
