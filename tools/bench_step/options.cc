// optstate-bench step's command line: its options, and the parsing both modes
// share.
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "tools/bench_step/step.h"
#include "tools/internal/bench.h"
#include "tools/internal/cli.h"
#include "vfs/store.h"

namespace optstate::tools::bench {
namespace step {

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

Result<MomentDType> MomentsNamed(const char* flag, const std::string& name) {
  Result<MomentDType> m = ParseMomentDType(name);
  if (!m.ok()) return m.status().WithContext(flag);
  return m;
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

}  // namespace step

void AddStepCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<step::StepOptions>();
  CLI::App* sub = app.add_subcommand(
      "step", "StreamedAdam step vs the I/O floor (fio) vs miles' NVMe streaming; or, with "
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
  CLI::Option* moments = sub->add_option("--moments", o->moments,
                  "synthetic mode: moment dtype, f32, bf16 or q8 (an existing store must hold it; default f32)")
      ->check(CLI::IsMember({"f32", "bf16", "q8"}));
  sub->add_option("--optimizer", o->optimizer,
                  "comparison mode: the update rule stepped, adamw (12 B/param), lion or sgd (8 B/param: one "
                  "moment; --state is then that many bytes of it), sgd_plain (SGD without momentum: 4 B/param, "
                  "the main alone), or muon (8 B/param for the weight matrices, each stepped whole, and "
                  "AdamW's 12 for the rest); miles' streaming and the moment-dtype stores are Adam's and run "
                  "only with adamw (default adamw)")
      ->check(CLI::IsMember({"adamw", "lion", "sgd", "sgd_plain", "muon"}));
  CLI::Option* ns_steps = sub->add_option(
      "--ns-steps", o->ns_steps,
      "comparison mode, --optimizer muon: Newton-Schulz iterations per matrix (Muon's ns_steps, 0..99; "
      "default 5); 0 measures the pipeline where Newton-Schulz would bound the step (the host backend)");
  sub->add_option("--dir", o->dir, "comparison mode: scratch directory (default: new dir in /tmp)");
  sub->add_option("--state", o->state_text,
                  "comparison mode: state bytes, 12 B/param for adamw, 8 for lion and sgd, 4 for sgd_plain "
                  "(default 1G)");
  sub->add_option("--rounds", o->rounds, "comparison mode: interleaved rounds (default 3)");
  sub->add_flag("--no-fio", o->no_fio, "skip the fio floor");
  sub->add_flag("--no-baselines", o->no_baselines, "skip every baseline but the floor (--baselines none)");
  sub->add_option("--baselines", o->baselines_text,
                  "baselines, comma-separated: warm (miles' NVMe streaming, state in the page cache), cold (its "
                  "files evicted before each step), direct (a synchronous O_DIRECT engine), none "
                  "(default warm,cold)");
  sub->add_option("--miles-moments", o->miles_moments,
                  "comparison mode: miles' streaming's moment dtype (its moment_dtype), f32 or bf16 (default "
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
               "miles' streaming's staging buffer); default: as the disk under --dir suggests (kAuto)");
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
  sub->callback([o, exit_code, moments, ns_steps] {
    o->moments_given = moments->count() > 0;
    o->ns_steps_given = ns_steps->count() > 0;
    *exit_code = o->store.empty() ? step::RunCompare(*o) : step::RunSynthetic(*o);
  });
}

}  // namespace optstate::tools::bench
