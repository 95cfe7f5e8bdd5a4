#include "base/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <memory>

namespace optstate {
namespace {
constexpr const char* kPattern = "[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] [pid %P] %v";
}  // namespace

spdlog::logger& Logger() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("optstate");
    const char* level = std::getenv("OPTSTATE_LOG_LEVEL");
    l->set_level(level != nullptr ? spdlog::level::from_str(level) : spdlog::level::info);
    l->set_pattern(kPattern);
    return l;
  }();
  return *logger;
}

bool LogToFile(const std::string& path, std::string* error) {
  try {
    auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
    spdlog::logger& l = Logger();
    l.sinks().clear();
    l.sinks().push_back(std::move(sink));
    l.set_pattern(kPattern);
    l.flush_on(spdlog::level::info);
    return true;
  } catch (const spdlog::spdlog_ex& e) {
    *error = e.what();
    return false;
  }
}

}  // namespace optstate
