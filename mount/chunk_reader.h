// ChunkReader: the read path of one open file of the mount.
//
// One synchronous 1 MiB O_DIRECT pread per FUSE request is latency-bound
// (~0.5 GB/s measured), so a reader keeps whole chunks of its file in flight:
// on each read it makes sure the next `readahead_chunks` chunks of the file's
// chunk sequence are submitted to its own ChunkIo (io_uring, from the
// generation's GenerationView, checksum-verified), then copies the requested
// bytes out of completed chunk buffers. Sequential readers therefore see the
// disk at queue depth; random readers still work (a miss is a plain read).
//
// A chunk whose checksum does not match fails the read with kCorruption and one
// log line naming store, generation, tensor, field and chunk.
//
// Ownership: holds a reference on its Generation (so the file reads that
// generation until closed). Thread-safety: Read() is serialised by an internal
// mutex (FUSE may call it from several threads for one handle).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "mount/store_tree.h"
#include "vfs/status.h"

namespace optstate::mount {

class ChunkReader {
 public:
  ChunkReader(std::shared_ptr<const Generation> gen, const vfs::CheckpointFile* file,
              uint32_t readahead_chunks);
  ~ChunkReader();

  // Reads up to len bytes at offset; short only at EOF.
  Result<uint64_t> Read(uint64_t offset, uint64_t len, char* out);

  const Generation& generation() const { return *gen_; }
  const vfs::CheckpointFile& file() const { return *file_; }

 private:
  enum class SlotState : uint8_t { kEmpty, kInFlight, kReady, kFailed };
  struct Slot {
    char* buf = nullptr;   // 4096-aligned, chunk size; freed in the destructor
    uint64_t seq = 0;
    SlotState state = SlotState::kEmpty;
    Status status;
  };
  Status EnsureIo();
  // Submits seq if it is not already held; false when no slot can be freed now.
  Result<bool> Submit(uint64_t seq, uint64_t window_lo, uint64_t window_hi);
  Status ReapOne();
  Result<Slot*> WaitFor(uint64_t seq);
  Status SlotError(const Slot& s) const;

  const std::shared_ptr<const Generation> gen_;
  const vfs::CheckpointFile* const file_;
  const uint32_t readahead_;
  const uint64_t chunk_size_;
  const uint64_t seq_len_;

  std::mutex mu_;                              // guards everything below
  std::unique_ptr<vfs::ChunkIo> io_;
  bool sync_fallback_ = false;                 // NewChunkIo failed: ReadChunk per chunk
  std::vector<Slot> slots_;
};

}  // namespace optstate::mount
