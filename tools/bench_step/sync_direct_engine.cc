// The synchronous O_DIRECT engine: private files, one pinned staging buffer,
// sync I/O, fdatasync.
#include "tools/bench_step/sync_direct_engine.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "kernels/adam.h"
#include "tools/bench_step/step.h"

namespace optstate::tools::bench::step {
namespace {

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

Result<std::unique_ptr<SyncDirectEngine>> SyncDirectEngine::Create(
    const std::string& dir, const std::vector<std::pair<std::string, uint64_t>>& params,
    uint64_t chunk, memmgr::MemoryManager* mm, const std::vector<float>& w0) {
  auto fv = std::unique_ptr<SyncDirectEngine>(new SyncDirectEngine);
  fv->mm_ = mm;
  fv->chunk_ = chunk;
  // One pinned buffer (miles' streaming's pin_memory() staging tensor).
  OPTSTATE_ASSIGN_OR_RETURN(fv->h_staging_, mm->AllocPinnedHost(chunk));
  for (int f = 0; f < 3; ++f) {
    OPTSTATE_ASSIGN_OR_RETURN(fv->d_[f], DeviceBuffer::Make(mm, chunk));
  }
  vfs::FileSystem* fsys = vfs::FileSystem::Default();
  OPTSTATE_RETURN_IF_ERROR(fsys->CreateDir(dir));
  for (size_t p = 0; p < params.size(); ++p) {
    Param prm;
    prm.numel = params[p].second;
    for (int f = 0; f < 3; ++f) {
      vfs::OpenOptions oo;
      oo.create = true;
      oo.direct = true;
      std::string path = fmt::format("{}/{}.{}", dir, params[p].first, f);
      OPTSTATE_ASSIGN_OR_RETURN(prm.files[f], fsys->Open(path, oo));
      uint64_t bytes = RoundUp(prm.numel * 4, 4096);
      OPTSTATE_RETURN_IF_ERROR(prm.files[f]->Fallocate(0, bytes));
      // Initial state: main = w0, moments zero; every byte written once.
      for (uint64_t off = 0; off < bytes; off += chunk) {
        uint64_t len = std::min(chunk, bytes - off);
        std::memset(fv->h_staging_, 0, len);
        if (f == 0) {
          uint64_t elems = std::min(len / 4, prm.numel - std::min(prm.numel, off / 4));
          std::memcpy(fv->h_staging_, w0.data(), elems * 4);
        }
        OPTSTATE_RETURN_IF_ERROR(prm.files[f]->Pwrite(off, fv->h_staging_, len));
      }
      OPTSTATE_RETURN_IF_ERROR(prm.files[f]->Fdatasync());
    }
    fv->params_.push_back(std::move(prm));
  }
  return fv;
}

Status SyncDirectEngine::Step(const std::vector<void*>& grads, uint64_t step, bool cuda) {
  kernels::AdamParams ap;
  ap.lr = 1e-3f;
  ap.weight_decay = 0.01f;
  ap.step = step;
  const uint64_t per_chunk = chunk_ / 4;
  for (size_t p = 0; p < params_.size(); ++p) {
    Param& prm = params_[p];
    for (uint64_t c = 0; c * per_chunk < prm.numel; ++c) {
      uint64_t elems = std::min(per_chunk, prm.numel - c * per_chunk);
      uint64_t io_len = RoundUp(elems * 4, 4096);
      for (int f = 0; f < 3; ++f) {
        OPTSTATE_RETURN_IF_ERROR(prm.files[f]->Pread(c * chunk_, h_staging_, io_len));
        OPTSTATE_RETURN_IF_ERROR(mm_->CopyToDevice(d_[f].get(), h_staging_, io_len));
      }
      kernels::AdamTensors t;
      t.main = static_cast<float*>(d_[0].get());
      t.exp_avg = d_[1].get();
      t.exp_avg_sq = d_[2].get();
      t.grad = static_cast<const float*>(grads[p]) + c * per_chunk;
      t.grad_type = DType::kF32;
      if (cuda) {
        int e = kernels::AdamStepCuda(t, elems, ap, nullptr);
        if (e != 0) return Internal(fmt::format("AdamStepCuda failed: cudaError {}", e));
      } else if (!kernels::AdamStepCpu(t, elems, ap, 1)) {
        return Internal("AdamStepCpu refused the tensors");
      }
      for (int f = 0; f < 3; ++f) {
        OPTSTATE_RETURN_IF_ERROR(mm_->CopyToHost(h_staging_, d_[f].get(), io_len));
        OPTSTATE_RETURN_IF_ERROR(prm.files[f]->Pwrite(c * chunk_, h_staging_, io_len));
      }
    }
  }
  for (auto& prm : params_) {
    for (auto& f : prm.files) OPTSTATE_RETURN_IF_ERROR(f->Fdatasync());
  }
  return Status::Ok();
}

}  // namespace optstate::tools::bench::step
