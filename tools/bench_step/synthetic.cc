// optstate-bench step --store: a deterministic synthetic run (initial weights
// and gradients from closed formulas) that creates or continues a store and
// leaves it behind, for tests and tools to read.
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "memmgr/streamed_adam.h"
#include "tools/bench_step/step.h"
#include "tools/internal/cli.h"
#include "tools/internal/device_buffer.h"
#include "tools/internal/store_read.h"
#include "vfs/store.h"

namespace optstate::tools::bench::step {
namespace {

namespace fs = std::filesystem;

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

}  // namespace

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
  auto moment_dtype = MomentsNamed("--moments", o.moments);
  if (!moment_dtype.ok()) return FailWith(kTool, moment_dtype.status());
  ao.moment_dtype = *moment_dtype;
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
  // Apart: the disk space a step's chunks take as the store allocates them.
  const FullWrite write = WriteOfEveryChunk(store->ListTensors(), store->identity().chunk_size_bytes);
  nlohmann::json out = {{"store", o.store}, {"created", created},
                        {"moments", o.moments},
                        {"write_bytes_per_step", write_bytes_per_step},
                        {"write_bytes_per_param", static_cast<double>(write_bytes_per_step) /
                                                      static_cast<double>(o.params)},
                        {"allocated_bytes_per_step", write.allocated_bytes},
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
    const std::string disk =
        write.allocated_bytes > write.logical_bytes
            ? fmt::format("; on disk, pieces and slots as allocated: {} ({:.2f} B/param)",
                          FormatBytes(write.allocated_bytes),
                          static_cast<double>(write.allocated_bytes) / static_cast<double>(o.params))
            : "";
    std::cout << fmt::format("written per step ({} moments): {} of chunks ({:.2f} B/param of state){}; at {} a "
                             "step: {:.3f} TB of drive writes per day\n",
                             o.moments, FormatBytes(write_bytes_per_step),
                             static_cast<double>(write_bytes_per_step) / static_cast<double>(o.params), disk,
                             FormatSeconds(step_seconds), tb_per_day);
  }
  return 0;
}

}  // namespace optstate::tools::bench::step
