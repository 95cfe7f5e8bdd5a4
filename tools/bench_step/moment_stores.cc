// optstate-bench step --bf16-moments / --q8-moments: the stores with narrower
// moments, each with its own store and manager, stepped in each round next to
// ours.
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "tools/bench_step/compare.h"
#include "tools/internal/cli.h"
#include "tools/internal/device_buffer.h"

namespace optstate::tools::bench::step {

Status SetUpMomentStores(const Comparison& cmp, std::vector<MomentStore>* extras) {
  const StepOptions& o = cmp.o;
  extras->reserve(2);
  for (const auto& [on, dtype, moment_dtype] :
       {std::tuple<bool, const char*, MomentDType>{o.compare_bf16, "bf16", MomentDType::kBF16},
        {o.compare_q8, "q8", MomentDType::kQ8}}) {
    if (!on) continue;
    extras->emplace_back();
    extras->back().dtype = dtype;
    extras->back().moment_dtype = moment_dtype;
  }
  for (MomentStore& x : *extras) {
    const std::string what = x.dtype + " moments";
    auto sx = vfs::Store::Create(cmp.dir + "/store." + x.dtype, cmp.so);
    if (!sx.ok()) return sx.status();
    x.store = std::move(*sx);
    auto mx = memmgr::MemoryManager::Create(x.store.get(), ManagerOptions(cmp.c, o));
    if (!mx.ok()) return mx.status();
    x.mm = std::move(*mx);
    memmgr::StreamedAdamOptions aox = cmp.ao;
    aox.moment_dtype = x.moment_dtype;
    auto ox = memmgr::StreamedAdam::Create(x.store.get(), x.mm.get(), aox);
    if (!ox.ok()) return ox.status().WithContext(what);
    x.opt = std::move(*ox);
    if (Status s = x.opt->SetGroup(cmp.g); !s.ok()) return s;
    auto dw = DeviceBuffer::Make(x.mm.get(), cmp.max_numel * 4);
    if (!dw.ok()) return dw.status();
    if (Status s = x.mm->CopyToDevice(dw->get(), cmp.w0.data(), cmp.max_numel * 4); !s.ok()) return s;
    for (auto& [name, n] : cmp.params) {
      if (Status s = x.opt->RegisterParam(name, n, 0, dw->get(), DType::kF32); !s.ok()) {
        return s.WithContext(name + " (" + what + ")");
      }
    }
    if (Status s = x.opt->Step(cmp.pg); !s.ok()) return s.WithContext("warm-up step, " + what);
    if (Status s = x.opt->WaitForCommit(); !s.ok()) return s.WithContext(what);
  }
  return Status::Ok();
}

Status StepMomentStore(const Comparison& cmp, MomentStore& x, uint32_t r, bool before_ours) {
  const uint64_t w0_x = x.mm->stats().nvme_write_bytes;
  const DiskCounters before = ReadDiskCounters(cmp.disk_path);
  const double t0 = NowSeconds();
  Status s = x.opt->Step(cmp.pg);
  if (s.ok()) s = x.opt->WaitForCommit();
  if (!s.ok()) return s.WithContext(fmt::format("{} moments, round {}", x.dtype, r + 1));
  x.t.push_back(NowSeconds() - t0);
  x.before_ours.push_back(before_ours);
  x.disk.Add(before, ReadDiskCounters(cmp.disk_path), x.t.back());
  x.written.push_back(x.mm->stats().nvme_write_bytes - w0_x);
  x.stats.push_back(x.opt->last_step_stats());
  return Status::Ok();
}

}  // namespace optstate::tools::bench::step
