// MemoryManager: the device-memory window through which optimizer state on
// NVMe (a vfs::Store) is made visible to a trainer.
//
// Every (tensor, field) of the store gets a device address range reserved once
// (CUDA VMM cuMemAddressReserve on the `cuda` backend, mmap(PROT_NONE) on the
// `host` backend); physical pages of one store chunk each (a multiple of 2 MiB)
// are mapped into it only while the chunk is resident. A pinned range is
// therefore plain contiguous memory with an address that is stable for the
// manager's lifetime. Resident pages never exceed `device_budget_bytes` (hard;
// the peak is in stats()).
//
// Tiers: NVMe (the store, home) -> pinned host staging buffers (registered
// with io_uring) -> pinned host cache tier (a read tier under write-through
// commits; MemoryManagerOptions::host_cache_bytes) -> device pages.
//
// Ownership: the manager does not own the store; the store must outlive it.
// PinnedRanges must be destroyed (or Unpin()ed) before the manager.
// Thread-safety: every method is thread-safe. Pin blocks while the budget is
// exhausted by other pins until they unpin; a thread that holds pins and asks
// for more than the rest of the budget can deadlock itself (don't). Pin,
// Prefetch, Flush and ReleaseAll first wait for a StreamedAdam commit running
// in the background (StreamedAdamOptions::commit_lag_steps) and for a
// StreamedAdam::Prefetch still reading.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"
#include "vfs/checkpoint.h"
#include "vfs/store.h"

namespace optstate::memmgr {

class MemoryManager;
namespace internal {
class EngineMemory;
class ManagerImpl;
// For the streamed optimizer engine only (memmgr/internal/engine_memory.h).
EngineMemory* EngineMemoryOf(const MemoryManager& mm);
// The whole manager state, for tests of its internals (manager_impl.h).
ManagerImpl* ImplOf(const MemoryManager& mm);
}  // namespace internal

enum class Backend { kAuto, kHost, kCuda };
// "auto", "host", "cuda".
const char* BackendName(Backend b);
// The inverse of BackendName; kInvalidArgument naming `name` otherwise.
Result<Backend> ParseBackend(std::string_view name);
// True when this binary contains the cuda backend and a CUDA device is
// visible (never throws or aborts where there is no driver).
bool CudaAvailable();

enum class Access {
  kRead,       // contents loaded; never written back
  kWrite,      // contents need not be loaded (undefined until written); written back
  kReadWrite,  // contents loaded and written back on unpin
};

struct MemoryManagerOptions {
  // kAuto: cuda when a CUDA device is visible, else host (logged).
  Backend backend = Backend::kAuto;
  // Hard cap on device pages used for state, bytes. Default 2 GiB.
  uint64_t device_budget_bytes = 2ull << 30;
  // Pinned host cache tier (RAM as a read tier), bytes of chunk state (each
  // chunk's bytes rounded up to 4 KiB); 0 = off. StreamedAdam steps read the
  // chunks it holds from RAM and write every new generation through to disk.
  // Buffers are allocated as chunks are admitted, so a smaller state uses
  // only its own size. Admission: a chunk is admitted while there is room and,
  // once the tier is full, a miss evicts nothing (the resident set stays):
  // a step walks the state in the same order every time, so LRU would evict
  // exactly the chunks the next step needs first and serve no reads, whereas
  // a fixed resident set serves capacity/state of every step's reads.
  // kAutoHostCache (default): half of /proc/meminfo MemAvailable, leaving at
  // least 4 GiB of it free, divided among the node's ranks (LOCAL_WORLD_SIZE,
  // as torchrun sets it; 1 when unset): the other half stays for the
  // trainer, its data loaders and the page cache. It is one budget for the
  // whole process: every manager created with kAutoHostCache while another
  // holds it draws from the same share (sized when the first was created),
  // so two optimizers of a rank together stay within it. The chosen size is
  // logged; options() reports the share (shared or not).
  static constexpr uint64_t kAutoHostCache = ~uint64_t{0};
  uint64_t host_cache_bytes = kAutoHostCache;
  // Chunk-sized pinned staging buffers for Pin/Prefetch/write-back and for the
  // StreamedAdam pipeline; 0 = auto: 3 at Create, grown as they are used, at
  // most to the throughput plan (3 x read-ahead + 4, with wider slices, bf16
  // or q8 moments, 4 or 8 buffers a slice): by a StreamedAdam to what its
  // state's slices use at once (a set per big slice; small slices share
  // 256 KiB pieces of a buffer; two kept for pins), by pins to the chunks
  // they load at once. A state of a few small tensors thus pins a few
  // buffers, not the plan's dozens (MemoryStats::staging_buffers).
  uint32_t staging_buffers = 0;
  // io_uring reads in flight (Pin/Prefetch: all requests) per ChunkIo. Default 32.
  uint32_t queue_depth = 32;
  // StreamedAdam: chunk writes in flight on top of queue_depth reads (the ring
  // holds both). 0 = reads and writes share queue_depth. Default 32: a shared
  // queue makes reads wait behind writes, and fio's floor (a read job and a
  // write job of depth 32 each) runs 64 deep too (docs/BENCHMARKS.md "Defaults").
  uint32_t write_queue_depth = 32;
  // Chunk slices (one chunk of main+exp_avg+exp_avg_sq) staged at once by the
  // StreamedAdam pipeline (reading, computing or writing); 0 = auto: enough
  // to keep both queues full, (queue_depth + write_queue_depth) / B + 4 with
  // B the chunks' worth of bytes a slice moves (3 f32, 4 bf16, 6 q8 moments).
  uint32_t read_ahead_chunks = 0;
  // CUDA device ordinal (cuda backend).
  int cuda_device = 0;
  // Pinned host buffers (staging, host cache tier, AllocPinnedHost) in 2 MiB
  // transparent huge pages (vfs/io_buffer.h, IoPages::kHuge): a chunk's
  // direct I/O then reaches the disk as few large requests instead of many
  // ~1 MiB ones. kAuto (default): huge pages when the device under the
  // store's first data dir takes requests of 2 MiB or more
  // (vfs::PreferredIoPages), base pages otherwise. Why: huge pages make a
  // step faster only on a disk that takes requests of 2 MiB or more, and
  // slower on one that takes ~1 MiB (docs/BENCHMARKS.md "Defaults").
  enum class StagingPages { kAuto, kBase, kHuge };
  StagingPages staging_pages = StagingPages::kAuto;
  // Chunk I/O goes to the kernel as parallel SQEs of at most this many bytes
  // (vfs IoEngineOptions::max_sqe_bytes); 0 = one SQE per chunk (default).
  // Why 0: the block layer merges adjacent parts back into large requests
  // unless merging is off (/sys/block/<dev>/queue/nomerges = 2), so smaller
  // SQEs only cost submissions (docs/BENCHMARKS.md "Defaults").
  uint64_t max_sqe_bytes = 0;
  // StreamedAdam's chunk I/O reaches the kernel in batches, one
  // io_uring_enter per pipeline pass (vfs IoEngineOptions::defer_submit), so
  // the block layer merges adjacent small chunks (a norm's or a bias's three
  // fields, side by side on disk) into one request. Default true. docs/BENCHMARKS.md
  // "Defaults".
  bool batch_submit = true;
  // Threads that hash chunks for the manager's and StreamedAdam's chunk I/O
  // (write checksums, read verification; vfs ChunkIoOptions::hash_threads),
  // so that the pipeline thread only submits and reaps. kAutoHashThreads
  // (default): 4 on machines of 8 or more cores, else 0 (the pipeline thread
  // hashes: on fewer cores the CPU kernels and the kernel's I/O workers
  // already take them all). docs/BENCHMARKS.md "Defaults".
  static constexpr uint32_t kAutoHashThreads = ~uint32_t{0};
  uint32_t hash_threads = kAutoHashThreads;
};

// The I/O and copy counters of a StreamedAdam step whose commit runs in the
// background (StreamedAdamOptions::commit_lag_steps) are added when that
// commit ends: read them after StreamedAdam::WaitForCommit (or Flush) to see
// the step's bytes.
struct MemoryStats {
  uint64_t resident_bytes = 0;        // device pages in use now (pins, cached, StreamedAdam slots)
  uint64_t peak_resident_bytes = 0;   // max of resident_bytes since Create
  uint64_t budget_bytes = 0;
  uint64_t nvme_read_bytes = 0;       // chunk bytes read from the store
  uint64_t nvme_write_bytes = 0;      // chunk bytes written to the store
  uint64_t cache_hit_bytes = 0;       // chunk bytes served by the host cache tier
  uint64_t cache_bytes = 0;           // host cache tier in use now
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  double io_stall_seconds = 0;        // time callers waited for NVMe I/O
  uint64_t pins = 0;
  uint64_t evictions = 0;
  uint32_t staging_in_use = 0;        // pinned staging buffers held now (pins, steps, prefetches)
  uint32_t staging_buffers = 0;       // pinned staging buffers in the pool (staging_buffers, or auto)
};

// RAII handle of one pinned range. Movable, not copyable. The memory stays
// valid (and resident) until Unpin() or destruction; ranges pinned for kWrite
// or kReadWrite are scheduled for write-back when unpinned.
// Thread-safety: one handle is used by one thread at a time.
class PinnedRange {
 public:
  PinnedRange() = default;
  ~PinnedRange();
  PinnedRange(PinnedRange&& other) noexcept;
  PinnedRange& operator=(PinnedRange&& other) noexcept;
  PinnedRange(const PinnedRange&) = delete;
  PinnedRange& operator=(const PinnedRange&) = delete;

  // Device pointer (host pointer on the host backend) of element first_elem.
  void* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  // The cudaStream_t the contents are ready on (already synchronised today:
  // data is ready when Pin returns), or null on the host backend.
  void* stream() const { return stream_; }
  bool valid() const { return impl_ != nullptr; }
  // Releases the pin (idempotent). Errors are those of scheduling write-back.
  Status Unpin();

 private:
  friend class internal::ManagerImpl;
  internal::ManagerImpl* impl_ = nullptr;
  uint64_t pin_id_ = 0;
  void* data_ = nullptr;
  uint64_t size_bytes_ = 0;
  void* stream_ = nullptr;
};

class MemoryManager {
 public:
  // REQUIRES: store is writable and outlives the manager. Fails with a clear
  // message when the backend is unavailable, the budget cannot hold one chunk,
  // or pinned memory cannot be allocated (RLIMIT_MEMLOCK).
  static Result<std::unique_ptr<MemoryManager>> Create(vfs::Store* store,
                                                       const MemoryManagerOptions& opts);
  ~MemoryManager();
  MemoryManager(const MemoryManager&) = delete;
  MemoryManager& operator=(const MemoryManager&) = delete;

  Backend backend() const;
  // What the pinned staging is in, and why: "huge pages" or "base pages",
  // with the device's request size when staging_pages was kAuto.
  const std::string& staging_pages() const;
  vfs::Store* store() const;
  const MemoryManagerOptions& options() const;

  // Pins elements [first_elem, first_elem + count) of a tensor field. The
  // whole chunks that hold the range become resident (loaded unless kWrite).
  // A range larger than the budget fails at once (kResourceExhausted with the
  // sizes); one that does not fit yet waits for other pins to be released.
  Result<PinnedRange> Pin(std::string_view tensor, std::string_view field, uint64_t first_elem,
                          uint64_t count, Access access);
  // Asynchronous hint: loads the range's chunks in the background when free
  // budget allows (never evicts a pinned chunk, never waits).
  Status Prefetch(std::string_view tensor, std::string_view field, uint64_t first_elem,
                  uint64_t count);
  // Waits until every unpinned dirty chunk is written to the store (pending
  // generation). Durability/publication is the store's Commit.
  Status Flush();
  // Writes dirty chunks back and drops every unpinned device page (sleep for
  // RL colocation). kFailedPrecondition while pins are outstanding.
  Status ReleaseAll();
  MemoryStats stats() const;

  // Scratch device memory and copies for callers that cannot include CUDA
  // (tools, demo). Not counted against the budget. Host backend: host memory.
  Result<void*> AllocDevice(uint64_t bytes);
  Status FreeDevice(void* d_ptr);
  Status CopyToDevice(void* d_dst, const void* h_src, uint64_t bytes);
  Status CopyToHost(void* h_dst, const void* d_src, uint64_t bytes);
  // Pinned (page-locked, DMA-able) host memory, 4096-aligned; for tools that
  // measure or feed copies at full bandwidth. Not counted anywhere.
  Result<void*> AllocPinnedHost(uint64_t bytes);
  void FreePinnedHost(void* h_ptr, uint64_t bytes);
  // Device memory free/total (cudaMemGetInfo); host backend: 0/0.
  Status DeviceMemInfo(uint64_t* free_bytes, uint64_t* total_bytes);

  // vfs::ExportCheckpoint of store()'s committed generation (opts.generation
  // or opts.snapshot), taking each chunk whose copy in the host cache tier
  // holds that generation's bytes (its checksum) from there and reading only
  // the others from the disk; the result counts both (source_*, disk_*).
  // The files are those of vfs::ExportCheckpoint(store(), dest, opts). Waits
  // first for a StreamedAdam commit running in the background. A cache entry
  // in use by a step (or being written back) is read from the disk instead.
  // opts.chunk_source is replaced.
  Result<vfs::ExportResult> ExportCheckpoint(const std::string& dest, vfs::ExportOptions opts);


 private:
  // The streamed optimizer engine drives the manager's machinery (the cache,
  // staging, arenas) through internal::EngineMemoryOf; no other user sees it.
  friend internal::EngineMemory* internal::EngineMemoryOf(const MemoryManager& mm);

  explicit MemoryManager(std::unique_ptr<internal::ManagerImpl> impl);
  std::unique_ptr<internal::ManagerImpl> impl_;
};

}  // namespace optstate::memmgr
