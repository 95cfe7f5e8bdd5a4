// Malformed command lines: every tool exits non-zero with a message that says
// what was wrong. Plus a tiny functional run of `optstate-bench io` (16 MiB,
// no fio) whose JSON must account for every byte; no timing is asserted.
#include <gtest/gtest.h>

#include "tests/tools/tools_test_util.h"

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

}  // namespace
}  // namespace optstate::tools
