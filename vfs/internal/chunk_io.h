// Chunk reads and writes of a store (vfs/store.h ChunkIo): the asynchronous
// ChunkIo over an IoEngine, and the synchronous read of one chunk version that
// GenerationView::ReadChunk, Store::ReadChunk and Verify share. Internal to vfs/.
#pragma once

#include <memory>
#include <string>

#include "vfs/internal/store_core.h"

namespace optstate::vfs::internal {

struct ViewData;

// `what` + ": checksum mismatch (expected xxh3 E, read R) at [PATH ]offset O".
Status ChecksumMismatch(const std::string& what, uint64_t expected, uint64_t read, const std::string& path,
                        uint64_t offset);

// Reads one version synchronously into buf (buf_bytes long: the tail past the
// chunk is zeroed up to there) and verifies it.
Status ReadVersion(Core* core, const TensorInfo* t, const Key& k, const Version& v, void* buf, uint64_t buf_bytes);

// A caller's buffer size (0 = a whole chunk), checked against the chunk it is
// to hold: the one rule of ChunkIo::SubmitRead and GenerationView::ReadChunk.
Result<uint64_t> BufferBytesFor(const Core& core, const TensorInfo* t, const Key& k, uint64_t chunk_len,
                                uint64_t buf_bytes);

// A ChunkIo over the store's newest versions (view null: writes allowed) or
// over a frozen generation (reads only).
Result<std::unique_ptr<ChunkIo>> MakeChunkIo(const std::shared_ptr<Core>& core, std::shared_ptr<ViewData> view,
                                             const ChunkIoOptions& opts);

}  // namespace optstate::vfs::internal
