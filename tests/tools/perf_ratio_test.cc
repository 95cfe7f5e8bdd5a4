// The CI regression check on speed: optstate-bench's ratios
// against baselines measured in the same run, interleaved, never absolute
// times. The bounds are loose on purpose: this 2-core VM's disk swings by 2x
// between runs, so they only catch what a broken pipeline does (the io
// engine no faster than synchronous I/O; the step far from the I/O floor:
// overlap lost), never a few percent.
// Not built under the sanitizers (their slowdown is not the code's), and run
// alone (RUN_SERIAL): another test's I/O would be in the baseline's rounds
// and not in ours, or the other way round.
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/tools/tools_test_util.h"

namespace optstate::tools {
namespace {

using testing::ParseJson;
using testing::TempDir;
using testing::Tool;

// 256 MiB of 8 MiB blocks at QD 32, 3 rounds of fio, ours and synchronous
// pwrite/pread of the same blocks. Dev VM, three runs: ours/sync write
// 1.97-2.10x, read 1.40-1.41x; ours/fio 0.92-1.21x. (8 MiB requests nearly
// fill this disk even one at a time, so this catches an engine that lost its
// asynchrony or its O_DIRECT, not a shallower queue.)
TEST(PerfRatioTest, IoEngineStaysAheadOfSynchronousIo) {
  TempDir dir;
  auto r = Tool("optstate-bench", {"io", "--dir", dir.path(), "--size", "256M", "--chunk-sizes", "8M",
                                   "--rounds", "3", "--no-mixed", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = ParseJson(r);
  ASSERT_EQ(j["results"].size(), 2u) << j.dump();
  for (const nlohmann::json& row : j["results"]) {
    const std::string phase = row["phase"].get<std::string>();
    const double vs_sync = row["ours_vs_sync"].get<double>();
    const double vs_fio = row["ours_vs_fio"].get<double>();
    EXPECT_GE(vs_sync, phase == "write" ? 1.3 : 1.1) << phase << ": " << row.dump();
    EXPECT_GE(vs_fio, 0.6) << phase << ": " << row.dump();
  }
}

// A 1 GiB state of the trainer mix through a 128 MiB budget (host backend),
// 3 rounds of ours and the I/O floor (fio reading and writing the same
// bytes). Dev VM: ours/floor 0.95x, 1.07x and, in a CI run with a fast disk,
// 1.25x (rounds 1.13-1.29x). The bound catches a step that lost its
// read-ahead and write overlap, not a few percent: with `--read-ahead 1
// --write-qd 1` (one slice staged, one write at a time) it was 1.93x. The
// miles' streaming's method is not checked here: on this disk it is only
// 1.06-1.44x slower than ours per round, so no bound on it separates a broken
// pipeline from a slow hour (one at 1.15x failed that CI run at 1.13x).
TEST(PerfRatioTest, StepStaysNearTheIoFloor) {
  TempDir dir;
  auto r = Tool("optstate-bench", {"step", "--dir", dir.path(), "--state", "1G", "--budget", "128M", "--backend",
                                   "host", "--rounds", "3", "--no-first-version", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = ParseJson(r);
  EXPECT_LE(j["ours_over_floor"].get<double>(), 1.8) << j["seconds"].dump();
  EXPECT_LE(j["peak_resident_bytes"].get<uint64_t>(), j["budget_bytes"].get<uint64_t>());
}

}  // namespace
}  // namespace optstate::tools
