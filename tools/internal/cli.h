// Shared helpers of the optstate command-line tools: byte sizes, suggestions
// for mistyped names, aligned tables, a progress bar that only draws on a TTY,
// JSON printing, medians, and the command-line parse and error exits every
// tool uses.
//
// Exit codes of every tool (docs/CLI.md): 0 success, 1 the command failed or
// was refused ("<tool>: error: <message>" on stderr), 2 a malformed command
// line (the same prefix, then a hint to run with --help); tools add their own
// codes above 2 (optstate-inspect verify: 3 when it found problems; diff: 3
// when the two differ).
//
// Everything here is a value type or a free function; none of it is
// thread-safe unless said otherwise. tools/ only; no library code uses it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "base/status.h"
#include "base/strings.h"

namespace optstate::tools {

// "8M", "8MiB", "8m", "2G", "4096", "1.5G" -> bytes (binary units: K = 1024).
// Also accepts "KB"/"MB"/"GB" as binary (fio's convention). Errors name the text.
Result<uint64_t> ParseBytes(std::string_view text);
// "2M,4M,8M" -> {2 MiB, 4 MiB, 8 MiB}.
Result<std::vector<uint64_t>> ParseBytesList(std::string_view csv);
// 8388608 -> "8 MiB", 1536 -> "1.5 KiB", 123 -> "123 B".
std::string FormatBytes(uint64_t bytes);
// bytes/second -> "1.23 GB/s" (decimal GB, as fio and disks report).
std::string FormatRate(double bytes_per_second);
std::string FormatSeconds(double seconds);   // "1.234 s", "12.3 ms"
std::string FormatDouble(double v, int precision = 3);
// "A:B" -> [A, B); "A:" -> [A, limit); ":B" -> [0, B); "A" -> [A, A+1).
// Rejects B < A and B > limit.
struct Range { uint64_t begin = 0; uint64_t end = 0; };
Result<Range> ParseRange(std::string_view text, uint64_t limit);

// Up to max_results candidates closest to `needle`: substring matches first,
// then by edit distance (only those within max(2, needle.size()/2)).
std::vector<std::string> ClosestMatches(std::string_view needle,
                                        const std::vector<std::string>& candidates,
                                        size_t max_results = 3);
// "unknown tensor 'x'; did you mean: 'a', 'b'?" or "... (known: none)".
std::string UnknownNameMessage(std::string_view kind, std::string_view name,
                               const std::vector<std::string>& candidates);

// For a command word that names no subcommand: "unknown command 'iox' (did
// you mean 'io'?; commands: io, step, ...)". Empty when `word` is known.
std::string UnknownCommandMessage(std::string_view word, const std::vector<std::string>& commands);

// A text table: columns left-aligned unless marked numeric (right-aligned).
class Table {
 public:
  explicit Table(std::vector<std::string> header, std::vector<bool> numeric = {});
  void AddRow(std::vector<std::string> cells);
  std::string Render() const;
  size_t rows() const { return rows_.size(); }

 private:
  std::vector<std::string> header_;
  std::vector<bool> numeric_;
  std::vector<std::vector<std::string>> rows_;
};

// A one-line progress bar on stderr, drawn only when stderr is a TTY (and
// OPTSTATE_NO_PROGRESS is unset); otherwise silent. Redraws at most ~10 times
// a second. Finish() (or the destructor) clears the line.
class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  void Update(uint64_t done);
  void Finish();
  bool enabled() const { return enabled_; }

 private:
  void Draw();
  std::string label_;
  uint64_t total_;
  uint64_t done_ = 0;
  bool enabled_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

bool StderrIsTty();

// Median of the values (mean of the middle two for an even count); NaN if empty.
double Median(std::vector<double> values);

// Prints j (indented 2) and a newline to stdout.
void PrintJson(const nlohmann::json& j);

// A number for JSON output: finite values as numbers; NaN, +Inf and -Inf as
// the strings "NaN", "Infinity" and "-Infinity" (JSON has no such numbers;
// nlohmann would write all three as null, and Python's json.loads reads the
// same words back with parse_constant).
nlohmann::json JsonNumber(double v);

inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Prints "<tool>: error: <status>" to stderr and returns kExitFailure.
int FailWith(std::string_view tool, const Status& status);
// Prints "<tool>: error: <message>" and the --help hint to stderr and returns
// kExitUsage: for a command line that is malformed in a way CLI11 cannot see.
int FailUsage(std::string_view tool, std::string_view message);

// Parses argv into app. nullopt: go on; otherwise the exit code to return at
// once: 0 after --help (printed on stdout), kExitUsage after a malformed
// command line (the error on stderr, prefixed like FailWith's). An unknown
// option or a surplus argument is named as such (with the closest known
// options), also where a required argument is missing as well (CLI11 checks
// requirements first and would only say that one is required).
std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv, std::string_view tool);

// Monotonic seconds.
double NowSeconds();

// For a tool that takes checkpoint directories (manifest.json, tensors/...):
// an error when `dir` is a store directory instead (IDENTITY, no
// manifest.json), saying how to get a checkpoint of that store; OK otherwise
// (other problems are for the reader of the checkpoint to name).
Status CheckNotAStoreDirectory(const std::string& dir);

// For a tool's -q/--quiet: the library's log from now on only warnings and
// errors (no [info] lines), whatever OPTSTATE_LOG_LEVEL asked for below warn.
void QuietLibraryLog();

}  // namespace optstate::tools
