// optstate-inspect's shared pieces: the parsed command line, opening a store
// read-only (Store::OpenReadOnly: a RocksDB secondary instance, no LOCK) and
// the generation a command reads, and the commands each file implements.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "vfs/store.h"

namespace optstate::tools::inspect {

inline constexpr const char* kTool = "optstate-inspect";
// verify found problems; diff found the two differ (as diff(1)'s 1, but 1 is
// every tool's "failed").
inline constexpr int kExitProblems = 3;
inline constexpr int kExitDiffer = 3;

struct Args {
  std::string store;
  bool json = false;
  // which generation (ls, show)
  std::string snapshot;
  int64_t generation = -1;
  // show
  std::string tensor;
  std::vector<std::string> fields;
  std::string range;
  uint64_t values = 8;
  // diff
  std::string snap_a, snap_b;
  // drop
  std::vector<std::string> tensors;
  // stat: the step time the drive writes per day are projected at
  double step_seconds = 1.0;
};

bool IsStoreDir(const std::string& p);
// "[a,b,c]"
std::string Shape(const std::vector<uint64_t>& s);
// The tensor's shape, or [numel] when it has none.
std::vector<uint64_t> EffectiveShape(const vfs::TensorInfo& t);

// NotFound, with what to do, when path is missing or is not a store.
Result<std::unique_ptr<vfs::Store>> OpenStore(const std::string& path);
// "latest", a snapshot name, or "gen:N" of a retained generation. A name
// that is none of these gets the closest of all of them.
Result<std::unique_ptr<vfs::GenerationView>> OpenNamed(vfs::Store& s, const std::string& name);
// The generation --snapshot or --generation names, else the latest.
Result<std::unique_ptr<vfs::GenerationView>> OpenView(vfs::Store& s, const Args& a);

// The commands: each returns the process's exit code.
int Ls(const Args& a);      // ls.cc
int Stat(const Args& a);    // stat.cc
int Show(const Args& a);    // show.cc
int Verify(const Args& a);  // verify.cc
int Diff(const Args& a);    // diff.cc
int Drop(const Args& a);    // drop.cc: the one command that writes (opens the store read-write)

}  // namespace optstate::tools::inspect
