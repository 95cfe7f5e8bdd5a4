// optstate-reshard: resume on a different number of ranks.
//
//   optstate-reshard layout --ranks M [--split RULE ... | --bucket-elements N] [-o LAYOUT.json] SOURCE...
//       writes a target layout that splits every tensor of the sources evenly
//       over M ranks by the first rule that matches its name (RULE:
//       [PATTERN=]rows|columns|dimN|flat; default rows), or the flat ranges of
//       a distributed optimizer's buckets of N elements.
//   optstate-reshard run --layout LAYOUT.json --dest DIR [--no-safetensors] SOURCE...
//       reads the SOURCE checkpoint directories (one per old rank, any order),
//       checks that they tile every tensor exactly once and agree on step and
//       hyperparameters, and writes DIR/rank-00000 ... one checkpoint per new
//       rank (all or nothing), each accepted by optstate-restore; with
//       --no-safetensors without state.safetensors (the state written once).
//
// The layout schema and the checks: docs/RESHARD.md. Exit codes as every
// tool's (tools/internal/cli.h): 0 done, 1 refused or failed, 2 a malformed
// command line.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "tools/internal/cli.h"
#include "vfs/file_system.h"
#include "vfs/reshard.h"

namespace optstate::tools {
namespace {

constexpr const char* kTool = "optstate-reshard";

int Main(int argc, char** argv) {
  CLI::App app{"Reshard optstate checkpoints of N ranks into checkpoints of M ranks"};
  app.name(kTool);
  app.require_subcommand(1);

  CLI::App* layout = app.add_subcommand("layout", "write a target layout that splits every tensor evenly");
  uint32_t ranks = 0;
  std::string out;
  std::vector<std::string> splits;
  std::vector<std::string> layout_sources;
  layout->add_option("--ranks", ranks, "number of destination ranks")->required()->check(CLI::Range(1u, 1u << 20));
  CLI::Option* split_opt =
      layout
          ->add_option("--split", splits,
                       "[PATTERN=]KIND, repeatable or comma-separated, first match wins: how tensors whose name "
                       "matches the glob PATTERN (default *) are split: rows (dimension 0), columns (last "
                       "dimension), dimN, flat (even flat ranges); default rows")
          ->delimiter(',')
          ->allow_extra_args(false);
  uint64_t bucket_elements = 0;
  layout->add_option("--bucket-elements", bucket_elements,
                     "flat buffers instead: tensors in name order packed into buckets of at least N "
                     "elements, each split evenly over the ranks (a distributed optimizer's layout)")
      ->excludes(split_opt);
  layout->add_option("-o,--output", out, "layout file to write (default: stdout)");
  layout->add_option("SOURCE", layout_sources, "source checkpoint directories (their global shapes)")->required();

  CLI::App* run = app.add_subcommand("run", "reshard the source checkpoints into DEST/rank-NNNNN");
  std::string layout_path, dest;
  std::vector<std::string> sources;
  std::string chunk_text, staging_text;
  bool quiet = false, no_safetensors = false;
  run->add_option("--layout", layout_path, "target layout JSON (optstate-reshard layout writes one)")->required();
  run->add_option("--dest", dest, "output directory (must not exist, or be empty)")->required();
  run->add_option("--chunk-size", chunk_text, "chunk size of the output manifests (default: the sources')");
  run->add_option("--staging", staging_text, "bytes gathered per destination rank before a write (default 4M)");
  run->add_flag("--no-safetensors", no_safetensors,
                "leave state.safetensors out of each rank's directory (it holds the field files' bytes again); "
                "optstate-restore reads the field files alone");
  run->add_flag("-q,--quiet", quiet, "no summary line, progress bar or [info] log lines");
  run->add_option("SOURCE", sources, "source checkpoint directories, one per old rank")->required();

  if (std::optional<int> code = ParseCommandLine(app, argc, argv, kTool)) return *code;

  if (layout->parsed()) {
    for (const std::string& src : layout_sources) {
      if (Status s = CheckNotAStoreDirectory(src); !s.ok()) return FailWith(kTool, s);
    }
    auto globals = vfs::GlobalTensorsOf(layout_sources);
    if (!globals.ok()) return FailWith(kTool, globals.status());
    vfs::TargetLayout t;
    if (bucket_elements > 0) {
      auto b = vfs::MakeBucketLayout(*globals, bucket_elements, ranks);
      if (!b.ok()) return FailWith(kTool, b.status());
      t = std::move(*b);
    } else {
      std::vector<vfs::SplitRule> rules;
      for (const std::string& text : splits) {
        auto rule = vfs::ParseSplitRule(text);
        if (!rule.ok()) return FailUsage(kTool, "--split: " + rule.status().message());
        rules.push_back(std::move(*rule));
      }
      if (rules.empty()) rules.push_back(vfs::SplitRule{});
      auto l = vfs::MakeRuleLayout(*globals, ranks, rules);
      if (!l.ok()) return FailWith(kTool, l.status());
      t = std::move(*l);
    }
    const std::string json = vfs::SerializeTargetLayout(t);
    if (out.empty()) {
      std::fwrite(json.data(), 1, json.size(), stdout);
      return 0;
    }
    Status st = vfs::FileSystem::Default()->WriteFileAtomic(out, json);
    if (!st.ok()) return FailWith(kTool, st.WithContext("writing the layout " + out));
    return 0;
  }

  vfs::ReshardOptions opts;
  opts.safetensors = !no_safetensors;
  if (!chunk_text.empty()) {
    auto b = ParseBytes(chunk_text);
    if (!b.ok()) return FailUsage(kTool, "--chunk-size: " + b.status().message());
    opts.chunk_size_bytes = *b;
  }
  if (!staging_text.empty()) {
    auto b = ParseBytes(staging_text);
    if (!b.ok() || *b == 0) return FailUsage(kTool, "--staging: a positive byte size, e.g. 4M");
    opts.staging_bytes_per_rank = *b;
  }
  if (quiet) QuietLibraryLog();
  for (const std::string& src : sources) {
    if (Status s = CheckNotAStoreDirectory(src); !s.ok()) return FailWith(kTool, s);
  }
  auto text = vfs::FileSystem::Default()->ReadFileToString(layout_path);
  if (!text.ok()) return FailWith(kTool, text.status().WithContext("reading the layout"));
  auto target = vfs::ParseTargetLayout(*text, layout_path);
  if (!target.ok()) return FailWith(kTool, target.status());
  std::unique_ptr<ProgressBar> bar;  // made at the first report, which knows the total
  if (!quiet) {
    opts.progress = [&](uint64_t done, uint64_t total) {
      if (!bar) bar = std::make_unique<ProgressBar>("reshard", total);
      bar->Update(done);
    };
  }
  const double start = NowSeconds();
  auto r = vfs::Reshard(sources, *target, dest, opts);
  if (bar) bar->Finish();
  if (!r.ok()) return FailWith(kTool, r.status());
  const double s = NowSeconds() - start;
  if (!quiet) {
    fmt::print("resharded {} checkpoint{} into {} rank{} under {}: {} read, {} written in {} ({})\n",
               sources.size(), sources.size() == 1 ? "" : "s", r->ranks, r->ranks == 1 ? "" : "s", dest,
               FormatBytes(r->bytes_read), FormatBytes(r->bytes_written), FormatSeconds(s),
               FormatRate(s > 0 ? r->bytes_read / s : 0));
  }
  return 0;
}

}  // namespace
}  // namespace optstate::tools

int main(int argc, char** argv) { return optstate::tools::Main(argc, argv); }
