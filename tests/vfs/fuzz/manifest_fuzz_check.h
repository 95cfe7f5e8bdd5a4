// The property the manifest fuzzer checks, shared with the gtest corpus replay.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "vfs/checkpoint.h"

namespace optstate::vfs {

// Returns true when the input was accepted. Aborts on a violated invariant.
inline bool CheckManifestInput(std::string_view in) {
  auto m = ParseManifest(in, "fuzz");
  if (!m.ok()) {
    if (m.status().message().find("manifest fuzz") == std::string::npos) {
      std::fprintf(stderr, "error does not name the manifest: %s\n", m.status().message().c_str());
      std::abort();
    }
    return false;
  }
  std::string s1 = SerializeManifest(*m);
  auto m2 = ParseManifest(s1, "fuzz-roundtrip");
  if (!m2.ok()) {
    std::fprintf(stderr, "accepted manifest does not round-trip: %s\n",
                 m2.status().ToString().c_str());
    std::abort();
  }
  if (SerializeManifest(*m2) != s1) {
    std::fprintf(stderr, "serialization is not stable\n");
    std::abort();
  }
  return true;
}

}  // namespace optstate::vfs
