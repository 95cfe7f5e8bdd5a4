#include "tools/internal/cli.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>

#include <fmt/format.h>

#include "base/log.h"

namespace optstate::tools {

namespace {

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

Result<uint64_t> ParseBytes(std::string_view text) {
  std::string t = Trim(text);
  if (t.empty()) return InvalidArgument("empty size (expected e.g. 8M, 2G, 4096)");
  size_t i = 0;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) ++i;
  if (i == 0) return InvalidArgument(fmt::format("bad size '{}' (expected e.g. 8M, 2G, 4096)", t));
  std::string num = t.substr(0, i);
  std::string unit = Lower(Trim(std::string_view(t).substr(i)));
  double mult = 1;
  if (unit.empty() || unit == "b") {
    mult = 1;
  } else if (unit == "k" || unit == "kb" || unit == "kib") {
    mult = 1024.0;
  } else if (unit == "m" || unit == "mb" || unit == "mib") {
    mult = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gb" || unit == "gib") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "t" || unit == "tb" || unit == "tib") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return InvalidArgument(fmt::format("bad size '{}': unknown unit '{}' (use K, M, G, T)", t, unit));
  }
  char* end = nullptr;
  double v = std::strtod(num.c_str(), &end);
  if (end == nullptr || *end != '\0' || !std::isfinite(v) || v < 0) {
    return InvalidArgument(fmt::format("bad size '{}'", t));
  }
  double bytes = v * mult;
  if (bytes >= 1.8e19) return InvalidArgument(fmt::format("size '{}' is too large", t));
  if (std::floor(bytes) != bytes) {
    return InvalidArgument(fmt::format("size '{}' is not a whole number of bytes", t));
  }
  return static_cast<uint64_t>(bytes);
}

Result<std::vector<uint64_t>> ParseBytesList(std::string_view csv) {
  std::vector<uint64_t> out;
  size_t start = 0;
  while (start <= csv.size()) {
    size_t comma = csv.find(',', start);
    if (comma == std::string_view::npos) comma = csv.size();
    OPTSTATE_ASSIGN_OR_RETURN(uint64_t v, ParseBytes(csv.substr(start, comma - start)));
    out.push_back(v);
    start = comma + 1;
  }
  return out;
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", bytes);
  if (v == std::floor(v)) return fmt::format("{:.0f} {}", v, kUnits[u]);
  return fmt::format("{:.{}f} {}", v, v < 10 ? 2 : 1, kUnits[u]);
}

std::string FormatRate(double bytes_per_second) {
  if (!std::isfinite(bytes_per_second)) return "-";
  if (bytes_per_second >= 1e9) return fmt::format("{:.2f} GB/s", bytes_per_second / 1e9);
  return fmt::format("{:.1f} MB/s", bytes_per_second / 1e6);
}

std::string FormatSeconds(double s) {
  if (!std::isfinite(s)) return "-";
  if (s >= 1.0) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string FormatDouble(double v, int precision) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{:.{}g}", v, precision);
}

Result<Range> ParseRange(std::string_view text, uint64_t limit) {
  std::string t = Trim(text);
  auto parse_u = [&](std::string_view s, uint64_t dflt) -> Result<uint64_t> {
    std::string x = Trim(s);
    if (x.empty()) return dflt;
    for (char c : x) {
      if (!std::isdigit(static_cast<unsigned char>(c))) {
        return InvalidArgument(fmt::format("bad range '{}': '{}' is not an element index", t, x));
      }
    }
    errno = 0;
    unsigned long long v = std::strtoull(x.c_str(), nullptr, 10);
    if (errno == ERANGE) return InvalidArgument(fmt::format("bad range '{}': index too large", t));
    return static_cast<uint64_t>(v);
  };
  Range r;
  size_t colon = t.find(':');
  if (colon == std::string::npos) {
    OPTSTATE_ASSIGN_OR_RETURN(r.begin, parse_u(t, 0));
    if (t.empty()) return InvalidArgument("empty range (expected A:B)");
    r.end = r.begin + 1;
  } else {
    OPTSTATE_ASSIGN_OR_RETURN(r.begin, parse_u(std::string_view(t).substr(0, colon), 0));
    OPTSTATE_ASSIGN_OR_RETURN(r.end, parse_u(std::string_view(t).substr(colon + 1), limit));
  }
  if (r.end < r.begin) {
    return InvalidArgument(fmt::format("bad range '{}': end {} is before begin {}", t, r.end, r.begin));
  }
  if (r.end > limit) {
    return InvalidArgument(
        fmt::format("bad range '{}': end {} is past the tensor's {} elements", t, r.end, limit));
  }
  return r;
}

std::vector<std::string> ClosestMatches(std::string_view needle,
                                        const std::vector<std::string>& candidates,
                                        size_t max_results) {
  std::string n = Lower(needle);
  size_t limit = std::max<size_t>(2, needle.size() / 2);
  std::vector<std::pair<size_t, std::string>> scored;
  for (const std::string& c : candidates) {
    std::string lc = Lower(c);
    size_t d;
    if (!n.empty() && (lc.find(n) != std::string::npos || n.find(lc) != std::string::npos)) {
      d = 0;  // substring either way: the best kind of suggestion
    } else {
      d = EditDistance(n, lc);
      if (d > limit) continue;
    }
    scored.emplace_back(d, c);
  }
  std::stable_sort(scored.begin(), scored.end(), [](const auto& x, const auto& y) {
    if (x.first != y.first) return x.first < y.first;
    return x.second < y.second;
  });
  std::vector<std::string> out;
  for (auto& [d, c] : scored) {
    if (out.size() >= max_results) break;
    out.push_back(c);
  }
  return out;
}

std::string UnknownNameMessage(std::string_view kind, std::string_view name,
                               const std::vector<std::string>& candidates) {
  std::vector<std::string> near = ClosestMatches(name, candidates);
  std::string msg = fmt::format("unknown {} '{}'", kind, name);
  if (!near.empty()) {
    msg += "; did you mean: ";
    for (size_t i = 0; i < near.size(); ++i) msg += (i ? ", '" : "'") + near[i] + "'";
    msg += "?";
  } else if (candidates.empty()) {
    msg += fmt::format(" (this store has no {}s)", kind);
  } else {
    msg += fmt::format(" ({} {}s exist; none is close)", candidates.size(), kind);
  }
  return msg;
}

std::string UnknownCommandMessage(std::string_view word, const std::vector<std::string>& commands) {
  for (const auto& c : commands) {
    if (c == word) return "";
  }
  std::vector<std::string> near = ClosestMatches(word, commands);
  std::string msg = fmt::format("unknown command '{}'", word);
  if (!near.empty()) msg += fmt::format(" (did you mean '{}'?)", near[0]);
  msg += "; commands:";
  for (const auto& c : commands) msg += " " + c;
  return msg;
}

Table::Table(std::vector<std::string> header, std::vector<bool> numeric)
    : header_(std::move(header)), numeric_(std::move(numeric)) {
  numeric_.resize(header_.size(), false);
}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(header_.size());
  rows_.push_back(std::move(cells));
}

std::string Table::Render() const {
  std::vector<size_t> width(header_.size());
  for (size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
  for (const auto& r : rows_) {
    for (size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  }
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c) l += "  ";
      size_t pad = width[c] - cells[c].size();
      if (numeric_[c]) l += std::string(pad, ' ') + cells[c];
      else l += cells[c] + (c + 1 < cells.size() ? std::string(pad, ' ') : "");
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    out += l + "\n";
  };
  line(header_);
  std::vector<std::string> rule;
  for (size_t c = 0; c < header_.size(); ++c) rule.push_back(std::string(width[c], '-'));
  line(rule);
  for (const auto& r : rows_) line(r);
  return out;
}

bool StderrIsTty() { return isatty(STDERR_FILENO) == 1; }

ProgressBar::ProgressBar(std::string label, uint64_t total)
    : label_(std::move(label)), total_(total),
      enabled_(StderrIsTty() && std::getenv("OPTSTATE_NO_PROGRESS") == nullptr) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(uint64_t done) {
  done_ = done;
  if (!enabled_ || finished_) return;
  auto now = std::chrono::steady_clock::now();
  if (done_ < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  Draw();
}

void ProgressBar::Draw() {
  constexpr int kWidth = 30;
  double frac = total_ ? std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_)) : 1.0;
  int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar += std::string(static_cast<size_t>(kWidth - filled), '.');
  std::fprintf(stderr, "\r\033[2K%s [%s] %3.0f%%", label_.c_str(), bar.c_str(), frac * 100);
  std::fflush(stderr);
}

void ProgressBar::Finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) {
    std::fprintf(stderr, "\r\033[2K");
    std::fflush(stderr);
  }
}

double Median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void PrintJson(const nlohmann::json& j) {
  std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  std::cout.flush();
}

int FailWith(std::string_view tool, const Status& status) {
  std::fflush(stdout);
  std::fprintf(stderr, "%.*s: error: %s\n", static_cast<int>(tool.size()), tool.data(),
               status.ToString().c_str());
  return 1;
}

nlohmann::json JsonNumber(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

int FailUsage(std::string_view tool, std::string_view message) {
  std::fflush(stdout);
  std::fprintf(stderr, "%.*s: error: %.*s\nRun with --help for more information.\n",
               static_cast<int>(tool.size()), tool.data(), static_cast<int>(message.size()),
               message.data());
  return kExitUsage;
}

namespace {

// Every option name of app and its subcommands ("--json", "-q", ...).
void OptionNames(const CLI::App& app, std::vector<std::string>* out) {
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& n : o->get_lnames()) out->push_back("--" + n);
    for (const std::string& n : o->get_snames()) out->push_back("-" + n);
  }
  for (const CLI::App* sub : app.get_subcommands({})) OptionNames(*sub, out);
}

}  // namespace

std::optional<int> ParseCommandLine(CLI::App& app, int argc, char** argv, std::string_view tool) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help
    std::string msg = e.what();
    const int code = e.get_exit_code();
    std::vector<std::string> extras = app.remaining(true);
    if (!extras.empty() && (code == static_cast<int>(CLI::ExitCodes::RequiredError) ||
                            code == static_cast<int>(CLI::ExitCodes::ExtrasError))) {
      std::vector<std::string> known;
      OptionNames(app, &known);
      std::vector<std::string> options, others;
      for (const std::string& x : extras) {
        (x.size() > 1 && x[0] == '-' && x != "--" ? options : others).push_back(x);
      }
      msg.clear();
      // An unknown option explains the arguments after it (its values).
      for (const std::string& x : options) {
        if (!msg.empty()) msg += "; ";
        const std::string name = x.substr(0, x.find('='));
        if (std::find(known.begin(), known.end(), name) != known.end()) {
          msg += fmt::format("option '{}' does not apply here (see --help of the command)", name);
          continue;
        }
        msg += fmt::format("unknown option '{}'", name);
        // Closest known option by the words after the dashes, within a third
        // of their length (the shared "--" would make every option look near).
        auto words = [](const std::string& o) {
          const size_t b = o.find_first_not_of('-');
          return b == std::string::npos ? std::string() : o.substr(b);
        };
        const std::string bare = words(name);
        std::string best;
        size_t best_d = std::max<size_t>(1, bare.size() / 3) + 1;
        for (const std::string& k : known) {
          if (bare.empty()) break;  // "--" or "-": nothing to compare
          const size_t d = EditDistance(bare, words(k));
          if (d < best_d) best_d = d, best = k;
        }
        if (!best.empty()) msg += fmt::format(" (did you mean '{}'?)", best);
      }
      if (options.empty()) {
        for (const std::string& x : others) {
          msg += fmt::format("{}unexpected argument '{}'", msg.empty() ? "" : "; ", x);
        }
      }
    }
    return FailUsage(tool, msg);
  }
}

Status CheckNotAStoreDirectory(const std::string& dir) {
  struct stat st;
  const bool manifest = ::stat((dir + "/manifest.json").c_str(), &st) == 0;
  const bool identity = ::stat((dir + "/IDENTITY").c_str(), &st) == 0 && S_ISREG(st.st_mode);
  if (manifest || !identity) return Status();
  return InvalidArgument(fmt::format(
      "{} is a store directory (IDENTITY, index/, no manifest.json), not a checkpoint directory; a checkpoint "
      "of it is a copy of one of its generations from the mount (optstate-mount STORE_ROOT MNT, then cp -r "
      "MNT/<store>/snapshots/<name> or MNT/<store>/latest), or what optstate.checkpoint.save (Python) or "
      "optstate_checkpoint_export (C) writes",
      dir));
}

void QuietLibraryLog() {
  spdlog::logger& l = Logger();
  if (l.level() < spdlog::level::warn) l.set_level(spdlog::level::warn);
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace optstate::tools
