"""Many small tensors: optstate.torch.AdamW against torch.optim.AdamW(foreach=False), same run.

A model of --tensors fp32 tensors of --elems elements each (default 5000 x 10)
on the CPU (the host backend). Measured, in one process, interleaved round by
round (so both see the same machine state):
  construction   optstate.torch.AdamW(params, store=...) (a new store each
                 round: registration, the initial mains, the first commit)
                 against torch.optim.AdamW(params, foreach=False);
  step           --steps back-to-back step() calls of each (with
                 commit_lag_steps 1, a step waits for the previous step's
                 commit, so the mean includes the commits), after one warm-up
                 step each;
  memory         the process's resident set (VmRSS) and locked memory (VmLck:
                 the pinned staging and host cache of the host backend) that
                 one optstate optimizer adds, from /proc/self/status.
Prints medians and the ratios ours / torch; --json writes them.

Usage (from the repository root, after building liboptstate.so):
  OPTSTATE_LIB=build/default/capi/liboptstate.so PYTHONPATH=python \
    python3 python/bench/small_tensors.py --dir /tmp/osb [--host-cache-bytes 0]
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time


def _status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=5000)
    ap.add_argument("--elems", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round and method")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory for the stores (default: a new one in /tmp)")
    ap.add_argument("--host-cache-bytes", default="auto", help='"auto" (default) or bytes (0 = no host cache)')
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    import torch
    import optstate.torch as ot

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    scratch = args.dir or tempfile.mkdtemp(prefix="optstate-small-")
    os.makedirs(scratch, exist_ok=True)
    cache = args.host_cache_bytes if args.host_cache_bytes == "auto" else int(args.host_cache_bytes)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def make_params():
        ps = [torch.randn(args.elems, requires_grad=True) for _ in range(args.tensors)]
        for p in ps:
            p.grad = torch.randn(args.elems) * 1e-2
        return ps

    res = {"ours_construct_s": [], "torch_construct_s": [], "ours_step_s": [], "torch_step_s": [],
           "rss_delta_kib": [], "locked_delta_kib": []}
    try:
        for r in range(args.rounds):
            store = os.path.join(scratch, "round%d" % r)
            shutil.rmtree(store, ignore_errors=True)
            ours_p, torch_p = make_params(), make_params()
            gc.collect()
            rss0, lck0 = _status_kib("VmRSS"), _status_kib("VmLck")
            t0 = time.perf_counter()
            ours = ot.AdamW(ours_p, store=store, backend="host", host_cache_bytes=cache, **kw)
            t1 = time.perf_counter()
            ref = torch.optim.AdamW(torch_p, foreach=False, **kw)
            t2 = time.perf_counter()
            res["ours_construct_s"].append(t1 - t0)
            res["torch_construct_s"].append(t2 - t1)
            ours.step()
            ref.step()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ours.step()
            t1 = time.perf_counter()
            for _ in range(args.steps):
                ref.step()
            t2 = time.perf_counter()
            ours.commit()  # the last step's commit, outside the timings of both
            res["ours_step_s"].append((t1 - t0) / args.steps)
            res["torch_step_s"].append((t2 - t1) / args.steps)
            res["rss_delta_kib"].append(_status_kib("VmRSS") - rss0)
            res["locked_delta_kib"].append(_status_kib("VmLck") - lck0)
            ours.close()
            shutil.rmtree(store, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in res.items()}
    out = {"tensors": args.tensors, "elems": args.elems, "steps": args.steps, "rounds": args.rounds,
           "host_cache_bytes": args.host_cache_bytes, "median": med, "all": res,
           "step_ratio": med["ours_step_s"] / med["torch_step_s"],
           "construct_ratio": med["ours_construct_s"] / max(med["torch_construct_s"], 1e-9)}
    print("%d tensors x %d elems, host cache %s, %d rounds (medians)" % (args.tensors, args.elems,
                                                                         args.host_cache_bytes, args.rounds))
    print("  %-34s %10s %10s %8s" % ("", "optstate", "torch", "ratio"))
    print("  %-34s %10.4f %10.4f %8.2f" % ("step s (torch foreach=False)", med["ours_step_s"], med["torch_step_s"],
                                           out["step_ratio"]))
    print("  %-34s %10.4f %10.4f %8.1f" % ("construction s", med["ours_construct_s"], med["torch_construct_s"],
                                           out["construct_ratio"]))
    print("  %-34s %10.1f" % ("RSS added by the optimizer, MiB", med["rss_delta_kib"] / 1024))
    print("  %-34s %10.1f" % ("locked (pinned) added, MiB", med["locked_delta_kib"] / 1024))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
