// CUDA backend. Device pages use the CUDA virtual memory API
// (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess). The driver
// functions are resolved at run time through cudart
// (cudaGetDriverEntryPointByVersion), so the binary links no libcuda and
// starts on a machine without a driver; cudart is linked statically and
// dlopens the driver on first use. Nothing here runs at static init.
//
// This file is the one place CUDA errors become Status (CudaStatus/CuStatus).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>

#include "memmgr/internal/device.h"
#include "vfs/io_buffer.h"
#include "base/log.h"

namespace optstate::memmgr::internal {
namespace {

Status CudaStatus(const std::string& what, cudaError_t e) {
  return Internal("CUDA error in " + what + ": " + cudaGetErrorName(e) + " (" +
                  cudaGetErrorString(e) + ", code " + std::to_string(static_cast<int>(e)) + ")");
}
Status CuStatus(const std::string& what, CUresult r) {
  StatusCode code = r == CUDA_ERROR_OUT_OF_MEMORY ? StatusCode::kResourceExhausted : StatusCode::kInternal;
  return Status(code, "CUDA driver error in " + what + ": CUresult " + std::to_string(static_cast<int>(r)));
}

#define OPTSTATE_CUDA_RETURN(what, expr)             \
  do {                                               \
    cudaError_t optstate_e_ = (expr);                \
    if (optstate_e_ != cudaSuccess) return CudaStatus(what, optstate_e_); \
  } while (0)
#define OPTSTATE_CU_RETURN(what, expr)               \
  do {                                               \
    CUresult optstate_r_ = (expr);                   \
    if (optstate_r_ != CUDA_SUCCESS) return CuStatus(what, optstate_r_); \
  } while (0)

struct DriverApi {
  decltype(&::cuMemAddressReserve) mem_address_reserve = nullptr;
  decltype(&::cuMemAddressFree) mem_address_free = nullptr;
  decltype(&::cuMemCreate) mem_create = nullptr;
  decltype(&::cuMemRelease) mem_release = nullptr;
  decltype(&::cuMemMap) mem_map = nullptr;
  decltype(&::cuMemUnmap) mem_unmap = nullptr;
  decltype(&::cuMemSetAccess) mem_set_access = nullptr;
  decltype(&::cuMemGetAllocationGranularity) mem_get_granularity = nullptr;
};

template <typename Fn>
Status Resolve(const char* name, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) {
    return FailedPrecondition(std::string("cuda backend: cannot resolve driver entry point ") + name +
                              " (cudaError " + std::to_string(static_cast<int>(e)) + ", query " +
                              std::to_string(static_cast<int>(q)) + "); driver too old or absent");
  }
  *out = reinterpret_cast<Fn>(fn);
  return Status::Ok();
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, bool huge_page_pinned) : ordinal_(ordinal), huge_page_pinned_(huge_page_pinned) {}

  Status Init() {
    OPTSTATE_CUDA_RETURN("cudaSetDevice(" + std::to_string(ordinal_) + ")", cudaSetDevice(ordinal_));
    OPTSTATE_CUDA_RETURN("cudaFree(0) (context init)", cudaFree(nullptr));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemAddressReserve", &api_.mem_address_reserve));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemAddressFree", &api_.mem_address_free));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemCreate", &api_.mem_create));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemRelease", &api_.mem_release));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemMap", &api_.mem_map));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemUnmap", &api_.mem_unmap));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemSetAccess", &api_.mem_set_access));
    OPTSTATE_RETURN_IF_ERROR(Resolve("cuMemGetAllocationGranularity", &api_.mem_get_granularity));
    std::memset(&prop_, 0, sizeof(prop_));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = ordinal_;
    size_t gran = 0;
    OPTSTATE_CU_RETURN("cuMemGetAllocationGranularity",
                       api_.mem_get_granularity(&gran, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    granularity_ = gran == 0 ? (2ull << 20) : gran;
    std::memset(&access_, 0, sizeof(access_));
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return Status::Ok();
  }

  Backend backend() const override { return Backend::kCuda; }
  uint64_t granularity() const override { return granularity_; }

  // Driver calls act on the calling thread's current context: make the
  // device's primary context current first (worker threads).
  Status Bind() {
    OPTSTATE_CUDA_RETURN("cudaSetDevice", cudaSetDevice(ordinal_));
    return Status::Ok();
  }

  Result<uint64_t> Reserve(uint64_t bytes) override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    CUdeviceptr p = 0;
    OPTSTATE_CU_RETURN("cuMemAddressReserve(" + std::to_string(bytes) + ")",
                       api_.mem_address_reserve(&p, bytes, 0, 0, 0));
    return static_cast<uint64_t>(p);
  }
  void Unreserve(uint64_t base, uint64_t bytes) override {
    if (Bind().ok()) api_.mem_address_free(static_cast<CUdeviceptr>(base), bytes);
  }
  Result<uint64_t> CreatePage(uint64_t bytes) override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    CUmemGenericAllocationHandle h = 0;
    OPTSTATE_CU_RETURN("cuMemCreate(" + std::to_string(bytes) + " bytes)", api_.mem_create(&h, bytes, &prop_, 0));
    return static_cast<uint64_t>(h);
  }
  void DestroyPage(uint64_t handle, uint64_t) override {
    if (Bind().ok()) api_.mem_release(static_cast<CUmemGenericAllocationHandle>(handle));
  }
  Status Map(uint64_t va, uint64_t bytes, uint64_t handle) override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    OPTSTATE_CU_RETURN("cuMemMap", api_.mem_map(static_cast<CUdeviceptr>(va), bytes, 0,
                                                static_cast<CUmemGenericAllocationHandle>(handle), 0));
    CUresult r = api_.mem_set_access(static_cast<CUdeviceptr>(va), bytes, &access_, 1);
    if (r != CUDA_SUCCESS) {
      api_.mem_unmap(static_cast<CUdeviceptr>(va), bytes);
      return CuStatus("cuMemSetAccess", r);
    }
    return Status::Ok();
  }
  Status Unmap(uint64_t va, uint64_t bytes) override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    OPTSTATE_CU_RETURN("cuMemUnmap", api_.mem_unmap(static_cast<CUdeviceptr>(va), bytes));
    return Status::Ok();
  }

  // cudaHostAlloc; with huge_page_pinned, huge-page I/O memory
  // (vfs/io_buffer.h) page-locked with cudaHostRegister instead.
  Result<void*> AllocPinnedHost(uint64_t bytes) override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    void* p = nullptr;
    if (!huge_page_pinned_) {
      cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
      if (e != cudaSuccess) {
        return Status(StatusCode::kResourceExhausted,
                      CudaStatus("cudaHostAlloc(" + std::to_string(bytes) + ")", e).message());
      }
      return p;
    }
    OPTSTATE_ASSIGN_OR_RETURN(p, vfs::AllocateIoMemory(bytes, vfs::IoPages::kHuge));
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      vfs::FreeIoMemory(p, bytes, vfs::IoPages::kHuge);
      return Status(StatusCode::kResourceExhausted,
                    CudaStatus("cudaHostRegister(" + std::to_string(bytes) + " bytes)", e).message());
    }
    return p;
  }
  void FreePinnedHost(void* p, uint64_t bytes) override {
    if (p == nullptr) return;
    if (!huge_page_pinned_) {
      cudaFreeHost(p);
      return;
    }
    (void)cudaHostUnregister(p);
    vfs::FreeIoMemory(p, bytes, vfs::IoPages::kHuge);
  }
  Result<void*> Malloc(uint64_t bytes) override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      return Status(StatusCode::kResourceExhausted,
                    CudaStatus("cudaMalloc(" + std::to_string(bytes) + ")", e).message());
    }
    return p;
  }
  Status Free(void* p) override {
    OPTSTATE_CUDA_RETURN("cudaFree", cudaFree(p));
    return Status::Ok();
  }
  Result<void*> CreateStream() override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    cudaStream_t s = nullptr;
    OPTSTATE_CUDA_RETURN("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return static_cast<void*>(s);
  }
  void DestroyStream(void* s) override {
    if (s != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(s));
  }
  Result<void*> CreateEvent() override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    cudaEvent_t e = nullptr;
    OPTSTATE_CUDA_RETURN("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return static_cast<void*>(e);
  }
  void DestroyEvent(void* e) override {
    if (e != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
  Status RecordEvent(void* e, void* stream) override {
    OPTSTATE_CUDA_RETURN("cudaEventRecord",
                         cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(stream)));
    return Status::Ok();
  }
  Result<bool> QueryEvent(void* e) override {
    cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (r == cudaSuccess) return true;
    if (r == cudaErrorNotReady) return false;
    return CudaStatus("cudaEventQuery", r);
  }
  Status SyncEvent(void* e) override {
    OPTSTATE_CUDA_RETURN("cudaEventSynchronize", cudaEventSynchronize(static_cast<cudaEvent_t>(e)));
    return Status::Ok();
  }
  Status SyncStream(void* s) override {
    OPTSTATE_CUDA_RETURN("cudaStreamSynchronize", cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
    return Status::Ok();
  }
  Status CopyH2D(void* d, const void* h, uint64_t bytes, void* s) override {
    OPTSTATE_CUDA_RETURN("cudaMemcpyAsync H2D " + std::to_string(bytes) + " bytes",
                         cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(s)));
    return Status::Ok();
  }
  Status CopyD2H(void* h, const void* d, uint64_t bytes, void* s) override {
    OPTSTATE_CUDA_RETURN("cudaMemcpyAsync D2H " + std::to_string(bytes) + " bytes",
                         cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(s)));
    return Status::Ok();
  }
  Status CopyD2D(void* d, const void* src, uint64_t bytes, void* s) override {
    OPTSTATE_CUDA_RETURN("cudaMemcpyAsync D2D",
                         cudaMemcpyAsync(d, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(s)));
    return Status::Ok();
  }
  Status Memset(void* d, int value, uint64_t bytes, void* s) override {
    OPTSTATE_CUDA_RETURN("cudaMemsetAsync", cudaMemsetAsync(d, value, bytes, static_cast<cudaStream_t>(s)));
    return Status::Ok();
  }
  Status RunRule(const UpdateRule& rule, const SliceOperands& o, const RuleArgs& a, int, void* stream) override {
    int e = rule.RunCuda(o, a, stream);
    if (e != 0) {
      return CudaStatus(std::string(rule.name()) + " kernel (" + std::to_string(o.count) + " elements)",
                        static_cast<cudaError_t>(e));
    }
    return Status::Ok();
  }
  Status MemInfo(uint64_t* free_bytes, uint64_t* total_bytes) override {
    OPTSTATE_RETURN_IF_ERROR(Bind());
    size_t f = 0, t = 0;
    OPTSTATE_CUDA_RETURN("cudaMemGetInfo", cudaMemGetInfo(&f, &t));
    *free_bytes = f;
    *total_bytes = t;
    return Status::Ok();
  }

 private:
  int ordinal_;
  bool huge_page_pinned_;  // AllocPinnedHost: huge-page I/O memory + cudaHostRegister
  DriverApi api_;
  CUmemAllocationProp prop_;
  CUmemAccessDesc access_;
  uint64_t granularity_ = 2ull << 20;
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky, but keep the runtime's last error clean
    return 0;
  }
  return n;
}

Result<std::unique_ptr<Device>> NewCudaDevice(int ordinal, bool huge_page_pinned) {
  int n = CudaDeviceCount();
  if (n <= 0) return FailedPrecondition("cuda backend: no CUDA device visible (no driver or no GPU)");
  if (ordinal < 0 || ordinal >= n) {
    return InvalidArgument("cuda backend: device " + std::to_string(ordinal) + " out of range (" +
                           std::to_string(n) + " visible)");
  }
  auto dev = std::make_unique<CudaDevice>(ordinal, huge_page_pinned);
  OPTSTATE_RETURN_IF_ERROR(dev->Init());
  return std::unique_ptr<Device>(std::move(dev));
}

}  // namespace optstate::memmgr::internal
