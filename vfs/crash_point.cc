// CrashPoint: named SIGKILL points for crash tests (vfs/store.h).
//
// OPTSTATE_CRASH_AT="name" kills at the first time `name` is reached,
// "name:N" at the Nth. Read once per process; a process without the variable
// pays one predictable branch per call.
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "vfs/store.h"

namespace optstate::vfs {
namespace {

struct CrashSpec {
  bool active = false;
  std::string name;
  uint64_t nth = 1;
  std::atomic<uint64_t> hits{0};
};

CrashSpec* Spec() {
  static CrashSpec* spec = [] {
    auto* s = new CrashSpec();  // never deleted: reachable at any exit path
    const char* env = std::getenv("OPTSTATE_CRASH_AT");
    if (env != nullptr && *env != '\0') {
      s->active = true;
      std::string v(env);
      const size_t colon = v.rfind(':');
      if (colon != std::string::npos) {
        s->name = v.substr(0, colon);
        s->nth = std::strtoull(v.c_str() + colon + 1, nullptr, 10);
        if (s->nth == 0) s->nth = 1;
      } else {
        s->name = v;
      }
    }
    return s;
  }();
  return spec;
}

}  // namespace

void CrashPoint(const char* name) {
  CrashSpec* spec = Spec();
  if (__builtin_expect(!spec->active, 1)) return;
  if (spec->name != name) return;
  if (spec->hits.fetch_add(1) + 1 >= spec->nth) raise(SIGKILL);
}

}  // namespace optstate::vfs
