#!/usr/bin/env python3
"""Our fused Adam/AdamW kernel vs torch's, on an H100/H200.

1. Accuracy: 10 steps of optstate_adam_step (liboptstate_kernels_capi.so,
   through ctypes on torch tensors' data_ptr()) and of
   torch.optim.AdamW(fused=True) / torch.optim.Adam(fused=True) on identical
   tensors; max abs / rel differences of params and both moments, and of the
   bf16 param copy against torch's param.bfloat16().
2. Benchmark on 2^28 elements: GB/s of our kernel (fp32 state, bf16 grad,
   bf16 param copy: 24 + 2 + 2 = 28 B/element), of torch's fused AdamW (fp32
   param and grad, which torch requires to share a dtype: 8 + 4 + 16 = 28
   B/element, the same traffic), of torch's step followed by the bf16 copy our
   kernel folds in, and of a device-to-device copy (read + write bytes), all in
   the same run. CUDA events, median of --iters after --warmup.

Usage: torch_compare.py --lib build/default/kernels/liboptstate_kernels_capi.so [--out DIR]
       torch_compare.py --lib ... --cpu-selftest   (no torch/GPU: checks the ctypes ABI with numpy)
"""
import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys

F32, BF16, F16, NONE = 0, 1, 2, 255
ADAM, ADAMW = 0, 1
BYTES_PER_ELEMENT = 28  # 3 fp32 state arrays read + written (24) + grad read (2) + param written (2)

_COMMON = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # main, exp_avg, exp_avg_sq
           ctypes.c_void_p, ctypes.c_int,                       # grad, grad_type
           ctypes.c_void_p, ctypes.c_int,                       # param, param_type
           ctypes.c_void_p, ctypes.c_uint64,                    # found_inf, count
           ctypes.c_double, ctypes.c_double, ctypes.c_double,   # lr, beta1, beta2
           ctypes.c_double, ctypes.c_double, ctypes.c_int,      # eps, weight_decay, mode
           ctypes.c_uint64, ctypes.c_float]                     # step, grad_scale


def load_lib(path):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.optstate_adam_step.argtypes = _COMMON + [ctypes.c_void_p]
    lib.optstate_adam_step.restype = ctypes.c_int
    lib.optstate_adam_step_config.argtypes = _COMMON + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.optstate_adam_step_config.restype = ctypes.c_int
    lib.optstate_adam_step_cpu.argtypes = _COMMON + [ctypes.c_int]
    lib.optstate_adam_step_cpu.restype = ctypes.c_int
    lib.optstate_kernels_cuda_built.argtypes = []
    lib.optstate_kernels_cuda_built.restype = ctypes.c_int
    return lib


class Hyper:
    def __init__(self, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01):
        self.lr, self.beta1, self.beta2, self.eps, self.weight_decay = lr, beta1, beta2, eps, weight_decay


def our_step(lib, main, m, v, grad, grad_type, param, param_type, n, h, mode, step,
             stream=0, config=None):
    args = [main, m, v, grad, grad_type, param, param_type, None, n, h.lr, h.beta1, h.beta2,
            h.eps, h.weight_decay, mode, step, 1.0]
    if config is None:
        err = lib.optstate_adam_step(*args, stream)
    else:
        err = lib.optstate_adam_step_config(*args, *config, stream)
    if err != 0:
        raise RuntimeError(f"optstate_adam_step returned cudaError {err} (n={n}, config={config})")


# --------------------------------------------------------------------------- CPU self-test
def cpu_selftest(lib):
    """Checks the ctypes signature (no torch, numpy or GPU needed):
    optstate_adam_step_cpu vs a plain-Python fp64 AdamW over 10 steps."""
    import random
    n, h = 1003, Hyper(lr=1e-2, weight_decay=0.1)
    rnd = random.Random(0)
    Arr = ctypes.c_float * n
    main = Arr(*[rnd.gauss(0, 1) for _ in range(n)])
    m, v, copy, g = Arr(), Arr(), Arr(), Arr()
    ref_p, ref_m, ref_v = [float(x) for x in main], [0.0] * n, [0.0] * n
    lr, b1, b2, eps, wd = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay  # doubles, as the C side sees them
    for step in range(1, 11):
        for i in range(n):
            g[i] = rnd.gauss(0, 1)
        err = lib.optstate_adam_step_cpu(ctypes.addressof(main), ctypes.addressof(m),
                                         ctypes.addressof(v), ctypes.addressof(g), F32,
                                         ctypes.addressof(copy), F32, None, n, h.lr, h.beta1,
                                         h.beta2, h.eps, h.weight_decay, ADAMW, step, 1.0, 1)
        assert err == 0, err
        for i in range(n):
            ref_p[i] *= 1 - lr * wd
            ref_m[i] = b1 * ref_m[i] + (1 - b1) * g[i]
            ref_v[i] = b2 * ref_v[i] + (1 - b2) * g[i] * g[i]
            denom = math.sqrt(ref_v[i] / (1 - b2 ** step)) + eps
            ref_p[i] -= lr / (1 - b1 ** step) * ref_m[i] / denom
    d = max(abs(main[i] - ref_p[i]) for i in range(n))
    same = all(copy[i] == main[i] for i in range(n))
    print(f"cpu selftest: max |main - fp64 ref| = {d:.3e}; param copy == main: {same}")
    return d < 1e-5 and same


# --------------------------------------------------------------------------- GPU parts
def diff_stats(torch, ours, ref):
    ours, ref = ours.double(), ref.double()
    d = (ours - ref).abs()
    scale = ref.abs().max().clamp_min(1e-30)
    # Elementwise relative difference with a floor of 1e-3 * max|ref| in the
    # denominator, so values near zero (moments of tiny grads) don't blow it up.
    rel = d / torch.maximum(ref.abs(), 1e-3 * scale)
    return {"max_abs": d.max().item(), "max_rel": rel.max().item(),
            "bit_identical": (ours == ref).double().mean().item()}


def accuracy(torch, lib, n, mode, grad_type, param_type, steps=10):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1234)
    h = Hyper()
    init = torch.randn(n, device=dev, generator=gen) * 0.1
    main = init.clone()
    m = torch.zeros(n, device=dev)
    v = torch.zeros(n, device=dev)
    tdt = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}
    param = torch.empty(n, device=dev, dtype=tdt[param_type]) if param_type != NONE else None
    p = torch.nn.Parameter(init.clone())
    cls = torch.optim.AdamW if mode == ADAMW else torch.optim.Adam
    opt = cls([p], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
              fused=True)
    stream = torch.cuda.current_stream().cuda_stream
    for step in range(1, steps + 1):
        g = (torch.randn(n, device=dev, generator=gen) * 1e-2).to(tdt[grad_type])
        p.grad = g.float()  # same values (bf16/fp16 -> fp32 is exact); torch needs grad dtype == param dtype
        opt.step()
        our_step(lib, main.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), grad_type,
                 param.data_ptr() if param is not None else None, param_type, n, h, mode, step,
                 stream)
    torch.cuda.synchronize()
    st = opt.state[p]
    out = {"mode": "AdamW" if mode == ADAMW else "Adam", "n": n, "steps": steps,
           "grad": {F32: "fp32", BF16: "bf16", F16: "fp16"}[grad_type],
           "param_copy": {F32: "fp32", BF16: "bf16", F16: "fp16", NONE: "none"}[param_type],
           "main": diff_stats(torch, main, p.detach()),
           "exp_avg": diff_stats(torch, m, st["exp_avg"]),
           "exp_avg_sq": diff_stats(torch, v, st["exp_avg_sq"])}
    if param is not None:
        out["param_copy_vs_torch_param_cast"] = diff_stats(torch, param.float(),
                                                           p.detach().to(param.dtype).float())
    return out


def time_ms(torch, fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def benchmark(torch, lib, n, warmup, iters, configs):
    dev = "cuda"
    h = Hyper()
    res = {"n": n, "bytes_per_element": BYTES_PER_ELEMENT, "warmup": warmup, "iters": iters}
    stream = torch.cuda.current_stream().cuda_stream
    gbs = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9

    # Device-to-device copy bandwidth on buffers the size of our largest
    # arrays (n fp32); bytes = read + write.
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(torch, lambda: dst.copy_(src), warmup, iters)
    res["copy"] = {"ms": ms, "GBps": gbs(2 * 4 * n, ms)}
    del src, dst

    # Ours: fp32 state, bf16 grad, bf16 param copy.
    main = torch.randn(n, device=dev) * 0.1
    m = torch.zeros(n, device=dev)
    v = torch.zeros(n, device=dev)
    g16 = (torch.randn(n, device=dev) * 1e-2).bfloat16()
    p16 = torch.empty(n, device=dev, dtype=torch.bfloat16)
    ptrs = (main.data_ptr(), m.data_ptr(), v.data_ptr(), g16.data_ptr())
    counter = [0]

    def ours(config=None, grad=BF16, gptr=None, param=BF16):
        counter[0] += 1
        our_step(lib, ptrs[0], ptrs[1], ptrs[2], gptr or ptrs[3], grad,
                 p16.data_ptr() if param != NONE else None, param, n, h, ADAMW,
                 counter[0], stream, config)

    ms = time_ms(torch, ours, warmup, iters)
    res["ours_bf16grad_bf16copy"] = {"ms": ms, "GBps": gbs(BYTES_PER_ELEMENT * n, ms)}
    sweep = []
    for c in configs:
        cms = time_ms(torch, lambda: ours(c), warmup, iters)
        sweep.append({"threads": c[0], "unroll": c[1], "blocks_per_sm": c[2], "ms": cms,
                      "GBps": gbs(BYTES_PER_ELEMENT * n, cms)})
    res["ours_sweep"] = sweep
    g32 = torch.randn(n, device=dev) * 1e-2
    ms = time_ms(torch, lambda: ours(grad=F32, gptr=g32.data_ptr(), param=NONE), warmup, iters)
    res["ours_fp32grad_nocopy"] = {"ms": ms, "GBps": gbs(BYTES_PER_ELEMENT * n, ms)}
    del main, m, v, g16, g32

    # torch fused AdamW: fp32 param + fp32 grad (28 B/element as well).
    p = torch.nn.Parameter(torch.randn(n, device=dev) * 0.1)
    p.grad = torch.randn(n, device=dev) * 1e-2
    opt = torch.optim.AdamW([p], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                            weight_decay=h.weight_decay, fused=True)
    opt.step()  # creates the state
    ms = time_ms(torch, opt.step, warmup, iters)
    res["torch_fused_adamw"] = {"ms": ms, "GBps": gbs(BYTES_PER_ELEMENT * n, ms)}

    def step_and_copy():
        opt.step()
        p16.copy_(p.detach())

    ms = time_ms(torch, step_and_copy, warmup, iters)
    res["torch_fused_adamw_plus_bf16_copy"] = {
        "ms": ms, "GBps_useful": gbs(BYTES_PER_ELEMENT * n, ms),
        "GBps_moved": gbs((BYTES_PER_ELEMENT + 6) * n, ms)}
    del p, opt, p16
    torch.cuda.empty_cache()

    best = min(sweep, key=lambda r: r["ms"]) if sweep else None
    ours_ms = res["ours_bf16grad_bf16copy"]["ms"]
    res["summary"] = {
        "speedup_vs_torch_fused": res["torch_fused_adamw"]["ms"] / ours_ms,
        "speedup_vs_torch_fused_plus_copy": res["torch_fused_adamw_plus_bf16_copy"]["ms"] / ours_ms,
        "fraction_of_copy_bw": res["ours_bf16grad_bf16copy"]["GBps"] / res["copy"]["GBps"],
        "best_config": best,
        "best_fraction_of_copy_bw": (best["GBps"] / res["copy"]["GBps"]) if best else None,
    }
    return res


def markdown(env, acc, bench):
    lines = [f"Run {env['date']} on {env['gpu']} (driver {env['driver']}, torch {env['torch']}).", ""]
    lines += ["| case | main max abs | main max rel | exp_avg max rel | exp_avg_sq max rel | param copy max abs |",
              "| --- | --- | --- | --- | --- | --- |"]
    for a in acc:
        pc = a.get("param_copy_vs_torch_param_cast", {}).get("max_abs", float("nan"))
        lines.append(f"| {a['mode']} grad {a['grad']} copy {a['param_copy']} n={a['n']} x{a['steps']} steps "
                     f"| {a['main']['max_abs']:.2e} | {a['main']['max_rel']:.2e} "
                     f"| {a['exp_avg']['max_rel']:.2e} | {a['exp_avg_sq']['max_rel']:.2e} | {pc:.2e} |")
    b = bench
    n = b["n"]
    lines += ["", f"Benchmark, n = {n} (2^{int(math.log2(n))}) elements, {b['bytes_per_element']} B/element, "
              f"median of {b['iters']} after {b['warmup']} warm-up:", "",
              "| what | ms | GB/s | vs copy BW |", "| --- | --- | --- | --- |"]
    cbw = b["copy"]["GBps"]
    def row(name, r, key="GBps"):
        return f"| {name} | {r['ms']:.3f} | {r[key]:.0f} | {r[key] / cbw:.1%} |"
    lines.append(row("device-to-device copy (read+write)", b["copy"]))
    lines.append(row("ours: fp32 state, bf16 grad, bf16 param copy", b["ours_bf16grad_bf16copy"]))
    lines.append(row("ours: fp32 state, fp32 grad, no copy", b["ours_fp32grad_nocopy"]))
    lines.append(row("torch AdamW(fused=True), fp32 param+grad", b["torch_fused_adamw"]))
    lines.append(row("torch fused step + param.to(bf16) copy (useful bytes)",
                     b["torch_fused_adamw_plus_bf16_copy"], "GBps_useful"))
    s = b["summary"]
    lines += ["", f"Ours vs torch fused AdamW: {s['speedup_vs_torch_fused']:.2f}x "
              f"(vs torch step + bf16 copy: {s['speedup_vs_torch_fused_plus_copy']:.2f}x); "
              f"ours = {s['fraction_of_copy_bw']:.1%} of copy bandwidth."]
    if b["ours_sweep"]:
        lines += ["", "Launch-shape sweep (threads, unroll, blocks/SM; 0 = occupancy max):", "",
                  "| threads | unroll | blocks/SM | ms | GB/s |", "| --- | --- | --- | --- | --- |"]
        for r in b["ours_sweep"]:
            lines.append(f"| {r['threads']} | {r['unroll']} | {r['blocks_per_sm']} | {r['ms']:.3f} | {r['GBps']:.0f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True, help="path to liboptstate_kernels_capi.so")
    ap.add_argument("--out", default=None, help="directory for torch_compare.json / .md")
    ap.add_argument("--n", type=int, default=1 << 28, help="benchmark elements (default 2^28)")
    ap.add_argument("--acc-n", type=int, default=(1 << 20) + 3, help="accuracy elements")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")
    ap.add_argument("--cpu-selftest", action="store_true")
    args = ap.parse_args()
    lib = load_lib(args.lib)
    if args.cpu_selftest:
        sys.exit(0 if cpu_selftest(lib) else 1)

    import torch
    if not torch.cuda.is_available():
        sys.exit("torch_compare: no CUDA device visible")
    if not lib.optstate_kernels_cuda_built():
        sys.exit(f"torch_compare: {args.lib} was built without CUDA")
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        driver = "?"
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
           "host": platform.node()}

    acc = []
    for mode, gt, pt in [(ADAMW, BF16, BF16), (ADAMW, F32, F32), (ADAMW, F16, F16), (ADAM, BF16, BF16),
                         (ADAM, F32, NONE)]:
        acc.append(accuracy(torch, lib, args.acc_n, mode, gt, pt))
        a = acc[-1]
        print(f"accuracy {a['mode']} grad={a['grad']} copy={a['param_copy']}: "
              f"main max_abs {a['main']['max_abs']:.3e} max_rel {a['main']['max_rel']:.3e}; "
              f"exp_avg max_rel {a['exp_avg']['max_rel']:.3e}; exp_avg_sq max_rel {a['exp_avg_sq']['max_rel']:.3e}",
              flush=True)
    configs = [] if args.no_sweep else [(t, u, b) for t in (128, 256, 512) for u in (1, 2, 4) for b in (0, 8, 32, 64)]
    bench = benchmark(torch, lib, args.n, args.warmup, args.iters, configs)
    md = markdown(env, acc, bench)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "torch_compare.json"), "w") as f:
            json.dump({"env": env, "accuracy": acc, "benchmark": bench}, f, indent=1)
        with open(os.path.join(args.out, "torch_compare.md"), "w") as f:
            f.write(md + "\n")
    # Accuracy gate: fp32 math with a few double products in torch vs all fp32
    # in ours; a real bug is orders of magnitude above these.
    ok = all(a["main"]["max_rel"] < 1e-4 and a["exp_avg"]["max_rel"] < 1e-4 and
             a["exp_avg_sq"]["max_rel"] < 1e-4 for a in acc)
    print("ACCURACY", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
