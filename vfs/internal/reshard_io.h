// Reshard's streaming I/O: source chunks read ahead and destination files
// written front to back, both with O_DIRECT through an io engine. Internal to
// vfs: reshard.cc's copy drives them. Neither class is thread-safe; each is
// used by the one thread that runs a Reshard.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "vfs/file_system.h"
#include "vfs/io_buffer.h"
#include "vfs/io_engine.h"
#include "base/status.h"

namespace optstate::vfs::internal {

// An io_uring engine, with `eo`'s registered buffers where they can be pinned
// (RLIMIT_MEMLOCK), else without them, else the synchronous engine.
Result<std::unique_ptr<IoEngine>> NewReshardEngine(IoEngineOptions eo, uint64_t sync_staging_bytes);

// Source chunks read ahead in the order the copy consumes them: O_DIRECT
// through the io engine with up to `depth` chunks in flight, so that the disk
// reads while earlier chunks are verified, scattered and written. Item i uses
// buffer i % depth; a buffer is reused once the copy has moved past its chunk.
// A chunk's unaligned tail (the end of a file whose size is no multiple of
// 4096 bytes) is read with a buffered pread when the chunk is consumed.
class SourceReader {
 public:
  struct FieldFile {
    std::string path;
    uint64_t bytes = 0;   // its size per the manifest
    std::string context;  // "tensor 'x' field 'y'"
  };
  struct Item {
    uint32_t file = 0;  // index into files
    uint64_t offset = 0, length = 0;
  };

  SourceReader(std::vector<FieldFile> files, std::vector<Item> items);
  ~SourceReader();
  SourceReader(const SourceReader&) = delete;
  SourceReader& operator=(const SourceReader&) = delete;

  Status Init(uint32_t depth, uint64_t max_chunk_bytes);

  // The bytes of the next item (valid until the following call).
  Result<const char*> Next();

 private:
  static constexpr uint64_t kDirectAlign = 4096;
  struct Slot {
    IoBuffer buf;
    bool done = false;
    Status status;
  };
  struct FileState {
    std::unique_ptr<File> direct;    // O_DIRECT where the file system allows it
    std::unique_ptr<File> buffered;  // for unaligned tails, opened when needed
  };

  uint64_t AlignedPart(const FileState& f, const Item& it) const;

  // The copy is done with item i: its buffer is free, and its file is closed
  // after its last chunk.
  void Release(size_t i);

  // Submits reads until `depth_` items are ahead of the copy. An item whose
  // file cannot be opened (or has the wrong size) stops the submission; its
  // error is returned when the copy reaches it.
  Status Fill();

  Status Open(uint32_t fi);

  std::vector<FieldFile> files_;
  std::vector<Item> items_;
  std::vector<FileState> open_;
  std::vector<uint32_t> left_;  // per file: items not yet released
  std::vector<Slot> slots_;
  uint32_t depth_ = 1;
  std::unique_ptr<IoEngine> engine_;
  size_t next_ = 0;       // the next item the copy takes
  size_t submitted_ = 0;  // items [0, submitted_) are read or being read
  bool failed_ = false;
  size_t failed_item_ = 0;
  Status failed_status_;
};

// Destination files written front to back with O_DIRECT through one io
// engine, so that the bytes go to the disk without filling the page cache and
// the copy goes on while they are written. A stream's bytes gather in a
// buffer of `buf_bytes` (a multiple of 4096) that is written whole once full;
// its last partial block is written padded with zeros and the file is then
// cut to its size (Truncate after Drain). Buffers, allocated and registered
// with io_uring up front: one per stream plus `depth` being written.
class DirectWriter {
 public:
  struct Stream {
    std::shared_ptr<File> file;  // kept alive by the writes in flight too
    uint64_t pos = 0;      // file offset of the buffer's first byte
    int32_t buf = -1;      // index into buffers_, -1 = none yet
    uint64_t fill = 0;     // bytes in the buffer
  };

  ~DirectWriter();

  // `streams`: how many streams hold a buffer at once at most.
  Status Init(uint32_t depth, uint64_t buf_bytes, uint32_t streams);

  Status Append(Stream& s, const char* p, uint64_t n);

  // Writes what the stream holds, its last block padded with zeros.
  Status Finish(Stream& s);

  // Waits for every write; the first failure, if any.
  Status Drain();

 private:
  static constexpr uint64_t kDirectAlign = 4096;

  Status Submit(Stream& s);
  Result<int32_t> Acquire();
  Status ReapSome();

  uint32_t depth_ = 1;
  uint64_t buf_bytes_ = 0;
  // Declared before engine_: they outlive its requests.
  std::vector<IoBuffer> buffers_;
  std::vector<std::shared_ptr<File>> files_;  // per buffer: the file it is being written to
  std::unique_ptr<IoEngine> engine_;
  std::vector<int32_t> free_;
  Status first_error_;
};

}  // namespace optstate::vfs::internal
