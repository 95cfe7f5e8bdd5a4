// optstate-bench step: a StreamedAdam step vs the I/O floor (fio reading and
// writing the same bytes at once) vs the first version's method as it runs
// (FirstVersionBaseline, tools/bench_first_version.h: buffered I/O, no fsync)
// with its state in the page cache (warm) and evicted before each step
// (cold), and a deterministic synthetic mode that leaves its store behind.
//
// Optionally (--first-version direct) a synchronous O_DIRECT engine: one
// private file per parameter field; per parameter, chunk by chunk, O_DIRECT
// pread of main, exp_avg and exp_avg_sq through one pinned staging buffer,
// each copied to the device; the fused kernel; each field copied back through
// the same buffer and pwritten in place; fdatasync of every file at the end.
// Durable like ours, with no pipelining: what the disk gives a naive engine.
//
// --prefetch T (seconds): a training-loop simulation of ours after each
// round's steps: "forward/backward" is T seconds of sleep on the host (the
// bench's stand-in for GPU work; the optimizer's threads have the CPU), then
// Step(); the exposed step time is from the end of T to Step's return, with
// the previous step's commit (and its write tail) in flight during T. Each
// round times one such step without Prefetch() and one with Prefetch() called
// at the start of T, after an untimed one that puts a commit in flight.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "base/dtype.h"
#include "kernels/adam.h"
#include "memmgr/memory_manager.h"
#include "memmgr/streamed_adam.h"
#include "tools/bench_first_version.h"
#include "tools/internal/bench.h"
#include "vfs/io_buffer.h"
#include "tools/internal/cli.h"
#include "tools/internal/device_buffer.h"
#include "tools/internal/fio.h"
#include "tools/internal/process.h"
#include "vfs/file_system.h"
#include "vfs/store.h"

namespace optstate::tools::bench {

namespace {

namespace fs = std::filesystem;

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
constexpr const char* kTool = "optstate-bench step";

// --moments and --first-version-moments are checked against these names by CLI11.
MomentDType MomentsNamed(const std::string& name) {
  Result<MomentDType> m = ParseMomentDType(name);
  return m.ok() ? *m : MomentDType::kF32;
}

struct StepOptions {
  // synthetic mode
  std::string store;
  uint64_t params = 0;
  uint64_t steps = 1;
  uint32_t tensors = 1;
  std::string snapshot;
  // comparison mode
  std::string dir;
  std::string state_text = "1G";
  uint32_t rounds = 3;
  bool no_fio = false;
  bool no_batch_submit = false;  // MemoryManagerOptions::batch_submit = false
  bool no_first_version = false;
  std::string first_version_text = "warm,cold";  // baselines: warm, cold, direct
  // both
  std::string chunk_text = "8M";
  std::string budget_text = "256M";
  std::string host_cache_text = "0";
  std::string backend = "auto";
  uint32_t queue_depth = 32;
  uint32_t write_queue_depth = 32;
  uint32_t read_ahead = 0;
  uint64_t hidden = 1024;
  uint32_t durable_every = 1;
  uint32_t commit_lag = 1;  // StreamedAdamOptions::commit_lag_steps
  std::string moments = "f32";  // synthetic mode: StreamedAdamOptions::moment_dtype
  bool compare_bf16 = false;    // comparison mode: also a store with bf16 moments, interleaved
  bool compare_q8 = false;      // comparison mode: also a store with q8 moments, interleaved
  std::string first_version_moments = "f32";  // the first version's moment_dtype: f32 or bf16
  int cpu_threads = 1;
  uint32_t hash_threads = memmgr::MemoryManagerOptions::kAutoHashThreads;
  std::string sync_every_text = "512M";
  bool huge_pages = false;
  bool base_pages = false;
  std::string max_sqe_text = "0";
  double prefetch_compute_s = 0;  // --prefetch: simulated forward/backward seconds (0 = off)
  bool json = false;
};


struct Common {
  uint64_t chunk = 0, budget = 0, host_cache = 0, sync_every = 0, max_sqe = 0;
  memmgr::Backend backend = memmgr::Backend::kAuto;
};

Result<Common> ParseCommon(const StepOptions& o) {
  Common c;
  OPTSTATE_ASSIGN_OR_RETURN(c.chunk, ParseBytes(o.chunk_text));
  if (c.chunk == 0 || c.chunk % vfs::kChunkAlignBytes != 0) {
    return InvalidArgument(fmt::format("--chunk-size {} is not a positive multiple of 2 MiB", c.chunk));
  }
  OPTSTATE_ASSIGN_OR_RETURN(c.budget, ParseBytes(o.budget_text));
  OPTSTATE_ASSIGN_OR_RETURN(c.host_cache, ParseBytes(o.host_cache_text));
  OPTSTATE_ASSIGN_OR_RETURN(c.sync_every, ParseBytes(o.sync_every_text));
  OPTSTATE_ASSIGN_OR_RETURN(c.max_sqe, ParseBytes(o.max_sqe_text));
  OPTSTATE_ASSIGN_OR_RETURN(c.backend, memmgr::ParseBackend(o.backend));
  return c;
}

memmgr::MemoryManagerOptions ManagerOptions(const Common& c, const StepOptions& o) {
  memmgr::MemoryManagerOptions mo;
  mo.backend = c.backend;
  mo.device_budget_bytes = c.budget;
  mo.host_cache_bytes = c.host_cache;
  mo.queue_depth = o.queue_depth;
  mo.write_queue_depth = o.write_queue_depth;
  mo.read_ahead_chunks = o.read_ahead;
  mo.staging_pages = o.huge_pages   ? memmgr::MemoryManagerOptions::StagingPages::kHuge
                     : o.base_pages ? memmgr::MemoryManagerOptions::StagingPages::kBase
                                    : memmgr::MemoryManagerOptions::StagingPages::kAuto;
  mo.max_sqe_bytes = c.max_sqe;
  mo.batch_submit = !o.no_batch_submit;
  mo.hash_threads = o.hash_threads;
  return mo;
}

// ---------------------------------------------------------------------------
// Deterministic synthetic mode.

std::vector<uint64_t> SplitSizes(uint64_t n, uint32_t t) {
  std::vector<uint64_t> sizes(t, n / t);
  for (uint32_t k = 0; k < n % t; ++k) ++sizes[k];
  return sizes;
}

// An existing store continues only the run that made it: the same tensors of
// the same sizes. Otherwise the error names the store, each differing tensor
// with both sizes, and the flags that continue the store.
Status CheckStoreMatches(const vfs::Store& store, const StepOptions& o, const std::vector<uint64_t>& sizes) {
  const uint64_t committed = store.LatestGeneration().generation;
  std::map<std::string, uint64_t> stored;
  for (const vfs::TensorInfo& t : store.ListTensors()) {
    if (t.created_generation <= committed) stored[t.name] = t.numel;  // not an uncommitted entry
  }
  if (stored.empty()) return Status::Ok();  // nothing committed yet: the registrations make it
  std::map<std::string, uint64_t> wanted;
  for (uint32_t k = 0; k < sizes.size(); ++k) wanted[fmt::format("param.{}", k)] = sizes[k];
  std::vector<std::string> diffs;
  for (const auto& [name, n] : wanted) {
    auto it = stored.find(name);
    if (it == stored.end()) {
      diffs.push_back(fmt::format("tensor {} ({} elements here) is not in the store", name, n));
    } else if (it->second != n) {
      diffs.push_back(fmt::format("tensor {} has {} elements in the store, {} here", name, it->second, n));
    }
  }
  for (const auto& [name, n] : stored) {
    if (!wanted.count(name)) {
      diffs.push_back(fmt::format("tensor {} ({} elements) is in the store, not in --tensors {}", name, n, o.tensors));
    }
  }
  if (diffs.empty()) return Status::Ok();
  std::string msg = fmt::format("store {} does not match --params {} --tensors {}: ", o.store, o.params, o.tensors);
  for (size_t i = 0; i < diffs.size() && i < 4; ++i) msg += (i ? "; " : "") + diffs[i];
  if (diffs.size() > 4) msg += fmt::format("; and {} more", diffs.size() - 4);
  // The flags of the run that made the store, when it is one of ours.
  uint64_t total = 0;
  bool ours = true;
  std::vector<uint64_t> stored_sizes;
  for (uint32_t k = 0; k < stored.size() && ours; ++k) {
    auto it = stored.find(fmt::format("param.{}", k));
    ours = it != stored.end();
    if (ours) {
      total += it->second;
      stored_sizes.push_back(it->second);
    }
  }
  ours = ours && stored_sizes == SplitSizes(total, static_cast<uint32_t>(stored.size()));
  if (ours) {
    msg += fmt::format(". It holds {} params in {} tensor(s): continue it with --params {} --tensors {}, or use a new "
                       "--store",
                       total, stored.size(), total, stored.size());
  } else {
    msg += ". Use a new --store";
  }
  return InvalidArgument(msg);
}

int RunSynthetic(const StepOptions& o) {
  auto c = ParseCommon(o);
  if (!c.ok()) return FailWith(kTool, c.status());
  if (o.params == 0) return FailWith(kTool, InvalidArgument("--params must be > 0"));
  if (o.tensors == 0 || o.tensors > o.params) {
    return FailWith(kTool, InvalidArgument("--tensors must be in 1..--params"));
  }
  std::unique_ptr<vfs::Store> store;
  bool created = false;
  if (fs::exists(o.store)) {
    auto s = vfs::Store::Open(o.store, vfs::StoreOptions{});
    if (!s.ok()) return FailWith(kTool, s.status());
    store = std::move(*s);
  } else {
    vfs::StoreOptions so;
    so.chunk_size_bytes = c->chunk;
    auto s = vfs::Store::Create(o.store, so);
    if (!s.ok()) return FailWith(kTool, s.status());
    store = std::move(*s);
    created = true;
  }
  auto mm = memmgr::MemoryManager::Create(store.get(), ManagerOptions(*c, o));
  if (!mm.ok()) return FailWith(kTool, mm.status());
  memmgr::StreamedAdamOptions ao;
  ao.cpu_threads = o.cpu_threads;
  ao.background_sync_bytes = c->sync_every;
  ao.moment_dtype = MomentsNamed(o.moments);
  auto opt = memmgr::StreamedAdam::Create(store.get(), mm->get(), ao);
  if (!opt.ok()) return FailWith(kTool, opt.status());
  memmgr::ParamGroup g;
  g.id = 0;
  g.lr = 1e-3;
  g.beta1 = 0.9;
  g.beta2 = 0.999;
  g.eps = 1e-8;
  g.weight_decay = 0.01;
  g.adamw = true;
  if (Status s = (*opt)->SetGroup(g); !s.ok()) return FailWith(kTool, s);
  std::vector<uint64_t> sizes = SplitSizes(o.params, o.tensors);
  if (!created) {
    if (Status s = CheckStoreMatches(*store, o, sizes); !s.ok()) return FailWith(kTool, s);
  }
  std::vector<DeviceBuffer> grads;
  std::vector<float> host;
  for (uint32_t k = 0; k < o.tensors; ++k) {
    std::string name = fmt::format("param.{}", k);
    host.resize(sizes[k]);
    auto d = DeviceBuffer::Make(mm->get(), sizes[k] * 4);
    if (!d.ok()) return FailWith(kTool, d.status());
    // Registered every run: a continued param keeps its stored state (its
    // sizes were checked above, and StreamedAdam checks them again).
    const bool fresh = !(*opt)->HasParam(name);
    if (fresh) {
      for (uint64_t i = 0; i < sizes[k]; ++i) {
        host[i] = static_cast<float>(0.1 * std::cos(0.25 * static_cast<double>(i) + k));
      }
    }
    Status s = fresh ? (*mm)->CopyToDevice(d->get(), host.data(), sizes[k] * 4) : Status::Ok();
    if (s.ok()) s = (*opt)->RegisterParam(name, sizes[k], 0, fresh ? d->get() : nullptr, DType::kF32);
    if (!s.ok()) return FailWith(kTool, s.WithContext(name));
    grads.push_back(std::move(*d));
  }
  const uint64_t t0_count = (*opt)->step_count(0);
  const uint64_t written0 = (*mm)->stats().nvme_write_bytes;
  double t_start = NowSeconds();
  ProgressBar bar("steps", o.steps);
  for (uint64_t s = 1; s <= o.steps; ++s) {
    const uint64_t t = t0_count + s;
    std::vector<memmgr::ParamGrad> pg;
    for (uint32_t k = 0; k < o.tensors; ++k) {
      host.resize(sizes[k]);
      for (uint64_t i = 0; i < sizes[k]; ++i) {
        host[i] = static_cast<float>(0.01 * std::sin(0.5 * static_cast<double>(i) +
                                                     1.3 * static_cast<double>(t) + k));
      }
      if (Status st = (*mm)->CopyToDevice(grads[k].get(), host.data(), sizes[k] * 4); !st.ok()) {
        return FailWith(kTool, st);
      }
      memmgr::ParamGrad p;
      p.name = fmt::format("param.{}", k);
      p.d_grad = grads[k].get();
      p.grad_type = DType::kF32;
      p.numel = sizes[k];
      pg.push_back(p);
    }
    if (Status st = (*opt)->Step(pg); !st.ok()) return FailWith(kTool, st.WithContext(fmt::format("step {}", t)));
    bar.Update(s);
  }
  bar.Finish();
  // The last step's commit may still run (commit_lag_steps 1): part of the run.
  if (auto d = (*opt)->MakeDurable(); !d.ok()) return FailWith(kTool, d.status());
  double secs = NowSeconds() - t_start;
  if (!o.snapshot.empty()) {
    auto sn = store->CreateSnapshot(o.snapshot);
    if (!sn.ok()) return FailWith(kTool, sn.status());
  }
  auto ms = (*mm)->stats();
  // Chunk bytes the steps wrote (the manager's count), per step, and the
  // drive writes per day they make at the measured step time.
  const uint64_t write_bytes_per_step = (ms.nvme_write_bytes - written0) / o.steps;
  const double step_seconds = secs / static_cast<double>(o.steps);
  const double tb_per_day = static_cast<double>(write_bytes_per_step) * 86400.0 / step_seconds / 1e12;
  nlohmann::json out = {{"store", o.store}, {"created", created},
                        {"moments", o.moments},
                        {"write_bytes_per_step", write_bytes_per_step},
                        {"write_bytes_per_param", static_cast<double>(write_bytes_per_step) /
                                                      static_cast<double>(o.params)},
                        {"step_seconds", step_seconds},
                        {"drive_writes_tb_per_day", tb_per_day},
                        {"backend", memmgr::BackendName((*mm)->backend())},
                        {"params", o.params}, {"tensors", o.tensors}, {"steps", o.steps},
                        {"step_count", (*opt)->step_count(0)},
                        {"generation", (*opt)->last_generation()},
                        {"snapshot", o.snapshot}, {"seconds", secs},
                        {"peak_resident_bytes", ms.peak_resident_bytes},
                        {"budget_bytes", ms.budget_bytes}};
  if (o.json) {
    PrintJson(out);
  } else {
    std::cout << fmt::format(
        "{} {} params in {} tensor(s) (param.0..param.{}), {} step(s) on {} in {}; step count {}, "
        "generation {}{}\npeak device memory {} (budget {}); store left at {}\n",
        created ? "created" : "continued", o.params, o.tensors, o.tensors - 1, o.steps,
        memmgr::BackendName((*mm)->backend()), FormatSeconds(secs), (*opt)->step_count(0),
        (*opt)->last_generation(), o.snapshot.empty() ? "" : ", snapshot " + o.snapshot,
        FormatBytes(ms.peak_resident_bytes), FormatBytes(ms.budget_bytes), o.store);
    std::cout << fmt::format("written per step ({} moments): {} of chunks ({:.2f} B/param); at {} a step: "
                             "{:.3f} TB of drive writes per day\n",
                             o.moments, FormatBytes(write_bytes_per_step),
                             static_cast<double>(write_bytes_per_step) / static_cast<double>(o.params),
                             FormatSeconds(step_seconds), tb_per_day);
  }
  return 0;
}

// ---------------------------------------------------------------------------
// Comparison mode.

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// The synchronous O_DIRECT engine: private files, one pinned staging buffer,
// sync I/O, fdatasync.
class SyncDirectEngine {
 public:
  static Result<std::unique_ptr<SyncDirectEngine>> Create(
      const std::string& dir, const std::vector<std::pair<std::string, uint64_t>>& params,
      uint64_t chunk, memmgr::MemoryManager* mm, const std::vector<float>& w0) {
    auto fv = std::unique_ptr<SyncDirectEngine>(new SyncDirectEngine);
    fv->mm_ = mm;
    fv->chunk_ = chunk;
    // One pinned buffer (the first version's pin_memory() staging tensor).
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

  // grads[p]: device pointer of param p's fp32 gradient.
  Status Step(const std::vector<void*>& grads, uint64_t step, bool cuda) {
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

 private:
  struct Param {
    uint64_t numel = 0;
    std::unique_ptr<vfs::File> files[3];
  };
  SyncDirectEngine() = default;

 public:
  ~SyncDirectEngine() {
    if (h_staging_ != nullptr) mm_->FreePinnedHost(h_staging_, chunk_);
  }

 private:
  memmgr::MemoryManager* mm_ = nullptr;
  uint64_t chunk_ = 0;
  void* h_staging_ = nullptr;  // pinned, chunk bytes
  DeviceBuffer d_[3];
  std::vector<Param> params_;
};

// H2D / D2H bandwidth through the manager's copies from pinned host memory
// (the same kind the host cache tier and the staging buffers use).
Status MeasureCopies(memmgr::MemoryManager* mm, double* h2d, double* d2h) {
  const uint64_t bytes = 1ull << 30;
  OPTSTATE_ASSIGN_OR_RETURN(void* h, mm->AllocPinnedHost(bytes));
  struct Free {
    memmgr::MemoryManager* mm;
    void* h;
    uint64_t n;
    ~Free() { mm->FreePinnedHost(h, n); }
  } free_h{mm, h, bytes};
  std::memset(h, 1, bytes);
  OPTSTATE_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::Make(mm, bytes));
  std::vector<double> a, b;
  for (int i = 0; i < 5; ++i) {
    double t0 = NowSeconds();
    OPTSTATE_RETURN_IF_ERROR(mm->CopyToDevice(d.get(), h, bytes));
    double t1 = NowSeconds();
    OPTSTATE_RETURN_IF_ERROR(mm->CopyToHost(h, d.get(), bytes));
    double t2 = NowSeconds();
    a.push_back(static_cast<double>(bytes) / (t1 - t0));
    b.push_back(static_cast<double>(bytes) / (t2 - t1));
  }
  *h2d = Median(a);
  *d2h = Median(b);
  return Status::Ok();
}

int RunCompare(const StepOptions& o) {
  auto c = ParseCommon(o);
  if (!c.ok()) return FailWith(kTool, c.status());
  auto state = ParseBytes(o.state_text);
  if (!state.ok()) return FailWith(kTool, state.status().WithContext("--state"));
  if (*state < 12 * 1024) return FailWith(kTool, InvalidArgument("--state must be >= 12 KiB"));
  if (o.rounds < 1) return FailWith(kTool, InvalidArgument("--rounds must be >= 1"));
  if (!(o.prefetch_compute_s >= 0) || o.prefetch_compute_s > 3600) {
    return FailWith(kTool, InvalidArgument(fmt::format("--prefetch {}: seconds of simulated forward/backward, 0..3600",
                                                       o.prefetch_compute_s)));
  }
  std::string dir = o.dir;
  bool own_dir = dir.empty();
  if (own_dir) {
    auto d = MakeTempDir("optstate-bench-step-", "/tmp");
    if (!d.ok()) return FailWith(kTool, d.status());
    dir = *d;
  } else if (!fs::is_directory(dir)) {
    return FailWith(kTool, NotFound(fmt::format("--dir {} is not a directory", dir)));
  }
  struct Cleanup {
    std::string d;
    bool own;
    ~Cleanup() {
      std::error_code ec;
      if (own) fs::remove_all(d, ec);
      else {
        for (const char* n : {"store", "store.bf16", "store.q8", "first_version", "sync_direct", "floor.read", "floor.write"}) fs::remove_all(d + "/" + n, ec);
      }
    }
  } cleanup{dir, own_dir};

  if (o.hidden < 64) return FailWith(kTool, InvalidArgument("--hidden must be >= 64"));
  // A q8 slice in flight holds 8 chunks of the device budget: four of main
  // (its f32 elements span four chunks of one-byte codes), one of each
  // moment's codes and one of each moment's absmax scales.
  constexpr uint64_t kQ8SliceChunks = 8;
  if (o.compare_q8 && c->budget < kQ8SliceChunks * c->chunk) {
    return FailWith(kTool, InvalidArgument(fmt::format(
                               "--budget {} with --q8-moments: a q8 step needs at least {} chunks of {} = {} of "
                               "device budget (four of main, one of each moment's codes and of each's absmax)",
                               FormatBytes(c->budget), kQ8SliceChunks, FormatBytes(c->chunk),
                               FormatBytes(kQ8SliceChunks * c->chunk))));
  }
  bool fv_warm = false, fv_cold = false, fv_direct = false;
  if (!o.no_first_version) {
    std::string list = o.first_version_text;
    for (size_t at = 0; at <= list.size();) {
      size_t end = std::min(list.find(',', at), list.size());
      const std::string item = list.substr(at, end - at);
      if (item == "warm") fv_warm = true;
      else if (item == "cold") fv_cold = true;
      else if (item == "direct") fv_direct = true;
      else if (item != "none" && !item.empty()) {
        return FailWith(kTool, InvalidArgument(fmt::format(
                                   "--first-version {}: unknown baseline '{}' (warm, cold, direct or none)", list, item)));
      }
      at = end + 1;
    }
  }
  auto params = ParamMix(*state, o.hidden);
  uint64_t numel_total = 0, max_numel = 0;
  for (auto& p : params) {
    numel_total += p.second;
    max_numel = std::max(max_numel, p.second);
  }
  const uint64_t state_bytes = numel_total * 12;

  vfs::StoreOptions so;
  so.chunk_size_bytes = c->chunk;
  auto store = vfs::Store::Create(dir + "/store", so);
  if (!store.ok()) return FailWith(kTool, store.status());
  auto mm = memmgr::MemoryManager::Create(store->get(), ManagerOptions(*c, o));
  if (!mm.ok()) return FailWith(kTool, mm.status());
  const bool cuda = (*mm)->backend() == memmgr::Backend::kCuda;
  memmgr::StreamedAdamOptions ao;
  ao.cpu_threads = o.cpu_threads;
  ao.durable_every_steps = o.durable_every;
  ao.background_sync_bytes = c->sync_every;
  ao.commit_lag_steps = o.commit_lag;
  auto opt = memmgr::StreamedAdam::Create(store->get(), mm->get(), ao);
  if (!opt.ok()) return FailWith(kTool, opt.status());
  memmgr::ParamGroup g;
  g.weight_decay = 0.01;
  if (Status s = (*opt)->SetGroup(g); !s.ok()) return FailWith(kTool, s);

  // Same initial weights and gradients for both methods.
  std::vector<float> w0(max_numel);
  for (uint64_t i = 0; i < max_numel; ++i) w0[i] = static_cast<float>(0.1 * std::cos(0.25 * static_cast<double>(i)));
  std::vector<DeviceBuffer> grads;
  std::vector<void*> grad_ptrs;
  {
    std::vector<float> gh(max_numel);
    for (uint64_t i = 0; i < max_numel; ++i) gh[i] = static_cast<float>(0.01 * std::sin(0.5 * static_cast<double>(i)));
    auto dw = DeviceBuffer::Make(mm->get(), max_numel * 4);
    if (!dw.ok()) return FailWith(kTool, dw.status());
    if (Status s = (*mm)->CopyToDevice(dw->get(), w0.data(), max_numel * 4); !s.ok()) return FailWith(kTool, s);
    for (auto& [name, n] : params) {
      auto d = DeviceBuffer::Make(mm->get(), n * 4);
      if (!d.ok()) return FailWith(kTool, d.status());
      Status s = (*mm)->CopyToDevice(d->get(), gh.data(), n * 4);
      if (s.ok()) s = (*opt)->RegisterParam(name, n, 0, dw->get(), DType::kF32);
      if (!s.ok()) return FailWith(kTool, s.WithContext(name));
      grad_ptrs.push_back(d->get());
      grads.push_back(std::move(*d));
    }
  }
  // The model's bf16 parameters, which both methods update (the first
  // version's _copy_main_to_model_params; ours in the kernel's pass).
  std::vector<DeviceBuffer> model_params;
  std::vector<void*> model_param_ptrs;
  for (auto& [name, n] : params) {
    auto d = DeviceBuffer::Make(mm->get(), n * 2);
    if (!d.ok()) return FailWith(kTool, d.status().WithContext(name));
    model_param_ptrs.push_back(d->get());
    model_params.push_back(std::move(*d));
  }
  std::vector<memmgr::ParamGrad> pg;
  for (size_t p = 0; p < params.size(); ++p) {
    memmgr::ParamGrad x;
    x.name = params[p].first;
    x.d_grad = grad_ptrs[p];
    x.grad_type = DType::kF32;
    x.d_param = model_param_ptrs[p];
    x.param_type = DType::kBF16;
    x.numel = params[p].second;
    pg.push_back(x);
  }
  // Warm-up step: commits the registrations and writes the moments, so every
  // timed step reads and writes all 12 bytes per parameter.
  if (Status s = (*opt)->Step(pg); !s.ok()) return FailWith(kTool, s.WithContext("warm-up step"));

  // --bf16-moments / --q8-moments: the same params, gradients and budget on
  // a store whose moments are bf16 or q8 (its own store and manager), stepped
  // in each round next to ours: what narrower moments save, measured side by
  // side.
  struct MomentStore {
    std::string dtype;  // "bf16" or "q8"
    MomentDType moment_dtype = MomentDType::kF32;
    std::unique_ptr<vfs::Store> store;
    std::unique_ptr<memmgr::MemoryManager> mm;
    std::unique_ptr<memmgr::StreamedAdam> opt;
    std::vector<double> t;       // until its commit is durable
    std::vector<bool> before_ours;  // per round: stepped before ours
    std::vector<memmgr::StreamedAdam::StepStats> stats;
    DiskPhase disk;
    std::vector<uint64_t> written;  // chunk bytes written per step (the manager's count)
  };
  std::vector<MomentStore> extras;
  extras.reserve(2);
  for (const auto& [on, dtype, moment_dtype] :
       {std::tuple<bool, const char*, MomentDType>{o.compare_bf16, "bf16", MomentDType::kBF16},
        {o.compare_q8, "q8", MomentDType::kQ8}}) {
    if (!on) continue;
    extras.emplace_back();
    extras.back().dtype = dtype;
    extras.back().moment_dtype = moment_dtype;
  }
  for (MomentStore& x : extras) {
    const std::string what = x.dtype + " moments";
    auto sx = vfs::Store::Create(dir + "/store." + x.dtype, so);
    if (!sx.ok()) return FailWith(kTool, sx.status());
    x.store = std::move(*sx);
    auto mx = memmgr::MemoryManager::Create(x.store.get(), ManagerOptions(*c, o));
    if (!mx.ok()) return FailWith(kTool, mx.status());
    x.mm = std::move(*mx);
    memmgr::StreamedAdamOptions aox = ao;
    aox.moment_dtype = x.moment_dtype;
    auto ox = memmgr::StreamedAdam::Create(x.store.get(), x.mm.get(), aox);
    if (!ox.ok()) return FailWith(kTool, ox.status().WithContext(what));
    x.opt = std::move(*ox);
    if (Status s = x.opt->SetGroup(g); !s.ok()) return FailWith(kTool, s);
    auto dw = DeviceBuffer::Make(x.mm.get(), max_numel * 4);
    if (!dw.ok()) return FailWith(kTool, dw.status());
    if (Status s = x.mm->CopyToDevice(dw->get(), w0.data(), max_numel * 4); !s.ok()) return FailWith(kTool, s);
    for (auto& [name, n] : params) {
      if (Status s = x.opt->RegisterParam(name, n, 0, dw->get(), DType::kF32); !s.ok()) {
        return FailWith(kTool, s.WithContext(name + " (" + what + ")"));
      }
    }
    if (Status s = x.opt->Step(pg); !s.ok()) return FailWith(kTool, s.WithContext("warm-up step, " + what));
    if (Status s = x.opt->WaitForCommit(); !s.ok()) return FailWith(kTool, s.WithContext(what));
  }
  MomentStore* const bf16 = o.compare_bf16 ? &extras.front() : nullptr;
  MomentStore* const q8 = o.compare_q8 ? &extras.back() : nullptr;
  static const std::vector<double> kNoTimes;
  static const std::vector<uint64_t> kNoBytes;
  static const std::vector<memmgr::StreamedAdam::StepStats> kNoStats;
  const std::vector<double>& t_bf16 = bf16 ? bf16->t : kNoTimes;
  const std::vector<double>& t_q8 = q8 ? q8->t : kNoTimes;

  std::unique_ptr<FirstVersionBaseline> fvb;
  if (fv_warm || fv_cold) {
    FirstVersionOptions fo;
    fo.adam.lr = g.lr;
    fo.adam.beta1 = g.beta1;
    fo.adam.beta2 = g.beta2;
    fo.adam.eps = g.eps;
    fo.adam.weight_decay = g.weight_decay;
    fo.adam.mode = g.adamw ? kernels::AdamMode::kAdamW : kernels::AdamMode::kAdam;
    fo.cuda = cuda;
    fo.cpu_threads = o.cpu_threads;
    fo.moment_type = MomentsNamed(o.first_version_moments);
    auto f = FirstVersionBaseline::Create(dir + "/first_version", params, mm->get(), w0.data(), fo);
    if (!f.ok()) return FailWith(kTool, f.status().WithContext("first-version setup"));
    fvb = std::move(*f);
    // Untimed first step (it reads only the mains; it writes every segment,
    // so the page cache then holds the whole state).
    std::vector<const void*> g_ptrs(grad_ptrs.begin(), grad_ptrs.end());
    if (Status s = fvb->Step(g_ptrs, model_param_ptrs); !s.ok()) {
      return FailWith(kTool, s.WithContext("first version, warm-up step"));
    }
  }
  std::unique_ptr<SyncDirectEngine> fv;
  if (fv_direct) {
    auto f = SyncDirectEngine::Create(dir + "/sync_direct", params, c->chunk, mm->get(), w0);
    if (!f.ok()) return FailWith(kTool, f.status().WithContext("synchronous O_DIRECT engine setup"));
    fv = std::move(*f);
  }
  bool use_fio = !o.no_fio && FioAvailable();
  if (!o.no_fio && !use_fio) Note("fio not found: no I/O floor");

  std::vector<double> t_floor, t_ours, t_fv, t_warm, t_cold;
  std::vector<double> t_ours_returned;  // until Step returned (its commit may still run)
  // The share of the first version's files in the page cache before each
  // warm step and after each eviction; the eviction's fdatasync time.
  std::vector<double> warm_resident, cold_resident, cold_writeback;
  const std::vector<const void*> grad_cptrs(grad_ptrs.begin(), grad_ptrs.end());
  std::vector<std::pair<double, double>> ours_unix;  // each step's start and end, Unix seconds (JSON)
  std::vector<memmgr::StreamedAdam::StepStats> stats;
  // How the disk under --dir was used during the floor and our steps.
  DiskPhase disk_floor, disk_ours;
  // Per timed step: chunk bytes read from the store / served by the host cache tier.
  std::vector<std::pair<uint64_t, uint64_t>> step_io;
  // Per timed step: chunk bytes written to the store (the manager's count).
  std::vector<uint64_t> step_written;
  // --prefetch: exposed step seconds in the loop simulation, without and with
  // Prefetch(), and the bytes each step found prefetched.
  std::vector<double> t_loop_plain, t_loop_prefetch;
  std::vector<uint64_t> loop_prefetch_hits;
  auto loop_step = [&](bool prefetch, std::vector<double>* exposed) -> Status {
    if (prefetch) OPTSTATE_RETURN_IF_ERROR((*opt)->Prefetch());
    std::this_thread::sleep_for(std::chrono::duration<double>(o.prefetch_compute_s));
    const double t0 = NowSeconds();
    OPTSTATE_RETURN_IF_ERROR((*opt)->Step(pg));
    if (exposed != nullptr) exposed->push_back(NowSeconds() - t0);
    if (prefetch) loop_prefetch_hits.push_back((*opt)->last_step_stats().prefetch_hit_bytes);
    return Status::Ok();
  };
  const std::string disk_path = dir + "/store";
  auto step_extra = [&](MomentStore& x, uint32_t r, bool before_ours) -> Status {
    const uint64_t w0_x = x.mm->stats().nvme_write_bytes;
    const DiskCounters before = ReadDiskCounters(disk_path);
    const double t0 = NowSeconds();
    Status s = x.opt->Step(pg);
    if (s.ok()) s = x.opt->WaitForCommit();
    if (!s.ok()) return s.WithContext(fmt::format("{} moments, round {}", x.dtype, r + 1));
    x.t.push_back(NowSeconds() - t0);
    x.before_ours.push_back(before_ours);
    x.disk.Add(before, ReadDiskCounters(disk_path), x.t.back());
    x.written.push_back(x.mm->stats().nvme_write_bytes - w0_x);
    x.stats.push_back(x.opt->last_step_stats());
    return Status::Ok();
  };
  // Round r steps the stores in the order (f32, extras...) rotated left by r,
  // so that each follows each other's writes (an SSD's write cache and
  // garbage collection slow the later writer) equally often. With one extra
  // store it runs after ours in even rounds and before it in odd ones.
  const size_t n_stores = 1 + extras.size();
  std::vector<std::vector<std::string>> step_order;  // per round, JSON
  auto json_name = [](const std::string& dtype) { return "ours_" + dtype + "_moments"; };
  ProgressBar bar("step rounds", o.rounds);
  for (uint32_t r = 0; r < o.rounds; ++r) {
    if (use_fio) {
      // The floor: read state_bytes and write state_bytes at the same time.
      FioJob rd;
      rd.name = "read";
      rd.filename = dir + "/floor.read";
      rd.rw = "read";
      rd.block_size_bytes = c->chunk;
      rd.iodepth = o.queue_depth;
      rd.size_bytes = state_bytes / c->chunk * c->chunk;
      FioJob wr = rd;
      wr.name = "write";
      wr.filename = dir + "/floor.write";
      wr.rw = "write";
      wr.end_fsync = true;
      DiskCounters before = ReadDiskCounters(disk_path);
      auto f = RunFio({rd, wr});
      if (!f.ok()) return FailWith(kTool, f.status().WithContext("fio floor"));
      double t = 0;
      for (auto& j : f->jobs) t = std::max(t, j.runtime_seconds);
      disk_floor.Add(before, ReadDiskCounters(disk_path), t);
      t_floor.push_back(t * static_cast<double>(state_bytes) / static_cast<double>(rd.size_bytes));
    }
    // The moment-dtype stores of this round before ours, then those after it
    // (indices into extras, in their order within the round).
    std::vector<size_t> extras_before, extras_after;
    {
      std::vector<std::string> names;
      bool seen_ours = false;
      for (size_t k = 0; k < n_stores; ++k) {
        const size_t i = (k + r) % n_stores;
        if (i == 0) {
          seen_ours = true;
          names.push_back("ours");
          continue;
        }
        (seen_ours ? extras_after : extras_before).push_back(i - 1);
        names.push_back(json_name(extras[i - 1].dtype));
      }
      step_order.push_back(std::move(names));
    }
    for (size_t i : extras_before) {
      if (Status s = step_extra(extras[i], r, true); !s.ok()) return FailWith(kTool, s);
    }
    DiskCounters before = ReadDiskCounters(disk_path);
    const memmgr::MemoryStats ms0 = (*mm)->stats();
    double t0 = NowSeconds();
    const double unix0 = UnixSeconds();
    if (Status s = (*opt)->Step(pg); !s.ok()) return FailWith(kTool, s.WithContext(fmt::format("round {}", r + 1)));
    t_ours_returned.push_back(NowSeconds() - t0);
    // --commit-lag 1: Step returned with its commit in flight. "ours" is the
    // step with its commit, as before (what a trainer with no forward/backward
    // to hide the commit behind sees); the wait also keeps our writes out of
    // the next method's time.
    if (Status s = (*opt)->WaitForCommit(); !s.ok()) return FailWith(kTool, s.WithContext("commit"));
    t_ours.push_back(NowSeconds() - t0);
    ours_unix.push_back({unix0, UnixSeconds()});
    disk_ours.Add(before, ReadDiskCounters(disk_path), t_ours.back());
    stats.push_back((*opt)->last_step_stats());
    const memmgr::MemoryStats ms1 = (*mm)->stats();
    step_io.push_back({ms1.nvme_read_bytes - ms0.nvme_read_bytes, ms1.cache_hit_bytes - ms0.cache_hit_bytes});
    step_written.push_back(ms1.nvme_write_bytes - ms0.nvme_write_bytes);
    if (fvb && fv_warm) {
      auto res = fvb->ResidentBytes();
      if (!res.ok()) return FailWith(kTool, res.status());
      warm_resident.push_back(static_cast<double>(*res) / static_cast<double>(fvb->file_bytes()));
      if (warm_resident.back() < 0.9) {
        Note(fmt::format("first version, warm: only {:.0f}% of its {} of files is in the page cache (RAM too small "
                         "for the state?)",
                         100 * warm_resident.back(), FormatBytes(fvb->file_bytes())));
      }
      t0 = NowSeconds();
      if (Status s = fvb->Step(grad_cptrs, model_param_ptrs); !s.ok()) {
        return FailWith(kTool, s.WithContext("first version, warm"));
      }
      t_warm.push_back(NowSeconds() - t0);
    }
    if (fvb && fv_cold) {
      double sync_s = 0;
      if (Status s = fvb->DropPageCache(&sync_s); !s.ok()) return FailWith(kTool, s.WithContext("first version, cold"));
      cold_writeback.push_back(sync_s);
      auto res = fvb->ResidentBytes();
      if (!res.ok()) return FailWith(kTool, res.status());
      cold_resident.push_back(static_cast<double>(*res) / static_cast<double>(fvb->file_bytes()));
      if (cold_resident.back() > 0.01) {
        Note(fmt::format("first version, cold: {:.1f}% of its files stayed in the page cache after "
                         "fdatasync + POSIX_FADV_DONTNEED (a tmpfs --dir?); the cold step is partly warm",
                         100 * cold_resident.back()));
      }
      t0 = NowSeconds();
      if (Status s = fvb->Step(grad_cptrs, model_param_ptrs); !s.ok()) {
        return FailWith(kTool, s.WithContext("first version, cold"));
      }
      t_cold.push_back(NowSeconds() - t0);
    }
    for (size_t i : extras_after) {
      if (Status s = step_extra(extras[i], r, false); !s.ok()) return FailWith(kTool, s);
    }
    if (fv) {
      t0 = NowSeconds();
      if (Status s = fv->Step(grad_ptrs, r + 1, cuda); !s.ok()) {
        return FailWith(kTool, s.WithContext("synchronous O_DIRECT engine"));
      }
      t_fv.push_back(NowSeconds() - t0);
    }
    if (o.prefetch_compute_s > 0) {
      Status s = loop_step(false, nullptr);
      if (s.ok()) s = loop_step(false, &t_loop_plain);
      if (s.ok()) s = loop_step(true, &t_loop_prefetch);
      if (s.ok()) s = (*opt)->WaitForCommit();  // keeps our writes out of the next round's methods
      if (!s.ok()) return FailWith(kTool, s.WithContext(fmt::format("loop simulation, round {}", r + 1)));
    }
    bar.Update(r + 1);
  }
  bar.Finish();
  // Steps held only in the host cache (--durable-every > 1): the time to make
  // them durable, reported on its own.
  double t_durable = NAN;
  const uint64_t cached_steps = (*opt)->uncommitted_steps();
  if (cached_steps > 0) {
    double t0 = NowSeconds();
    auto g = (*opt)->MakeDurable();
    if (!g.ok()) return FailWith(kTool, g.status().WithContext("MakeDurable"));
    t_durable = NowSeconds() - t0;
  }
  double h2d = NAN, d2h = NAN;
  if (Status s = MeasureCopies(mm->get(), &h2d, &d2h); !s.ok()) Note("copy bandwidth: " + s.ToString());
  auto ratio = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> r;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) r.push_back(a[i] / b[i]);
    return Median(r);
  };
  // Same-round extra / f32 ratios of the rounds in which the extra store
  // stepped before (or after) ours.
  auto order_ratios = [&](const MomentStore& x, bool before_ours) {
    std::string out;
    for (size_t i = 0; i < x.t.size() && i < t_ours.size(); ++i) {
      if (x.before_ours[i] != before_ours) continue;
      out += fmt::format("{}{:.3f}", out.empty() ? "" : " ", x.t[i] / t_ours[i]);
    }
    return out;
  };
  // Bytes a step moves each way per parameter: main 4 + two moments.
  const double q8_bytes_per_param = 4.0 + 2.0 * (1.0 + 4.0 / static_cast<double>(vfs::kQ8BlockElems));
  auto ms = (*mm)->stats();
  double copy_floor = std::max(static_cast<double>(state_bytes) / h2d, static_cast<double>(state_bytes) / d2h);
  nlohmann::json out;
  out["machine"] = MachineInfo();
  out["backend"] = memmgr::BackendName((*mm)->backend());
  out["state_bytes"] = state_bytes;
  out["params"] = numel_total;
  out["tensors"] = params.size();
  out["chunk_bytes"] = c->chunk;
  out["budget_bytes"] = c->budget;
  out["host_cache_bytes"] = c->host_cache;
  out["rounds"] = o.rounds;
  // Baselines by key; "names" says what each is.
  out["seconds"] = {{"ours", t_ours},
                    {"fio_floor", t_floor},
                    {"first_version_warm", t_warm},
                    {"first_version_cold", t_cold},
                    {"sync_direct_engine", t_fv},
                    {"ours_bf16_moments", t_bf16},
                    {"ours_q8_moments", t_q8}};
  out["names"] = {{"ours", "StreamedAdam step (ours), O_DIRECT, until its commit is durable"},
                  {"fio_floor", "I/O floor (fio read+write)"},
                  {"first_version_warm", "first version, buffered, page cache warm"},
                  {"first_version_cold", "first version, buffered, page cache cold"},
                  {"sync_direct_engine", "synchronous O_DIRECT engine"},
                  {"ours_bf16_moments", "StreamedAdam step (ours) on a store with bf16 moments (8 B/param)"},
                  {"ours_q8_moments", fmt::format("StreamedAdam step (ours) on a store with q8 moments ({:.2f} B/param)",
                                                  q8_bytes_per_param)}};
  if (!t_bf16.empty()) out["bf16_moments_over_f32"] = ratio(t_bf16, t_ours);
  if (!t_q8.empty()) out["q8_moments_over_f32"] = ratio(t_q8, t_ours);
  out["first_version_moments"] = o.first_version_moments;
  if (!t_bf16.empty() && o.first_version_moments == "bf16") {
    out["bf16_moments_over_first_version"] = {{"warm", ratio(t_bf16, t_warm)}, {"cold", ratio(t_bf16, t_cold)}};
  }
  out["bf16_moments_step_first_in"] =
      n_stores == 3 ? "rounds 2, 5, 8, ... (1-based); after ours in the others (see step_order)"
                    : "odd rounds (1-based: 2, 4, ...); after ours in the others";
  out["step_order"] = step_order;  // per round: the stores in the order they stepped
  out["commit_lag_steps"] = o.commit_lag;
  out["ours_step_returned_seconds"] = t_ours_returned;
  out["median_ours_step_returned_seconds"] = Median(t_ours_returned);
  out["ours_unix_seconds"] = ours_unix;  // [start, end] per round, to match against a disk trace
  out["batch_submit"] = !o.no_batch_submit;
  const std::string& pages = (*mm)->staging_pages();
  out["staging_pages"] = pages;
  out["median_seconds"] = {{"ours", Median(t_ours)},
                           {"fio_floor", Median(t_floor)},
                           {"first_version_warm", Median(t_warm)},
                           {"first_version_cold", Median(t_cold)},
                           {"sync_direct_engine", Median(t_fv)}};
  out["ours_over_floor"] = ratio(t_ours, t_floor);
  // ours / each baseline: the median over rounds of the same-round ratios.
  out["ours_over"] = {{"fio_floor", ratio(t_ours, t_floor)},
                      {"first_version_warm", ratio(t_ours, t_warm)},
                      {"first_version_cold", ratio(t_ours, t_cold)},
                      {"sync_direct_engine", ratio(t_ours, t_fv)}};
  if (fvb) {
    out["first_version"] = {{"buckets", fvb->buckets().size()},
                            {"bucket_numel_limit", fvb->options().bucket_numel_limit},
                            {"staging_bytes", fvb->options().staging_bytes},
                            {"file_bytes", fvb->file_bytes()},
                            {"warm_resident_fraction", warm_resident},
                            {"cold_resident_fraction_after_drop", cold_resident},
                            {"cold_writeback_seconds", cold_writeback}};
  }
  out["h2d_bytes_per_second"] = h2d;
  out["d2h_bytes_per_second"] = d2h;
  out["ours_over_copy_floor"] = Median(t_ours) / copy_floor;
  out["durable_every_steps"] = o.durable_every;
  out["cached_steps_at_end"] = cached_steps;
  out["make_durable_seconds"] = t_durable;
  out["peak_resident_bytes"] = ms.peak_resident_bytes;
  out["io_wait_seconds"] = stats.empty() ? 0.0 : stats.back().io_wait_seconds;
  // Where each timed step spent its time (StreamedAdam::StepStats).
  auto step_json = [](const memmgr::StreamedAdam::StepStats& st) -> nlohmann::json {
    return {{"seconds", st.seconds},
            {"read_bytes", st.read_bytes},
            {"write_bytes", st.write_bytes},
            {"io_wait", st.io_wait_seconds},
            {"submit", st.submit_seconds},
            {"compute", st.compute_seconds},
            {"commit", st.commit_seconds},
            {"slices", st.slices},
            {"slices_in_flight", st.slices_in_flight},
            {"small_sets", st.small_sets},
            {"small_slices", st.small_slices},
            {"peak_read_bytes_in_flight", st.peak_read_bytes_in_flight},
            {"peak_write_bytes_in_flight", st.peak_write_bytes_in_flight},
            {"device_slots", st.device_slots}};
  };
  for (const char* dtype : {"bf16", "q8"}) {
    nlohmann::json breakdown_x = nlohmann::json::array();
    for (const MomentStore& x : extras) {
      if (x.dtype != dtype) continue;
      for (const auto& st : x.stats) breakdown_x.push_back(step_json(st));
    }
    out[fmt::format("step_stats_{}_moments", dtype)] = breakdown_x;
  }
  nlohmann::json breakdown = nlohmann::json::array();
  for (size_t i = 0; i < stats.size(); ++i) {
    const auto& st = stats[i];
    breakdown.push_back({{"seconds", st.seconds},
                         {"store_read_bytes", step_io[i].first},
                         {"cache_hit_bytes", step_io[i].second},
                         {"write_bytes", st.write_bytes},
                         {"io_wait", st.io_wait_seconds},
                         {"submit", st.submit_seconds},
                         {"compute", st.compute_seconds},
                         {"commit", st.commit_seconds},
                         {"slices_in_flight", st.slices_in_flight},
                         {"small_sets", st.small_sets},
                         {"small_slices", st.small_slices},
                         {"peak_read_bytes_in_flight", st.peak_read_bytes_in_flight},
                         {"peak_write_bytes_in_flight", st.peak_write_bytes_in_flight},
                         {"device_slots", st.device_slots}});
  }
  out["step_stats"] = breakdown;
  if (o.prefetch_compute_s > 0) {
    out["loop"] = {{"compute_seconds", o.prefetch_compute_s},
                   {"exposed_seconds", {{"without_prefetch", t_loop_plain}, {"with_prefetch", t_loop_prefetch}}},
                   {"median_exposed_seconds",
                    {{"without_prefetch", Median(t_loop_plain)}, {"with_prefetch", Median(t_loop_prefetch)}}},
                   {"with_over_without", ratio(t_loop_prefetch, t_loop_plain)},
                   {"prefetch_hit_bytes", loop_prefetch_hits}};
  }
  out["disk"] = {{"ours", disk_ours.Describe()}, {"fio_floor", disk_floor.Describe()},
                 {"ours_bf16_moments", bf16 ? bf16->disk.Describe() : DiskPhase().Describe()},
                 {"ours_q8_moments", q8 ? q8->disk.Describe() : DiskPhase().Describe()}};
  // Endurance: chunk bytes written per step (the manager's count) and the
  // drive writes per day at the measured median step time.
  auto tb_per_day = [](const std::vector<uint64_t>& written, const std::vector<double>& secs) {
    if (written.empty() || secs.empty()) return 0.0;
    std::vector<double> w(written.begin(), written.end());
    return Median(w) * 86400.0 / Median(secs) / 1e12;
  };
  const std::vector<uint64_t>& step_written_bf16 = bf16 ? bf16->written : kNoBytes;
  const std::vector<uint64_t>& step_written_q8 = q8 ? q8->written : kNoBytes;
  out["write_bytes_per_step"] = {{"ours", step_written},
                                 {"ours_bf16_moments", step_written_bf16},
                                 {"ours_q8_moments", step_written_q8}};
  out["drive_writes_tb_per_day"] = {{"ours", tb_per_day(step_written, t_ours)},
                                    {"ours_bf16_moments", tb_per_day(step_written_bf16, t_bf16)},
                                    {"ours_q8_moments", tb_per_day(step_written_q8, t_q8)}};
  if (o.json) {
    PrintJson(out);
    return 0;
  }
  std::cout << fmt::format(
      "optstate-bench step: {} of state ({} params in {} tensors), chunk {}, budget {}, host cache "
      "{}, backend {}, {} interleaved rounds (floor, ours, baselines); ours: O_DIRECT, commit "
      "(fdatasync) included\nstaging pages: {}\nmachine: {}\n\n",
      FormatBytes(state_bytes), numel_total, params.size(), FormatBytes(c->chunk),
      FormatBytes(c->budget), FormatBytes(c->host_cache), memmgr::BackendName((*mm)->backend()),
      o.rounds, pages, MachineLine());
  Table t({"method", "median step", "state GB/s each way", "ours / this"}, {false, true, true, true});
  auto row = [&](const std::string& n, const std::vector<double>& v, double r) {
    if (v.empty()) return;
    double m = Median(v);
    t.AddRow({n, FormatSeconds(m), FormatRate(static_cast<double>(state_bytes) / m),
              std::isnan(r) ? "-" : fmt::format("{:.2f}x", r)});
  };
  row("StreamedAdam step (ours)", t_ours, 1.0);
  row("I/O floor (fio read+write)", t_floor, ratio(t_ours, t_floor));
  const std::string fv_moments = o.first_version_moments == "bf16" ? " (bf16 moments)" : "";
  row("first version, buffered, page cache warm" + fv_moments, t_warm, ratio(t_ours, t_warm));
  row("first version, buffered, page cache cold" + fv_moments, t_cold, ratio(t_ours, t_cold));
  row("synchronous O_DIRECT engine", t_fv, ratio(t_ours, t_fv));
  row("StreamedAdam step (ours), bf16 moments", t_bf16, ratio(t_ours, t_bf16));
  row("StreamedAdam step (ours), q8 moments", t_q8, ratio(t_ours, t_q8));
  std::cout << t.Render();
  // With one extra store the orders are the round's parity; with two, the
  // rounds of each order are in step_order.
  const bool parity_orders = n_stores == 2;
  if (!t_bf16.empty()) {
    std::cout << fmt::format(
        "bf16 moments / f32 moments (same rounds): {:.2f}x (bytes moved: 8/12 = 0.67x); bf16 after f32{} [{}], "
        "before it{} [{}]\n",
        ratio(t_bf16, t_ours), parity_orders ? " (even rounds)" : "", order_ratios(*bf16, false),
        parity_orders ? " (odd rounds)" : "", order_ratios(*bf16, true));
    if (o.first_version_moments == "bf16" && (!t_warm.empty() || !t_cold.empty())) {
      std::cout << fmt::format("ours, bf16 moments / first version, bf16 moments (same rounds): warm {:.2f}x, cold "
                               "{:.2f}x\n",
                               ratio(t_bf16, t_warm), ratio(t_bf16, t_cold));
    }
  }
  if (!t_q8.empty()) {
    std::cout << fmt::format(
        "q8 moments / f32 moments (same rounds): {:.2f}x (bytes moved: {:.2f}/12 = {:.2f}x); q8 after f32{} [{}], "
        "before it{} [{}]\n",
        ratio(t_q8, t_ours), q8_bytes_per_param, q8_bytes_per_param / 12.0, parity_orders ? " (even rounds)" : "",
        order_ratios(*q8, false), parity_orders ? " (odd rounds)" : "", order_ratios(*q8, true));
  }
  auto list = [](const std::vector<double>& v) {
    std::string out;
    for (double x : v) out += fmt::format("{}{:.3f}", out.empty() ? "" : " ", x);
    return out.empty() ? std::string("-") : out;
  };
  std::cout << fmt::format("per round (s): ours [{}]  floor [{}]  first version warm [{}]  cold [{}]{}{}{}\n",
                           list(t_ours), list(t_floor), list(t_warm), list(t_cold),
                           t_fv.empty() ? "" : "  sync O_DIRECT engine [" + list(t_fv) + "]",
                           t_bf16.empty() ? "" : "  bf16 moments [" + list(t_bf16) + "]",
                           t_q8.empty() ? "" : "  q8 moments [" + list(t_q8) + "]");
  if (fvb) {
    std::cout << fmt::format(
        "first version: {} bucket(s) of <= {} elements, {} of files, {} staging buffer; page cache held {} of "
        "them before the warm steps, {} after each eviction (fdatasync of the previous step's writes: [{}] s, "
        "untimed)\n",
        fvb->buckets().size(), fvb->options().bucket_numel_limit, FormatBytes(fvb->file_bytes()),
        FormatBytes(fvb->options().staging_bytes),
        warm_resident.empty() ? "-" : fmt::format("{:.0f}%", 100 * Median(warm_resident)),
        cold_resident.empty() ? "-" : fmt::format("{:.1f}%", 100 * Median(cold_resident)), list(cold_writeback));
  }
  std::cout << fmt::format(
      "\nours / floor: {:.2f}x (target <= 1.10)   ours / first version warm: {:.2f}x, cold: {:.2f}x\n"
      "H2D {} D2H {} (1 GiB, pinned); ours / copy floor: {:.2f}x\npeak device memory {} "
      "(budget {})\n",
      ratio(t_ours, t_floor), ratio(t_ours, t_warm), ratio(t_ours, t_cold), FormatRate(h2d), FormatRate(d2h),
      Median(t_ours) / copy_floor, FormatBytes(ms.peak_resident_bytes), FormatBytes(c->budget));
  if (o.commit_lag > 0) {
    std::cout << fmt::format("commit lag {}: Step() returned after {} (median), its commit done after {}\n",
                             o.commit_lag, FormatSeconds(Median(t_ours_returned)), FormatSeconds(Median(t_ours)));
  }
  if (cached_steps > 0) {
    std::cout << fmt::format(
        "durable every {} steps: the timed steps stayed in the host cache (no disk I/O); MakeDurable of "
        "{} cached step(s) (writes the state, commits): {}\n",
        o.durable_every, cached_steps, FormatSeconds(t_durable));
  }
  for (const auto& [name, all] : {std::pair<const char*, const std::vector<memmgr::StreamedAdam::StepStats>*>{
                                       "last step", &stats},
                                   {"last step, bf16 moments", bf16 ? &bf16->stats : &kNoStats},
                                   {"last step, q8 moments", q8 ? &q8->stats : &kNoStats}}) {
    if (all->empty()) continue;
    const auto& st = all->back();
    std::cout << fmt::format(
        "{}: {:.3f} s; io wait {:.3f} s, submit {:.3f} s, compute {:.3f} s, commit {:.3f} s; "
        "{} + {} small staging sets ({} small slices), at most {} read / {} written in flight, {} device slots\n",
        name, st.seconds, st.io_wait_seconds, st.submit_seconds, st.compute_seconds, st.commit_seconds,
        st.slices_in_flight, st.small_sets, st.small_slices, FormatBytes(st.peak_read_bytes_in_flight),
        FormatBytes(st.peak_write_bytes_in_flight), st.device_slots);
  }
  std::string reads, hits;
  for (const auto& [rd, hit] : step_io) {
    reads += (reads.empty() ? "" : " ") + FormatBytes(rd);
    hits += (hits.empty() ? "" : " ") + FormatBytes(hit);
  }
  std::cout << fmt::format("per step: read from the store [{}]  served by the host cache [{}]\n", reads, hits);
  for (const auto& [name, written, secs] :
       {std::tuple<const char*, const std::vector<uint64_t>*, const std::vector<double>*>{"f32 moments", &step_written, &t_ours},
        {"bf16 moments", &step_written_bf16, &t_bf16},
        {"q8 moments", &step_written_q8, &t_q8}}) {
    if (written->empty()) continue;
    std::vector<double> w(written->begin(), written->end());
    std::cout << fmt::format(
        "written per step, {}: {} of chunks ({:.2f} B/param); at the median step time {}: {:.3f} TB of drive "
        "writes per day\n",
        name, FormatBytes(static_cast<uint64_t>(Median(w))), Median(w) / static_cast<double>(numel_total),
        FormatSeconds(Median(*secs)), tb_per_day(*written, *secs));
  }
  if (o.prefetch_compute_s > 0) {
    std::string found;
    for (uint64_t b : loop_prefetch_hits) found += (found.empty() ? "" : " ") + FormatBytes(b);
    std::cout << fmt::format(
        "loop, forward/backward {} then Step (commit of the previous step in flight): exposed step {} without "
        "Prefetch, {} with ({:.2f}x); the step found prefetched [{}]; per round without [{}] with [{}]\n",
        FormatSeconds(o.prefetch_compute_s), FormatSeconds(Median(t_loop_plain)),
        FormatSeconds(Median(t_loop_prefetch)), ratio(t_loop_prefetch, t_loop_plain), found, list(t_loop_plain),
        list(t_loop_prefetch));
  }
  const DiskPhase no_disk;
  for (const auto& [name, d] : {std::pair<const char*, const DiskPhase*>{"ours", &disk_ours},
                                {"bf16", bf16 ? &bf16->disk : &no_disk},
                                {"q8", q8 ? &q8->disk : &no_disk},
                                {"floor", &disk_floor}}) {
    std::string u = d->Describe();
    if (!u.empty()) std::cout << fmt::format("{:<6}{}\n", name, u);
  }
  return 0;
}

}  // namespace

void AddStepCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<StepOptions>();
  CLI::App* sub = app.add_subcommand(
      "step", "StreamedAdam step vs the I/O floor (fio) vs the first version's method; or, with "
              "--store, a deterministic synthetic run that leaves its store behind");
  sub->add_option("--store", o->store, "synthetic mode: store directory (created if missing)");
  sub->add_option("--params", o->params, "synthetic mode: total parameters N");
  sub->add_option("--steps", o->steps, "synthetic mode: steps K (default 1)");
  sub->add_option("--tensors", o->tensors, "synthetic mode: tensors T named param.<k> (default 1)");
  sub->add_option("--snapshot", o->snapshot, "synthetic mode: snapshot name to create at the end");
  sub->add_flag("--bf16-moments", o->compare_bf16,
                "comparison mode: also time a store with bf16 moments (same params, gradients, budget; its own "
                "store and manager), interleaved, and report bf16 / f32");
  sub->add_flag("--q8-moments", o->compare_q8,
                "comparison mode: also time a store with q8 moments (same params, gradients, budget; its own "
                "store and manager; the budget must hold 8 chunks), interleaved, and report q8 / f32; with "
                "--bf16-moments too, the three stores step in an order that rotates each round");
  sub->add_option("--moments", o->moments,
                  "synthetic mode: moment dtype, f32, bf16 or q8 (an existing store must hold it; default f32)")
      ->check(CLI::IsMember({"f32", "bf16", "q8"}));
  sub->add_option("--dir", o->dir, "comparison mode: scratch directory (default: new dir in /tmp)");
  sub->add_option("--state", o->state_text, "comparison mode: state bytes, 12 B/param (default 1G)");
  sub->add_option("--rounds", o->rounds, "comparison mode: interleaved rounds (default 3)");
  sub->add_flag("--no-fio", o->no_fio, "skip the fio floor");
  sub->add_flag("--no-first-version", o->no_first_version, "skip every baseline but the floor (--first-version none)");
  sub->add_option("--first-version", o->first_version_text,
                  "baselines, comma-separated: warm (the first version, state in the page cache), cold (its "
                  "files evicted before each step), direct (a synchronous O_DIRECT engine), none "
                  "(default warm,cold)");
  sub->add_option("--first-version-moments", o->first_version_moments,
                  "comparison mode: the first version's moment dtype (its moment_dtype), f32 or bf16 (default "
                  "f32); with --bf16-moments the bf16 step is also compared with it")
      ->check(CLI::IsMember({"f32", "bf16"}));
  sub->add_option("--chunk-size", o->chunk_text, "chunk size, multiple of 2M (default 8M)");
  sub->add_option("--budget", o->budget_text, "device budget (default 256M)");
  sub->add_option("--host-cache-bytes", o->host_cache_text, "pinned host cache tier (default 0)");
  sub->add_option("--backend", o->backend, "auto, host or cuda (default auto)");
  sub->add_option("--qd", o->queue_depth, "reads in flight; also each fio floor job's depth (default 32)");
  sub->add_option("--write-qd", o->write_queue_depth,
                  "StreamedAdam writes in flight on top of --qd reads; 0 = share --qd (default 32)");
  sub->add_option("--read-ahead", o->read_ahead, "slices staged at once; 0 = auto (default 0)");
  sub->add_option("--durable-every", o->durable_every,
                  "commit every N-th step when --host-cache-bytes holds the whole state (default 1)");
  sub->add_option("--hidden", o->hidden,
                  "comparison mode: hidden size h of the parameter mix (default 1024)");
  sub->add_option("--sync-every", o->sync_every_text,
                  "StreamedAdam: background fdatasync every N bytes written during a step; 0 = only at "
                  "commit (default 512M)");
  sub->add_flag("--huge-pages", o->huge_pages,
               "pinned staging in 2 MiB huge pages (MemoryManagerOptions::staging_pages kHuge; also the "
               "first version's staging buffer); default: as the disk under --dir suggests (kAuto)");
  sub->add_flag("--base-pages", o->base_pages, "pinned staging in base pages (staging_pages kBase)");
  sub->add_flag("--no-batch-submit", o->no_batch_submit,
                "StreamedAdam's chunk I/O to the kernel one request at a time "
                "(MemoryManagerOptions::batch_submit = false)");
  sub->add_option("--max-sqe", o->max_sqe_text,
                  "chunk I/O as parallel SQEs of at most N bytes (MemoryManagerOptions::max_sqe_bytes); "
                  "0 = one per chunk (default 0)");
  sub->add_option("--hash-threads", o->hash_threads,
                  "threads hashing chunks besides the pipeline's (MemoryManagerOptions::hash_threads); "
                  "default: 4 with 8 or more cores, else 0");
  sub->add_option("--commit-lag", o->commit_lag,
                  "steps whose commit may run after Step returns: 0 or 1 (default 1); ours is timed until its "
                  "commit is done, and to Step's return on its own");
  sub->add_option("--cpu-threads", o->cpu_threads, "CPU Adam threads on the host backend (default 1)");
  sub->add_option("--prefetch", o->prefetch_compute_s,
                  "comparison mode: also time a training loop whose forward/backward takes this many seconds "
                  "(simulated), exposed step without and with Prefetch() (default 0: off)");
  sub->add_flag("--json", o->json, "print JSON");
  sub->callback([o, exit_code] {
    *exit_code = o->store.empty() ? RunCompare(*o) : RunSynthetic(*o);
  });
}

}  // namespace optstate::tools::bench
