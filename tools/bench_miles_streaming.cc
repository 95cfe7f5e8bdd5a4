#include "tools/bench_miles_streaming.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "tools/internal/cli.h"

namespace optstate::tools::bench {

namespace {

constexpr uint64_t kIoAlign = 4096;  // IO_ALIGN
constexpr const char* kSegments[3] = {"main", "exp_avg", "exp_avg_sq"};  // SEGMENTS

uint64_t Align(uint64_t nbytes) { return (nbytes + kIoAlign - 1) / kIoAlign * kIoAlign; }  // _align

// _allocate_file: posix_fallocate, or ftruncate where the file system has no
// fallocate.
Result<int> AllocateFile(const std::string& path, uint64_t nbytes) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(fmt::format("open {}", path), errno);
  int e = ::posix_fallocate(fd, 0, static_cast<off_t>(nbytes));
  if (e == EOPNOTSUPP || e == EINVAL) {
    e = ::ftruncate(fd, static_cast<off_t>(nbytes)) == 0 ? 0 : errno;
  }
  if (e != 0) {
    ::close(fd);
    return ErrnoStatus(fmt::format("allocate {} bytes for {}", nbytes, path), e);
  }
  return fd;
}

// _rw_full: loops over short reads and writes.
Status RwFull(bool write, int fd, uint64_t offset, void* buf, uint64_t len, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  uint64_t done = 0;
  while (done < len) {
    ssize_t n = write ? ::pwrite(fd, p + done, len - done, static_cast<off_t>(offset + done))
                      : ::pread(fd, p + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return ErrnoStatus(fmt::format("{} {} at offset {}", write ? "pwrite" : "pread", path, offset + done), errno);
    }
    if (n == 0) return IoError(fmt::format("short {} of {} at offset {}", write ? "pwrite" : "pread", path, offset + done));
    done += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<MilesStreamingBaseline>> MilesStreamingBaseline::Create(
    const std::string& dir, const std::vector<std::pair<std::string, uint64_t>>& params,
    memmgr::MemoryManager* mm, const float* h_w0, const MilesStreamingOptions& options) {
  if (options.bucket_numel_limit == 0 || options.staging_bytes < 4 || options.staging_bytes % 4 != 0) {
    return InvalidArgument(fmt::format("miles' streaming: bucket limit {} elements, staging {} bytes: both must be > 0, "
                                       "staging a multiple of 4",
                                       options.bucket_numel_limit, options.staging_bytes));
  }
  if (options.moment_type != MomentDType::kF32 && options.moment_type != MomentDType::kBF16) {
    return InvalidArgument("miles' streaming: moments must be f32 or bf16");
  }
  auto ms = std::unique_ptr<MilesStreamingBaseline>(new MilesStreamingBaseline);
  ms->mm_ = mm;
  ms->options_ = options;
  ms->params_ = params;
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return ErrnoStatus(fmt::format("mkdir {}", dir), errno);

  // plan_buckets, over one DDP bucket (Megatron without overlap_grad_reduce
  // puts every parameter in one): a bucket closes once it reaches the limit.
  std::vector<std::vector<size_t>> planned(1);
  uint64_t numel = 0;
  for (size_t p = 0; p < params.size(); ++p) {
    planned.back().push_back(p);
    numel += params[p].second;
    if (numel >= options.bucket_numel_limit) {
      planned.emplace_back();
      numel = 0;
    }
  }
  if (planned.back().empty()) planned.pop_back();

  // _Bucket.__init__: segment by segment, each param's region aligned.
  uint64_t max_numel = 0;
  for (size_t i = 0; i < planned.size(); ++i) {
    Bucket b;
    b.path = fmt::format("{}/bucket{:05d}.bin", dir, i);
    b.params = planned[i];
    uint64_t at = 0;
    for (int s = 0; s < 3; ++s) {
      for (size_t p : b.params) {
        b.offsets[s].push_back(at);
        at += Align(params[p].second * ms->SegmentElemBytes(s));
      }
    }
    for (size_t p : b.params) {
      b.device_elems.push_back(b.numel);
      b.numel += params[p].second;
    }
    b.nbytes = at;
    OPTSTATE_ASSIGN_OR_RETURN(b.fd, AllocateFile(b.path, b.nbytes));
    max_numel = std::max(max_numel, b.numel);
    ms->buckets_.push_back(std::move(b));
  }
  OPTSTATE_ASSIGN_OR_RETURN(ms->h_staging_, mm->AllocPinnedHost(options.staging_bytes));
  for (int s = 0; s < 3; ++s) {
    OPTSTATE_ASSIGN_OR_RETURN(ms->d_state_[s], DeviceBuffer::Make(mm, max_numel * ms->SegmentElemBytes(s)));
  }

  // refresh_main_from_model_params: each main from the model, flushed
  // (main only), then sync_and_drop_main_cache.
  for (const Bucket& b : ms->buckets_) {
    for (size_t k = 0; k < b.params.size(); ++k) {
      const uint64_t n = params[b.params[k]].second;
      char* d_main = static_cast<char*>(ms->d_state_[0].get()) + b.device_elems[k] * 4;
      OPTSTATE_RETURN_IF_ERROR(mm->CopyToDevice(d_main, h_w0, n * 4));
      OPTSTATE_RETURN_IF_ERROR(ms->Transfer(b, 0, k, /*to_disk=*/true));
    }
    const uint64_t main_bytes = b.offsets[1].empty() ? 0 : b.offsets[1][0];
    if (::fdatasync(b.fd) != 0) return ErrnoStatus(fmt::format("fdatasync {}", b.path), errno);
    (void)::posix_fadvise(b.fd, 0, static_cast<off_t>(main_bytes), POSIX_FADV_DONTNEED);
  }
  return ms;
}

MilesStreamingBaseline::~MilesStreamingBaseline() {
  for (Bucket& b : buckets_) {
    if (b.fd >= 0) ::close(b.fd);
  }
  if (h_staging_ != nullptr) mm_->FreePinnedHost(h_staging_, options_.staging_bytes);
}

uint64_t MilesStreamingBaseline::file_bytes() const {
  uint64_t n = 0;
  for (const Bucket& b : buckets_) n += b.nbytes;
  return n;
}

uint64_t MilesStreamingBaseline::SegmentElemBytes(int segment) const {
  return segment == 0 || options_.moment_type == MomentDType::kF32 ? 4 : 2;
}

// _Stager.transfer (the device holds the disk's dtype: see the header):
// staging-buffer-sized chunks, each read then copied to the device, or
// copied to the host then written, before the next.
Status MilesStreamingBaseline::Transfer(const Bucket& b, int segment, size_t k, bool to_disk) {
  const uint64_t numel = params_[b.params[k]].second;
  const uint64_t es = SegmentElemBytes(segment);
  const uint64_t chunk = options_.staging_bytes / es;
  char* d = static_cast<char*>(d_state_[segment].get()) + b.device_elems[k] * es;
  for (uint64_t pos = 0; pos < numel; pos += chunk) {
    const uint64_t nbytes = std::min(chunk, numel - pos) * es;
    const uint64_t at = b.offsets[segment][k] + pos * es;
    if (to_disk) {
      OPTSTATE_RETURN_IF_ERROR(mm_->CopyToHost(h_staging_, d + pos * es, nbytes));
      OPTSTATE_RETURN_IF_ERROR(RwFull(true, b.fd, at, h_staging_, nbytes, b.path));
    } else {
      OPTSTATE_RETURN_IF_ERROR(RwFull(false, b.fd, at, h_staging_, nbytes, b.path));
      OPTSTATE_RETURN_IF_ERROR(mm_->CopyToDevice(d + pos * es, h_staging_, nbytes));
    }
  }
  return Status::Ok();
}

// NVMeOptimizerStateStore.step: per bucket fetch, Adam, copy to the model
// params, flush; nothing synced.
Status MilesStreamingBaseline::Step(const std::vector<const void*>& d_grads, const std::vector<void*>& d_params) {
  if (d_grads.size() != params_.size() || (!d_params.empty() && d_params.size() != params_.size())) {
    return InvalidArgument(fmt::format("miles' streaming: {} gradients and {} param copies for {} params",
                                       d_grads.size(), d_params.size(), params_.size()));
  }
  kernels::AdamParams ap = options_.adam;
  ap.step = step_count_ + 1;
  for (const Bucket& b : buckets_) {
    // _Bucket.fetch: all segments once the moments exist, else main only.
    for (int s = 0; s < (moments_ready_ ? 3 : 1); ++s) {
      for (size_t k = 0; k < b.params.size(); ++k) OPTSTATE_RETURN_IF_ERROR(Transfer(b, s, k, false));
    }
    if (!moments_ready_) {
      // FusedAdam's lazily created state: zeros.
      std::memset(h_staging_, 0, options_.staging_bytes);
      for (int s = 1; s < 3; ++s) {
        const uint64_t bytes = b.numel * SegmentElemBytes(s);
        for (uint64_t pos = 0; pos < bytes; pos += options_.staging_bytes) {
          const uint64_t n = std::min(options_.staging_bytes, bytes - pos);
          OPTSTATE_RETURN_IF_ERROR(mm_->CopyToDevice(static_cast<char*>(d_state_[s].get()) + pos, h_staging_, n));
        }
      }
    }
    // bucket.adam.step() and _copy_main_to_model_params, in one pass.
    for (size_t k = 0; k < b.params.size(); ++k) {
      const size_t p = b.params[k];
      const uint64_t off = b.device_elems[k];
      kernels::AdamTensors t;
      const uint64_t mb = SegmentElemBytes(1);
      t.main = static_cast<float*>(d_state_[0].get()) + off;
      t.exp_avg = static_cast<char*>(d_state_[1].get()) + off * mb;
      t.exp_avg_sq = static_cast<char*>(d_state_[2].get()) + off * mb;
      t.moment_type = options_.moment_type;
      t.grad = d_grads[p];
      t.grad_type = DType::kF32;
      if (!d_params.empty() && d_params[p] != nullptr) {
        t.param = d_params[p];
        t.param_type = DType::kBF16;
      }
      const uint64_t n = params_[p].second;
      if (options_.cuda) {
        int e = kernels::AdamStepCuda(t, n, ap, nullptr);
        if (e != 0) return Internal(fmt::format("miles' streaming: AdamStepCuda on {}: cudaError {}", params_[p].first, e));
      } else if (!kernels::AdamStepCpu(t, n, ap, options_.cpu_threads)) {
        return Internal(fmt::format("miles' streaming: AdamStepCpu refused {}", params_[p].first));
      }
    }
    // _Bucket.flush: every segment, param by param (CopyToHost waits for
    // the kernels on the default stream).
    for (int s = 0; s < 3; ++s) {
      for (size_t k = 0; k < b.params.size(); ++k) OPTSTATE_RETURN_IF_ERROR(Transfer(b, s, k, true));
    }
  }
  moments_ready_ = true;
  ++step_count_;
  return Status::Ok();
}

Status MilesStreamingBaseline::DropPageCache(double* sync_seconds) {
  double t = 0;
  for (const Bucket& b : buckets_) {
    const double t0 = NowSeconds();
    if (::fdatasync(b.fd) != 0) return ErrnoStatus(fmt::format("fdatasync {}", b.path), errno);
    t += NowSeconds() - t0;
    int e = ::posix_fadvise(b.fd, 0, static_cast<off_t>(b.nbytes), POSIX_FADV_DONTNEED);
    if (e != 0) return ErrnoStatus(fmt::format("posix_fadvise(DONTNEED) {}", b.path), e);
  }
  if (sync_seconds != nullptr) *sync_seconds = t;
  return Status::Ok();
}

Result<uint64_t> MilesStreamingBaseline::ResidentBytes() const {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t resident = 0;
  std::vector<unsigned char> vec;
  for (const Bucket& b : buckets_) {
    if (b.nbytes == 0) continue;
    void* m = ::mmap(nullptr, b.nbytes, PROT_READ, MAP_SHARED, b.fd, 0);
    if (m == MAP_FAILED) return ErrnoStatus(fmt::format("mmap {} for mincore", b.path), errno);
    vec.assign((b.nbytes + page - 1) / page, 0);
    int rc = ::mincore(m, b.nbytes, vec.data());
    int err = errno;
    ::munmap(m, b.nbytes);
    if (rc != 0) return ErrnoStatus(fmt::format("mincore {}", b.path), err);
    for (unsigned char v : vec) resident += (v & 1) ? page : 0;
  }
  return std::min(resident, file_bytes());
}

}  // namespace optstate::tools::bench
