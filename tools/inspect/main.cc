// optstate-inspect STORE COMMAND: inspection of a store.
//
// Opens the store with Store::OpenReadOnly (a RocksDB secondary instance, no
// LOCK), so it works while a trainer has the store open and after the trainer
// died. Commands: ls, stat, show, verify, diff; --json on every one. `drop`
// alone writes (tools/inspect/drop.cc): it opens the store read-write and is
// refused while a trainer has it open. When
// STORE is a directory of stores (a store root), `ls` lists the stores.
// Exit codes: every tool's (tools/internal/cli.h: 0 success, 1 error, 2 a
// malformed command line), and 3 when verify found problems or diff found the
// two snapshots differ.
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tools/inspect/common.h"
#include "tools/internal/cli.h"

int main(int argc, char** argv) {
  using optstate::tools::inspect::Args;
  Args a;
  CLI::App app{"optstate-inspect: look inside an optstate store (read-only but for drop; safe while a "
               "trainer runs and after it died)"};
  app.name(optstate::tools::inspect::kTool);
  app.add_option("store", a.store, "store directory (or, for ls, a directory of stores)")->required();
  app.require_subcommand(1, 1);
  auto add_json = [&](CLI::App* c) { c->add_flag("--json", a.json, "print JSON"); };
  auto add_which = [&](CLI::App* c) {
    CLI::Option* snap = c->add_option(
        "--snapshot", a.snapshot, "read this snapshot (or latest, gen:N) instead of the latest generation");
    c->add_option("--generation", a.generation, "read this retained generation")
        ->check(CLI::NonNegativeNumber)
        ->excludes(snap);
  };
  CLI::App* ls = app.add_subcommand("ls", "tensors with dtype, numel, shape, bytes per field (or the stores under a root)");
  add_json(ls);
  add_which(ls);
  CLI::App* stat = app.add_subcommand(
      "stat", "generations, snapshots, step, chunk size, disk use, lifetime bytes written, bytes written per "
              "step and the drive writes per day they make");
  stat->add_option("--step-seconds", a.step_seconds,
                   "step time the drive writes per day are projected at, in seconds (default 1)");
  add_json(stat);
  CLI::App* show = app.add_subcommand("show", "values and statistics of a tensor (min, max, mean, L2, NaN, Inf)");
  show->add_option("tensor", a.tensor, "tensor name")->required();
  show->add_option("--field", a.fields, "field(s) to show (default: all)");
  show->add_option("--range", a.range, "element range A:B (default: all)");
  show->add_option("--values", a.values, "how many values to print (default 8)");
  add_json(show);
  add_which(show);
  CLI::App* verify = app.add_subcommand("verify", "check every checksum and reference, count leaked extents; exit 3 on problems");
  add_json(verify);
  CLI::App* diff = app.add_subcommand("diff", "per tensor and field: max abs difference and norms between two snapshots");
  diff->add_option("snap_a", a.snap_a, "snapshot name (or latest, gen:N)")->required();
  diff->add_option("snap_b", a.snap_b, "snapshot name (or latest, gen:N)")->required();
  add_json(diff);
  CLI::App* drop = app.add_subcommand(
      "drop", "drop tensors from the store for good (a new generation without them; the head it replaces is "
              "kept as snapshot pre-drop-<generation>-<ms>); refused while a trainer has the store open");
  drop->add_option("names", a.tensors, "tensor names")->required();
  add_json(drop);
  // argv: STORE COMMAND ...; a mistyped COMMAND gets a suggestion.
  if (argc > 2 && argv[1][0] != '-' && argv[2][0] != '-') {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    std::string msg = optstate::tools::UnknownCommandMessage(argv[2], names);
    if (!msg.empty()) return optstate::tools::FailUsage(optstate::tools::inspect::kTool, msg);
  }
  if (std::optional<int> code = optstate::tools::ParseCommandLine(app, argc, argv, optstate::tools::inspect::kTool)) {
    return *code;
  }
  if (*ls) return optstate::tools::inspect::Ls(a);
  if (*stat) return optstate::tools::inspect::Stat(a);
  if (*show) return optstate::tools::inspect::Show(a);
  if (*verify) return optstate::tools::inspect::Verify(a);
  if (*diff) return optstate::tools::inspect::Diff(a);
  if (*drop) return optstate::tools::inspect::Drop(a);
  return 1;
}
