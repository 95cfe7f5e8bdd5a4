// Helpers for the tools tests: run a tool of this build, parse its JSON.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tools/internal/process.h"

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

}  // namespace optstate::tools::testing
