// optstate-bench sleep: ReleaseAll ("sleep" for RL colocation) and waking,
// with the whole device budget resident.
//
// Each round pins the whole budget (one tensor field of budget bytes, written
// and flushed, so every page is resident and clean), then times ReleaseAll
// and records how much device memory it gave back (cudaMemGetInfo). Waking
// needs no call: the next Pin maps pages again. The table shows the first
// one-chunk Pin after sleep next to the same Pin while awake (both read the
// chunk from the store, with the host cache tier off).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "memmgr/memory_manager.h"
#include "tools/internal/bench.h"
#include "tools/internal/cli.h"
#include "tools/internal/process.h"
#include "vfs/store.h"

namespace optstate::tools::bench {

namespace {

namespace fs = std::filesystem;
constexpr const char* kTool = "optstate-bench sleep";

struct SleepOptions {
  std::string dir;
  std::string budget_text = "2G";
  std::string chunk_text = "8M";
  std::string backend = "auto";
  uint32_t rounds = 3;
  bool json = false;
};

Status FillBudget(memmgr::MemoryManager* mm, const std::string& tensor, uint64_t numel) {
  OPTSTATE_ASSIGN_OR_RETURN(memmgr::PinnedRange r, mm->Pin(tensor, "main", 0, numel, memmgr::Access::kReadWrite));
  std::vector<float> h(1 << 20, 0.5f);
  for (uint64_t off = 0; off < numel; off += h.size()) {
    uint64_t n = std::min<uint64_t>(h.size(), numel - off);
    OPTSTATE_RETURN_IF_ERROR(mm->CopyToDevice(static_cast<float*>(r.data()) + off, h.data(), n * 4));
  }
  OPTSTATE_RETURN_IF_ERROR(r.Unpin());
  return mm->Flush();
}

int RunSleep(const SleepOptions& o) {
  auto budget = ParseBytes(o.budget_text);
  if (!budget.ok()) return FailWith(kTool, budget.status().WithContext("--budget"));
  auto chunk = ParseBytes(o.chunk_text);
  if (!chunk.ok()) return FailWith(kTool, chunk.status().WithContext("--chunk-size"));
  if (*chunk == 0 || *chunk % vfs::kChunkAlignBytes != 0 || *budget < *chunk) {
    return FailWith(kTool, InvalidArgument("--chunk-size must be a multiple of 2M and <= --budget"));
  }
  auto backend = memmgr::ParseBackend(o.backend);
  if (!backend.ok()) return FailWith(kTool, backend.status().WithContext("--backend"));
  if (o.rounds < 1) return FailWith(kTool, InvalidArgument("--rounds must be >= 1"));
  std::string dir = o.dir;
  const bool own = dir.empty();
  if (own) {
    auto d = MakeTempDir("optstate-bench-sleep-", "/tmp");
    if (!d.ok()) return FailWith(kTool, d.status());
    dir = *d;
  }
  struct Cleanup {
    std::string d;
    bool own;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(own ? d : d + "/sleep_store", ec);
    }
  } cleanup{dir, own};
  vfs::StoreOptions so;
  so.chunk_size_bytes = *chunk;
  auto store = vfs::Store::Create(dir + "/sleep_store", so);
  if (!store.ok()) return FailWith(kTool, store.status());
  memmgr::MemoryManagerOptions mo;
  mo.backend = *backend;
  mo.device_budget_bytes = *budget;
  mo.host_cache_bytes = 0;  // the woken Pin must read the store, as after a sleep without spare RAM
  auto mm = memmgr::MemoryManager::Create(store->get(), mo);
  if (!mm.ok()) return FailWith(kTool, mm.status());
  const uint64_t pages = *budget / *chunk;
  const uint64_t numel = pages * *chunk / 4;
  vfs::TensorSpec spec;
  spec.name = "sleep.weight";
  spec.numel = numel;
  if (auto t = (*store)->CreateTensor(spec); !t.ok()) return FailWith(kTool, t.status());
  if (auto g = (*store)->Commit({}); !g.ok()) return FailWith(kTool, g.status());

  std::vector<double> t_sleep, t_pin_awake, t_pin_woken, freed;
  for (uint32_t r = 0; r < o.rounds; ++r) {
    if (Status s = FillBudget(mm->get(), spec.name, numel); !s.ok()) return FailWith(kTool, s);
    if (auto g = (*store)->Commit({}); !g.ok()) return FailWith(kTool, g.status());
    // Awake: one chunk of another field (not resident) read from the store.
    double t0 = NowSeconds();
    {
      auto p = (*mm)->Pin(spec.name, "exp_avg", 0, *chunk / 4, memmgr::Access::kRead);
      if (!p.ok()) return FailWith(kTool, p.status());
    }
    t_pin_awake.push_back(NowSeconds() - t0);
    uint64_t free0 = 0, free1 = 0, total = 0;
    (void)(*mm)->DeviceMemInfo(&free0, &total);
    const uint64_t resident = (*mm)->stats().resident_bytes;
    t0 = NowSeconds();
    if (Status s = (*mm)->ReleaseAll(); !s.ok()) return FailWith(kTool, s.WithContext("ReleaseAll"));
    t_sleep.push_back(NowSeconds() - t0);
    (void)(*mm)->DeviceMemInfo(&free1, &total);
    if ((*mm)->stats().resident_bytes != 0) {
      return FailWith(kTool, Internal(fmt::format("{} bytes still resident after ReleaseAll",
                                                  (*mm)->stats().resident_bytes)));
    }
    freed.push_back(total > 0 ? static_cast<double>(free1) - static_cast<double>(free0)
                              : static_cast<double>(resident));
    // Woken: the same one-chunk pin, first call after sleep.
    t0 = NowSeconds();
    {
      auto p = (*mm)->Pin(spec.name, "exp_avg", *chunk / 4, *chunk / 4, memmgr::Access::kRead);
      if (!p.ok()) return FailWith(kTool, p.status());
    }
    t_pin_woken.push_back(NowSeconds() - t0);
    if (Status s = (*mm)->ReleaseAll(); !s.ok()) return FailWith(kTool, s);
  }
  const double sleep_med = Median(t_sleep);
  nlohmann::json out;
  out["machine"] = MachineInfo();
  out["backend"] = memmgr::BackendName((*mm)->backend());
  out["budget_bytes"] = *budget;
  out["chunk_bytes"] = *chunk;
  out["rounds"] = o.rounds;
  out["sleep_seconds"] = t_sleep;
  out["device_bytes_returned"] = freed;
  out["pin_awake_seconds"] = t_pin_awake;
  out["pin_after_sleep_seconds"] = t_pin_woken;
  if (o.json) {
    PrintJson(out);
    return 0;
  }
  std::cout << fmt::format(
      "optstate-bench sleep: budget {} ({} pages of {}) resident and clean, backend {}, {} rounds\n"
      "machine: {}\n\n",
      FormatBytes(*budget), pages, FormatBytes(*chunk), memmgr::BackendName((*mm)->backend()), o.rounds,
      MachineLine());
  Table t({"what", "median", "target"}, {false, true, true});
  t.AddRow({"sleep: ReleaseAll", FormatSeconds(sleep_med), "< 50 ms"});
  t.AddRow({std::string("device memory returned") + ((*mm)->backend() == memmgr::Backend::kCuda ? " (cudaMemGetInfo)" : " (resident bytes)"),
            FormatBytes(static_cast<uint64_t>(std::max(0.0, Median(freed)))), FormatBytes(*budget)});
  t.AddRow({"wake", "no call", "free"});
  t.AddRow({"first 1-chunk Pin after sleep", FormatSeconds(Median(t_pin_woken)), "-"});
  t.AddRow({"same Pin while awake", FormatSeconds(Median(t_pin_awake)), "-"});
  std::cout << t.Render();
  return 0;
}

}  // namespace

void AddSleepCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<SleepOptions>();
  CLI::App* sub = app.add_subcommand("sleep", "ReleaseAll (sleep) time and memory returned with the whole budget "
                                              "resident; waking");
  sub->add_option("--dir", o->dir, "scratch directory (default: new dir in /tmp)");
  sub->add_option("--budget", o->budget_text, "device budget, all of it resident before sleep (default 2G)");
  sub->add_option("--chunk-size", o->chunk_text, "chunk size, multiple of 2M (default 8M)");
  sub->add_option("--backend", o->backend, "auto, host or cuda (default auto)");
  sub->add_option("--rounds", o->rounds, "rounds (default 3)");
  sub->add_flag("--json", o->json, "print JSON");
  sub->callback([o, exit_code] { *exit_code = RunSleep(*o); });
}

}  // namespace optstate::tools::bench
