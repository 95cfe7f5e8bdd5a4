"""Training quality of each moment dtype: the same GPT-2 from the same start.

Trains one randomly initialised GPT-2 (transformers; the default 12 x 768 with
GPT-2's vocabulary has 124M parameters) once per moment dtype, interleaved
step by step on the same synthetic batches (gpt2_compare.token_batches):
  f32      optstate.torch.AdamW, fp32 mains and moments in the store;
  bf16     the same with bf16 moments;
  q8       the same with 8-bit block-scaled moments;
  torch    (with --torch) torch.optim.AdamW(fused=True) on fp32 params, the
           reference for optstate's f32 run itself.
optstate runs use bf16 params and bf16 grads (fp32 mains in the store), the
set-up of a bf16 trainer with master weights. A dtype the library refuses is
reported and left out.

Reports each run's loss per step, its final loss (mean of the last --tail
steps) and that loss's gap to f32's, in percent. Writes JSON (--json) and a
loss-curve plot as SVG (--svg; plain SVG, no plotting library needed).

Usage (GPU): OPTSTATE_LIB=.../liboptstate.so PYTHONPATH=python \
    python3 python/bench/moment_quality.py --steps 300 --json q.json --svg q.svg
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

import torch

import optstate
import optstate.torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_compare import build_model, token_batches  # noqa: E402


def make_runs(args, work):
    dev = torch.device("cuda")
    base = build_model(args)
    runs = {}
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for dt in args.dtypes.split(","):
        model = build_model(args).to(dev).to(torch.bfloat16)
        with torch.no_grad():
            for p, q in zip(model.parameters(), base.parameters()):
                p.copy_(q.to(dev).to(torch.bfloat16))
        try:
            opt = optstate.torch.AdamW(model.named_parameters(), store=os.path.join(work, dt + ".store"),
                                       budget=args.budget_mib << 20, moment_dtype=dt, **hyper)
        except (optstate.Error, TypeError) as e:
            print(f"moment dtype {dt}: not available: {e}", flush=True)
            continue
        runs[dt] = (model, opt, False)
    if args.torch:
        model = build_model(args).to(dev)
        with torch.no_grad():
            for p, q in zip(model.parameters(), base.parameters()):
                p.copy_(q.to(dev).to(torch.bfloat16).float())  # the same start as the bf16 runs
        runs["torch"] = (model, torch.optim.AdamW(model.parameters(), fused=True, **hyper), True)
    return runs


def train(args, work):
    runs = make_runs(args, work)
    losses = {name: [] for name in runs}
    dev = torch.device("cuda")
    for step, x in enumerate(token_batches(args.steps, args.batch, args.seq, args.vocab, args.seed + 1)):
        x = x.to(dev)
        for name, (model, opt, autocast) in runs.items():
            if autocast:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, labels=x).loss
            else:
                loss = model(x, labels=x).loss
            loss.backward()
            torch.cuda.synchronize()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d} " + "  ".join(f"{n} {l[-1]:.4f}" for n, l in losses.items()), flush=True)
    for _, opt, is_torch in runs.values():
        if not is_torch:
            opt.close()
    nparams = sum(p.numel() for p in runs[next(iter(runs))][0].parameters())
    final = {n: statistics.mean(l[-args.tail:]) for n, l in losses.items()}
    gap = {n: 100.0 * (v - final["f32"]) / final["f32"] for n, v in final.items()} if "f32" in final else {}
    return dict(params=nparams, steps=args.steps, tail=args.tail, first_loss=losses[next(iter(losses))][0],
                final_loss=final, gap_to_f32_percent=gap, losses=losses)


def svg(result, path):
    """Loss curves, one polyline per run, a 50-step moving average."""
    colors = {"f32": "#1f77b4", "bf16": "#ff7f0e", "q8": "#2ca02c", "torch": "#7f7f7f"}
    W, H, L, B = 720, 420, 60, 40
    curves = {}
    for n, l in result["losses"].items():
        k = 10
        curves[n] = [statistics.mean(l[max(0, i - k + 1):i + 1]) for i in range(len(l))]
    lo = min(min(c) for c in curves.values())
    hi = max(max(c[5:]) for c in curves.values())
    steps = result["steps"]

    def xy(i, v):
        return L + (W - L - 20) * i / max(1, steps - 1), 20 + (H - B - 20) * (hi - v) / max(1e-9, hi - lo)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="14">GPT-2 ({result["params"] / 1e6:.0f}M params), training loss '
           f'(10-step mean) by moment dtype</text>']
    for f in range(5):
        v = lo + (hi - lo) * f / 4
        _, y = xy(0, v)
        out.append(f'<line x1="{L}" x2="{W - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="4" y="{y + 4:.1f}">{v:.3f}</text>')
    for f in range(5):
        i = (steps - 1) * f // 4
        x, _ = xy(i, lo)
        out.append(f'<text x="{x:.1f}" y="{H - B + 16}" text-anchor="middle">{i}</text>')
    out.append(f'<text x="{(W + L) / 2}" y="{H - 6}" text-anchor="middle">step</text>')
    for j, (n, c) in enumerate(curves.items()):
        pts = " ".join("%.1f,%.1f" % xy(i, v) for i, v in enumerate(c))
        col = colors.get(n, "#000")
        out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.5" points="{pts}"/>')
        gap = result["gap_to_f32_percent"].get(n)
        label = n + (f" (final {result['final_loss'][n]:.4f}, {gap:+.2f}% vs f32)" if gap is not None else "")
        out.append(f'<text x="{W - 330}" y="{40 + 16 * j}" fill="{col}">{label}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="f32,bf16,q8")
    ap.add_argument("--torch", action="store_true", help="also torch.optim.AdamW(fused=True) on fp32 params")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None)
    ap.add_argument("--svg", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moment_quality: no CUDA device; nothing to measure")
        return
    work = args.dir or tempfile.mkdtemp(prefix="optstate-moments-")
    os.makedirs(work, exist_ok=True)
    try:
        result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, **train(args, work))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.svg:
        svg(result, args.svg)


if __name__ == "__main__":
    main()
