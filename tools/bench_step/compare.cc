// optstate-bench step's comparison mode: a StreamedAdam step vs the I/O floor
// (fio reading and writing the same bytes at once) vs miles' streaming's
// method as it runs, and the other baselines --baselines,
// --bf16-moments, --q8-moments and --prefetch ask for, in interleaved rounds.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "base/dtype.h"
#include "kernels/adam.h"
#include "memmgr/memory_manager.h"
#include "memmgr/muon_rule.h"
#include "memmgr/rules.h"
#include "memmgr/streamed_adam.h"
#include "tools/bench_step/compare.h"
#include "tools/bench_step/sync_direct_engine.h"
#include "tools/internal/bench.h"
#include "tools/internal/cli.h"
#include "tools/internal/device_buffer.h"
#include "tools/internal/fio.h"
#include "tools/internal/process.h"
#include "vfs/store.h"

namespace optstate::tools::bench::step {
namespace {

namespace fs = std::filesystem;

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

int RunCompare(const StepOptions& o) {
  auto c = ParseCommon(o);
  if (!c.ok()) return FailWith(kTool, c.status());
  auto state = ParseBytes(o.state_text);
  if (!state.ok()) return FailWith(kTool, state.status().WithContext("--state"));
  if (*state < 12 * 1024) return FailWith(kTool, InvalidArgument("--state must be >= 12 KiB"));
  if (o.rounds < 1) return FailWith(kTool, InvalidArgument("--rounds must be >= 1"));
  if (o.moments_given) {
    // Not silently f32: this mode's own store always keeps f32 moments.
    return FailWith(kTool, InvalidArgument(fmt::format(
                               "--moments {} is for synthetic mode (--store); comparison mode steps a store of "
                               "f32 moments and adds stores of bf16 or q8 moments with --bf16-moments, "
                               "--q8-moments",
                               o.moments)));
  }
  if (!(o.prefetch_compute_s >= 0) || o.prefetch_compute_s > 3600) {
    return FailWith(kTool, InvalidArgument(fmt::format("--prefetch {}: seconds of simulated forward/backward, 0..3600",
                                                       o.prefetch_compute_s)));
  }
  // The rule stepped and its bytes per param read and written per step.
  const bool adamw = o.optimizer == "adamw";
  const bool muon = o.optimizer == "muon";
  if (o.ns_steps_given && !muon) {
    return FailWith(kTool, InvalidArgument(fmt::format(
                               "--ns-steps {}: Newton-Schulz iterations are Muon's (--optimizer muon), not {}'s",
                               o.ns_steps, o.optimizer)));
  }
  if (!adamw && (o.compare_bf16 || o.compare_q8)) {
    return FailWith(kTool, InvalidArgument(fmt::format(
                               "--optimizer {}: --bf16-moments and --q8-moments compare AdamW's moment dtypes",
                               o.optimizer)));
  }
  // Muon: 8 B/param for the weight matrices (main, momentum_buffer), 12 for
  // the AdamW rest (layer norms, biases); sized as 8, counted exactly below.
  // Plain SGD: main alone, 4.
  const uint64_t bytes_per_param = adamw ? 12 : o.optimizer == "sgd_plain" ? 4 : 8;
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
        for (const char* n : {"store", "store.bf16", "store.q8", "miles_streaming", "sync_direct", "floor.read", "floor.write"}) fs::remove_all(d + "/" + n, ec);
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
  bool run_warm = false, run_cold = false, run_direct = false;
  if (!adamw && !o.no_baselines && o.baselines_text != "none") {
    Note("--optimizer " + o.optimizer + ": miles' streaming and the O_DIRECT baseline step Adam; only the floor runs");
  }
  if (adamw && !o.no_baselines) {
    std::string list = o.baselines_text;
    for (size_t at = 0; at <= list.size();) {
      size_t end = std::min(list.find(',', at), list.size());
      const std::string item = list.substr(at, end - at);
      if (item == "warm") run_warm = true;
      else if (item == "cold") run_cold = true;
      else if (item == "direct") run_direct = true;
      else if (item != "none" && !item.empty()) {
        return FailWith(kTool, InvalidArgument(fmt::format(
                                   "--baselines {}: unknown baseline '{}' (warm, cold, direct or none)", list, item)));
      }
      at = end + 1;
    }
  }
  // ParamMix sizes a 12 B/param state: scale --state to the rule's bytes.
  auto params = ParamMix(*state / bytes_per_param * 12, o.hidden);
  uint64_t numel_total = 0, max_numel = 0;
  for (auto& p : params) {
    numel_total += p.second;
    max_numel = std::max(max_numel, p.second);
  }
  // Muon's matrices: a ParamMix weight of k x h elements is a k x h matrix
  // (rule 0, Muon); the rest, and a weight cut short by --state, AdamW (rule 1).
  std::vector<uint32_t> param_rule(params.size(), 0);
  uint64_t state_bytes = numel_total * bytes_per_param;
  if (muon) {
    state_bytes = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, n] = params[i];
      const bool matrix = name.ends_with(".weight") && n > o.hidden && n % o.hidden == 0;
      param_rule[i] = matrix ? 0 : 1;
      state_bytes += n * (matrix ? 8 : 12);
    }
  }

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
  std::vector<std::unique_ptr<memmgr::UpdateRule>> rules;
  if (muon) {
    rules.push_back(memmgr::NewMuonRule(MomentDType::kF32));
    auto a = memmgr::NewRuleByName("adamw", MomentDType::kF32);
    if (!a.ok()) return FailWith(kTool, a.status());
    rules.push_back(std::move(*a));
  } else {
    auto r = memmgr::NewRuleByName(o.optimizer, MomentDType::kF32);
    if (!r.ok()) return FailWith(kTool, r.status());
    rules.push_back(std::move(*r));
  }
  // Each rule's state per param: its fields' bytes (a q8 scale covers a block).
  std::vector<std::pair<std::string, double>> rule_bytes_per_param;
  for (const auto& r : rules) {
    double b = 0;
    for (const memmgr::RuleField& f : r->Fields()) b += static_cast<double>(DTypeSize(f.dtype)) / f.elems_per_value;
    rule_bytes_per_param.emplace_back(std::string(r->name()), b);
  }
  auto opt = memmgr::StreamedAdam::Create(store->get(), mm->get(), ao, std::move(rules));
  if (!opt.ok()) return FailWith(kTool, opt.status());
  memmgr::ParamGroup g;
  g.weight_decay = 0.01;
  Status gs = Status::Ok();
  if (adamw) {
    gs = (*opt)->SetGroup(g);
  } else if (o.optimizer == "lion") {
    gs = (*opt)->SetGroupHyperparams(0, {{"lr", 1e-4}, {"weight_decay", 0.01}});
  } else if (o.optimizer == "sgd_plain") {
    gs = (*opt)->SetGroupHyperparams(0, {{"lr", 1e-2}});
  } else if (muon) {
    gs = (*opt)->SetGroupHyperparams(
        0, {{"lr", 2e-4}, {"weight_decay", 0.01}, {"adjust_lr_fn", 1.0}, {"ns_steps", static_cast<double>(o.ns_steps)}});
  } else {
    gs = (*opt)->SetGroupHyperparams(0, {{"lr", 1e-2}, {"momentum", 0.9}, {"nesterov", 1.0}});
  }
  if (!gs.ok()) return FailWith(kTool, gs);

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
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& [name, n] = params[i];
      auto d = DeviceBuffer::Make(mm->get(), n * 4);
      if (!d.ok()) return FailWith(kTool, d.status());
      Status s = (*mm)->CopyToDevice(d->get(), gh.data(), n * 4);
      memmgr::ShardInfo shape;
      if (muon && param_rule[i] == 0) shape.shape = {n / o.hidden, o.hidden};
      if (s.ok()) s = (*opt)->RegisterParam(name, n, 0, dw->get(), DType::kF32, shape, param_rule[i]);
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
  // timed step reads and writes all the rule's bytes per parameter.
  if (Status s = (*opt)->Step(pg); !s.ok()) return FailWith(kTool, s.WithContext("warm-up step"));
  // Its commit (in the background with --commit-lag 1) ends here, so that
  // neither its time nor the manager's count of its writes (added when the
  // commit ends) falls into the first timed step.
  if (Status s = (*opt)->WaitForCommit(); !s.ok()) return FailWith(kTool, s.WithContext("warm-up step's commit"));

  const std::string disk_path = dir + "/store";
  const std::vector<const void*> grad_cptrs(grad_ptrs.begin(), grad_ptrs.end());
  const Comparison cmp{.o = o,
                       .c = *c,
                       .dir = dir,
                       .disk_path = disk_path,
                       .params = params,
                       .numel_total = numel_total,
                       .max_numel = max_numel,
                       .state_bytes = state_bytes,
                       .so = so,
                       .mm = mm->get(),
                       .opt = opt->get(),
                       .cuda = cuda,
                       .ao = ao,
                       .g = g,
                       .w0 = w0,
                       .grad_ptrs = grad_ptrs,
                       .grad_cptrs = grad_cptrs,
                       .model_param_ptrs = model_param_ptrs,
                       .pg = pg};
  std::vector<MomentStore> extras;
  if (Status s = SetUpMomentStores(cmp, &extras); !s.ok()) return FailWith(kTool, s);

  std::unique_ptr<MilesStreamingBaseline> miles;
  if (run_warm || run_cold) {
    auto f = SetUpMilesStreaming(cmp);
    if (!f.ok()) return FailWith(kTool, f.status());
    miles = std::move(*f);
  }
  std::unique_ptr<SyncDirectEngine> direct;
  if (run_direct) {
    auto f = SyncDirectEngine::Create(dir + "/sync_direct", params, c->chunk, mm->get(), w0);
    if (!f.ok()) return FailWith(kTool, f.status().WithContext("synchronous O_DIRECT engine setup"));
    direct = std::move(*f);
  }
  bool use_fio = !o.no_fio && FioAvailable();
  if (!o.no_fio && !use_fio) Note("fio not found: no I/O floor");
  CompareResults res;
  res.rule_bytes_per_param = std::move(rule_bytes_per_param);
  res.write_ours = WriteOfEveryChunk((*store)->ListTensors(), c->chunk);
  // Round r steps the stores in the order (f32, extras...) rotated left by r,
  // so that each follows each other's writes (an SSD's write cache and
  // garbage collection slow the later writer) equally often. With one extra
  // store it runs after ours in even rounds and before it in odd ones.
  const size_t n_stores = 1 + extras.size();
  auto json_name = [](const std::string& dtype) { return "ours_" + dtype + "_moments"; };
  ProgressBar bar("step rounds", o.rounds);
  for (uint32_t r = 0; r < o.rounds; ++r) {
    if (use_fio) {
      if (Status s = RunFioFloor(cmp, &res); !s.ok()) return FailWith(kTool, s);
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
      res.step_order.push_back(std::move(names));
    }
    for (size_t i : extras_before) {
      if (Status s = StepMomentStore(cmp, extras[i], r, true); !s.ok()) return FailWith(kTool, s);
    }
    DiskCounters before = ReadDiskCounters(disk_path);
    const memmgr::MemoryStats ms0 = (*mm)->stats();
    double t0 = NowSeconds();
    const double unix0 = UnixSeconds();
    if (Status s = (*opt)->Step(pg); !s.ok()) return FailWith(kTool, s.WithContext(fmt::format("round {}", r + 1)));
    res.t_ours_returned.push_back(NowSeconds() - t0);
    // --commit-lag 1: Step returned with its commit in flight. "ours" is the
    // step with its commit, as before (what a trainer with no forward/backward
    // to hide the commit behind sees); the wait also keeps our writes out of
    // the next method's time.
    if (Status s = (*opt)->WaitForCommit(); !s.ok()) return FailWith(kTool, s.WithContext("commit"));
    res.t_ours.push_back(NowSeconds() - t0);
    res.ours_unix.push_back({unix0, UnixSeconds()});
    res.disk_ours.Add(before, ReadDiskCounters(disk_path), res.t_ours.back());
    res.stats.push_back((*opt)->last_step_stats());
    const memmgr::MemoryStats ms1 = (*mm)->stats();
    res.step_io.push_back({ms1.nvme_read_bytes - ms0.nvme_read_bytes, ms1.cache_hit_bytes - ms0.cache_hit_bytes});
    res.step_written.push_back(ms1.nvme_write_bytes - ms0.nvme_write_bytes);
    if (miles && run_warm) {
      if (Status s = StepMilesStreamingWarm(cmp, *miles, &res); !s.ok()) return FailWith(kTool, s);
    }
    if (miles && run_cold) {
      if (Status s = StepMilesStreamingCold(cmp, *miles, &res); !s.ok()) return FailWith(kTool, s);
    }
    for (size_t i : extras_after) {
      if (Status s = StepMomentStore(cmp, extras[i], r, false); !s.ok()) return FailWith(kTool, s);
    }
    if (direct) {
      t0 = NowSeconds();
      if (Status s = direct->Step(grad_ptrs, r + 1, cuda); !s.ok()) {
        return FailWith(kTool, s.WithContext("synchronous O_DIRECT engine"));
      }
      res.t_direct.push_back(NowSeconds() - t0);
    }
    if (o.prefetch_compute_s > 0) {
      if (Status s = SimulateLoopRound(cmp, &res); !s.ok()) {
        return FailWith(kTool, s.WithContext(fmt::format("loop simulation, round {}", r + 1)));
      }
    }
    bar.Update(r + 1);
  }
  bar.Finish();
  // Steps held only in the host cache (--durable-every > 1): the time to make
  // them durable, reported on its own.
  res.cached_steps = (*opt)->uncommitted_steps();
  if (res.cached_steps > 0) {
    double t0 = NowSeconds();
    auto g = (*opt)->MakeDurable();
    if (!g.ok()) return FailWith(kTool, g.status().WithContext("MakeDurable"));
    res.t_durable = NowSeconds() - t0;
  }
  if (Status s = MeasureCopies(mm->get(), &res.h2d, &res.d2h); !s.ok()) Note("copy bandwidth: " + s.ToString());
  return ReportComparison(cmp, extras, miles.get(), res);
}

}  // namespace optstate::tools::bench::step
