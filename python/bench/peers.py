"""optstate side by side with what a user would pick instead, each through its own code.

One training loop: a GPT-2 from a transformers config (random init, fp32
params on the GPU, bf16 autocast in forward and backward), the same synthetic
token batches for every method, methods interleaved in rounds of --round
steps. Methods (--methods, comma separated; a method whose package is missing
is reported as not run, with the reason):

  torch-fused        torch.optim.AdamW(fused=True), state in GPU memory: the
                     speed and quality reference where the state fits.
  bnb-8bit           bitsandbytes AdamW8bit, 8-bit state in GPU memory: the
                     quality reference for optstate's q8 moments.
  torchao-cpu        torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW,
                     fused CPU AdamW): state and an fp32 param copy in pinned
                     host memory, the step on the CPU.
  miles              miles' NVMe streaming's step as it runs (buffered
                     preadv/pwritev through one pinned buffer, no fsync; the
                     port in miles_loop.py).
  ours-f32, ours-bf16, ours-q8
                     optstate.torch.AdamW with that moment dtype, the host
                     RAM tier on (--host-cache-mib), durable every step.
  ours-f32-disk      the same with no RAM tier: every step reads the state
                     from the disk.
  ours-f32-prefetch  ours-f32 with opt.prefetch_on_forward(model).
  ours-f32-dur<N>    ours-f32 made durable every N steps (the durability of a
                     peer that checkpoints every N steps).
  ds-nvme, ds-cpu     DeepSpeed ZeRO stage 3 through its own engine (bf16,
                     its forward, backward and step), the optimizer offloaded
                     to NVMe (ZeRO-Infinity; --ds-aio block size, queue depth
                     and threads as its docs advise tuning) or to host memory;
                     DeepSpeedCPUAdam steps on the CPU in both.

Per method: the optimizer step's time (synchronised), the iteration's time
with forward and backward, peak GPU memory (torch's allocator plus optstate's
device window, which is mapped outside it), host memory it holds, disk bytes
written per step, checkpoint save and restore time through its own API, the
mean loss of the last 5 steps, and what a crash loses.

A checkpoint's save time is until durable, for every method: its save call
and then os.sync() inside the timed region (optstate's save fsyncs what it
writes; torch.save, DeepSpeed's save_checkpoint and miles' file copy leave
their bytes in the page cache, which os.sync() writes out). optstate's
checkpoint is its field files only (optstate.checkpoint.save(...,
safetensors=False): no state.safetensors, which would hold the same bytes
again), noted in its row.

Usage (GPU machine, from the repository root):
  OPTSTATE_LIB=build/default/capi/liboptstate.so PYTHONPATH=python \
    python3 python/bench/peers.py --size small --dir /root/peers --json peers.json
"""
import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_compare import token_batches  # noqa: E402  (same synthetic stream)

SIZES = {
    "tiny": dict(layers=2, hidden=128),  # the loop's smoke test  # GPT-2 shapes: 124M (state fits in GPU memory), 774M (12.4 GB of fp32 state + moments)
    "small": dict(layers=12, hidden=768),
    "large": dict(layers=36, hidden=1280),
}


def build_model(layers, hidden, vocab, seq, seed):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=hidden // 64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


CUDA = True  # --device cpu: a smoke run of the loop on the host (torch, miles and ours only)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def gpu_allocated():
    return torch.cuda.memory_allocated() if CUDA else 0


def gpu_peak():
    return torch.cuda.max_memory_allocated() if CUDA else 0


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def io_write_bytes():
    """Bytes this process sent (or dirtied for) storage so far (/proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("write_bytes"))


def tree_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


class Method:
    """One optimizer under test: build() makes its model and optimizer; step() one optimizer step."""
    durability = ""
    checkpoint_note = ""  # what save() writes, where it differs from the method's defaults
    disk_dir = None

    def __init__(self, name, args, work):
        self.name, self.args, self.work = name, args, work
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir, exist_ok=True)

    def window_peak(self):
        return 0

    def forward_backward(self, x):
        with torch.autocast("cuda" if CUDA else "cpu", dtype=torch.bfloat16):
            loss = self.model(x, labels=x).loss
        loss.backward()
        return loss

    def disk_written(self):
        """Bytes written to storage during this method's own iterations (/proc/self/io)."""
        return self.io_written

    def settle(self):
        """Waits for writes the last step left in flight, so that disk_written counts whole steps."""

    def save(self, path):
        torch.save(self.opt.state_dict(), os.path.join(path, "optim.pt"))

    def load(self, path):
        self.opt.load_state_dict(torch.load(os.path.join(path, "optim.pt"), weights_only=False))

    def close(self):
        pass


class TorchFused(Method):
    durability = "GPU memory: a crash loses everything since the last checkpoint"

    def build(self, model, hyper):
        self.opt = torch.optim.AdamW(model.parameters(), fused=CUDA, **hyper)

    def step(self):
        self.opt.step()


class Bnb8bit(Method):
    durability = "GPU memory: a crash loses everything since the last checkpoint"

    def build(self, model, hyper):
        import bitsandbytes as bnb
        self.opt = bnb.optim.AdamW8bit(model.parameters(), **hyper)

    def step(self):
        self.opt.step()


class TorchaoCpu(Method):
    durability = "host memory: a crash loses everything since the last checkpoint"

    def build(self, model, hyper):
        from torchao.optim import CPUOffloadOptimizer
        self.opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=False, **hyper)

    def step(self):
        self.opt.step()


class Miles(Method):
    durability = "page cache, never synced: a crash of the node loses what the kernel had not written"

    def build(self, model, hyper):
        from miles_loop import MilesStreaming
        self.params = list(model.parameters())
        self.opt = MilesStreaming(self.params, self.dir, **hyper)

    def step(self):
        self.opt.step([p.grad.float().view(-1) for p in self.params])

    def save(self, path):  # its state is its files (miles copies them into the checkpoint)
        for b in self.opt.files:
            os.fdatasync(b["fd"])
            shutil.copy(b["path"], path)

    def load(self, path):
        for b in self.opt.files:
            shutil.copy(os.path.join(path, os.path.basename(b["path"])), b["path"])
            b["moments_ready"] = True

    def close(self):
        self.opt.close()


class DeepSpeed(Method):
    """ZeRO-3 with the optimizer offloaded; one rank (torch.distributed over NCCL, world size 1)."""

    def __init__(self, name, args, work):
        super().__init__(name, args, work)
        self.device = name.split("-", 1)[1]
        self.durability = ("NVMe, never synced: a crash loses everything since the last checkpoint"
                           if self.device == "nvme" else
                           "host memory: a crash loses everything since the last checkpoint")

    def build(self, model, hyper):
        # DeepSpeed's JIT op builder parses each TORCH_CUDA_ARCH_LIST entry as "major.minor[+PTX]"; an
        # arch-specific entry such as "9.0a" (what some CUDA images export) fails its int() parse. Build its
        # ops for the device's own capability instead.
        if CUDA:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability()
        import deepspeed
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                     ("MASTER_PORT", "29533")):
            os.environ.setdefault(k, v)
        deepspeed.init_distributed(dist_backend="nccl")
        bs, qd, threads = (int(v) for v in self.args.ds_aio.split(","))
        offload = {"device": self.device, "pin_memory": True}
        if self.device == "nvme":
            offload.update(nvme_path=self.dir, buffer_count=4)
        cfg = {
            "train_micro_batch_size_per_gpu": self.args.batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 1 << 30,
            "optimizer": {"type": "AdamW", "params": {"lr": hyper["lr"], "betas": list(hyper["betas"]),
                                                      "eps": hyper["eps"], "weight_decay": hyper["weight_decay"]}},
            "zero_optimization": {"stage": 3, "offload_optimizer": offload},
            "aio": {"block_size": bs, "queue_depth": qd, "intra_op_parallelism": threads, "single_submit": False,
                    "overlap_events": True},
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=cfg)

    def forward_backward(self, x):
        loss = self.engine(x, labels=x).loss
        self.engine.backward(loss)
        return loss

    def step(self):
        self.engine.step()

    def save(self, path):
        self.engine.save_checkpoint(path, tag="bench")

    def load(self, path):
        self.engine.load_checkpoint(path, tag="bench")


class Ours(Method):
    def __init__(self, name, args, work):
        super().__init__(name, args, work)
        rest = name[len("ours-"):].split("-")
        self.moment = rest[0]
        self.ram = "disk" not in rest
        self.prefetch = "prefetch" in rest
        self.every = next((int(r[3:]) for r in rest if r.startswith("dur")), 1)
        self.durability = ("disk, durable every step: a crash loses at most the step in flight" if self.every == 1
                           else "disk, durable every %d steps: a crash loses at most %d steps" % (self.every,
                                                                                                  self.every))

    def build(self, model, hyper):
        import optstate.torch
        self.store = os.path.join(self.dir, "store")
        n = sum(p.numel() for p in model.parameters())  # the RAM tier holds the state, no more
        self.opt = optstate.torch.AdamW(
            model.named_parameters(), store=self.store, budget=self.args.budget_mib << 20,
            host_cache_bytes=min(self.args.host_cache_mib << 20, 16 * n) if self.ram else 0, moment_dtype=self.moment,
            durable_every_steps=self.every, **hyper)
        if self.prefetch:
            self.opt.prefetch_on_forward(model)
        self.model = model

    def step(self):
        self.opt.step()

    def window_peak(self):
        return self.opt.stats()["peak_resident_bytes"]

    def disk_written(self):
        return self.opt.store.stats()["lifetime_bytes_written"]

    def settle(self):
        self.opt.generation  # waits for the step's commit (its writes lag the step by one)

    checkpoint_note = "field files only (safetensors=False: no state.safetensors)"

    def save(self, path):
        import optstate.checkpoint
        optstate.checkpoint.save(self.opt, os.path.join(path, "optstate"), safetensors=False)

    def load(self, path):
        import optstate.checkpoint
        optstate.checkpoint.load(self.opt, os.path.join(path, "optstate"), force=True)

    def close(self):
        self.opt.close()


def make(name, args, work):
    table = {"torch-fused": TorchFused, "bnb-8bit": Bnb8bit, "torchao-cpu": TorchaoCpu, "miles": Miles}
    if name in table:
        return table[name](name, args, work)
    if name in ("ds-nvme", "ds-cpu"):
        return DeepSpeed(name, args, work)
    if name.startswith("ours-"):
        return Ours(name, args, work)
    raise SystemExit("unknown method %r (see --help)" % name)


def run(args, work):
    dev = torch.device("cuda" if CUDA else "cpu")
    shape = SIZES[args.size]
    hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batches = [x for x in token_batches(args.steps, args.batch, args.seq, args.vocab, args.seed + 1)]
    methods, skipped = [], {}
    template = build_model(shape["layers"], shape["hidden"], args.vocab, args.seq, args.seed)
    for name in [m for m in args.methods.split(",") if m]:
        m = make(name, args, work)
        sync()
        gc.collect()
        before_gpu, before_rss = gpu_allocated(), rss_bytes()
        try:
            model = copy.deepcopy(template).to(dev)
            m.build(model, hyper)
        except Exception as e:  # a peer that is not installed or refuses this setup: say so, go on
            tb = traceback.extract_tb(e.__traceback__)[-1]
            skipped[name] = "%s: %s (at %s:%d)" % (type(e).__name__, e, tb.filename, tb.lineno)
            print("%-18s not run: %s" % (name, skipped[name]), flush=True)
            continue
        sync()
        # What building it took (model, and any state made eagerly); the first step adds what it makes lazily.
        m.model = model
        m.built_gpu, m.built_rss = gpu_allocated() - before_gpu, rss_bytes() - before_rss
        m.losses, m.step_s, m.iter_s, m.peak, m.io_written = [], [], [], 0, 0
        methods.append(m)
    nparams = sum(p.numel() for p in methods[0].model.parameters()) if methods else 0
    print("GPT-2 %s: %d params (%.2f GB of fp32 main + Adam moments), %d steps, rounds of %d"
          % (args.size, nparams, 12 * nparams / 1e9, args.steps, args.round), flush=True)
    for r0 in range(0, args.steps, args.round):
        for m in methods:
            for s in range(r0, min(r0 + args.round, args.steps)):
                x = batches[s].to(dev)
                sync()
                base = gpu_allocated()
                if CUDA:
                    torch.cuda.reset_peak_memory_stats()
                io0, rss0 = io_write_bytes(), rss_bytes()
                t0 = time.perf_counter()
                loss = m.forward_backward(x)
                sync()
                t1 = time.perf_counter()
                m.step()
                sync()
                t2 = time.perf_counter()
                for p in m.model.parameters():
                    p.grad = None
                m.io_written += io_write_bytes() - io0
                m.losses.append(loss.item())
                m.step_s.append(t2 - t1)
                m.iter_s.append(t2 - t0)
                if s == 0:  # what the method holds once its state exists (lazily made by the first step)
                    m.held_gpu = m.built_gpu + gpu_allocated() - base
                    m.held_rss = m.built_rss + rss_bytes() - rss0
                    m.settle()
                    m.written0 = m.disk_written()
                m.peak = max(m.peak, gpu_peak() - base)
        print("round to step %d: %s" % (min(r0 + args.round, args.steps),
                                        "  ".join("%s %.4f" % (m.name, m.losses[-1]) for m in methods)), flush=True)
    rows = []
    warm = min(3, args.steps - 1)
    timed = slice(warm, None)
    for m in methods:
        m.settle()
        rows.append(dict(
            method=m.name, durability=m.durability,
            step_s=statistics.median(m.step_s[timed]), iter_s=statistics.median(m.iter_s[timed]),
            held_gpu_bytes=m.held_gpu, held_host_bytes=m.held_rss,
            disk_written_per_step=(m.disk_written() - m.written0) / max(1, args.steps - 1),
            final_loss=statistics.mean(m.losses[-5:]), losses=m.losses))
        print("%-18s step %.3f s, iteration %.3f s" % (m.name, rows[-1]["step_s"], rows[-1]["iter_s"]), flush=True)
    # Each method's checkpoint through its own API; then its files go (every method's state on one disk at once,
    # plus a checkpoint of each, does not fit beside a large model's).
    for m, row in zip(methods, rows):
        ck = os.path.join(work, "ck-" + m.name)
        os.makedirs(ck, exist_ok=True)
        window = m.window_peak()  # before the load, which makes a new manager
        sync()
        t0 = time.perf_counter()
        m.save(ck)
        os.sync()  # until durable: only some methods sync what they write
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.load(ck)
        sync()
        load_s = time.perf_counter() - t0
        row.update(peak_gpu_bytes=m.held_gpu + m.peak + window, window_peak_bytes=window,
                   checkpoint_save_s=save_s, checkpoint_load_s=load_s, checkpoint_bytes=tree_bytes(ck),
                   checkpoint_note=m.checkpoint_note)
        print("%-18s checkpoint save (until durable) %.2f s, load %.2f s, %.2f GB%s" % (
            m.name, save_s, load_s, row["checkpoint_bytes"] / 1e9,
            ", " + m.checkpoint_note if m.checkpoint_note else ""), flush=True)
        shutil.rmtree(ck, ignore_errors=True)
        m.close()
        shutil.rmtree(m.dir, ignore_errors=True)
    ref = next((r for r in rows if r["method"] == "torch-fused"), None)
    print("\n%-18s %9s %9s %8s %9s %9s %11s %8s %8s %10s" % (
        "method", "step s", "iter s", "step/ref", "peak GPU", "host", "disk/step", "save s", "load s",
        "final loss"))
    for r in rows:
        print("%-18s %9.3f %9.3f %8s %8.2fG %8.2fG %9.1fMB %8.2f %8.2f %10.4f" % (
            r["method"], r["step_s"], r["iter_s"], "%.2f" % (r["step_s"] / ref["step_s"]) if ref else "-",
            r["peak_gpu_bytes"] / 2**30, r["held_host_bytes"] / 2**30, r["disk_written_per_step"] / 1e6,
            r["checkpoint_save_s"], r["checkpoint_load_s"], r["final_loss"]))
    print("save s: the method's checkpoint save, then os.sync(): until durable, for every method")
    for r in rows:
        print("  %-18s %s%s" % (r["method"], r["durability"],
                                "; checkpoint: " + r["checkpoint_note"] if r["checkpoint_note"] else ""))
    for name, why in skipped.items():
        print("  %-18s not run: %s" % (name, why))
    return dict(size=args.size, params=nparams, steps=args.steps, rows=rows, skipped=skipped)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--methods", default="torch-fused,bnb-8bit,torchao-cpu,ds-nvme,ds-cpu,miles,ours-f32,"
                                         "ours-bf16,ours-q8,ours-f32-disk,ours-f32-prefetch,ours-f32-dur10")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--round", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--budget-mib", type=int, default=512)
    ap.add_argument("--host-cache-mib", type=int, default=16384)
    ap.add_argument("--ds-aio", default="8388608,32,8",
                    help="DeepSpeed aio block_size,queue_depth,intra_op_parallelism")
    ap.add_argument("--dir", default=None, help="where stores, state files and checkpoints go (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    global CUDA
    CUDA = args.device == "cuda"
    if CUDA and not torch.cuda.is_available():
        print("peers.py: no CUDA device; the peers (bitsandbytes, torchao, fused AdamW) need one")
        return
    work = args.dir or tempfile.mkdtemp(prefix="optstate-peers-")
    os.makedirs(work, exist_ok=True)
    try:
        result = dict(device=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__,
                      **run(args, work))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
