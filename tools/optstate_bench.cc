// optstate-bench: the performance harness. Subcommands io, reshard, step,
// sleep, mount, kernel; each prints a table of ratios (or --json). See docs/CLI.md.
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>

#include "tools/internal/bench.h"
#include "tools/internal/cli.h"

int main(int argc, char** argv) {
  CLI::App app{"optstate-bench: optstate's performance harness (tables of ratios vs fio and "
               "vs miles' NVMe streaming)"};
  app.name("optstate-bench");
  app.require_subcommand(1, 1);
  int exit_code = 0;
  optstate::tools::bench::AddIoCommand(app, &exit_code);
  optstate::tools::bench::AddReshardCommand(app, &exit_code);
  optstate::tools::bench::AddStepCommand(app, &exit_code);
  optstate::tools::bench::AddKernelCommand(app, &exit_code);
  optstate::tools::bench::AddSleepCommand(app, &exit_code);
  optstate::tools::bench::AddMountCommand(app, &exit_code);
  // A mistyped command gets a suggestion instead of CLI11's "A subcommand is required".
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    std::string msg = optstate::tools::UnknownCommandMessage(argv[1], names);
    if (!msg.empty()) return optstate::tools::FailUsage("optstate-bench", msg);
  }
  if (std::optional<int> code = optstate::tools::ParseCommandLine(app, argc, argv, "optstate-bench")) {
    return *code;
  }
  return exit_code;
}
