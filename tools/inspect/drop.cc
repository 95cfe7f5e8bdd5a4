// optstate-inspect STORE drop NAME...: drops tensors from a store for good
// (Store::DropTensors), keeping the head it replaces as a snapshot.
//
// The one command of optstate-inspect that writes: it opens the store
// read-write (Store::Open), so a store a trainer has open is refused with the
// trainer's pid (kBusy); there is nothing to force: a running trainer would
// commit the tensors again. Before the drop, the head is pinned as snapshot
// pre-drop-<generation>-<ms> (O(1)), so nothing is lost until it is released;
// a failed drop releases it again.
#include <chrono>
#include <iostream>
#include <set>

#include <fmt/format.h>

#include "tools/inspect/common.h"
#include "tools/internal/cli.h"

namespace optstate::tools::inspect {
namespace {

using nlohmann::json;

// A snapshot name `store` does not have: pre-drop-<generation>-<ms>, with
// -<n> appended while taken.
std::string PreDropSnapshotName(const vfs::Store& store, uint64_t generation) {
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  std::set<std::string> taken;
  for (const vfs::SnapshotInfo& s : store.ListSnapshots()) taken.insert(s.name);
  const std::string base = fmt::format("pre-drop-{}-{}", generation, ms);
  std::string name = base;
  for (int n = 2; taken.count(name); ++n) name = fmt::format("{}-{}", base, n);
  return name;
}

}  // namespace

int Drop(const Args& a) {
  if (!IsStoreDir(a.store)) {
    return FailWith(kTool, NotFound(fmt::format("{} is not a store (no IDENTITY file)", a.store)));
  }
  auto s = vfs::Store::Open(a.store, vfs::StoreOptions{});
  if (!s.ok()) return FailWith(kTool, s.status());
  vfs::Store& store = **s;
  // Every name first, so a typo drops nothing and leaves no snapshot behind.
  for (const std::string& n : a.tensors) {
    if (!store.LookupTensor(n)) {
      auto f = store.FindTensor(n);  // its message lists near names
      return FailWith(kTool, f.ok() ? NotFound(fmt::format("store {}: no tensor '{}'", a.store, n)) : f.status());
    }
  }
  const vfs::GenerationInfo head = store.LatestGeneration();
  std::string kept;
  if (head.generation > 0) {
    kept = PreDropSnapshotName(store, head.generation);
    auto snap = store.CreateSnapshot(kept);
    if (!snap.ok()) return FailWith(kTool, snap.status().WithContext("keeping the head before the drop"));
  }
  auto g = store.DropTensors(a.tensors);
  if (!g.ok()) {
    if (!kept.empty()) (void)store.ReleaseSnapshot(kept);
    return FailWith(kTool, g.status());
  }
  if (a.json) {
    PrintJson(json{{"store", a.store},
                   {"dropped", a.tensors},
                   {"generation", *g},
                   {"replaced_generation", head.generation},
                   {"kept_snapshot", kept}});
    return 0;
  }
  std::cout << fmt::format("dropped {} tensor(s) from {}: generation {} no longer holds {}\n", a.tensors.size(),
                           a.store, *g, fmt::join(a.tensors, ", "));
  if (!kept.empty()) {
    std::cout << fmt::format("kept the replaced head (generation {}) as snapshot {} (it holds its disk space "
                             "until released: optstate.Store.release_snapshot or optstate_store_snapshot_release)\n",
                             head.generation, kept);
  }
  return 0;
}

}  // namespace optstate::tools::inspect
