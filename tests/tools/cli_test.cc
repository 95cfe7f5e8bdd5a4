// Malformed command lines: every tool exits non-zero with a message that says
// what was wrong. Plus tiny functional runs of `optstate-bench io` (16 MiB,
// no fio) whose JSON must account for every byte, and of `optstate-bench
// mount`; no timing is asserted.
#include <fcntl.h>
#include <math.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "tests/tools/tools_test_util.h"
#include "tools/internal/cli.h"
#include "tools/internal/process.h"

namespace optstate::tools {
namespace {

using testing::ParseJson;
using testing::TempDir;
using testing::Tool;

void ExpectUsageError(const std::string& tool, std::vector<std::string> args,
                      const std::string& needle) {
  auto r = Tool(tool, args);
  EXPECT_NE(r.exit_code, 0) << tool << " " << JoinCommand(args);
  std::string all = r.err + r.out;
  EXPECT_NE(all.find(needle), std::string::npos)
      << tool << " " << JoinCommand(args) << "\nstdout: " << r.out << "\nstderr: " << r.err;
}

TEST(CliTest, InspectRejectsMalformedArguments) {
  ExpectUsageError("optstate-inspect", {}, "store");
  ExpectUsageError("optstate-inspect", {"/tmp"}, "subcommand");
  ExpectUsageError("optstate-inspect", {"/tmp", "lss"}, "lss");
  ExpectUsageError("optstate-inspect", {"/nonexistent/store", "stat"}, "/nonexistent/store");
  ExpectUsageError("optstate-inspect", {"/tmp", "stat"}, "not a store");
  ExpectUsageError("optstate-inspect", {"/tmp", "show"}, "tensor");
  ExpectUsageError("optstate-inspect", {"/tmp", "diff", "a"}, "snap_b");
  ExpectUsageError("optstate-inspect", {"/tmp", "show", "x", "--values", "many"}, "many");
}

TEST(CliTest, JsonNumberTellsNanFromInfinity) {
  EXPECT_EQ(JsonNumber(1.5), nlohmann::json(1.5));
  EXPECT_EQ(JsonNumber(std::nan("")), nlohmann::json("NaN"));
  EXPECT_EQ(JsonNumber(HUGE_VAL), nlohmann::json("Infinity"));
  EXPECT_EQ(JsonNumber(-HUGE_VAL), nlohmann::json("-Infinity"));
  EXPECT_EQ(JsonNumber(-0.0).dump(), "-0.0");
}

TEST(CliTest, BenchCommandLineErrorsExitTwoWithThePrefix) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{}, {"iox"}, {"io", "--frobnicate"}, {"io", "--rounds", "x"}}) {
    auto r = Tool("optstate-bench", args);
    EXPECT_EQ(r.exit_code, 2) << JoinCommand(args) << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("optstate-bench: error: ", 0), 0u) << JoinCommand(args) << "\n" << r.err;
  }
}

TEST(CliTest, BenchRejectsMalformedArguments) {
  ExpectUsageError("optstate-bench", {}, "subcommand");
  ExpectUsageError("optstate-bench", {"iox"}, "iox");
  ExpectUsageError("optstate-bench", {"io", "--chunk-sizes", "8Q"}, "unknown unit");
  ExpectUsageError("optstate-bench", {"io", "--chunk-sizes", "1000"}, "multiple of 4 KiB");
  ExpectUsageError("optstate-bench", {"io", "--size", "1M", "--chunk-sizes", "8M"}, "smaller");
  ExpectUsageError("optstate-bench", {"io", "--rounds", "0"}, "--rounds");
  ExpectUsageError("optstate-bench", {"io", "--dir", "/nonexistent/dir"}, "/nonexistent/dir");
}

TEST(CliTest, BenchIoSmallRunAccountsForEveryByte) {
  TempDir dir;
  auto r = Tool("optstate-bench", {"io", "--dir", dir.path(), "--size", "16M", "--chunk-sizes",
                                   "2M,4M", "--rounds", "1", "--no-fio", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = ParseJson(r);
  ASSERT_EQ(j["results"].size(), 6u);  // 2 chunk sizes x (write, read, mixed)
  for (const auto& row : j["results"]) {
    EXPECT_EQ(row["bytes"].get<uint64_t>(), 16u << 20);
    EXPECT_EQ(row["ours"]["seconds"].size(), 1u);
    EXPECT_GT(row["ours"]["seconds"][0].get<double>(), 0.0);
    EXPECT_EQ(row["sync"]["seconds"].size(), 1u);
    EXPECT_TRUE(row["fio"]["seconds"].empty());
  }
  EXPECT_EQ(j["results"][0]["chunk_bytes"].get<uint64_t>(), 2u << 20);
  EXPECT_EQ(j["results"][3]["chunk_bytes"].get<uint64_t>(), 4u << 20);
}

// optstate-bench mount end to end on a small store: every phase ran once, the
// read(2) phase got every byte of the snapshot's files back (the tool fails
// otherwise), and the daemon reported what it served.
TEST(CliTest, BenchMountFuseSmallRunReadsEveryByte) {
  if (!InPath("fio")) GTEST_SKIP() << "fio is not installed";
  int fd = open("/dev/fuse", O_RDWR);
  if (fd < 0) GTEST_SKIP() << "/dev/fuse unusable here";
  close(fd);
  TempDir dir;
  fd = open((dir.path() + "/probe").c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) GTEST_SKIP() << dir.path() << " refuses O_DIRECT (fio's reference needs it)";
  close(fd);
  auto r = Tool("optstate-bench", {"mount", "--dir", dir.path(), "--state", "48M", "--rounds", "1", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  auto j = ParseJson(r);
  const uint64_t bytes = j["bytes"].get<uint64_t>();
  EXPECT_GE(bytes, 2 * (48u << 20));  // state.safetensors + the three field files
  for (const char* phase : {"cp", "fio", "read"}) {
    ASSERT_EQ(j["seconds"][phase].size(), 1u) << phase;
    EXPECT_GT(j["seconds"][phase][0].get<double>(), 0.0) << phase;
  }
  // With room in tmpfs for two copies (the rows against cp's own speed),
  // each round also copies from the mount with the page cache kept.
  EXPECT_EQ(j["seconds"]["cp_warm"].size(), j["seconds"]["cp_from_tmpfs"].size());
  const std::string served = j["daemon_served"].get<std::string>();
  EXPECT_NE(served.find(" reads ("), std::string::npos) << served;
  EXPECT_NE(served.find("chunks loaded"), std::string::npos) << served;
  EXPECT_NE(served.rfind("0 reads", 0), 0u) << served;  // it served something
  // It evicted the mount's files and the store's from the page cache (only
  // those: the rest of the machine's page cache is not its to drop).
  EXPECT_EQ(j["page_cache_dropped"], true) << r.out;
}

}  // namespace
}  // namespace optstate::tools
