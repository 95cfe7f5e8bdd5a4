// Helpers for the tools tests: run a tool of this build, parse its JSON.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

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

class TempDir {
 public:
  TempDir() {
    auto d = MakeTempDir("optstate-tools-test-");
    path_ = d.ok() ? *d : "/tmp/optstate-tools-test-failed";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& s) const { return path_ + "/" + s; }

 private:
  std::string path_;
};

// Creates a store at `path` with chunk 2 MiB, one tensor "w" of `numel`
// elements whose main[i] = i (as float), committed once (step 1), and a
// snapshot "s1". Returns the open writable store.
inline std::unique_ptr<vfs::Store> MakeSmallStore(const std::string& path, uint64_t numel = 1000) {
  vfs::StoreOptions o;
  o.chunk_size_bytes = 2 * vfs::kMiB;
  o.preallocate_step_bytes = 8 * vfs::kMiB;
  auto s = vfs::Store::Create(path, o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  vfs::TensorSpec spec;
  spec.name = "w";
  spec.numel = numel;
  auto t = (*s)->CreateTensor(spec);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  const uint64_t per_chunk = o.chunk_size_bytes / 4;
  vfs::IoBuffer buf(o.chunk_size_bytes);
  for (uint64_t c = 0; c * per_chunk < numel; ++c) {
    for (uint64_t i = 0; i < per_chunk; ++i) buf.as<float>()[i] = static_cast<float>(c * per_chunk + i);
    EXPECT_TRUE((*s)->WriteChunk({t->id, 0, c}, buf.data()).ok());
  }
  vfs::CommitInfo ci;
  ci.step = 1;
  ci.groups.push_back(vfs::GroupInfo{0, 1, {{"lr", 1e-3}}});
  auto g = (*s)->Commit(ci);
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_TRUE((*s)->CreateSnapshot("s1").ok());
  return std::move(*s);
}

}  // namespace optstate::tools::testing
