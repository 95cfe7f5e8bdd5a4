// optstate-restore CHECKPOINT_DIR STORE [--create NAME [--moments f32|bf16|q8]] [--data-dir DIR ...]
//                  [--force] [--queue-depth N] [-q]
//
// Verifies a checkpoint directory (manifest.json, state.safetensors and
// tensors/..., e.g. a `cp -r` of a mounted snapshot) against its manifest,
// chunk by chunk, and imports it as one new committed generation of STORE
// (with its step counts and hyperparameters). With --create, makes STORE from
// the manifest first, all or nothing (STORE appears only with the restored
// generation committed). A layout mismatch, a truncated or altered file
// (manifest.json included: it carries its own checksum), files of different
// generations are refused and nothing is imported. Into an existing store
// whose newest generation has taken steps, a checkpoint of another store is
// refused unless --force, and the generation the restore replaces is kept as
// a snapshot, named in the output. With --moments
// (needs --create), the new store keeps exp_avg and exp_avg_sq in that dtype
// (tools/internal/convert_moments.h: f32 -> bf16 rounds to nearest even,
// relative error <= 2^-8; bf16 -> f32 is exact). Exit codes as
// every tool's (tools/internal/cli.h): 0 restored, 1 refused or failed, 2 a
// malformed command line.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "tools/internal/cli.h"
#include "tools/internal/convert_moments.h"
#include "vfs/checkpoint.h"
#include "vfs/store.h"

namespace optstate::tools {
namespace {

constexpr const char* kTool = "optstate-restore";

int Main(int argc, char** argv) {
  CLI::App app{"Import a checkpoint directory into an optstate store as a new generation"};
  app.name(kTool);
  std::string dir, store_path, create_name;
  std::vector<std::string> data_dirs;
  uint32_t depth = 16;
  bool quiet = false;
  app.add_option("CHECKPOINT_DIR", dir, "directory with manifest.json (e.g. a copied snapshot)")
      ->required();
  app.add_option("STORE", store_path, "store directory (with --create: a path that does not exist yet)")
      ->required();
  CLI::Option* create =
      app.add_option("--create", create_name, "create STORE with this name from the manifest");
  app.add_option("--data-dir", data_dirs, "data directory for --create (repeatable)")->needs(create);
  std::string moments;
  app.add_option("--moments", moments,
                 "with --create: store exp_avg/exp_avg_sq as f32, bf16 or q8, converting the checkpoint's")
      ->needs(create)
      ->check(CLI::IsMember({"f32", "bf16", "q8"}));
  bool force = false;
  app.add_flag("--force", force,
               "restore a checkpoint of another store into STORE although STORE has taken steps (its head is "
               "kept as a snapshot)")
      ->excludes(create);
  app.add_option("--queue-depth", depth, "chunk writes in flight")->check(CLI::Range(1, 1024));
  app.add_flag("-q,--quiet", quiet, "no progress output or [info] log lines");
  if (std::optional<int> code = ParseCommandLine(app, argc, argv, kTool)) return *code;
  if (create->count() > 0 && create_name.empty()) {
    return FailUsage(kTool, "--create needs a store name");
  }

  if (quiet) QuietLibraryLog();
  if (Status s = CheckNotAStoreDirectory(dir); !s.ok()) return FailWith(kTool, s);
  const bool tty = !quiet && isatty(STDERR_FILENO);
  auto start = std::chrono::steady_clock::now();
  vfs::RestoreOptions ro;
  ro.queue_depth = depth;
  if (tty) {
    ro.progress = [&](uint64_t done, uint64_t total) {
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      int width = 40;
      int filled = total ? static_cast<int>(width * done / total) : width;
      fmt::print(stderr, "\r[{}{}] {:5.1f}% {:.2f} GB {:.2f} GB/s", std::string(filled, '#'),
                 std::string(width - filled, ' '), total ? 100.0 * done / total : 100.0, done / 1e9,
                 s > 0 ? done / 1e9 / s : 0.0);
    };
  }
  uint64_t generation = 0;
  std::string kept_snapshot;
  if (!moments.empty()) {
    vfs::StoreOptions so;
    so.name = create_name;
    so.data_dirs = data_dirs;
    Result<MomentDType> md = ParseMomentDType(moments);
    if (!md.ok()) return FailWith(kTool, md.status().WithContext("--moments"));
    auto store = CreateStoreWithMoments(dir, store_path, so, *md, ro.progress);
    if (tty) fmt::print(stderr, "\n");
    if (!store.ok()) {
      return FailWith(kTool, store.status());
    }
    generation = (*store)->LatestGeneration().generation;
  } else if (!create_name.empty()) {
    vfs::StoreOptions so;
    so.name = create_name;
    so.data_dirs = data_dirs;
    auto store = vfs::CreateStoreFromCheckpoint(dir, store_path, so, ro);
    if (tty) fmt::print(stderr, "\n");
    if (!store.ok()) {
      return FailWith(kTool, store.status());
    }
    generation = (*store)->LatestGeneration().generation;
  } else {
    std::error_code ec;
    if (!std::filesystem::exists(store_path, ec)) {
      return FailWith(kTool, NotFound(fmt::format(
                                 "store {} does not exist; to make a new store from the "
                                 "checkpoint, add --create NAME",
                                 store_path)));
    }
    auto store = vfs::Store::Open(store_path, vfs::StoreOptions{});
    if (!store.ok()) {
      return FailWith(kTool, store.status());
    }
    ro.force = force;
    auto g = vfs::RestoreCheckpointInto(store->get(), dir, ro);
    if (tty) fmt::print(stderr, "\n");
    if (!g.ok()) {
      return FailWith(kTool, g.status());
    }
    generation = g->generation;
    kept_snapshot = g->kept_snapshot;
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!quiet) {
    fmt::print("restored {} into {} as generation {} ({:.1f} s)\n", dir, store_path, generation, s);
  }
  // Named even with -q: the snapshot holds disk space until it is released.
  if (!kept_snapshot.empty()) {
    fmt::print("kept the replaced head of {} as snapshot {} (it holds its disk space until released: "
               "optstate.Store.release_snapshot or optstate_store_snapshot_release)\n",
               store_path, kept_snapshot);
  }
  return 0;
}

}  // namespace
}  // namespace optstate::tools

int main(int argc, char** argv) { return optstate::tools::Main(argc, argv); }
