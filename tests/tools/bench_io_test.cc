// optstate-bench io runs its three methods over the same blocks and reports
// each phase's ratios from the same run. How fast the engine is, against fio
// and against synchronous I/O, is the bench's to print, not a test's to
// assert: this checks that the comparison is made and reported, so the
// numbers in docs/BENCHMARKS.md can be reproduced; and that optstate-bench
// reshard cleans up after itself. Not built under the
// sanitizers (the bench is slow under them and measures nothing there).
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/tools/tools_test_util.h"

namespace optstate::tools {
namespace {

using testing::ParseJson;
using testing::TempDir;
using testing::Tool;

TEST(BenchIoTest, ReportsEachPhaseOfEachMethodOverTheSameBytes) {
  TempDir dir;
  auto r = Tool("optstate-bench", {"io", "--dir", dir.path(), "--size", "64M", "--chunk-sizes", "8M",
                                   "--rounds", "2", "--no-mixed", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = ParseJson(r);
  ASSERT_EQ(j["results"].size(), 2u) << j.dump();
  for (const nlohmann::json& row : j["results"]) {
    const std::string phase = row["phase"].get<std::string>();
    EXPECT_TRUE(phase == "write" || phase == "read") << row.dump();
    EXPECT_EQ(row["bytes"].get<uint64_t>(), 64u << 20) << row.dump();
    EXPECT_EQ(row["chunk_bytes"].get<uint64_t>(), 8u << 20) << row.dump();
    for (const char* method : {"ours", "sync"}) {
      ASSERT_TRUE(row.contains(method)) << phase << ": " << row.dump();
      EXPECT_EQ(row[method]["seconds"].size(), 2u) << phase << " " << method << ": " << row.dump();
      EXPECT_GT(row[method]["median_bytes_per_second"].get<double>(), 0.0) << phase << " " << method;
    }
    EXPECT_GT(row["ours_vs_sync"].get<double>(), 0.0) << phase << ": " << row.dump();
  }
}

// optstate-bench reshard with --dir writes its source checkpoints there and
// removes them at the end: the directory is left as it was, and a second run
// with the same --dir works (it used to find the first run's sources and
// refuse to export over them).
TEST(BenchReshardTest, LeavesItsDirAsItWasAndRunsAgainInIt) {
  TempDir dir;
  for (int run = 0; run < 2; ++run) {
    auto r = Tool("optstate-bench", {"reshard", "--dir", dir.path(), "--size", "16M", "--chunk-size", "2M",
                                     "--rounds", "1", "--no-fio", "--json"});
    ASSERT_EQ(r.exit_code, 0) << "run " << run << ": " << r.err;
    const nlohmann::json j = ParseJson(r);
    EXPECT_EQ(j["from_ranks"].get<uint64_t>(), 4u);
    EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "run " << run << " left files in " << dir.path();
  }
}

}  // namespace
}  // namespace optstate::tools
