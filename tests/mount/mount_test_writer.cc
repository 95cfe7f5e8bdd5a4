// A trainer stand-in for the mount tests: opens a store read-write and commits
// steps (every chunk rewritten with the deterministic pattern of that step,
// tests/vfs/checkpoint_test_util.h), optionally taking a snapshot after one of
// them, until a step count is reached and, with --until, a stop file exists.
//
//   mount_test_writer STORE --first-step S --steps N [--snapshot-after K NAME]
//                     [--until FILE] [--progress FILE] [--create NAME:NUMEL ...] [--chunk-mib N]
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "tests/vfs/checkpoint_test_util.h"

using namespace optstate;       // NOLINT
using namespace optstate::vfs;  // NOLINT

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  std::string store_path = argv[1], snap_name, until, progress;
  std::vector<std::string> create;
  uint64_t first = 1, steps = 1, snap_after = 0, chunk_mib = 8;
  for (int i = 2; i + 1 < argc; ++i) {
    std::string a = argv[i];
    if (a == "--first-step") first = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--steps") steps = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--snapshot-after" && i + 2 < argc) {
      snap_after = std::strtoull(argv[++i], nullptr, 10);
      snap_name = argv[++i];
    } else if (a == "--until") until = argv[++i];
    else if (a == "--progress") progress = argv[++i];
    else if (a == "--create") create.push_back(argv[++i]);
    else if (a == "--chunk-mib") chunk_mib = std::strtoull(argv[++i], nullptr, 10);
  }
  // A fresh store with NAME:NUMEL tensors (benchmarks), kept open: tensors
  // only the pending generation holds do not outlive the writer, so the
  // first step's commit publishes them.
  Result<std::unique_ptr<Store>> store = create.empty() ? Store::Open(store_path, StoreOptions{})
                                                        : Result<std::unique_ptr<Store>>(nullptr);
  if (!create.empty()) {
    StoreOptions o;
    o.chunk_size_bytes = chunk_mib * kMiB;
    store = Store::Create(store_path, o);
    for (size_t i = 0; store.ok() && i < create.size(); ++i) {
      const std::string& c = create[i];
      TensorSpec spec;
      spec.name = c.substr(0, c.rfind(':'));
      spec.numel = std::strtoull(c.substr(c.rfind(':') + 1).c_str(), nullptr, 10);
      auto t = (*store)->CreateTensor(spec);
      if (!t.ok()) {
        std::fprintf(stderr, "writer: %s\n", t.status().ToString().c_str());
        return 1;
      }
    }
  }
  if (!store.ok()) {
    std::fprintf(stderr, "writer: %s\n", store.status().ToString().c_str());
    return 1;
  }
  for (uint64_t n = 0; n < 100000; ++n) {
    uint64_t step = first + n;
    if (n >= steps && (until.empty() || access(until.c_str(), F_OK) == 0)) break;
    if (optstate::vfs::testing::WriteStep(store->get(), step) == 0) return 1;
    if (step == snap_after) {
      auto s = (*store)->CreateSnapshot(snap_name);
      if (!s.ok()) {
        std::fprintf(stderr, "writer: %s\n", s.status().ToString().c_str());
        return 1;
      }
    }
    if (!progress.empty()) {
      std::ofstream(progress + ".tmp") << step << "\n";
      std::rename((progress + ".tmp").c_str(), progress.c_str());
    }
  }
  return 0;
}
