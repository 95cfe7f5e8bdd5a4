// Arms test sync points (base/sync_point.h) from the environment of a test
// child process. Linked (as an object library) only into test binaries: the
// product tools and library never read these variables.
//
//   OPTSTATE_CRASH_AT="point"      SIGKILL the first time `point` is passed;
//                     "point:N"    at the Nth time.
//   OPTSTATE_TEST_DELAY_AT="point=MS[,point=MS...]"
//                                  sleep MS milliseconds each time `point` is
//                                  passed (widens a window in which another
//                                  process, such as the kernel, acts).
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "base/sync_point.h"

namespace optstate::test_hooks {
namespace {

// "point:N" -> (point, N); N defaults to 1.
std::pair<std::string, uint64_t> ParseCrashAt(const std::string& v) {
  const size_t colon = v.rfind(':');
  if (colon == std::string::npos) return {v, 1};
  const uint64_t n = std::strtoull(v.c_str() + colon + 1, nullptr, 10);
  return {v.substr(0, colon), n == 0 ? 1 : n};
}

void Die(const char* var) {
  std::fprintf(stderr, "%s is set, but this build has no test sync points (configure with -DOPTSTATE_TEST_HOOKS=ON)\n",
               var);
  std::_Exit(2);
}

bool Arm() {
  SyncPoint* sp = SyncPoint::Get();
  bool armed = false;
  if (const char* e = std::getenv("OPTSTATE_CRASH_AT"); e != nullptr && *e != '\0') {
    if (!SyncPoint::CompiledIn()) Die("OPTSTATE_CRASH_AT");
    auto [point, nth] = ParseCrashAt(e);
    auto hits = std::make_shared<std::atomic<uint64_t>>(0);
    sp->SetCallBack(point, [hits, nth = nth](void*) {
      if (hits->fetch_add(1) + 1 >= nth) ::raise(SIGKILL);
    });
    armed = true;
  }
  if (const char* e = std::getenv("OPTSTATE_TEST_DELAY_AT"); e != nullptr && *e != '\0') {
    if (!SyncPoint::CompiledIn()) Die("OPTSTATE_TEST_DELAY_AT");
    std::string spec(e);
    for (size_t pos = 0; pos < spec.size();) {
      size_t comma = spec.find(',', pos);
      if (comma == std::string::npos) comma = spec.size();
      const std::string item = spec.substr(pos, comma - pos);
      pos = comma + 1;
      const size_t eq = item.rfind('=');
      if (eq == std::string::npos) continue;
      const auto ms = std::chrono::milliseconds(std::strtoul(item.c_str() + eq + 1, nullptr, 10));
      sp->SetCallBack(item.substr(0, eq), [ms](void*) { std::this_thread::sleep_for(ms); });
      armed = true;
    }
  }
  if (armed) sp->EnableProcessing();
  return armed;
}

[[maybe_unused]] const bool kArmed = Arm();

}  // namespace
}  // namespace optstate::test_hooks
