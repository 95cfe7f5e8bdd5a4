// Device: what the memory manager needs from a backend. Two implementations:
// HostDevice (host_device.cc: mmap reservations + memfd pages, CPU kernels)
// and CudaDevice (cuda_device.cc: CUDA VMM through driver entry points
// resolved at run time, cudart streams/events, the rules' CUDA kernels).
//
// Addresses are uint64_t so that this header needs no CUDA include.
// Thread-safety: every method is thread-safe except that one stream is driven
// by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>

#include "memmgr/memory_manager.h"
#include "memmgr/update_rule.h"
#include "base/status.h"

namespace optstate::memmgr::internal {

class Device {
 public:
  virtual ~Device() = default;
  virtual Backend backend() const = 0;
  // Mapping granularity; page sizes are multiples of it.
  virtual uint64_t granularity() const = 0;

  // Virtual address space (no memory).
  virtual Result<uint64_t> Reserve(uint64_t bytes) = 0;
  virtual void Unreserve(uint64_t base, uint64_t bytes) = 0;
  // Physical pages of `bytes` each.
  virtual Result<uint64_t> CreatePage(uint64_t bytes) = 0;
  virtual void DestroyPage(uint64_t handle, uint64_t bytes) = 0;
  // Maps page `handle` at va (read/write access); va must be inside a reservation.
  virtual Status Map(uint64_t va, uint64_t bytes, uint64_t handle) = 0;
  virtual Status Unmap(uint64_t va, uint64_t bytes) = 0;

  // Pinned (page-locked) host memory, 4096-aligned.
  virtual Result<void*> AllocPinnedHost(uint64_t bytes) = 0;
  virtual void FreePinnedHost(void* p, uint64_t bytes) = 0;

  // Scratch device memory (not budgeted).
  virtual Result<void*> Malloc(uint64_t bytes) = 0;
  virtual Status Free(void* p) = 0;

  // Streams and events (null on host, where every operation is synchronous).
  virtual Result<void*> CreateStream() = 0;
  virtual void DestroyStream(void* s) = 0;
  virtual Result<void*> CreateEvent() = 0;
  virtual void DestroyEvent(void* e) = 0;
  virtual Status RecordEvent(void* e, void* stream) = 0;
  // True when complete; error when the device reported one.
  virtual Result<bool> QueryEvent(void* e) = 0;
  virtual Status SyncEvent(void* e) = 0;
  virtual Status SyncStream(void* stream) = 0;

  virtual Status CopyH2D(void* d, const void* h, uint64_t bytes, void* stream) = 0;
  virtual Status CopyD2H(void* h, const void* d, uint64_t bytes, void* stream) = 0;
  virtual Status CopyD2D(void* d, const void* s, uint64_t bytes, void* stream) = 0;
  virtual Status Memset(void* d, int value, uint64_t bytes, void* stream) = 0;

  // One kernel call of an update rule (its RunCpu on host with cpu_threads,
  // its RunCuda on the stream), its failure as a Status.
  virtual Status RunRule(const UpdateRule& rule, const SliceOperands& o, const RuleArgs& a, int cpu_threads,
                         void* stream) = 0;

  virtual Status MemInfo(uint64_t* free_bytes, uint64_t* total_bytes) = 0;
};

// huge_page_pinned: AllocPinnedHost returns vfs::IoPages::kHuge memory
// (MemoryManagerOptions::staging_pages).
std::unique_ptr<Device> NewHostDevice(bool huge_page_pinned);
// Unimplemented when this build has no cuda backend; kUnavailable-like
// FailedPrecondition naming the reason when no device/driver is present.
Result<std::unique_ptr<Device>> NewCudaDevice(int ordinal, bool huge_page_pinned);
// Number of visible CUDA devices; 0 without driver/GPU or cuda backend.
int CudaDeviceCount();

}  // namespace optstate::memmgr::internal
