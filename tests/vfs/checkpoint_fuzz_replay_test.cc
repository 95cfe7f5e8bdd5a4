// Replays the manifest fuzzer's corpus (tests/vfs/fuzz/corpus) through the same
// property check as the libFuzzer target, so every build checks it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/vfs/checkpoint_fake_view.h"
#include "tests/vfs/fuzz/manifest_fuzz_check.h"

namespace optstate::vfs {
namespace {

TEST(ManifestFuzzReplay, Corpus) {
  const std::filesystem::path dir = OPTSTATE_FUZZ_CORPUS_DIR;
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << "no corpus at " << dir;
  size_t n = 0, accepted = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::string s((std::istreambuf_iterator<char>(in)), {});
    accepted += CheckManifestInput(s);
    ++n;
  }
  EXPECT_GT(n, 0u);
  EXPECT_GT(accepted, 0u) << "the corpus should hold at least one valid manifest";
}

TEST(ManifestFuzzReplay, MutatedValidManifest) {
  testing::FakeView v(2 * kMiB, 3, 9);
  v.Add("a/b", 600000, 1);
  v.Add("c", 5, 2);
  std::string base = SerializeManifest(*ManifestFromView(v));
  ASSERT_TRUE(CheckManifestInput(base));
  // Every truncation and a sweep of single-byte edits: no crash, stable accept.
  for (size_t i = 0; i < base.size(); i += 7) {
    CheckManifestInput(base.substr(0, i));
    for (char c : {'0', '9', '"', '{', ']', '-', 'e', '\0'}) {
      std::string m = base;
      m[i] = c;
      CheckManifestInput(m);
    }
  }
}

}  // namespace
}  // namespace optstate::vfs
