// ChunkChecksum: XXH3-64 of a chunk's logical bytes (vfs/store.h).
#include <xxhash.h>

#include <cstdio>

#include "vfs/store.h"

namespace optstate::vfs {

uint64_t ChunkChecksum(const void* data, uint64_t len) {
  return XXH3_64bits(data, static_cast<size_t>(len));
}

Status VerifyChunkRead(const ChunkCompletion& c, const void* buf) {
  if (!c.needs_verify) return Status();
  const uint64_t sum = ChunkChecksum(buf, c.verify_length);
  if (sum == c.expected_checksum) return Status();
  char m[128];
  snprintf(m, sizeof(m), ": checksum mismatch (expected xxh3 %016llx, read %016llx) at offset %llu",
           static_cast<unsigned long long>(c.expected_checksum), static_cast<unsigned long long>(sum),
           static_cast<unsigned long long>(c.file_offset));
  return Corruption(c.what + m);
}

}  // namespace optstate::vfs
