// optstate-restore as a user runs it, and the README's walkthrough step that
// reads state.safetensors with the Python that tools/setup.sh installs:
// each run on a checkpoint directory exported here from a small real store.
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>

#include "tests/tools/tools_test_util.h"
#include "vfs/checkpoint.h"

namespace optstate::tools {
namespace {

namespace fs = std::filesystem;
using testing::MakeSmallStore;
using testing::TempDir;
using testing::Tool;

// Writes the latest generation of `store` as a checkpoint directory, through
// the layout the mount serves (what `cp -r` of latest/ gives).
void ExportLatest(vfs::Store* store, const std::string& dir) {
  auto v = store->OpenGeneration(vfs::kLatest);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  auto l = vfs::CheckpointLayout::Build(v->get());
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  for (const vfs::CheckpointFile& f : (*l)->files()) {
    fs::path p = fs::path(dir) / f.path;
    fs::create_directories(p.parent_path());
    std::string bytes(f.size_bytes, '\0');
    auto n = (*l)->Read(f, 0, bytes.data(), bytes.size());
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
}

class RestoreToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = MakeSmallStore(dir_ / "src");
    ASSERT_NE(store_, nullptr);
    ckpt_ = dir_ / "ckpt";
    ExportLatest(store_.get(), ckpt_);
  }
  TempDir dir_;
  std::unique_ptr<vfs::Store> store_;
  std::string ckpt_;
};

TEST_F(RestoreToolTest, CreatesAStoreAndSaysWhatIsInTheWay) {
  auto ok = Tool("optstate-restore", {ckpt_, dir_ / "restored", "--create", "restored", "-q"});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::exists(dir_ / "restored/IDENTITY"));

  // An existing empty directory: named as such, left as it was.
  fs::create_directory(dir_ / "empty");
  auto empty = Tool("optstate-restore", {ckpt_, dir_ / "empty", "--create", "x", "-q"});
  EXPECT_EQ(empty.exit_code, 1);
  EXPECT_NE(empty.err.find("optstate-restore: error: "), std::string::npos) << empty.err;
  EXPECT_NE(empty.err.find("is an existing empty directory"), std::string::npos) << empty.err;
  EXPECT_EQ(empty.err.find(" already exists"), std::string::npos) << empty.err;
  EXPECT_TRUE(fs::is_empty(dir_ / "empty"));
  // A regular file: named as such, untouched.
  std::ofstream(dir_ / "file") << "precious";
  auto file = Tool("optstate-restore", {ckpt_, dir_ / "file", "--create", "x", "-q"});
  EXPECT_EQ(file.exit_code, 1);
  EXPECT_NE(file.err.find("is a regular file"), std::string::npos) << file.err;
  std::ifstream in(dir_ / "file");
  std::stringstream got;
  got << in.rdbuf();
  EXPECT_EQ(got.str(), "precious");
  // No store there and no --create: the hint says how.
  auto none = Tool("optstate-restore", {ckpt_, dir_ / "nothing", "-q"});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("--create NAME"), std::string::npos) << none.err;
}

// Malformed command lines: exit 2, the tools' common prefix, and what is
// wrong (an unknown option is named even when the positionals are missing).
TEST_F(RestoreToolTest, BadArgumentsExitTwoAndSayWhatIsWrong) {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{"--frobnicate"}, "unknown option '--frobnicate'"},
      {{ckpt_, dir_ / "x", "--frobnicate"}, "unknown option '--frobnicate'"},
      {{"--quiett", ckpt_, dir_ / "x"}, "did you mean '--quiet'"},
      {{}, "CHECKPOINT_DIR is required"},
      {{ckpt_}, "STORE is required"},
      {{ckpt_, dir_ / "x", "extra"}, "unexpected argument 'extra'"},
      {{ckpt_, dir_ / "x", "--data-dir", "/tmp"}, "--data-dir requires --create"},
      {{ckpt_, dir_ / "x", "--queue-depth", "0"}, "--queue-depth"},
  };
  for (const Case& c : cases) {
    auto r = Tool("optstate-restore", c.args);
    EXPECT_EQ(r.exit_code, 2) << JoinCommand(c.args) << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("optstate-restore: error: ", 0), 0u) << JoinCommand(c.args) << "\n" << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << JoinCommand(c.args) << "\n" << r.err;
    if (c.needle.find("unknown option") != std::string::npos) {
      EXPECT_EQ(r.err.find("is required"), std::string::npos) << r.err;
    }
  }
  EXPECT_FALSE(fs::exists(dir_ / "x"));
  // The same conventions in optstate-inspect.
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--frobnicate"}, {dir_ / "src", "lss"},
                                             {dir_ / "src", "stat", "--frobnicate"},
                                             {dir_ / "src", "ls", "--snapshot", "s1", "--generation", "1"}}) {
    auto r = Tool("optstate-inspect", args);
    EXPECT_EQ(r.exit_code, 2) << JoinCommand(args) << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("optstate-inspect: error: ", 0), 0u) << JoinCommand(args) << "\n" << r.err;
  }
}

// The README's walkthrough reads state.safetensors with /usr/bin/python3 and
// Debian's python3-numpy (Debian 12 packages no safetensors module). The
// command is taken from README.md as it stands and run on a checkpoint.
TEST_F(RestoreToolTest, ReadmeSafetensorsStepWorks) {
  std::ifstream readme(std::string(OPTSTATE_SOURCE_DIR) + "/README.md");
  ASSERT_TRUE(readme.good());
  std::string line, script;
  bool in = false;
  while (std::getline(readme, line)) {
    if (!in && line.rfind("/usr/bin/python3 - /tmp/ckpt/state.safetensors <<'EOF'", 0) == 0) {
      in = true;
      script = line + "\n";
      continue;
    }
    if (in) {
      script += line + "\n";
      if (line == "EOF") break;
    }
  }
  ASSERT_FALSE(script.empty()) << "README.md has no `/usr/bin/python3 - /tmp/ckpt/state.safetensors <<'EOF'` step";
  ASSERT_EQ(script.substr(script.size() - 4), "EOF\n") << script;
  script = std::regex_replace(script, std::regex("/tmp/ckpt"), ckpt_);
  auto r = RunCommand({"/bin/sh", "-c", script});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->exit_code, 0) << "stdout: " << r->out << "\nstderr: " << r->err
                             << "\n(tools/setup.sh installs python3-numpy)";
  // main[i] = i (MakeSmallStore): the first values as numpy prints them, and
  // the generation from the header's metadata.
  EXPECT_NE(r->out.find("w/main F32 (1000,) [0. 1. 2. 3.]"), std::string::npos) << r->out;
  EXPECT_NE(r->out.find("w/exp_avg_sq F32 (1000,) [0. 0. 0. 0.]"), std::string::npos) << r->out;
  EXPECT_NE(r->out.find("'optstate.generation': '" +
                        std::to_string(store_->LatestGeneration().generation) + "'"),
            std::string::npos)
      << r->out;
}

}  // namespace
}  // namespace optstate::tools
