"""Megatron-core's optimizer step on one GPU: its own DistributedOptimizer (state in GPU memory),
the same optimizer streaming its state through optstate, and through miles' NVMe streaming
(radixark/miles miles_plugins/optimizers/nvme_stream.py, re-implemented in miles_loop.py's
MilesStreaming and bound into the DistributedOptimizer's step as miles binds it), on the same model
and batches in one run.

Each method builds the same GPTModel (Megatron-core's local layer spec: no Transformer Engine
needed), wraps it in Megatron's DDP with the distributed optimizer (NCCL, world size 1) and trains
--warmup + --steps steps; the time of optimizer.step() (grad copy, clipping, the update and the
param all-gather; the same code around the update for every method) is measured per step with the
GPU synchronised around it. Prints a table (median and max step seconds, the state's bytes, the
losses' largest relative difference to Megatron's own) and writes JSON with --json. miles-cold
evicts its files from the page cache before each step (untimed), as a state larger than RAM would.
The port of miles' streaming uses one lr and weight decay for all params (as the loop benchmark does);
optstate and Megatron follow the param groups.

Usage (GPU machine; repository root, liboptstate.so built, megatron-core installed):
  OPTSTATE_LIB=build/default/capi/liboptstate.so PYTHONPATH=python \\
    python3 python/bench/megatron_step.py --dir /root/osb --layers 8 --hidden 2048 --json megatron.json
Without CUDA or megatron-core it prints why and exits 0.
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ("megatron", "optstate", "miles-warm", "miles-cold")


def build(a):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=4 * a.hidden,
                               num_attention_heads=max(1, a.hidden // 128), use_cpu_initialization=True,
                               bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=a.vocab,
                   max_sequence_length=a.seq).cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               overlap_param_gather=False, use_distributed_optimizer=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=a.lr, weight_decay=0.1,
                                                       adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0, bf16=True,
                                                       use_distributed_optimizer=True), [model])
    return model, optimizer


def bind_miles(optimizer, directory, lr):
    """miles' streaming bound as miles binds it: step_with_ready_grads runs its bucketed step over
    the rank's shards, then Megatron's param all-gather; Megatron's own mains are freed."""
    from types import MethodType
    import optstate.megatron as om
    from miles_loop import MilesStreaming
    ports = []
    for dist_opt in optimizer.chained_optimizers:
        shards = om.shard_layout(dist_opt)
        port = MilesStreaming([s.param for s in shards], os.path.join(directory, "opt%d" % len(ports)), lr=lr,
                          betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        for s in shards:
            if s.own_main:
                s.main.untyped_storage().resize_(0)

        def step_with_ready_grads(self, port=port, shards=shards):
            port.step([s.main.grad for s in shards])
            if not self.ddp_config.overlap_param_gather:
                for chunk in self.model_chunks:
                    chunk.start_param_sync()
            return True
        dist_opt.step_with_ready_grads = MethodType(step_with_ready_grads, dist_opt)
        ports.append(port)
    return ports


def batch(a, step):
    import torch
    g = torch.Generator().manual_seed(5000 + step)
    start = torch.randint(0, a.vocab, (a.batch, 1), generator=g)
    stride = torch.randint(1, 4, (a.batch, 1), generator=g)
    tokens = (start + stride * torch.arange(a.seq + 1).unsqueeze(0)) % a.vocab
    pos = torch.arange(a.seq).unsqueeze(0).expand(a.batch, a.seq)
    mask = torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), diagonal=1).view(1, 1, a.seq, a.seq)
    return [t.cuda() for t in (tokens[:, :-1].contiguous(), pos.contiguous(), mask, tokens[:, 1:].contiguous())]


def run(a, method):
    import torch
    model, optimizer = build(a)
    numel = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    states, ports = [], []
    directory = os.path.join(a.dir, method)
    shutil.rmtree(directory, ignore_errors=True)
    if method == "optstate":
        import optstate.megatron as om
        states = om.stream_optimizer_state(optimizer, store=os.path.join(directory, "rank{rank}"),
                                           budget=a.budget_mib << 20, moment_dtype=a.moment_dtype,
                                           host_cache_bytes=a.host_cache_mib << 20)
    elif method.startswith("miles"):
        ports = bind_miles(optimizer, directory, a.lr)
    losses, times = [], []
    for step in range(a.warmup + a.steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, pos, mask, labels = batch(a, step)
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        if method == "miles-cold":
            for port in ports:
                port.drop_page_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    for st in states:
        st.close()
    for port in ports:
        port.close()
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    shutil.rmtree(directory, ignore_errors=True)
    return dict(method=method, state_bytes=12 * numel, median_s=statistics.median(times), max_s=max(times),
                losses=losses)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a directory on the NVMe the stores and files go to")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-mib", type=int, default=2048)
    p.add_argument("--host-cache-mib", type=int, default=0, help="optstate's pinned host cache tier (0: off)")
    p.add_argument("--moment-dtype", default="f32", choices=("f32", "bf16", "q8"))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json")
    a = p.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            print("megatron_step: no CUDA device; nothing measured")
            return 0
        import megatron.core  # noqa: F401
    except ImportError as e:
        print("megatron_step: %s; nothing measured" % e)
        return 0
    import torch.distributed as dist
    from megatron.core import parallel_state
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    results = [run(a, m) for m in a.methods.split(",")]
    ref = next((r for r in results if r["method"] == "megatron"), None)
    print("%-11s %10s %10s %12s %14s" % ("method", "median s", "max s", "state GiB", "loss vs ref"))
    for r in results:
        diff = (max(abs(x - y) / abs(y) for x, y in zip(r["losses"], ref["losses"])) if ref else float("nan"))
        r["max_rel_loss_diff"] = diff
        print("%-11s %10.4f %10.4f %12.3f %14.2e" % (r["method"], r["median_s"], r["max_s"], r["state_bytes"] / 2**30,
                                                   diff))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), results=results), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
