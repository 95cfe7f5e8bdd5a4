// optstate-demo end to end with a small model: it must train, copy the
// snapshot (through FUSE in the fuse-labelled test, by direct export in the
// other), restore it and report a bit-for-bit match; its JSON summary (stderr)
// is checked against the budget and the bytes a step must stream.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "tests/tools/tools_test_util.h"
#include "vfs/store.h"

namespace optstate::tools {
namespace {

using testing::TempDir;
using testing::Tool;

nlohmann::json SummaryLine(const std::string& err) {
  size_t p = err.rfind("{\"");
  if (p == std::string::npos) return {};
  return nlohmann::json::parse(err.substr(p), nullptr, false);
}

void RunDemo(bool mount) {
  TempDir dir;
  std::vector<std::string> args = {"--dir", dir / "demo", "--params", "1000000", "--steps", "4",
                                   "--budget", "8M", "--keep", "--json", "--backend", "host"};
  if (!mount) args.push_back("--no-mount");
  auto r = Tool("optstate-demo", args);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("identical"), std::string::npos) << r.out;
  auto j = SummaryLine(r.err);
  ASSERT_TRUE(j.is_object()) << r.err;
  EXPECT_TRUE(j["identical"].get<bool>());
  EXPECT_TRUE(j["verify_ok"].get<bool>());
  EXPECT_EQ(j["mounted"].get<bool>(), mount);
  EXPECT_LE(j["peak_resident_bytes"].get<uint64_t>(), j["budget_bytes"].get<uint64_t>());
  EXPECT_LT(j["budget_bytes"].get<uint64_t>(), j["state_bytes"].get<uint64_t>());
  // Every step reads and writes the whole state (moments read from step 2 on).
  uint64_t state = j["state_bytes"].get<uint64_t>();
  EXPECT_GE(j["nvme_write_bytes"].get<uint64_t>(), 4 * state);
  // The reads come from the store or, once the state is in the RAM tier, from it.
  EXPECT_GE(j["nvme_read_bytes"].get<uint64_t>() + j["cache_hit_bytes"].get<uint64_t>(), 3 * state);
  EXPECT_GE(j["copied_bytes"].get<uint64_t>(), state);  // field files + safetensors
  // --keep left the restored store, and it inspects clean.
  auto v = Tool("optstate-inspect", {dir / "demo/restored/demo.rank0000", "verify"});
  EXPECT_EQ(v.exit_code, 0) << v.out << v.err;
  // Its tensors have the model's shapes (2-D weights as 2-D), from the
  // trained store through the checkpoint's manifest.
  auto restored = vfs::Store::OpenReadOnly(dir / "demo/restored/demo.rank0000", vfs::StoreOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  std::map<std::string, std::vector<uint64_t>> shapes;
  for (const vfs::TensorInfo& t : (*restored)->ListTensors()) shapes[t.name] = t.shape;
  ASSERT_EQ(shapes.size(), 5u);
  const uint64_t params = j["params"].get<uint64_t>();
  const uint64_t mlp = 64 * 32 + 64 + 64 + 1;  // the demo's MLP (kHidden 64, kDim 32)
  EXPECT_EQ(shapes["embed.weight"], (std::vector<uint64_t>{(params - mlp) / 32, 32}));
  EXPECT_EQ(shapes["mlp.fc1.weight"], (std::vector<uint64_t>{64, 32}));
  EXPECT_EQ(shapes["mlp.fc1.bias"], (std::vector<uint64_t>{64}));
  EXPECT_EQ(shapes["mlp.fc2.weight"], (std::vector<uint64_t>{1, 64}));
  EXPECT_EQ(shapes["mlp.fc2.bias"], (std::vector<uint64_t>{1}));
}

TEST(DemoTest, RunsEndToEndWithDirectExport) { RunDemo(false); }

TEST(DemoFuseTest, RunsEndToEndThroughTheMount) {
  int fd = open("/dev/fuse", O_RDWR);
  if (fd < 0) GTEST_SKIP() << "/dev/fuse unusable here";
  close(fd);
  RunDemo(true);
}

TEST(DemoTest, RejectsMalformedArguments) {
  // A malformed command line: exit 2 and the tools' common prefix (docs/CLI.md).
  for (const auto& [args, needle] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--params", "lots"}, "lots"},
           {{"--budget", "12Q"}, "--budget"},
           {{"--params", "5"}, "--params must be >= 10000"},
           {{"--frobnicate"}, "unknown option '--frobnicate'"}}) {
    auto r = Tool("optstate-demo", args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.err.rfind("optstate-demo: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace optstate::tools
