"""optstate.torch.AdamW against torch.optim.AdamW(fused=True) on a GPT-2 model.

Trains the same randomly initialised GPT-2 (transformers) on the same
synthetic token stream twice, interleaved step by step:
  torch:    fp32 params on the GPU, bf16 autocast, torch.optim.AdamW(fused=True)
            (fp32 weights, grads and both moments in GPU memory: 16 B/param);
  optstate: bf16 params on the GPU, fp32 mains and moments in an optstate store
            streamed through a --budget-mib device window.
Prints per-step losses, the largest relative loss difference, step times and
peak GPU memory of each (torch.cuda.max_memory_allocated for the model, grads
and activations; the store's device window is mapped outside torch's allocator
and reported from the manager's own peak).

Then the per-step overhead of the Python layer: a model of --many-tensors small
parameters, opt.step() wall time against the C++ step's own time
(StreamedAdam's last step seconds), as a ratio.

Usage (GPU): OPTSTATE_LIB=.../liboptstate.so PYTHONPATH=python python3 python/bench/gpt2_compare.py --json out.json
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import optstate.torch


def token_batches(steps, batch, seq, vocab, seed):
    """A learnable synthetic stream: tokens drawn from a Zipf(1.1) law over the
    vocabulary, and with probability 1/2 the successor of the previous token
    under a fixed random permutation, so the loss falls well below log V."""
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    perm = torch.randperm(vocab, generator=g)
    for _ in range(steps):
        x = torch.multinomial(probs, batch * seq, replacement=True, generator=g).view(batch, seq)
        follow = torch.rand(batch, seq, generator=g) < 0.5
        for t in range(1, seq):
            x[:, t] = torch.where(follow[:, t], perm[x[:, t - 1]], x[:, t])
        yield x


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                     n_head=args.hidden // 64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(cfg)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def compare(args, store_dir):
    dev = torch.device("cuda")
    base = build_model(args)
    nparams = sum(p.numel() for p in base.parameters())
    ntensors = sum(1 for _ in base.parameters())
    ref = base.to(dev)  # fp32
    ours = build_model(args).to(dev).to(torch.bfloat16)
    with torch.no_grad():
        for (n1, p1), (n2, p2) in zip(ref.named_parameters(), ours.named_parameters()):
            assert n1 == n2
            p2.copy_(p1.to(torch.bfloat16))
    # Our fp32 mains start from the bf16 params (as a user's bf16 model would).
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    topt = torch.optim.AdamW(ref.parameters(), fused=True, **hyper)
    oopt = optstate.torch.AdamW(ours.named_parameters(), store=store_dir, budget=args.budget_mib << 20,
                                host_cache_bytes=args.host_cache_mib << 20, **hyper)
    warm = 3
    rows = []
    peak_torch = peak_ours = 0
    for step, x in enumerate(token_batches(args.steps, args.batch, args.seq, args.vocab, args.seed + 1)):
        x = x.to(dev)
        # torch
        torch.cuda.reset_peak_memory_stats()

        def run_ref():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ref(x, labels=x).loss
            loss.backward()
            fb = time.perf_counter()
            topt.step()
            topt.zero_grad(set_to_none=True)
            return loss.item(), fb
        (lt, fb_t), t_ref = timed(run_ref)
        peak_torch = max(peak_torch, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

        def run_ours():
            loss = ours(x, labels=x).loss
            loss.backward()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            oopt.step()
            t1 = time.perf_counter()
            oopt.zero_grad(set_to_none=True)
            return loss.item(), t1 - t0
        (lo, opt_s), t_ours = timed(run_ours)
        peak_ours = max(peak_ours, torch.cuda.max_memory_allocated())
        rows.append(dict(step=step, loss_torch=lt, loss_optstate=lo, step_s_torch=t_ref, step_s_optstate=t_ours,
                         opt_s_optstate=opt_s))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss torch {lt:.4f} optstate {lo:.4f}  step {t_ref:.3f}s / {t_ours:.3f}s", flush=True)
    st = oopt.stats()
    rel = [abs(r["loss_optstate"] - r["loss_torch"]) / abs(r["loss_torch"]) for r in rows]
    timed_rows = rows[warm:]
    out = dict(
        params=nparams, tensors=ntensors, steps=args.steps, budget_bytes=args.budget_mib << 20,
        state_bytes=12 * nparams,
        max_rel_loss_diff=max(rel), max_rel_loss_diff_step=rel.index(max(rel)),
        final_loss_torch=statistics.mean(r["loss_torch"] for r in rows[-10:]),
        final_loss_optstate=statistics.mean(r["loss_optstate"] for r in rows[-10:]),
        first_loss=rows[0]["loss_torch"],
        median_step_s_torch=statistics.median(r["step_s_torch"] for r in timed_rows),
        median_step_s_optstate=statistics.median(r["step_s_optstate"] for r in timed_rows),
        median_opt_step_s_optstate=statistics.median(r["opt_s_optstate"] for r in timed_rows),
        peak_torch_alloc_bytes=peak_torch, peak_optstate_torch_alloc_bytes=peak_ours,
        optstate_peak_device_window_bytes=st["peak_resident_bytes"],
        rows=rows)
    oopt.close()
    return out


def overhead(args, store_dir):
    """opt.step() wall against the C++ step's own seconds, many small tensors."""
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)
    params = [torch.nn.Parameter(torch.randn(args.many_numel, device=dev, dtype=torch.bfloat16))
              for _ in range(args.many_tensors)]
    opt = optstate.torch.AdamW([(f"p{i:05d}", p) for i, p in enumerate(params)], store=store_dir,
                               budget=args.budget_mib << 20, lr=1e-3)
    walls, cpps = [], []
    for step in range(args.overhead_steps):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        wall = time.perf_counter() - t0
        print(f"overhead step {step}: opt.step() {wall:.4f} s, library {opt.last_step_seconds():.4f} s", flush=True)
        if step >= 2:
            walls.append(wall)
            cpps.append(opt.last_step_seconds())
    opt.close()
    ratio = [w / c for w, c in zip(walls, cpps)]
    return dict(tensors=args.many_tensors, numel_each=args.many_numel, steps=len(walls),
                median_wall_s=statistics.median(walls), median_cpp_step_s=statistics.median(cpps),
                median_ratio=statistics.median(ratio), min_ratio=min(ratio), max_ratio=max(ratio))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--host-cache-mib", type=int, default=4096)
    ap.add_argument("--many-tensors", type=int, default=1024)
    ap.add_argument("--many-numel", type=int, default=4096)
    ap.add_argument("--overhead-steps", type=int, default=10)
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="optstate-gpt2-")
    os.makedirs(work, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    try:
        if not args.skip_compare:
            result["compare"] = compare(args, os.path.join(work, "gpt2.store"))
            c = result["compare"]
            print(json.dumps({k: v for k, v in c.items() if k != "rows"}, indent=1), flush=True)
        result["overhead"] = overhead(args, os.path.join(work, "many.store"))
        print(json.dumps(result["overhead"], indent=1), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
