// Helpers for the tools tests: run a tool of this build, parse its JSON.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/common/test_util.h"
#include "vfs/io_buffer.h"
#include "tools/internal/process.h"
#include "vfs/store.h"

namespace optstate::tools::testing {

inline std::string ToolPath(const std::string& name) {
  return std::string(OPTSTATE_TOOLS_DIR) + "/" + name;
}

// Runs a tool of this build with args; the test fails if it cannot start.
inline CommandResult Tool(const std::string& name, std::vector<std::string> args) {
  args.insert(args.begin(), ToolPath(name));
  auto r = RunCommand(args);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : CommandResult{};
}

inline nlohmann::json ParseJson(const CommandResult& r) {
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << r.out << "\nstderr: " << r.err;
  return j;
}

// A fresh directory under TMPDIR (default /tmp), removed (recursively) on destruction.
class TempDir : public test_util::TempDir {
 public:
  TempDir() : test_util::TempDir(test_util::EnvDirOr("TMPDIR", "/tmp") + "/optstate-tools-test-") {}
};

// A new writable store at `path` with chunk 2 MiB (null, and a failure, if it
// cannot be created).
inline std::unique_ptr<vfs::Store> CreateTestStore(const std::string& path) {
  vfs::StoreOptions o;
  o.chunk_size_bytes = 2 * vfs::kMiB;
  o.preallocate_step_bytes = 8 * vfs::kMiB;
  auto s = vfs::Store::Create(path, o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

// Writes `field` of tensor `tensor_id` (fp32, `numel` elements, element i =
// value(i)) chunk by chunk into the pending generation.
inline void WriteFloatField(vfs::Store* s, uint32_t tensor_id, uint32_t field, uint64_t numel,
                            const std::function<float(uint64_t)>& value) {
  const uint64_t chunk = s->identity().chunk_size_bytes;
  const uint64_t per_chunk = chunk / 4;
  vfs::IoBuffer buf(chunk);
  for (uint64_t c = 0; c * per_chunk < numel; ++c) {
    for (uint64_t i = 0; i < per_chunk; ++i) buf.as<float>()[i] = value(c * per_chunk + i);
    EXPECT_TRUE(s->WriteChunk({tensor_id, field, c}, buf.data()).ok());
  }
}

// Creates a store at `path` with chunk 2 MiB, one tensor "w" of `numel`
// elements whose main[i] = i (as float), committed once (step 1), and a
// snapshot "s1". Returns the open writable store.
inline std::unique_ptr<vfs::Store> MakeSmallStore(const std::string& path, uint64_t numel = 1000) {
  std::unique_ptr<vfs::Store> s = CreateTestStore(path);
  if (s == nullptr) return nullptr;
  vfs::TensorSpec spec;
  spec.name = "w";
  spec.numel = numel;
  auto t = s->CreateTensor(spec);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  WriteFloatField(s.get(), t->id, 0, numel, [](uint64_t i) { return static_cast<float>(i); });
  vfs::CommitInfo ci;
  ci.step = 1;
  ci.groups.push_back(vfs::GroupInfo{0, 1, {{"lr", 1e-3}}});
  auto g = s->Commit(ci);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE(s->CreateSnapshot("s1").ok());
  return s;
}

}  // namespace optstate::tools::testing
