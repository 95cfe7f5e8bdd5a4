// Logging: spdlog, one process-wide logger named "optstate".
// The level comes from OPTSTATE_LOG_LEVEL (trace, debug, info, warn, error,
// off; default info) the first time Logger() is called.
#pragma once

#include <spdlog/spdlog.h>

namespace optstate {

spdlog::logger& Logger();

#define OPTSTATE_LOG_TRACE(...) ::optstate::Logger().trace(__VA_ARGS__)
#define OPTSTATE_LOG_DEBUG(...) ::optstate::Logger().debug(__VA_ARGS__)
#define OPTSTATE_LOG_INFO(...) ::optstate::Logger().info(__VA_ARGS__)
#define OPTSTATE_LOG_WARN(...) ::optstate::Logger().warn(__VA_ARGS__)
#define OPTSTATE_LOG_ERROR(...) ::optstate::Logger().error(__VA_ARGS__)

}  // namespace optstate
