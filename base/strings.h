// Small string helpers shared by every folder.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <string_view>

namespace optstate {

// Levenshtein distance: the fewest single-character insertions, deletions and
// substitutions that turn `a` into `b` (case-sensitive, bytes). Used to
// suggest the closest known name in an error message.
size_t EditDistance(std::string_view a, std::string_view b);

}  // namespace optstate
