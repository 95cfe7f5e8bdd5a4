// ExportCheckpoint: the directory it writes is byte for byte the layout the
// mount serves (CheckpointLayout::Read, written by WriteCheckpointDir), restores
// bit for bit, and appears at dest complete or not at all: an I/O error or a
// SIGKILL mid-export leaves no dest, an existing non-empty dest is refused.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "tests/common/test_util.h"
#include "tests/vfs/checkpoint_test_util.h"
#include "vfs/checkpoint.h"
#include "vfs/fault_injection.h"

namespace optstate::vfs {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

constexpr const char* kChildEnv = "OPTSTATE_EXPORT_CHILD";  // "<store>|<dest>" for the child below

// Every file under root, by relative path, with its bytes.
std::map<std::string, std::string> Tree(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) out[fs::relative(e.path(), root).string()] = ReadFile(e.path().string());
  }
  return out;
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = MakeTempDir("export");
    store_ = CreateStore(root_ + "/store");
    ASSERT_NE(store_, nullptr);
    CreateTensors(store_.get(), DefaultTensors());
    gen1_ = WriteStep(store_.get(), 11, /*sparse=*/true);  // some chunks never written: zeros
    auto v = store_->OpenGeneration(kLatest);
    ASSERT_TRUE(v.ok());
    want_ = DumpView(**v);
    mount_view_ = root_ + "/mount_view";
    WriteCheckpointDir(**v, mount_view_);
  }
  void TearDown() override {
    store_.reset();
    fs::remove_all(root_);
  }

  std::string root_, mount_view_;
  std::unique_ptr<Store> store_;
  uint64_t gen1_ = 0;
  std::map<std::string, std::string> want_;
};

TEST_F(ExportTest, EqualsTheMountsFilesAndRestoresBitExact) {
  ASSERT_TRUE(store_->CreateSnapshot("s").ok());
  WriteStep(store_.get(), 12);  // latest moves on; the snapshot still names gen1_
  ExportOptions o;
  o.snapshot = "s";
  o.queue_depth = 3;  // fewer buffers than chunks: buffers are reused across files
  uint64_t progress_calls = 0, last_done = 0, last_total = 0;
  o.progress = [&](uint64_t done, uint64_t total) {
    ++progress_calls;
    EXPECT_GE(done, last_done);
    last_done = done, last_total = total;
  };
  auto r = ExportCheckpoint(store_.get(), root_ + "/out", o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->generation, gen1_);
  EXPECT_TRUE(Tree(root_ + "/out") == Tree(mount_view_)) << "exported bytes differ from the layout's";
  EXPECT_EQ(r->files, Tree(mount_view_).size());
  EXPECT_GT(progress_calls, 0u);
  EXPECT_EQ(last_done, last_total);
  EXPECT_EQ(Entries(root_), (std::vector<std::string>{"mount_view", "out", "store"}));  // no partial left
  auto b = CreateStoreFromCheckpoint(root_ + "/out", root_ + "/fresh", StoreOptions{});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_TRUE(DumpLatest(b->get()) == want_);

  // The newest generation (the default), into an existing empty directory.
  auto latest = store_->OpenGeneration(kLatest);
  ASSERT_TRUE(latest.ok());
  WriteCheckpointDir(**latest, root_ + "/latest_view");
  fs::create_directory(root_ + "/empty");
  auto r2 = ExportCheckpoint(store_.get(), root_ + "/empty/");
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->generation, store_->LatestGeneration().generation);
  EXPECT_NE(r2->generation, gen1_);
  EXPECT_TRUE(Tree(root_ + "/empty") == Tree(root_ + "/latest_view"));
}

TEST_F(ExportTest, RefusesExistingDestAndMissingSources) {
  fs::create_directory(root_ + "/full");
  std::ofstream(root_ + "/full/keep") << "mine";
  auto r = ExportCheckpoint(store_.get(), root_ + "/full");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(r.status().message().find(root_ + "/full"), std::string::npos) << r.status().message();
  EXPECT_EQ(ReadFile(root_ + "/full/keep"), "mine");
  std::ofstream(root_ + "/file") << "x";
  EXPECT_EQ(ExportCheckpoint(store_.get(), root_ + "/file").status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(ExportCheckpoint(store_.get(), root_ + "/no/parent").status().code(), StatusCode::kNotFound);
  ExportOptions o;
  o.snapshot = "nope";
  auto r2 = ExportCheckpoint(store_.get(), root_ + "/x", o);
  EXPECT_EQ(r2.status().code(), StatusCode::kNotFound) << r2.status().ToString();
  EXPECT_EQ(Entries(root_), (std::vector<std::string>{"file", "full", "mount_view", "store"}));
}

TEST_F(ExportTest, WriteErrorLeavesNoDest) {
  FaultInjectionFileSystem ffs(FileSystem::Default());
  for (uint64_t nth : {1, 2, 7}) {  // the manifest, the safetensors header, a chunk of a field
    FaultRule rule = FaultRule::FailNth(OpClass::kWrite, nth);
    rule.path_contains = root_ + "/out";
    ffs.AddRule(rule);
    ExportOptions o;
    o.fs = &ffs;
    auto r = ExportCheckpoint(store_.get(), root_ + "/out", o);
    ASSERT_FALSE(r.ok()) << "write " << nth;
    EXPECT_NE(r.status().message().find("export: store " + root_ + "/store"), std::string::npos)
        << r.status().message();
    EXPECT_EQ(Entries(root_), (std::vector<std::string>{"mount_view", "store"})) << "write " << nth;
    ffs.ClearRules();
  }
  ExportOptions o;
  o.fs = &ffs;
  ASSERT_TRUE(ExportCheckpoint(store_.get(), root_ + "/out", o).ok());
  EXPECT_TRUE(Tree(root_ + "/out") == Tree(mount_view_));
}

// Run by CrashLeavesNoDest in a child process: exports, and is killed by OPTSTATE_CRASH_AT.
TEST(ExportChild, DISABLED_Run) {
  const char* env = std::getenv(kChildEnv);
  ASSERT_NE(env, nullptr);
  const std::string arg(env);
  const size_t bar = arg.find('|');
  auto store = Store::Open(arg.substr(0, bar), StoreOptions{});
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto r = ExportCheckpoint(store->get(), arg.substr(bar + 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::printf("EXPORTED\n");
}

TEST_F(ExportTest, CrashLeavesNoDest) {
  store_.reset();  // the child opens it
  for (const char* point : {"export.after_chunk:3", "export.before_rename"}) {
    const std::string dest = root_ + "/out";
    ::setenv(kChildEnv, (root_ + "/store|" + dest).c_str(), 1);
    test_util::ChildOptions co;
    co.exe = "/proc/self/exe";
    co.args = {"--gtest_filter=ExportChild.DISABLED_Run", "--gtest_also_run_disabled_tests"};
    co.crash_at = point;
    test_util::ChildResult res = test_util::RunChild(co);
    ::unsetenv(kChildEnv);
    ASSERT_TRUE(WIFSIGNALED(res.wait_status) && WTERMSIG(res.wait_status) == SIGKILL)
        << point << ": the child was not killed there:\n" << res.output;
    EXPECT_FALSE(fs::exists(dest)) << point;
    // What a crash leaves: the partial directory only.
    bool partial = false;
    for (const std::string& n : Entries(root_)) {
      if (n.rfind("out.partial-", 0) == 0) {
        partial = true;
        fs::remove_all(root_ + "/" + n);
      }
    }
    EXPECT_TRUE(partial) << point;
  }
  // Without a crash point the child's export completes.
  ::setenv(kChildEnv, (root_ + "/store|" + root_ + "/out").c_str(), 1);
  test_util::ChildOptions co;
  co.exe = "/proc/self/exe";
  co.args = {"--gtest_filter=ExportChild.DISABLED_Run", "--gtest_also_run_disabled_tests"};
  test_util::ChildResult res = test_util::RunChild(co);
  ::unsetenv(kChildEnv);
  ASSERT_TRUE(WIFEXITED(res.wait_status) && WEXITSTATUS(res.wait_status) == 0) << res.output;
  EXPECT_TRUE(Tree(root_ + "/out") == Tree(mount_view_));
}

}  // namespace
}  // namespace optstate::vfs
