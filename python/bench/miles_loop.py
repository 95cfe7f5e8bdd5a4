"""What a user feels: the optimizer time a training loop exposes, ours vs miles' NVMe streaming.

A training-loop simulation on one GPU. Each iteration runs "forward + backward"
as real GPU work lasting T (bf16 matmuls, calibrated), then the optimizer step,
and waits for the GPU. The exposed optimizer time is the iteration's wall time
minus T (T measured as the median of compute-only iterations). T is swept over
0, 0.5x, 1x and 2x the I/O floor of the state (the time to read and write its
bytes at once on the disk under --dir, measured here with O_DIRECT threads,
or given with --floor-s).

Methods, interleaved iteration by iteration:
  ours            optstate.torch.AdamW over the C ABI (bf16 params, state in a
                  store under --dir, --budget-mib device window,
                  --host-cache-mib host tier); opt.prefetch() is called before
                  the forward when the optimizer has it and --prefetch is given.
  miles-warm         miles' streaming's step as it runs (radixark/miles
                  miles_plugins/optimizers/nvme_stream.py,
                  NVMeOptimizerStateStore.step), re-implemented below: its
                  state files stay in the page cache.
  miles-cold         the same step after its files are fdatasynced and evicted
                  with POSIX_FADV_DONTNEED (both untimed): a state larger than
                  RAM, emulated without root.

Prints a table per T and writes JSON with --json. Without CUDA it prints why
and exits 0.

Usage (GPU machine; from the repository root, after building liboptstate.so):
  OPTSTATE_LIB=build/default/capi/liboptstate.so PYTHONPATH=python \
    python3 python/bench/miles_loop.py --dir /root/osb --state-gib 8 --json loop.json
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# Miles' streaming's constants (nvme_stream.py: BUCKET_NUMEL_LIMIT, IO_ALIGN,
# and miles' --offload-train-disk-chunk-mb default of 256).
BUCKET_NUMEL_LIMIT = 200_000_000
IO_ALIGN = 4096
STAGING_BYTES = 256 << 20
SEGMENTS = ("main", "exp_avg", "exp_avg_sq")


def param_mix(state_bytes, h):
    """The parameter sizes of optstate-bench's mix (tools/bench_common.cc
    ParamMix): transformer layers of hidden size h up to state_bytes / 12."""
    layer = [("ln1.weight", h), ("ln1.bias", h), ("attn.qkv.weight", 3 * h * h), ("attn.qkv.bias", 3 * h),
             ("attn.proj.weight", h * h), ("attn.proj.bias", h), ("ln2.weight", h), ("ln2.bias", h),
             ("mlp.fc1.weight", 4 * h * h), ("mlp.fc1.bias", 4 * h), ("mlp.fc2.weight", 4 * h * h),
             ("mlp.fc2.bias", h)]
    out, total, target, l = [], 0, state_bytes // 12, 0
    while total < target:
        for n, sz in layer:
            if total >= target:
                break
            take = min(sz, target - total)
            out.append(("layer%d.%s" % (l, n), take))
            total += take
        l += 1
    return out


def _align(nbytes):
    return (nbytes + IO_ALIGN - 1) // IO_ALIGN * IO_ALIGN


def _resize(t, numel):
    """_resize: frees or re-creates a tensor's storage, keeping the tensor
    (and so the optimizer's state keys)."""
    if hasattr(t, "untyped_storage"):
        t.untyped_storage().resize_(numel * t.element_size())
    else:  # torch < 2.0
        t.storage().resize_(numel)


def _rw_full(write, fd, offset, view):
    done = 0
    while done < len(view):
        n = (os.pwritev if write else os.preadv)(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError("short %s at offset %d" % ("pwritev" if write else "preadv", offset + done))
        done += n


class MilesStreaming:
    """Miles' streaming's optimizer step, as it runs, over fp32 mains of the
    given bf16 model params (a re-implementation of nvme_stream.py's method;
    the module itself needs Megatron):
      - plan_buckets: params in order, a bucket closes at BUCKET_NUMEL_LIMIT;
      - _Bucket: one file per bucket, segments [main | exp_avg | exp_avg_sq],
        each param's region IO_ALIGN-aligned, posix_fallocate'd;
      - _Stager.transfer: one pinned staging buffer; per chunk, buffered
        preadv then copy to the device (or copy to the host then pwritev);
      - step: per bucket fetch (main only before the moments exist), fused
        AdamW (torch.optim.AdamW(fused=True) standing in for Megatron's
        FusedAdam), copy the mains into the bf16 params
        (_copy_main_to_model_params), flush, and free the bucket's device
        storage (_resize to 0); no fsync anywhere.
    """

    def __init__(self, model_params, directory, lr, betas, eps, weight_decay):
        import torch
        self.torch = torch
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        cuda = bool(model_params) and model_params[0].is_cuda
        self.stage = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=cuda)
        self.stage_np = self.stage.numpy()
        self.buckets = []
        current, numel = [], 0
        for p in model_params:
            current.append(p)
            numel += p.numel()
            if numel >= BUCKET_NUMEL_LIMIT:
                self.buckets.append(current)
                current, numel = [], 0
        if current:
            self.buckets.append(current)
        self.files = []
        for i, params in enumerate(self.buckets):
            mains = [torch.empty(p.numel(), dtype=torch.float32, device=p.device) for p in params]
            offsets, at = {}, 0
            for seg in SEGMENTS:
                offsets[seg] = []
                for p in params:
                    offsets[seg].append(at)
                    at += _align(p.numel() * 4)
            path = os.path.join(directory, "bucket%05d.bin" % i)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.posix_fallocate(fd, 0, at)
            fused = {"fused": True} if cuda else {}
            opt = torch.optim.AdamW(mains, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **fused)
            # refresh_main_from_model_params: mains from the model, flushed,
            # synced and dropped from the page cache.
            for m, p in zip(mains, params):
                m.copy_(p.detach().view(-1))
            b = dict(path=path, fd=fd, params=params, mains=mains, offsets=offsets, nbytes=at, opt=opt,
                     moments_ready=False)
            self._move(b, ("main",), to_disk=True)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, offsets["exp_avg"][0], os.POSIX_FADV_DONTNEED)
            self.files.append(b)

    def _tensors(self, b, seg):
        for k, m in enumerate(b["mains"]):
            yield (m if seg == "main" else b["opt"].state[m][seg]), b["offsets"][seg][k]

    def _transfer(self, fd, offset, flat, to_disk):
        chunk = STAGING_BYTES // 4
        for pos in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - pos)
            host = self.stage[: n * 4].view(self.torch.float32)
            view = memoryview(self.stage_np[: n * 4])
            if to_disk:
                host.copy_(flat[pos:pos + n])
                _rw_full(True, fd, offset + pos * 4, view)
            else:
                _rw_full(False, fd, offset + pos * 4, view)
                flat[pos:pos + n].copy_(host)

    def _move(self, b, segs, to_disk):
        for seg in segs:
            for t, off in self._tensors(b, seg):
                if not to_disk:
                    _resize(t, t.numel())
                self._transfer(b["fd"], off, t.view(-1), to_disk)
                if to_disk:
                    _resize(t, 0)

    def step(self, grads):
        """grads: one fp32 device tensor per model param, in order."""
        gi = 0
        for b in self.files:
            self._move(b, SEGMENTS if b["moments_ready"] else SEGMENTS[:1], to_disk=False)
            for m in b["mains"]:
                m.grad = grads[gi]
                gi += 1
            b["opt"].step()
            for m, p in zip(b["mains"], b["params"]):
                m.grad = None
                p.detach().view(-1).copy_(m)
            self._move(b, SEGMENTS, to_disk=True)
            b["moments_ready"] = True

    def drop_page_cache(self):
        """The untimed eviction before a cold step (miles' streaming's own
        _drop_file_cache(sync=True)); returns the fdatasync seconds."""
        t = 0.0
        for b in self.files:
            t0 = time.perf_counter()
            os.fdatasync(b["fd"])
            t += time.perf_counter() - t0
            os.posix_fadvise(b["fd"], 0, b["nbytes"], os.POSIX_FADV_DONTNEED)
        return t

    def close(self):
        for b in self.files:
            os.close(b["fd"])


def io_floor(directory, nbytes, block=64 << 20, threads=4):
    """Seconds to read nbytes and write nbytes at the same time with O_DIRECT
    (threads per direction, fdatasync at the end): the I/O floor of a step."""
    import mmap
    import threading
    rpath, wpath = os.path.join(directory, "floor.read"), os.path.join(directory, "floor.write")
    nbytes = max(block, nbytes // block * block)
    with open(rpath, "wb") as f:
        buf = os.urandom(1 << 20) * (block >> 20)
        for _ in range(nbytes // block):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    rfd = os.open(rpath, os.O_RDONLY | os.O_DIRECT)
    wfd = os.open(wpath, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(wfd, 0, nbytes)
    blocks = nbytes // block
    times = {}

    def worker(write, k):
        m = mmap.mmap(-1, block)
        mv = memoryview(m)
        for i in range(k, blocks, threads):
            _rw_full(write, wfd if write else rfd, i * block, mv)
        mv.release()
        m.close()

    def run(write):
        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker, args=(write, k)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if write:
            os.fdatasync(wfd)
        times[write] = time.perf_counter() - t0

    both = [threading.Thread(target=run, args=(w,)) for w in (False, True)]
    for t in both:
        t.start()
    for t in both:
        t.join()
    os.close(rfd)
    os.close(wfd)
    os.unlink(rpath)
    os.unlink(wpath)
    return max(times.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--state-gib", type=float, default=8.0, help="optimizer state, 12 B/param (default 8)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the parameter mix (default 1024)")
    ap.add_argument("--budget-mib", type=int, default=2048, help="ours: device window (default 2048)")
    ap.add_argument("--host-cache-mib", type=int, default=0, help="ours: host cache tier (default 0)")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per method and T (default 3)")
    ap.add_argument("--t-factors", default="0,0.5,1,2", help="T as multiples of the I/O floor (default 0,0.5,1,2)")
    ap.add_argument("--floor-s", type=float, default=None, help="the I/O floor in seconds (default: measured)")
    ap.add_argument("--methods", default="ours,miles-warm,miles-cold", help="default ours,miles-warm,miles-cold")
    ap.add_argument("--prefetch", action="store_true", help="ours: call opt.prefetch() before the forward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        print("miles_loop: skipped: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("miles_loop: skipped: no CUDA device")
        return 0
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in ("ours", "miles-warm", "miles-cold"):
            ap.error("--methods: unknown method %r (ours, miles-warm, miles-cold)" % m)
    own_dir = args.dir is None
    root = tempfile.mkdtemp(prefix="optstate-loop-") if own_dir else args.dir
    work = os.path.join(root, "miles_loop")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    dev = torch.device("cuda")
    state_bytes = int(args.state_gib * (1 << 30))
    mix = param_mix(state_bytes, args.hidden)
    nparams = sum(n for _, n in mix)
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    print("state %.2f GiB: %d params in %d tensors; dir %s" % (nparams * 12 / 2**30, nparams, len(mix), work),
          flush=True)

    floor = args.floor_s if args.floor_s is not None else io_floor(work, nparams * 12)
    print("I/O floor (read + write %.2f GiB at once, O_DIRECT): %.3f s" % (nparams * 12 / 2**30, floor), flush=True)

    # "forward + backward": bf16 matmuls, calibrated.
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    bm = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, bm, out=c)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.matmul(a, bm, out=c)
    torch.cuda.synchronize()
    per_mm = (time.perf_counter() - t0) / 20

    def compute(n):
        for _ in range(n):
            torch.matmul(a, bm, out=c)

    g = torch.Generator(device=dev).manual_seed(1)
    models, grads32, opts = {}, {}, {}
    for m in methods:
        key = "miles" if m.startswith("miles") else m
        if key in models:
            continue
        params = [torch.nn.Parameter((torch.rand(n, device=dev, generator=g) * 0.2 - 0.1).to(torch.bfloat16))
                  for _, n in mix]
        models[key] = params
        if key == "ours":
            import optstate.torch
            for p in params:
                p.grad = (torch.rand(p.numel(), device=dev, generator=g) * 0.02 - 0.01).to(torch.bfloat16)
            opts[key] = optstate.torch.AdamW([(name, p) for (name, _), p in zip(mix, params)],
                                             store=os.path.join(work, "store"), budget=args.budget_mib << 20,
                                             host_cache_bytes=args.host_cache_mib << 20, **hyper)
        else:
            grads32[key] = [torch.rand(p.numel(), device=dev, generator=g) * 0.02 - 0.01 for p in params]
            opts[key] = MilesStreaming(params, os.path.join(work, "miles_streaming"), **hyper)

    def opt_step(m):
        if m == "ours":
            opts["ours"].step()
        else:
            opts["miles"].step(grads32["miles"])

    # Untimed first steps: ours commits its registrations and writes the
    # moments; miles' streaming's first step reads only its mains.
    for key in opts:
        opt_step("ours" if key == "ours" else "miles-warm")
    torch.cuda.synchronize()

    results = []
    factors = [float(x) for x in args.t_factors.split(",")]
    for f in factors:
        n_mm = int(round(f * floor / per_mm))
        # T: the compute alone, measured.
        t_comp = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            compute(n_mm)
            torch.cuda.synchronize()
            t_comp.append(time.perf_counter() - t0)
        T = statistics.median(t_comp)
        loops = {m: [] for m in methods}
        writeback = []
        for _ in range(args.iters):
            for m in methods:
                if m == "miles-cold":
                    writeback.append(opts["miles"].drop_page_cache())
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if m == "ours" and args.prefetch and hasattr(opts["ours"], "prefetch"):
                    opts["ours"].prefetch()
                compute(n_mm)
                opt_step(m)
                torch.cuda.synchronize()
                loops[m].append(time.perf_counter() - t0)
        row = {"t_factor": f, "t_seconds": T, "matmuls": n_mm,
               "loop_seconds": loops,
               "exposed_seconds": {m: statistics.median(v) - T for m, v in loops.items()},
               "fv_cold_writeback_seconds": writeback}
        ex = row["exposed_seconds"]
        if "ours" in ex:
            row["ours_over"] = {m: ex["ours"] / ex[m] for m in ex if m != "ours" and ex[m] > 0}
        results.append(row)
        print("\nT = %.2fx floor = %.3f s (%d matmuls of 8192^3 bf16)" % (f, T, n_mm))
        print("  %-8s %12s %14s %12s" % ("method", "loop (med)", "exposed (med)", "ours / this"))
        for m in methods:
            r = row.get("ours_over", {}).get(m)
            print("  %-8s %10.3f s %12.3f s %12s" % (m, statistics.median(loops[m]), ex[m],
                                                    "-" if r is None else "%.2fx" % r))
        sys.stdout.flush()

    out = {"state_bytes": nparams * 12, "params": nparams, "tensors": len(mix), "floor_seconds": floor,
           "budget_bytes": args.budget_mib << 20, "host_cache_bytes": args.host_cache_mib << 20,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results,
           "miles_streaming": {"buckets": len(opts["miles"].files) if "miles" in opts else 0,
                             "bucket_numel_limit": BUCKET_NUMEL_LIMIT, "staging_bytes": STAGING_BYTES}}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    for o in opts.values():
        o.close()
    opts.clear()
    shutil.rmtree(work, ignore_errors=True)
    if own_dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
