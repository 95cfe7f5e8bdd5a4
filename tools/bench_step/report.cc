// optstate-bench step's comparison report: the table of median step times and
// ratios with the lines that explain them, or (--json) every number.
#include <cmath>
#include <iostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "tools/bench_step/compare.h"
#include "tools/internal/bench.h"
#include "tools/internal/cli.h"
#include "tools/internal/store_read.h"
#include "vfs/store.h"

namespace optstate::tools::bench::step {

int ReportComparison(const Comparison& cmp, const std::vector<MomentStore>& extras, const MilesStreamingBaseline* miles,
                     const CompareResults& res) {
  const StepOptions& o = cmp.o;
  const Common& c = cmp.c;
  const MomentStore* const bf16 = o.compare_bf16 ? &extras.front() : nullptr;
  const MomentStore* const q8 = o.compare_q8 ? &extras.back() : nullptr;
  static const std::vector<double> kNoTimes;
  static const std::vector<uint64_t> kNoBytes;
  static const std::vector<memmgr::StreamedAdam::StepStats> kNoStats;
  const std::vector<double>& t_bf16 = bf16 ? bf16->t : kNoTimes;
  const std::vector<double>& t_q8 = q8 ? q8->t : kNoTimes;
  const size_t n_stores = 1 + extras.size();
  auto ratio = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> r;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) r.push_back(a[i] / b[i]);
    return Median(r);
  };
  // Same-round extra / f32 ratios of the rounds in which the extra store
  // stepped before (or after) ours.
  auto order_ratios = [&](const MomentStore& x, bool before_ours) {
    std::string out;
    for (size_t i = 0; i < x.t.size() && i < res.t_ours.size(); ++i) {
      if (x.before_ours[i] != before_ours) continue;
      out += fmt::format("{}{:.3f}", out.empty() ? "" : " ", x.t[i] / res.t_ours[i]);
    }
    return out;
  };
  // Bytes a step moves each way per parameter: main 4 + two moments.
  const double q8_bytes_per_param = 4.0 + 2.0 * (1.0 + 4.0 / static_cast<double>(vfs::kQ8BlockElems));
  auto ms = cmp.mm->stats();
  double copy_floor =
      std::max(static_cast<double>(cmp.state_bytes) / res.h2d, static_cast<double>(cmp.state_bytes) / res.d2h);
  nlohmann::json out;
  out["machine"] = MachineInfo();
  out["backend"] = memmgr::BackendName(cmp.mm->backend());
  out["optimizer"] = cmp.o.optimizer;
  out["state_bytes"] = cmp.state_bytes;
  out["params"] = cmp.numel_total;
  out["tensors"] = cmp.params.size();
  out["chunk_bytes"] = c.chunk;
  out["budget_bytes"] = c.budget;
  out["host_cache_bytes"] = c.host_cache;
  out["rounds"] = o.rounds;
  // Baselines by key; "names" says what each is.
  out["seconds"] = {{"ours", res.t_ours},
                    {"fio_floor", res.t_floor},
                    {"miles_warm", res.t_warm},
                    {"miles_cold", res.t_cold},
                    {"sync_direct_engine", res.t_direct},
                    {"ours_bf16_moments", t_bf16},
                    {"ours_q8_moments", t_q8}};
  out["names"] = {{"ours", "StreamedAdam step (ours), O_DIRECT, until its commit is durable"},
                  {"fio_floor", "I/O floor (fio read+write)"},
                  {"miles_warm", "miles' streaming, buffered, page cache warm"},
                  {"miles_cold", "miles' streaming, buffered, page cache cold"},
                  {"sync_direct_engine", "synchronous O_DIRECT engine"},
                  {"ours_bf16_moments", "StreamedAdam step (ours) on a store with bf16 moments (8 B/param)"},
                  {"ours_q8_moments", fmt::format("StreamedAdam step (ours) on a store with q8 moments ({:.2f} B/param)",
                                                  q8_bytes_per_param)}};
  if (!t_bf16.empty()) out["bf16_moments_over_f32"] = ratio(t_bf16, res.t_ours);
  if (!t_q8.empty()) out["q8_moments_over_f32"] = ratio(t_q8, res.t_ours);
  out["miles_moments"] = o.miles_moments;
  if (!t_bf16.empty() && o.miles_moments == "bf16") {
    out["bf16_moments_over_miles"] = {{"warm", ratio(t_bf16, res.t_warm)}, {"cold", ratio(t_bf16, res.t_cold)}};
  }
  out["bf16_moments_step_first_in"] =
      n_stores == 3 ? "rounds 2, 5, 8, ... (1-based); after ours in the others (see step_order)"
                    : "odd rounds (1-based: 2, 4, ...); after ours in the others";
  out["step_order"] = res.step_order;  // per round: the stores in the order they stepped
  out["commit_lag_steps"] = o.commit_lag;
  out["ours_step_returned_seconds"] = res.t_ours_returned;
  out["median_ours_step_returned_seconds"] = Median(res.t_ours_returned);
  out["ours_unix_seconds"] = res.ours_unix;  // [start, end] per round, to match against a disk trace
  out["batch_submit"] = !o.no_batch_submit;
  const std::string& pages = cmp.mm->staging_pages();
  out["staging_pages"] = pages;
  out["median_seconds"] = {{"ours", Median(res.t_ours)},
                           {"fio_floor", Median(res.t_floor)},
                           {"miles_warm", Median(res.t_warm)},
                           {"miles_cold", Median(res.t_cold)},
                           {"sync_direct_engine", Median(res.t_direct)}};
  out["ours_over_floor"] = ratio(res.t_ours, res.t_floor);
  // ours / each baseline: the median over rounds of the same-round ratios.
  out["ours_over"] = {{"fio_floor", ratio(res.t_ours, res.t_floor)},
                      {"miles_warm", ratio(res.t_ours, res.t_warm)},
                      {"miles_cold", ratio(res.t_ours, res.t_cold)},
                      {"sync_direct_engine", ratio(res.t_ours, res.t_direct)}};
  if (miles) {
    out["miles_streaming"] = {{"buckets", miles->buckets().size()},
                            {"bucket_numel_limit", miles->options().bucket_numel_limit},
                            {"staging_bytes", miles->options().staging_bytes},
                            {"file_bytes", miles->file_bytes()},
                            {"warm_resident_fraction", res.warm_resident},
                            {"cold_resident_fraction_after_drop", res.cold_resident},
                            {"cold_writeback_seconds", res.cold_writeback}};
  }
  out["h2d_bytes_per_second"] = res.h2d;
  out["d2h_bytes_per_second"] = res.d2h;
  out["ours_over_copy_floor"] = Median(res.t_ours) / copy_floor;
  out["durable_every_steps"] = o.durable_every;
  out["cached_steps_at_end"] = res.cached_steps;
  out["make_durable_seconds"] = res.t_durable;
  out["peak_resident_bytes"] = ms.peak_resident_bytes;
  out["io_wait_seconds"] = res.stats.empty() ? 0.0 : res.stats.back().io_wait_seconds;
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
            {"device_slots", st.device_slots},
            {"peak_unit_windows", st.peak_unit_windows}};
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
  for (size_t i = 0; i < res.stats.size(); ++i) {
    const auto& st = res.stats[i];
    breakdown.push_back({{"seconds", st.seconds},
                         {"store_read_bytes", res.step_io[i].first},
                         {"cache_hit_bytes", res.step_io[i].second},
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
                         {"device_slots", st.device_slots},
                         {"peak_unit_windows", st.peak_unit_windows}});
  }
  out["step_stats"] = breakdown;
  if (o.prefetch_compute_s > 0) {
    out["loop"] = {{"compute_seconds", o.prefetch_compute_s},
                   {"exposed_seconds",
                    {{"without_prefetch", res.t_loop_plain}, {"with_prefetch", res.t_loop_prefetch}}},
                   {"median_exposed_seconds",
                    {{"without_prefetch", Median(res.t_loop_plain)}, {"with_prefetch", Median(res.t_loop_prefetch)}}},
                   {"with_over_without", ratio(res.t_loop_prefetch, res.t_loop_plain)},
                   {"prefetch_hit_bytes", res.loop_prefetch_hits}};
  }
  out["disk"] = {{"ours", res.disk_ours.Describe()}, {"fio_floor", res.disk_floor.Describe()},
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
  // The state's bytes per param (what a step reads and writes of it, the
  // rules' fields) and, apart, the disk space a step's chunks take as the
  // store allocates them (a short chunk takes a piece of at least 4 KiB).
  out["state_bytes_per_param"] =
      cmp.numel_total ? static_cast<double>(cmp.state_bytes) / static_cast<double>(cmp.numel_total) : 0.0;
  out["state_bytes_per_param_by_rule"] = nlohmann::json::object();
  for (const auto& [rule, b] : res.rule_bytes_per_param) out["state_bytes_per_param_by_rule"][rule] = b;
  const FullWrite write_bf16 = bf16 ? WriteOfEveryChunk(bf16->store->ListTensors(), c.chunk) : FullWrite{};
  const FullWrite write_q8 = q8 ? WriteOfEveryChunk(q8->store->ListTensors(), c.chunk) : FullWrite{};
  out["allocated_bytes_per_step"] = {{"ours", res.write_ours.allocated_bytes},
                                     {"ours_bf16_moments", write_bf16.allocated_bytes},
                                     {"ours_q8_moments", write_q8.allocated_bytes}};
  out["write_bytes_per_step"] = {{"ours", res.step_written},
                                 {"ours_bf16_moments", step_written_bf16},
                                 {"ours_q8_moments", step_written_q8}};
  out["drive_writes_tb_per_day"] = {{"ours", tb_per_day(res.step_written, res.t_ours)},
                                    {"ours_bf16_moments", tb_per_day(step_written_bf16, t_bf16)},
                                    {"ours_q8_moments", tb_per_day(step_written_q8, t_q8)}};
  if (o.json) {
    PrintJson(out);
    return 0;
  }
  std::cout << fmt::format(
      "optstate-bench step: {} {} of state ({} params in {} tensors), chunk {}, budget {}, host cache "
      "{}, backend {}, {} interleaved rounds (floor, ours, baselines); ours: O_DIRECT, commit "
      "(fdatasync) included\nstaging pages: {}\nmachine: {}\n\n",
      o.optimizer, FormatBytes(cmp.state_bytes), cmp.numel_total, cmp.params.size(), FormatBytes(c.chunk),
      FormatBytes(c.budget), FormatBytes(c.host_cache), memmgr::BackendName(cmp.mm->backend()),
      o.rounds, pages, MachineLine());
  Table t({"method", "median step", "state GB/s each way", "ours / this"}, {false, true, true, true});
  auto row = [&](const std::string& n, const std::vector<double>& v, double r) {
    if (v.empty()) return;
    double m = Median(v);
    t.AddRow({n, FormatSeconds(m), FormatRate(static_cast<double>(cmp.state_bytes) / m),
              std::isnan(r) ? "-" : fmt::format("{:.2f}x", r)});
  };
  row("StreamedAdam step (ours)", res.t_ours, 1.0);
  row("I/O floor (fio read+write)", res.t_floor, ratio(res.t_ours, res.t_floor));
  const std::string fv_moments = o.miles_moments == "bf16" ? " (bf16 moments)" : "";
  row("miles' streaming, buffered, page cache warm" + fv_moments, res.t_warm, ratio(res.t_ours, res.t_warm));
  row("miles' streaming, buffered, page cache cold" + fv_moments, res.t_cold, ratio(res.t_ours, res.t_cold));
  row("synchronous O_DIRECT engine", res.t_direct, ratio(res.t_ours, res.t_direct));
  row("StreamedAdam step (ours), bf16 moments", t_bf16, ratio(res.t_ours, t_bf16));
  row("StreamedAdam step (ours), q8 moments", t_q8, ratio(res.t_ours, t_q8));
  std::cout << t.Render();
  // With one extra store the orders are the round's parity; with two, the
  // rounds of each order are in res.step_order.
  const bool parity_orders = n_stores == 2;
  if (!t_bf16.empty()) {
    std::cout << fmt::format(
        "bf16 moments / f32 moments (same rounds): {:.2f}x (bytes moved: 8/12 = 0.67x); bf16 after f32{} [{}], "
        "before it{} [{}]\n",
        ratio(t_bf16, res.t_ours), parity_orders ? " (even rounds)" : "", order_ratios(*bf16, false),
        parity_orders ? " (odd rounds)" : "", order_ratios(*bf16, true));
    if (o.miles_moments == "bf16" && (!res.t_warm.empty() || !res.t_cold.empty())) {
      std::cout << fmt::format("ours, bf16 moments / miles' streaming, bf16 moments (same rounds): warm {:.2f}x, cold "
                               "{:.2f}x\n",
                               ratio(t_bf16, res.t_warm), ratio(t_bf16, res.t_cold));
    }
  }
  if (!t_q8.empty()) {
    std::cout << fmt::format(
        "q8 moments / f32 moments (same rounds): {:.2f}x (bytes moved: {:.2f}/12 = {:.2f}x); q8 after f32{} [{}], "
        "before it{} [{}]\n",
        ratio(t_q8, res.t_ours), q8_bytes_per_param, q8_bytes_per_param / 12.0, parity_orders ? " (even rounds)" : "",
        order_ratios(*q8, false), parity_orders ? " (odd rounds)" : "", order_ratios(*q8, true));
  }
  auto list = [](const std::vector<double>& v) {
    std::string out;
    for (double x : v) out += fmt::format("{}{:.3f}", out.empty() ? "" : " ", x);
    return out.empty() ? std::string("-") : out;
  };
  std::cout << fmt::format("per round (s): ours [{}]  floor [{}]  miles' streaming warm [{}]  cold [{}]{}{}{}\n",
                           list(res.t_ours), list(res.t_floor), list(res.t_warm), list(res.t_cold),
                           res.t_direct.empty() ? "" : "  sync O_DIRECT engine [" + list(res.t_direct) + "]",
                           t_bf16.empty() ? "" : "  bf16 moments [" + list(t_bf16) + "]",
                           t_q8.empty() ? "" : "  q8 moments [" + list(t_q8) + "]");
  if (miles) {
    std::cout << fmt::format(
        "miles' streaming: {} bucket(s) of <= {} elements, {} of files, {} staging buffer; page cache held {} of "
        "them before the warm steps, {} after each eviction (fdatasync of the previous step's writes: [{}] s, "
        "untimed)\n",
        miles->buckets().size(), miles->options().bucket_numel_limit, FormatBytes(miles->file_bytes()),
        FormatBytes(miles->options().staging_bytes),
        res.warm_resident.empty() ? "-" : fmt::format("{:.0f}%", 100 * Median(res.warm_resident)),
        res.cold_resident.empty() ? "-" : fmt::format("{:.1f}%", 100 * Median(res.cold_resident)),
        list(res.cold_writeback));
  }
  // Only the ratios to the baselines that ran.
  std::string ratios;
  if (!res.t_floor.empty()) ratios += fmt::format("ours / floor: {:.2f}x (target <= 1.10)", ratio(res.t_ours, res.t_floor));
  for (const auto& [name, t] : {std::pair<const char*, const std::vector<double>*>{"miles' streaming warm", &res.t_warm},
                                {"miles' streaming cold", &res.t_cold},
                                {"sync O_DIRECT engine", &res.t_direct}}) {
    if (!t->empty()) ratios += fmt::format("{}ours / {}: {:.2f}x", ratios.empty() ? "" : "   ", name, ratio(res.t_ours, *t));
  }
  std::cout << fmt::format(
      "\n{}{}H2D {} D2H {} (1 GiB, pinned); ours / copy floor: {:.2f}x\npeak device memory {} (budget {})\n", ratios,
      ratios.empty() ? "" : "\n", FormatRate(res.h2d), FormatRate(res.d2h), Median(res.t_ours) / copy_floor,
      FormatBytes(ms.peak_resident_bytes), FormatBytes(c.budget));
  if (o.commit_lag > 0) {
    std::cout << fmt::format("commit lag {}: Step() returned after {} (median), its commit done after {}\n",
                             o.commit_lag, FormatSeconds(Median(res.t_ours_returned)),
                             FormatSeconds(Median(res.t_ours)));
  }
  if (res.cached_steps > 0) {
    std::cout << fmt::format(
        "durable every {} steps: the timed steps stayed in the host cache (no disk I/O); MakeDurable of "
        "{} cached step(s) (writes the state, commits): {}\n",
        o.durable_every, res.cached_steps, FormatSeconds(res.t_durable));
  }
  for (const auto& [name, all] : {std::pair<const char*, const std::vector<memmgr::StreamedAdam::StepStats>*>{
                                       "last step", &res.stats},
                                   {"last step, bf16 moments", bf16 ? &bf16->stats : &kNoStats},
                                   {"last step, q8 moments", q8 ? &q8->stats : &kNoStats}}) {
    if (all->empty()) continue;
    const auto& st = all->back();
    std::cout << fmt::format(
        "{}: {:.3f} s; io wait {:.3f} s, submit {:.3f} s, compute {:.3f} s, commit {:.3f} s; "
        "{} + {} small staging sets ({} small slices), at most {} read / {} written in flight, {} device slots, "
        "at most {} whole-tensor windows held\n",
        name, st.seconds, st.io_wait_seconds, st.submit_seconds, st.compute_seconds, st.commit_seconds,
        st.slices_in_flight, st.small_sets, st.small_slices, FormatBytes(st.peak_read_bytes_in_flight),
        FormatBytes(st.peak_write_bytes_in_flight), st.device_slots, st.peak_unit_windows);
  }
  std::string reads, hits;
  for (const auto& [rd, hit] : res.step_io) {
    reads += (reads.empty() ? "" : " ") + FormatBytes(rd);
    hits += (hits.empty() ? "" : " ") + FormatBytes(hit);
  }
  std::cout << fmt::format("per step: read from the store [{}]  served by the host cache [{}]\n", reads, hits);
  const std::string ours_name = o.optimizer == "adamw" ? "f32 moments" : o.optimizer + ", f32";
  for (const auto& [name, written, secs, write] :
       {std::tuple<const char*, const std::vector<uint64_t>*, const std::vector<double>*, const FullWrite*>{
            ours_name.c_str(), &res.step_written, &res.t_ours, &res.write_ours},
        {"bf16 moments", &step_written_bf16, &t_bf16, &write_bf16},
        {"q8 moments", &step_written_q8, &t_q8, &write_q8}}) {
    if (written->empty()) continue;
    std::vector<double> w(written->begin(), written->end());
    const double n = static_cast<double>(cmp.numel_total);
    // Piece rounding apart, when the store's chunks take more disk than their bytes.
    const std::string disk =
        write->allocated_bytes > write->logical_bytes
            ? fmt::format("; on disk, pieces and slots as allocated: {} ({:.2f} B/param)",
                          FormatBytes(write->allocated_bytes), static_cast<double>(write->allocated_bytes) / n)
            : "";
    std::cout << fmt::format(
        "written per step, {}: {} of chunks ({:.2f} B/param of state){}; at the median step time {}: {:.3f} TB "
        "of drive writes per day\n",
        name, FormatBytes(static_cast<uint64_t>(Median(w))), Median(w) / n, disk, FormatSeconds(Median(*secs)),
        tb_per_day(*written, *secs));
  }
  if (o.prefetch_compute_s > 0) {
    std::string found;
    for (uint64_t b : res.loop_prefetch_hits) found += (found.empty() ? "" : " ") + FormatBytes(b);
    std::cout << fmt::format(
        "loop, forward/backward {} then Step (commit of the previous step in flight): exposed step {} without "
        "Prefetch, {} with ({:.2f}x); the step found prefetched [{}]; per round without [{}] with [{}]\n",
        FormatSeconds(o.prefetch_compute_s), FormatSeconds(Median(res.t_loop_plain)),
        FormatSeconds(Median(res.t_loop_prefetch)), ratio(res.t_loop_prefetch, res.t_loop_plain), found,
        list(res.t_loop_plain), list(res.t_loop_prefetch));
  }
  const DiskPhase no_disk;
  for (const auto& [name, d] : {std::pair<const char*, const DiskPhase*>{"ours", &res.disk_ours},
                                {"bf16", bf16 ? &bf16->disk : &no_disk},
                                {"q8", q8 ? &q8->disk : &no_disk},
                                {"floor", &res.disk_floor}}) {
    std::string u = d->Describe();
    if (!u.empty()) std::cout << fmt::format("{:<6}{}\n", name, u);
  }
  return 0;
}

}  // namespace optstate::tools::bench::step
