// Logging: spdlog, one process-wide logger named "optstate".
// The level comes from OPTSTATE_LOG_LEVEL (trace, debug, info, warn, error,
// off; default info) the first time Logger() is called.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace optstate {

spdlog::logger& Logger();

// Sends the log to `path` (appended, created if missing) instead of stderr,
// from now on. Call before other threads log. Returns false with `error` set
// when the file cannot be opened.
bool LogToFile(const std::string& path, std::string* error);

#define OPTSTATE_LOG_TRACE(...) ::optstate::Logger().trace(__VA_ARGS__)
#define OPTSTATE_LOG_DEBUG(...) ::optstate::Logger().debug(__VA_ARGS__)
#define OPTSTATE_LOG_INFO(...) ::optstate::Logger().info(__VA_ARGS__)
#define OPTSTATE_LOG_WARN(...) ::optstate::Logger().warn(__VA_ARGS__)
#define OPTSTATE_LOG_ERROR(...) ::optstate::Logger().error(__VA_ARGS__)

}  // namespace optstate
