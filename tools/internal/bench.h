// optstate-bench subcommands. Each Add*Command registers its subcommand, its
// options and a callback that stores the exit code in *exit_code. Shared
// benchmark conventions (DESIGN.md): every ratio is the median of
// >= 3 interleaved rounds (baseline, ours, baseline, ours, ...); our timings
// include the fdatasync that makes data durable (fio: end_fsync=1); O_DIRECT.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace optstate::tools::bench {

void AddIoCommand(CLI::App& app, int* exit_code);
void AddStepCommand(CLI::App& app, int* exit_code);
void AddMountCommand(CLI::App& app, int* exit_code);
void AddKernelCommand(CLI::App& app, int* exit_code);
void AddSleepCommand(CLI::App& app, int* exit_code);
void AddReshardCommand(CLI::App& app, int* exit_code);

// {"host", "cpu", "cores", "kernel", "date_utc", "command"} for result tables.
nlohmann::json MachineInfo();
// The command line of this process, for the record.
std::string CommandLine();
// "host (cpu, N cores), 2026-11-30 01:23 UTC"
std::string MachineLine();
// Prints "note: ..." to stderr unless quiet.
void Note(const std::string& msg);
// A realistic mix of parameter sizes: transformer layers of hidden size h
// (qkv 3h^2, proj h^2, fc1 4h^2, fc2 4h^2, two norms and biases of h..4h),
// repeated until the state (12 B per parameter) reaches state_bytes.
// {name, numel} in layer order.
std::vector<std::pair<std::string, uint64_t>> ParamMix(uint64_t state_bytes, uint64_t h);

}  // namespace optstate::tools::bench
