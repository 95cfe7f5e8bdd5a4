// ChunkChecksum: XXH3-64 of a chunk's logical bytes (vfs/store.h).
#include <xxhash.h>

#include "vfs/store.h"

namespace optstate::vfs {

uint64_t ChunkChecksum(const void* data, uint64_t len) {
  return XXH3_64bits(data, static_cast<size_t>(len));
}

}  // namespace optstate::vfs
