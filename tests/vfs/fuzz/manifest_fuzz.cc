// libFuzzer target for the manifest parser (clang -fsanitize=fuzzer only).
// Invariants: ParseManifest never crashes, throws or leaks on any input; what
// it accepts serializes to JSON that parses back to the same bytes.
//   cmake with CXX=clang++: target manifest_fuzz; run
//   ./manifest_fuzz -max_total_time=600 tests/vfs/fuzz/corpus
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "tests/vfs/fuzz/manifest_fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  optstate::vfs::CheckManifestInput(
      std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
