// Machine description and shared bits of optstate-bench.
#include <sys/utsname.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "tools/internal/bench.h"

namespace optstate::tools::bench {

namespace {

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string m = line.substr(colon + 1);
        while (!m.empty() && m.front() == ' ') m.erase(m.begin());
        return m;
      }
    }
  }
  return "unknown cpu";
}

std::string UtcNow() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

}  // namespace

std::string CommandLine() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string out;
  std::string arg;
  for (char c : all) {
    if (c == '\0') {
      if (!out.empty()) out += ' ';
      size_t slash = out.empty() ? arg.rfind('/') : std::string::npos;
      out += slash == std::string::npos ? arg : arg.substr(slash + 1);
      arg.clear();
    } else {
      arg += c;
    }
  }
  return out;
}

nlohmann::json MachineInfo() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  utsname u{};
  uname(&u);
  return {{"host", host},
          {"cpu", CpuModel()},
          {"cores", std::thread::hardware_concurrency()},
          {"kernel", u.release},
          {"date_utc", UtcNow()},
          {"command", CommandLine()}};
}

std::string MachineLine() {
  nlohmann::json m = MachineInfo();
  return fmt::format("{} ({}, {} cores), {}", m["host"].get<std::string>(),
                     m["cpu"].get<std::string>(), m["cores"].get<unsigned>(),
                     m["date_utc"].get<std::string>());
}

void Note(const std::string& msg) { std::fprintf(stderr, "note: %s\n", msg.c_str()); }

std::vector<std::pair<std::string, uint64_t>> ParamMix(uint64_t state_bytes, uint64_t h) {
  const std::vector<std::pair<const char*, uint64_t>> layer = {
      {"ln1.weight", h},     {"ln1.bias", h},          {"attn.qkv.weight", 3 * h * h},
      {"attn.qkv.bias", 3 * h}, {"attn.proj.weight", h * h}, {"attn.proj.bias", h},
      {"ln2.weight", h},     {"ln2.bias", h},          {"mlp.fc1.weight", 4 * h * h},
      {"mlp.fc1.bias", 4 * h}, {"mlp.fc2.weight", 4 * h * h}, {"mlp.fc2.bias", h}};
  std::vector<std::pair<std::string, uint64_t>> out;
  uint64_t total = 0, target = state_bytes / 12;
  for (int l = 0; total < target; ++l) {
    for (const auto& [n, sz] : layer) {
      if (total >= target) break;
      uint64_t take = std::min(sz, target - total);
      out.emplace_back(fmt::format("layer{}.{}", l, n), take);
      total += take;
    }
  }
  return out;
}


}  // namespace optstate::tools::bench
