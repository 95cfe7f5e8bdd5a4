#include "vfs/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <memory>

namespace optstate {

spdlog::logger& Logger() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("optstate");
    const char* level = std::getenv("OPTSTATE_LOG_LEVEL");
    l->set_level(level != nullptr ? spdlog::level::from_str(level) : spdlog::level::info);
    l->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] [pid %P] %v");
    return l;
  }();
  return *logger;
}

}  // namespace optstate
