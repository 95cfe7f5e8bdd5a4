// optstate-inspect STORE verify: every checksum and reference; exit 3 on problems.
#include <iostream>

#include <fmt/format.h>

#include "tools/inspect/common.h"
#include "tools/internal/cli.h"

namespace optstate::tools::inspect {
namespace {

using nlohmann::json;

}  // namespace

int Verify(const Args& a) {
  auto s = OpenStore(a.store);
  if (!s.ok()) return FailWith(kTool, s.status());
  double t0 = NowSeconds();
  auto rep = (*s)->Verify();
  if (!rep.ok()) return FailWith(kTool, rep.status());
  double secs = NowSeconds() - t0;
  json out = {{"store", a.store}, {"ok", rep->ok()}, {"chunks_checked", rep->chunks_checked},
              {"bytes_checked", rep->bytes_checked}, {"problems", rep->problems},
              {"leaked_slots", rep->leaked_slots}, {"seconds", secs}};
  if (a.json) {
    PrintJson(out);
  } else {
    std::cout << fmt::format("verify {}: {} chunks, {} checked in {}\n", a.store,
                             rep->chunks_checked, FormatBytes(rep->bytes_checked),
                             FormatSeconds(secs));
    for (const auto& p : rep->problems) std::cout << "  problem: " << p << "\n";
    if (rep->leaked_slots) std::cout << fmt::format("  leaked extents: {}\n", rep->leaked_slots);
    std::cout << (rep->ok() ? "OK\n" : fmt::format("FAILED: {} problem(s), {} leaked extent(s)\n",
                                                    rep->problems.size(), rep->leaked_slots));
  }
  return rep->ok() ? 0 : kExitProblems;
}

}  // namespace optstate::tools::inspect
