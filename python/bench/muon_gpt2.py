"""Streamed optstate.torch.Muon against the unstreamed reference on GPT-2.

Trains the same randomly initialised GPT-2 (transformers' GPT2LMHeadModel, 124M
with the default sizes) on the same synthetic token stream twice, interleaved
step by step, with the same hyperparameters:
  reference: torch.optim.Muon for the hidden weight matrices and
             torch.optim.AdamW for the rest (embeddings, layer norms, biases),
             all state in device memory;
  optstate:  optstate.torch.Muon (Muon for the same matrices, AdamW for the
             rest, use_muon=False for the embeddings), its state in an optstate
             store streamed through a --budget-mib device window.
Both use adjust_lr_fn "match_rms_adamw" (Moonlight's: one lr and weight decay
for both kinds of param). torch.optim.Muon runs Newton-Schulz in bf16, optstate
in fp32, so the runs drift apart by rounding; the final losses (mean of the
last 10 steps, or of all with fewer) are compared: target within 0.5%.

Prints both final losses and their relative difference; --json writes them with
every step's losses. --tiny (2 layers, hidden 128, vocab 512) with --steps 3
runs on the CPU in seconds (a smoke test). Needs a torch with torch.optim.Muon
(>= 2.9) and transformers.

Usage (GPU): OPTSTATE_LIB=.../liboptstate.so PYTHONPATH=python python3 python/bench/muon_gpt2.py --steps 200
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_compare import token_batches  # noqa: E402  (the same synthetic stream as the AdamW comparison)

import optstate.torch  # noqa: E402


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                     n_head=max(1, args.hidden // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=True, bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(cfg)


def split(model):
    """(Muon's matrices, the rest): the 2-D weights of the transformer blocks; the embeddings (wte is
    tied to the output head) and every 1-D param go to AdamW, as in Moonlight and Keller Jordan's runs."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        (matrices if p.ndim == 2 and ".wte." not in "." + name and ".wpe." not in "." + name else rest).append(
            (name, p))
    return matrices, rest


def run(args, store_dir):
    dev = torch.device(args.device)
    ref = build_model(args).to(dev)
    ours = build_model(args).to(dev)
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay, momentum=0.95, nesterov=True,
                 adjust_lr_fn="match_rms_adamw")
    adamw_hyper = dict(betas=(0.9, 0.95), eps=1e-8)
    ref_m, ref_r = split(ref)
    ref_muon = torch.optim.Muon([p for _, p in ref_m], **hyper)
    ref_adamw = torch.optim.AdamW([p for _, p in ref_r], lr=args.lr, weight_decay=args.weight_decay, **adamw_hyper)
    our_m, our_r = split(ours)
    backend = "cuda" if dev.type == "cuda" else "host"
    opt = optstate.torch.Muon([{"params": our_m}, {"params": our_r, "use_muon": False}], store=store_dir,
                              budget=args.budget_mib << 20, backend=backend,
                              host_cache_bytes=args.host_cache_mib << 20, adamw_betas=adamw_hyper["betas"],
                              adamw_eps=adamw_hyper["eps"], **hyper)
    autocast = dev.type == "cuda"
    rows = []
    try:
        for step, x in enumerate(token_batches(args.steps, args.batch, args.seq, args.vocab, args.seed + 1)):
            x = x.to(dev)
            losses, times = [], []
            for model, step_fns in ((ref, (ref_muon.step, ref_adamw.step)), (ours, (opt.step,))):
                t0 = time.perf_counter()
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = model(x, labels=x).loss
                loss.backward()
                for fn in step_fns:
                    fn()
                model.zero_grad(set_to_none=True)
                losses.append(loss.item())
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            rows.append(dict(step=step, loss_reference=losses[0], loss_optstate=losses[1], step_s_reference=times[0],
                             step_s_optstate=times[1]))
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:4d} loss reference {losses[0]:.4f} optstate {losses[1]:.4f}  "
                      f"step {times[0]:.3f}s / {times[1]:.3f}s", flush=True)
        stats = opt.stats()
    finally:
        opt.close()
    tail = rows[-10:]
    final_ref = statistics.mean(r["loss_reference"] for r in tail)
    final_ours = statistics.mean(r["loss_optstate"] for r in tail)
    return dict(params=sum(p.numel() for p in ref.parameters()), muon_params=sum(p.numel() for _, p in ref_m),
                steps=args.steps, device=str(dev), first_loss=rows[0]["loss_reference"],
                final_loss_reference=final_ref, final_loss_optstate=final_ours,
                rel_diff=abs(final_ours - final_ref) / abs(final_ref),
                median_step_s_reference=statistics.median(r["step_s_reference"] for r in rows),
                median_step_s_optstate=statistics.median(r["step_s_optstate"] for r in rows),
                optstate_peak_device_window_bytes=stats["peak_resident_bytes"], rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 128, vocab 512, seq 32, batch 2")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--budget-mib", type=int, default=512)
    ap.add_argument("--host-cache-mib", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.vocab, args.seq, args.batch = 2, 128, 512, 32, 2
        args.host_cache_mib = 0
    if not hasattr(torch.optim, "Muon"):
        sys.exit("muon_gpt2: torch %s has no torch.optim.Muon (torch >= 2.9)" % torch.__version__)
    work = args.dir or tempfile.mkdtemp(prefix="optstate-muon-gpt2-")
    try:
        out = run(args, os.path.join(work, "store"))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"final loss (mean of the last {min(10, args.steps)} steps): reference {out['final_loss_reference']:.5f} "
          f"optstate {out['final_loss_optstate']:.5f}  relative difference {100 * out['rel_diff']:.3f}% "
          f"(target < 0.5%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
