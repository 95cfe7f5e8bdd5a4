"""optstate.megatron on the CPU: Megatron-core's own DistributedOptimizer code (its range maps, its
grad copy, its step) with the state streamed through a store on the host backend, against the same
DistributedOptimizer with its own inner torch AdamW.

Megatron's DistributedOptimizer builds only over CUDA tensors and NCCL buffers; here it is assembled
from its real class methods over CPU param and grad buffers (two data-parallel ranks sharing one
buffer, so each rank's write of its shard is the all-gather), which is what its __init__ does past
the CUDA checks. Needs megatron-core (tools/requirements-current.txt); skipped without it."""
import json
import os
import shutil
import types
import unittest

import torch

from common import TempDirTest, safetensors_of

import optstate

try:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer
    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

import optstate.megatron as om  # noqa: E402  (imports megatron-core only when called)

if HAVE_MEGATRON:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy, SaveShardedStrategy

    class _ObjectsOnlySave(SaveShardedStrategy):
        """Megatron's torch_dist writer needs CUDA (it syncs the device and gathers its results on it). The
        optimizer's sharded state is ShardedObjects only; with a sharded strategy that does not handle them,
        dist_checkpointing.save writes them through its common (torch.save) strategy, on the CPU."""

        def __init__(self):
            super().__init__("optstate_test_objects", 1)

        def save(self, sharded_state_dict, checkpoint_dir):
            assert not list(nested_values(sharded_state_dict)), "only ShardedObjects expected"

        def async_save(self, sharded_state_dict, checkpoint_dir):
            raise NotImplementedError

    class _ObjectsOnlyLoad(LoadShardedStrategy):
        def check_backend_compatibility(self, loaded_backend):
            assert loaded_backend == "optstate_test_objects", loaded_backend

        def check_version_compatibility(self, loaded_version):
            pass

        def load(self, sharded_state_dict, checkpoint_dir):
            assert not list(nested_values(sharded_state_dict)), "only ShardedObjects expected"
            return {}

        def load_tensors_metadata(self, checkpoint_dir):
            return {}


# name, shape, dtype, group (0: decay, 1: no decay, lr x 0.5), buffer/bucket
PARAMS = [
    ("embedding.word_embeddings.weight", (37, 16), torch.bfloat16, 0, 0),
    ("decoder.layers.0.linear_fc1.weight", (24, 16), torch.bfloat16, 0, 0),
    ("decoder.layers.0.linear_fc1.bias", (24,), torch.bfloat16, 1, 0),
    ("decoder.layers.0.linear_fc2.weight", (16, 24), torch.bfloat16, 0, 1),
    ("decoder.final_layernorm.weight", (16,), torch.bfloat16, 1, 1),
    ("decoder.layers.0.mlp.router.expert_bias", (5,), torch.float32, 1, 2),  # native fp32
]
LR, WD = 1e-2, 0.1
CHUNK = dict(chunk_size_bytes=2 << 20, backend="host", host_cache_bytes=0, job="megatron-test")


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _Chunk(torch.nn.Module):
    """A model chunk: its params by name, and the param all-gather (the shared buffer is it)."""

    def __init__(self, params, ddp_config):
        super().__init__()
        self.ddp_config = ddp_config
        self.holder = torch.nn.Module()
        for name, p in params.items():
            mod = self.holder
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, p)
        self.syncs = 0

    def named_parameters(self, *a, **k):
        for name, p in self.holder.named_parameters(*a, **k):
            yield "module." + name, p

    def start_param_sync(self, *a, **k):
        self.syncs += 1


class Model:
    """Params in Megatron's layout: per dtype a flat param buffer and grad buffer, cut in buckets,
    each bucket padded to a multiple of the data-parallel size; param.data and param.main_grad are
    views of them."""

    def __init__(self, seed, dp_size, specs=PARAMS, values=None, grads=None, grad_dtype=torch.float32):
        """values: {name: tensor} of the params' initial values (default: random from seed); grads:
        step -> {name: tensor}, each step's grads (default: random from the step). grad_dtype: the 16-bit
        params' grad buffer's (grad_reduce_in_fp32=False: their own dtype)."""
        g = torch.Generator().manual_seed(seed)
        self.grad_fn = grads
        self.params, self.buffers_spec = {}, []
        by_buffer = {}
        for name, shape, dtype, group, bucket in specs:
            by_buffer.setdefault(dtype, {}).setdefault(bucket, []).append((name, shape, group))
        self.groups = {}
        self.buffers = []
        for dtype, buckets in by_buffer.items():
            layout, offset, bucket_meta = {}, 0, []
            for bucket_id, (_, entries) in enumerate(sorted(buckets.items())):
                start = offset
                for name, shape, group in entries:
                    n = int(torch.Size(shape).numel())
                    layout[name] = (offset, offset + n, bucket_id, shape, group)
                    offset += n
                size = offset - start
                padded = -(-size // dp_size) * dp_size
                offset = start + padded
                bucket_meta.append((start, padded, size))
            pbuf = torch.zeros(offset, dtype=dtype)
            gbuf = torch.zeros(offset, dtype=torch.float32 if dtype == torch.float32 else grad_dtype)
            index_map = {}
            for name, (a, b, bucket_id, shape, group) in layout.items():
                p = torch.nn.Parameter(torch.empty(0, dtype=dtype))
                p.data = pbuf[a:b].view(shape)
                with torch.no_grad():
                    p.copy_(values[name] if values is not None else torch.randn(shape, generator=g) * 0.5)
                p.main_grad = gbuf[a:b].view(shape)
                cuda_type = {torch.bfloat16: "torch.cuda.BFloat16Tensor",
                             torch.float32: "torch.cuda.FloatTensor"}[dtype]
                p.type = (lambda t: (lambda *args: t))(cuda_type)  # Megatron's dtype test names CUDA types
                index_map[p] = (a, b, bucket_id)
                self.params[name] = p
                self.groups[name] = group
            buckets_ns = [types.SimpleNamespace(offset=s, grad_data=gbuf[s:s + n], param_data=pbuf[s:s + n],
                                                numel_unpadded=u) for s, n, u in bucket_meta]
            self.buffers.append(dict(pbuf=pbuf, gbuf=gbuf, index_map=index_map, buckets=buckets_ns, dtype=dtype,
                                     grad_dtype=gbuf.dtype))

    def set_grads(self, step):
        if self.grad_fn is not None:
            grads = self.grad_fn(step)
            for name, p in self.params.items():
                p.main_grad.copy_(grads[name])
            return
        g = torch.Generator().manual_seed(1000 + step)
        for name in sorted(self.params):
            p = self.params[name]
            p.main_grad.copy_(torch.randn(p.shape, generator=g))

    def flat(self):
        return {name: p.detach().float().clone() for name, p in self.params.items()}


def make_dist_opt(model, dp_rank, dp_size, *, decoupled=True, names=None):
    """A DistributedOptimizer for rank dp_rank over model's buffers, built as its __init__ builds it."""
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=False)
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD, bf16=True, use_distributed_optimizer=True,
                             clip_grad=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             decoupled_weight_decay=decoupled)
    selected = [n for n in model.params if names is None or n in names]
    groups = []
    for gid in (0, 1):
        groups.append({"params": [model.params[n] for n in selected if model.groups[n] == gid],
                       "wd_mult": 1.0 - gid, "lr_mult": 1.0 - 0.5 * gid, "is_expert_parallel": False})
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    inner = cls(groups, lr=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.optimizer, opt.config, opt.grad_scaler, opt.init_state_fn = inner, config, None, None
    opt._dummy_overflow_buf = None
    opt.model_chunks = [_Chunk({n: model.params[n] for n in selected}, ddp_config)]
    opt.ddp_config = ddp_config
    opt.distributed_optimizer_instance_id = 0
    opt.is_stub_optimizer = False
    group = _Group(dp_rank, dp_size)
    opt.data_parallel_group = group
    opt.buffers = []
    for b in model.buffers:
        index_map = {p: r for p, r in b["index_map"].items() if p in set(inner.param_groups[0]["params"]) |
                     set(inner.param_groups[1]["params"])}
        if index_map:
            opt.buffers.append(types.SimpleNamespace(param_index_map=index_map, buckets=b["buckets"],
                                                     params=list(index_map),
                                                     data_parallel_group=group, param_dtype=b["dtype"],
                                                     grad_dtype=b["grad_dtype"]))
    opt.gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in opt.buffers]
    opt.model_param_gbuf_map = DistributedOptimizer._build_model_param_gbuf_map(opt.gbuf_ranges)
    opt.model_param_group_index_map, opt.opt_group_ranges = DistributedOptimizer._build_optimizer_group_ranges(
        inner.param_groups, opt.gbuf_ranges)
    (opt.model_float16_groups, opt.model_fp32_groups, opt.shard_float16_groups, opt.shard_fp32_groups,
     opt.shard_fp32_from_float16_groups) = DistributedOptimizer._build_model_and_main_param_groups(
        opt.gbuf_ranges, opt.model_param_gbuf_map, opt.opt_group_ranges, config)
    inner.param_groups = [g["orig_group"] for g in opt.opt_group_ranges]
    inner.load_state_dict(inner.state_dict())
    return opt


# Tensor parallelism: the params as whole tensors and the dimension Megatron's layers split each along
# (None: every tensor-parallel rank holds it whole): column-parallel fc1 (dimension 0), row-parallel
# fc2 (dimension 1: a data-parallel shard of its slice is no flat range of the whole tensor).
TP_PARAMS = [
    ("embedding.word_embeddings.weight", (36, 16), torch.bfloat16, 0, 0, 0),
    ("decoder.layers.0.linear_fc1.weight", (24, 16), torch.bfloat16, 0, 0, 0),
    ("decoder.layers.0.linear_fc1.bias", (24,), torch.bfloat16, 1, 0, 0),
    ("decoder.layers.0.linear_fc2.weight", (16, 24), torch.bfloat16, 0, 1, 1),
    ("decoder.layers.0.linear_fc2.bias", (16,), torch.bfloat16, 1, 1, None),
    ("decoder.final_layernorm.weight", (16,), torch.bfloat16, 1, 1, None),
    ("decoder.layers.0.mlp.router.expert_bias", (6,), torch.float32, 1, 2, None),
]


def _tp_slice(t, dim, tp_rank, tp_size):
    return t if dim is None else t.chunk(tp_size, dim)[tp_rank].contiguous()


def tp_values(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=g) * 0.5).to(dtype) for name, shape, dtype, *_ in TP_PARAMS}


def tp_grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(shape, generator=g) for name, shape, *_ in TP_PARAMS}


def tp_model(values, tp_rank, tp_size, dp_size):
    """Tensor-parallel rank tp_rank's model: its slice of each param, with the attributes Megatron's
    layers set (tensor_model_parallel, partition_dim, partition_stride); grads the slices of the
    whole model's."""
    dims = {name: dim for name, _, _, _, _, dim in TP_PARAMS}
    specs = [(name, tuple(_tp_slice(torch.empty(shape), dim, tp_rank, tp_size).shape), dtype, group, bucket)
             for name, shape, dtype, group, bucket, dim in TP_PARAMS]
    model = Model(0, dp_size, specs, values={n: _tp_slice(v, dims[n], tp_rank, tp_size) for n, v in values.items()},
                  grads=lambda step: {n: _tp_slice(v, dims[n], tp_rank, tp_size) for n, v in tp_grads(step).items()})
    for name, p in model.params.items():
        p.tensor_model_parallel = dims[name] is not None
        p.partition_dim = dims[name] if dims[name] is not None else -1
        p.partition_stride = 1
    return model


def tp_assemble(models):
    """The whole params from the tensor-parallel ranks' slices (fp32)."""
    out = {}
    for name, _, _, _, _, dim in TP_PARAMS:
        parts = [m.params[name].detach().float() for m in models]
        out[name] = parts[0] if dim is None else torch.cat(parts, dim)
    return out


def schedule(opts, step):
    """What Megatron's OptimizerParamScheduler does each step: lr and wd times each group's multipliers."""
    lr = LR * (1.0 - 0.03 * step)
    for opt in opts:
        for g in opt.optimizer.param_groups:
            g["lr"] = lr * g["lr_mult"]
            g["weight_decay"] = WD * g["wd_mult"]


def run_steps(model, opts, first, last):
    for step in range(first, last):
        model.set_grads(step)
        schedule(opts, step)
        for opt in opts:
            ok, _, _ = opt.step()
            assert ok


@unittest.skipUnless(HAVE_MEGATRON, "megatron-core is not installed")
class MegatronTest(TempDirTest):
    def stream(self, opts, **kw):
        states = []
        for r, opt in enumerate(opts):
            states += om.stream_optimizer_state(opt, store=self.path("rank%d" % r), budget=32 << 20,
                                                **dict(CHUNK, **kw))
        return states

    def test_layout_flat_ranges_tile_each_param(self):
        model = Model(0, 2)
        opts = [make_dist_opt(model, r, 2) for r in range(2)]
        cover = {}
        for opt in opts:
            for s in om.shard_layout(opt):
                p = model.params[s.name]
                self.assertEqual(s.global_shape, tuple(p.shape))
                # The shard's memory is the param's flat range in its param buffer.
                self.assertEqual(s.param.data_ptr(), p.data_ptr() + s.begin * p.element_size())
                self.assertEqual(s.param.numel(), s.numel)
                self.assertEqual(s.group, model.groups[s.name])
                cover.setdefault(s.name, []).append((s.begin, s.begin + s.numel))
        for name, p in model.params.items():
            ranges = sorted(cover[name])
            self.assertEqual(ranges[0][0], 0, name)
            self.assertEqual(ranges[-1][1], p.numel(), name)
            for (_, b), (a, _) in zip(ranges, ranges[1:]):
                self.assertEqual(a, b, name)
        # Some param is split between the two ranks (the test exercises real flat ranges).
        self.assertTrue(any(len(v) == 2 for v in cover.values()))
        # The store records each shard as that flat range of the param's global shape.
        self.stream(opts)
        for r, opt in enumerate(opts):
            st = opt._optstate
            d = self.path("export%d" % r)
            st.store.export_checkpoint(d)
            with open(os.path.join(d, "manifest.json")) as f:
                tensors = {t["name"]: t for t in json.load(f)["tensors"]}
            for s in st.shards:
                t = tensors[s.name]
                self.assertEqual(list(t["global_shape"]), list(s.global_shape))
                self.assertEqual(list(t["shard_offset"]), [s.begin])
                self.assertEqual(int(t["numel"]), s.numel)

    def test_step_matches_megatrons_own(self):
        for decoupled in (True, False):
            with self.subTest(decoupled=decoupled):
                ref_model, model = Model(0, 2), Model(0, 2)
                refs = [make_dist_opt(ref_model, r, 2, decoupled=decoupled) for r in range(2)]
                opts = [make_dist_opt(model, r, 2, decoupled=decoupled) for r in range(2)]
                states = self.stream(opts) if decoupled else self.stream_sub(opts, "l2")
                # The fp32 mains of the 16-bit params are gone from memory; code that reads
                # param.main_param (params-norm logging) gets a clear error, not freed memory.
                for st in states:
                    for s in st.shards:
                        if s.own_main:
                            self.assertEqual(s.main.untyped_storage().size(), 0)
                            with self.assertRaisesRegex(optstate.FailedPrecondition,
                                                        "param %s, flat.*lives in an optstate store" % s.name):
                                s.model_param.main_param.norm()
                run_steps(ref_model, refs, 0, 6)
                run_steps(model, opts, 0, 6)
                self.check_close(refs, opts, ref_model, model)
                self.assertEqual(opts[0].model_chunks[0].syncs, 6)  # the param all-gather still runs
                for st in states:
                    st.close()

    def stream_sub(self, opts, sub):
        states = []
        for r, opt in enumerate(opts):
            states += om.stream_optimizer_state(opt, store=self.path("%s-rank%d" % (sub, r)), budget=32 << 20,
                                                **CHUNK)
        return states

    def check_close(self, refs, opts, ref_model, model, moments_rtol=1e-4):
        # Tolerances: optstate's fused kernel and torch's single-tensor AdamW round differently by a
        # few ulps a step (torch_adamw_test.py); 6 steps at lr 1e-2 of |p| < 3 stay far below 2e-5.
        # A wrong lr, decay in the wrong group or a missed step moves a main by >= 1e-4.
        for ref, opt in zip(refs, opts):
            st = opt._optstate
            st.adam.make_durable()
            ref_shards = {s.name: s for s in om.shard_layout(ref)}
            for s in st.shards:
                r = ref_shards[s.name]
                main = torch.from_numpy(st.store.read(s.name, "main"))
                torch.testing.assert_close(main, r.main.detach().float(), rtol=0, atol=2e-5, msg=s.name)
                # The param buffer holds the main, rounded to the param's dtype.
                self.assertTrue(torch.equal(s.param, main.to(s.param.dtype)), s.name)
                state = ref.optimizer.state[r.main]
                for f in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(torch.from_numpy(st.store.read(s.name, f)), state[f].float(),
                                               rtol=moments_rtol, atol=1e-7, msg="%s %s" % (s.name, f))
                self.assertEqual(st.adam.param_step_count(s.name), int(state["step"]))
        for name in model.params:
            torch.testing.assert_close(model.params[name].detach().float(), ref_model.params[name].detach().float(),
                                       rtol=0, atol=2e-2 if model.params[name].dtype == torch.bfloat16 else 2e-5)

    def test_bf16_grad_buffers_are_read_directly(self):
        # grad_reduce_in_fp32=False, no grad scaler: the step reads the bf16 grad buffer's shards, and
        # without clipping that is the same update as from Megatron's fp32 copy of them, bit for bit.
        runs = {}
        for direct in (True, False):
            model = Model(0, 2, grad_dtype=torch.bfloat16)
            opts = [make_dist_opt(model, r, 2) for r in range(2)]
            for r, opt in enumerate(opts):
                om.stream_optimizer_state(opt, store=self.path("%s-rank%d" % (direct, r)), budget=32 << 20,
                                          direct_grads=direct, **CHUNK)
            run_steps(model, opts, 0, 3)
            for opt in opts:
                for s in opt._optstate.shards:
                    if s.own_main:
                        want = s.model_param.main_grad.view(-1)[s.begin:s.begin + s.numel]
                        self.assertEqual(s.main.grad.dtype, torch.bfloat16 if direct else torch.float32, s.name)
                        # Direct: the grad buffer's own memory, no copy (Megatron's grad norm reads it too).
                        self.assertEqual(s.main.grad.data_ptr() == want.data_ptr(), direct, s.name)
                        self.assertTrue(any(p is s.main for p in opt.get_parameters()), s.name)
            for opt in opts:
                opt._optstate.adam.make_durable()  # the last step's commit lands before the store is read
            runs[direct] = (model.flat(), {(r, s.name): opts[r]._optstate.store.read(s.name, f).tobytes()
                                           for r in range(2) for s in opts[r]._optstate.shards
                                           for f in ("main", "exp_avg", "exp_avg_sq")})
            for opt in opts:
                opt._optstate.close()
        for n in runs[True][0]:
            self.assertTrue(torch.equal(runs[True][0][n], runs[False][0][n]), n)
        self.assertEqual(runs[True][1], runs[False][1])
        # And against Megatron's own optimizer on the same bf16 grads.
        ref_model, model = Model(0, 2, grad_dtype=torch.bfloat16), Model(0, 2, grad_dtype=torch.bfloat16)
        refs = [make_dist_opt(ref_model, r, 2) for r in range(2)]
        opts = [make_dist_opt(model, r, 2) for r in range(2)]
        self.stream(opts)
        run_steps(ref_model, refs, 0, 3)
        run_steps(model, opts, 0, 3)
        self.check_close(refs, opts, ref_model, model)

    def test_clipping_bf16_grads_read_directly_scales_the_step(self):
        # Megatron's clip_grad_by_total_norm_fp32 takes fp32 grads only. For the bf16 grads the step reads
        # in the grad buffer, its coefficient becomes that step's grad scale: the buffer is left as it
        # is, and the moments are those of the clipped grads (float64 reference); the steps after it are
        # not scaled, whether the norm is below max_norm or nothing clips (clip_grad 0).
        from megatron.core.optimizer import optimizer as megatron_optimizer
        model = Model(0, 1, grad_dtype=torch.bfloat16)
        opt = make_dist_opt(model, 0, 1)
        self.stream([opt])
        st = opt._optstate
        direct = [s for s in st.shards if s.own_main and s.main.dtype == torch.bfloat16]
        self.assertTrue(direct)
        m, v = {}, {}
        for step, ratio in ((0, 0.25), (1, 4.0), (2, 0.5), (3, None)):  # max_norm / the grads' norm
            model.set_grads(step)
            schedule([opt], step)
            self.assertFalse(opt.prepare_grads())
            grads = {s.name: s.main.grad.double().clone() for s in direct}
            norm = sum(float((g * g).sum()) for g in grads.values()) ** 0.5
            if ratio is not None:
                megatron_optimizer.clip_grad_by_total_norm_fp32([s.main for s in direct], ratio * norm, norm)
            for s in direct:  # not scaled in place (Megatron's own clip would round them to bf16)
                self.assertTrue(torch.equal(s.main.grad.double(), grads[s.name]), s.name)
            self.assertTrue(opt.step_with_ready_grads())
            coeff = min(ratio * norm / (norm + 1.0e-6), 1.0) if ratio is not None else 1.0
            st.adam.make_durable()
            for s in direct:
                g = grads[s.name] * coeff
                m[s.name] = 0.9 * m.get(s.name, 0.0) + 0.1 * g
                v[s.name] = 0.95 * v.get(s.name, 0.0) + 0.05 * g * g
                for field, want in (("exp_avg", m[s.name]), ("exp_avg_sq", v[s.name])):
                    got = torch.from_numpy(st.store.read(s.name, field)).double()
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7,
                                               msg=lambda d: "step %d %s %s: %s" % (step, s.name, field, d))

    def test_bf16_moments_within_bound(self):
        ref_model, model = Model(0, 1), Model(0, 1)
        refs, opts = [make_dist_opt(ref_model, 0, 1)], [make_dist_opt(model, 0, 1)]
        self.stream(opts, moment_dtype="bf16")
        run_steps(ref_model, refs, 0, 5)
        run_steps(model, opts, 0, 5)
        st, ref = opts[0]._optstate, refs[0]
        st.adam.make_durable()
        ref_shards = {s.name: s for s in om.shard_layout(ref)}
        for s in st.shards:
            r = ref_shards[s.name]
            # bf16 moments: each step's rounding is <= 2^-8 relative (docs/MOMENTS.md); over 5 steps the
            # moments stay within 3% and the mains within lr x 5 steps x 3% of an update of size lr.
            state = ref.optimizer.state[r.main]
            torch.testing.assert_close(torch.from_numpy(st.store.read(s.name, "exp_avg_sq")), state["exp_avg_sq"],
                                       rtol=0.03, atol=1e-6, msg=s.name)
            torch.testing.assert_close(torch.from_numpy(st.store.read(s.name, "main")), r.main.detach(),
                                       rtol=0, atol=5 * LR * 0.03 + 1e-5, msg=s.name)

    def test_chained_optimizers_get_stores_of_their_own(self):
        model = Model(0, 1)
        names = [n for n, *_ in PARAMS]
        dense = make_dist_opt(model, 0, 1, names=names[:3])
        expert = make_dist_opt(model, 0, 1, names=names[3:])
        for g in expert.optimizer.param_groups:
            g["is_expert_parallel"] = True
        chain = ChainedOptimizer([dense, expert])
        # Two stores need one slice in flight each (3 chunks of 2 MiB with f32 moments).
        with self.assertRaisesRegex(optstate.ResourceExhausted, "budget 8388608 bytes.*2 stores"):
            om.stream_optimizer_state(chain, store=self.path("rank{rank}"), budget=8 << 20, **CHUNK)
        states = om.stream_optimizer_state(chain, store=self.path("rank{rank}"), budget=32 << 20, **CHUNK)
        self.assertLessEqual(sum(st.mm.stats()["budget_bytes"] for st in states), 32 << 20)
        self.assertEqual([os.path.relpath(st.store.path, self.dir) for st in states],
                         ["rank0/0.dense", "rank0/1.expert"])
        self.assertEqual(len({st.store.uuid for st in states}), 2)
        self.assertEqual(states[0].store.job, states[1].store.job)
        self.assertEqual(om.streamed_states(chain), states)
        # A second optimizer on the same directory is refused while the first holds it.
        other = ChainedOptimizer([make_dist_opt(Model(1, 1), 0, 1, names=names[:3])])
        with self.assertRaises(optstate.Busy):
            om.stream_optimizer_state(other, store=self.path("rank{rank}"), budget=32 << 20, **CHUNK)
        with self.assertRaisesRegex(optstate.FailedPrecondition, "already streams"):
            om.stream_optimizer_state(chain, store=self.path("x"), budget=32 << 20, **CHUNK)
        ref_model = Model(0, 1)
        refs = [make_dist_opt(ref_model, 0, 1, names=names[:3]), make_dist_opt(ref_model, 0, 1, names=names[3:])]
        model.set_grads(0)
        ref_model.set_grads(0)
        # ChainedOptimizer.step() is these two plus the grad norm over the model-parallel groups, which
        # need torch.distributed's parallel state.
        self.assertFalse(chain.prepare_grads())
        self.assertTrue(chain.step_with_ready_grads())
        for ref in refs:
            ref.step()
        self.check_close(refs, [dense, expert], ref_model, model)

    def test_refusals(self):
        model = Model(0, 1)

        def fresh():
            return make_dist_opt(model, 0, 1)
        opt = fresh()
        opt.config.use_precision_aware_optimizer = True
        with self.assertRaisesRegex(optstate.Unimplemented, "use_precision_aware_optimizer.*moment_dtype"):
            om.stream_optimizer_state(opt, store=self.path("a"), **CHUNK)
        opt = fresh()
        opt.config.optimizer_cpu_offload = True
        with self.assertRaisesRegex(optstate.Unimplemented, "optimizer_cpu_offload"):
            om.stream_optimizer_state(opt, store=self.path("a"), **CHUNK)
        opt = fresh()
        opt.config.optimizer = "sgd"
        with self.assertRaisesRegex(optstate.Unimplemented, "optimizer='sgd'"):
            om.stream_optimizer_state(opt, store=self.path("a"), **CHUNK)
        opt = fresh()
        opt.ddp_config.use_megatron_fsdp = True
        with self.assertRaisesRegex(optstate.Unimplemented, "use_megatron_fsdp"):
            om.stream_optimizer_state(opt, store=self.path("a"), **CHUNK)
        with self.assertRaisesRegex(optstate.Unimplemented, "FP32Optimizer.*use_distributed_optimizer"):
            om.stream_optimizer_state(FP32Optimizer.__new__(FP32Optimizer), store=self.path("a"), **CHUNK)
        import megatron.core.fp8_utils as fp8_utils
        fp8 = model.params["decoder.layers.0.linear_fc1.weight"]
        real = fp8_utils.is_float8tensor
        fp8_utils.is_float8tensor = lambda t: t is fp8
        try:
            with self.assertRaisesRegex(optstate.Unimplemented, "fp8 params"):
                om.stream_optimizer_state(fresh(), store=self.path("a"), **CHUNK)
        finally:
            fp8_utils.is_float8tensor = real
        opt = fresh()
        model.set_grads(0)
        opt.step()  # the inner AdamW now holds moments
        with self.assertRaisesRegex(optstate.FailedPrecondition, "already taken a step"):
            om.stream_optimizer_state(opt, store=self.path("a"), **CHUNK)
        self.assertFalse(os.path.exists(self.path("a")))  # nothing was created by a refused call
        # Megatron's legacy (torch format) parameter-state files would read the freed GPU mains.
        opt = fresh()
        om.stream_optimizer_state(opt, store=self.path("b"), **CHUNK)
        with self.assertRaisesRegex(optstate.Unimplemented, "save_parameter_state.*torch_dist"):
            opt.save_parameter_state(self.path("legacy.pt"))
        with self.assertRaisesRegex(optstate.Unimplemented, "get_parameter_state_dp_zero"):
            ChainedOptimizer([opt, fresh()]).save_parameter_state(self.path("legacy.pt"))

    def test_save_and_resume_same_topology_is_exact(self):
        # Run A: 3 steps, a checkpoint (Megatron's state_dict and sharded_state_dict), 3 more steps.
        model = Model(0, 2)
        opts = [make_dist_opt(model, r, 2) for r in range(2)]
        self.stream(opts)
        run_steps(model, opts, 0, 3)
        records = [opt.state_dict() for opt in opts]
        sharded = opts[0].sharded_state_dict({}, is_loading=False)
        self.assertEqual(sharded["optstate"].data["generation"], records[0]["optstate"]["generation"])
        ckpt_params = {n: p.detach().clone() for n, p in model.params.items()}
        run_steps(model, opts, 3, 6)
        after_a = model.flat()
        for opt in opts:  # the last step's commit completes in the background (commit_lag_steps=1)
            opt._optstate.adam.make_durable()
        mains_a = {(r, s.name): opts[r]._optstate.store.read(s.name, "main") for r in range(2)
                   for s in opts[r]._optstate.shards}
        for opt in opts:
            opt._optstate.close()
        # Run B, "a new process": a fresh model (other weights) and optimizer on the same stores; the
        # model takes the checkpoint's weights, the optimizer its state.
        model_b = Model(7, 2)
        opts_b = [make_dist_opt(model_b, r, 2) for r in range(2)]
        states_b = self.stream(opts_b)
        self.assertTrue(all(st.resumed for st in states_b))
        with torch.no_grad():
            for n, p in model_b.params.items():
                p.copy_(ckpt_params[n])
        for opt, rec in zip(opts_b, records):
            opt.load_state_dict(rec)
        run_steps(model_b, opts_b, 3, 6)
        for n, p in model_b.params.items():
            self.assertTrue(torch.equal(p.detach().float(), after_a[n]), n)
        for r in range(2):
            opts_b[r]._optstate.adam.make_durable()
            for s in opts_b[r]._optstate.shards:
                self.assertTrue((opts_b[r]._optstate.store.read(s.name, "main") == mains_a[(r, s.name)]).all(), s.name)
        # A record of another store is refused, naming both.
        with self.assertRaisesRegex(optstate.FailedPrecondition, "rank1.*rank0|rank0.*rank1"):
            opts_b[0].load_state_dict(records[1])

    def test_reload_model_params_goes_through_the_store(self):
        model = Model(0, 2)
        opts = [make_dist_opt(model, r, 2) for r in range(2)]
        self.stream(opts)
        run_steps(model, opts, 0, 2)
        with torch.no_grad():
            for p in model.params.values():
                p.mul_(-1.0)
        for opt in opts:
            opt.reload_model_params()
            st = opt._optstate
            for s in st.shards:
                want = model.params[s.name].detach().reshape(-1)[s.begin:s.begin + s.numel].float()
                self.assertTrue(torch.equal(torch.from_numpy(st.store.read(s.name, "main")), want), s.name)
        # From a state dict's tensors instead of the model's.
        sd = {"model": {n: torch.full_like(p, 0.25) for n, p in model.params.items()}}
        opts[0].reload_model_params(sd)
        for s in opts[0]._optstate.shards:
            self.assertTrue((opts[0]._optstate.store.read(s.name, "main") == 0.25).all(), s.name)
            self.assertTrue((s.param == 0.25).all(), s.name)

    def test_sleep_releases_the_window_and_the_next_step_continues(self):
        ref_model, model = Model(0, 1), Model(0, 1)
        refs, opts = [make_dist_opt(ref_model, 0, 1)], [make_dist_opt(model, 0, 1)]
        self.stream(opts)
        run_steps(ref_model, refs, 0, 2)
        run_steps(model, opts, 0, 2)
        opts[0].offload_to_cpu()
        self.assertEqual(opts[0]._optstate.mm.stats()["resident_bytes"], 0)
        opts[0].restore_from_cpu()
        run_steps(ref_model, refs, 2, 4)
        run_steps(model, opts, 2, 4)
        self.assertGreater(opts[0]._optstate.mm.stats()["resident_bytes"], 0)
        om.sleep(opts[0])
        self.assertEqual(opts[0]._optstate.mm.stats()["resident_bytes"], 0)
        om.wake(opts[0])
        run_steps(ref_model, refs, 4, 5)
        run_steps(model, opts, 4, 5)
        self.check_close(refs, opts, ref_model, model)

    def test_save_load_directories_and_reshard_to_other_data_parallel_sizes(self):
        model = Model(0, 2)
        opts = [make_dist_opt(model, r, 2) for r in range(2)]
        self.stream(opts)
        run_steps(model, opts, 0, 3)
        dirs = []
        for r, opt in enumerate(opts):
            # save() names the rank from torch.distributed; these two ranks share one process.
            st = opt._optstate
            st.adam.make_durable()
            d = om.rank_dir(self.path("ckpt"), st.sub_name, r)
            os.makedirs(os.path.dirname(d), exist_ok=True)
            st.store.export_checkpoint(d)
            dirs.append(d)
        ckpt_params = {n: p.detach().clone() for n, p in model.params.items()}
        run_steps(model, opts, 3, 5)
        after = model.flat()
        for ranks in (1, 3):  # fewer ranks; more (each bucket padded to a multiple of 3: other ranges)
            with self.subTest(ranks=ranks):
                new = Model(0, ranks)
                with torch.no_grad():
                    for n, p in new.params.items():
                        p.copy_(ckpt_params[n])
                new_opts = [make_dist_opt(new, r, ranks) for r in range(ranks)]
                # The layout of the new ranks' shards, from their own DistributedOptimizers.
                layout = om.reshard_layout(new_opts)
                dest = self.path("dp%d" % ranks)
                os.makedirs(dest)
                optstate.reshard(dirs, os.path.join(dest, "0.dense"), layout)
                for r, opt in enumerate(new_opts):
                    om.stream_optimizer_state(opt, store=self.path("dp%d-rank%d" % (ranks, r)), budget=32 << 20,
                                              **CHUNK)
                    om.load(opt, dest, rank=r)
                run_steps(new, new_opts, 3, 5)
                for n, p in new.params.items():
                    self.assertTrue(torch.equal(p.detach().float(), after[n]), n)


    def test_save_load_and_layout_over_torch_distributed(self):
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + self.path("pg"), rank=0, world_size=1)
        try:
            model = Model(0, 1)
            opt = make_dist_opt(model, 0, 1)
            kw = dict(CHUNK)
            del kw["job"]  # one job id agreed over torch.distributed
            om.stream_optimizer_state(ChainedOptimizer([opt]), store=self.path("r{rank}"), budget=32 << 20, **kw)
            self.assertTrue(os.path.isdir(self.path("r0/0.dense")))
            self.assertEqual(om.gather_reshard_layout(opt), om.reshard_layout([opt]))
            run_steps(model, [opt], 0, 2)
            self.assertEqual(om.save(opt, self.path("ck")), [om.rank_dir(self.path("ck"), "0.dense", 0)])
            saved = model.flat()
            run_steps(model, [opt], 2, 4)
            after = model.flat()
            om.load(opt, self.path("ck"))  # back to step 2: the params take the saved mains
            self.assertTrue(all(torch.equal(model.params[n].detach().float(), saved[n]) for n in saved))
            run_steps(model, [opt], 2, 4)
            self.assertTrue(all(torch.equal(model.params[n].detach().float(), after[n]) for n in after))
        finally:
            dist.destroy_process_group()

    def _dist(self):
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + self.path("pg"), rank=0, world_size=1)
        self.addCleanup(dist.destroy_process_group)

    def _dist_save(self, opt, d):
        from megatron.core import dist_checkpointing
        os.makedirs(d)
        dist_checkpointing.save({"optimizer": opt.sharded_state_dict({})}, d, sharded_strategy=_ObjectsOnlySave())

    def _dist_load(self, opt, d):
        from megatron.core import dist_checkpointing
        return dist_checkpointing.load({"optimizer": opt.sharded_state_dict({}, is_loading=True)}, d,
                                       sharded_strategy=_ObjectsOnlyLoad())

    def test_dist_checkpoint_carries_the_state_to_a_fresh_store(self):
        # Megatron's dist_checkpointing save (what save_checkpoint does with torch_dist) writes the state's
        # files into the checkpoint directory, once (no state.safetensors, the manifest says so): a copy of
        # it on another node resumes bit for bit.
        self.carry_to_fresh_store({}, (False, False))

    def test_dist_checkpoint_with_safetensors_carries_the_state_to_a_fresh_store(self):
        # stream_optimizer_state(..., safetensors=True): the files carry state.safetensors too, and such
        # a checkpoint (the adapter's default before it wrote the state once) resumes through a default
        # stream_optimizer_state on another node, bit for bit.
        self.carry_to_fresh_store(dict(safetensors=True), (True, None))

    def carry_to_fresh_store(self, stream_kw, files_safetensors):
        """A dist_checkpointing save at step 3 by an optimizer streamed with stream_kw, whose files are
        checked with safetensors_of; its copy resumed on a fresh store path against the run that went on."""
        self._dist()
        model = Model(0, 1)
        opt = make_dist_opt(model, 0, 1)
        om.stream_optimizer_state(opt, store=self.path("node-a/r{rank}"), budget=32 << 20, **CHUNK, **stream_kw)
        run_steps(model, [opt], 0, 3)
        ckpt = self.path("node-a/save/iter_3")
        self._dist_save(opt, ckpt)
        files = om.rank_dir(os.path.join(ckpt, om.STATE_DIR), "0.dense", 0)
        self.assertEqual(safetensors_of(files), files_safetensors)
        ckpt_params = model.flat()
        run_steps(model, [opt], 3, 6)
        after = model.flat()
        st = opt._optstate
        st.adam.make_durable()
        mains_a = {s.name: st.store.read(s.name, "main") for s in st.shards}
        st.close()
        # Another node: the checkpoint directory copied, the first node's stores gone; a fresh model
        # (other weights) and a fresh store path.
        copy = self.path("node-b/iter_3")
        shutil.copytree(ckpt, copy)
        shutil.rmtree(self.path("node-a"))
        model_b = Model(7, 1)
        opt_b = make_dist_opt(model_b, 0, 1)
        (st_b,) = om.stream_optimizer_state(opt_b, store=self.path("node-b/r{rank}"), budget=32 << 20, **CHUNK)
        self.assertFalse(st_b.resumed)
        loaded = self._dist_load(opt_b, copy)
        opt_b.load_state_dict(loaded["optimizer"])
        for n, p in model_b.params.items():  # the params take the checkpoint's mains
            self.assertTrue(torch.equal(p.detach().float(), ckpt_params[n]), n)
        run_steps(model_b, [opt_b], 3, 6)
        for n, p in model_b.params.items():
            self.assertTrue(torch.equal(p.detach().float(), after[n]), n)
        st_b.adam.make_durable()
        for s in st_b.shards:
            self.assertTrue((st_b.store.read(s.name, "main") == mains_a[s.name]).all(), s.name)
        self.assertEqual(st_b.adam.param_step_count(st_b.shards[0].name), 6)

    def test_checkpoint_snapshots_are_released_with_their_directories(self):
        self._dist()
        model = Model(0, 1)
        opt = make_dist_opt(model, 0, 1)
        (st,) = om.stream_optimizer_state(opt, store=self.path("r{rank}"), budget=32 << 20, **CHUNK)
        saves = []
        for i in range(3):
            run_steps(model, [opt], i, i + 1)
            d = self.path("save/iter_%d" % (i + 1))
            self._dist_save(opt, d)
            saves.append(d)
        held = optstate.checkpoint.held_snapshots(st.store)
        self.assertEqual(sorted(h for hs in held.values() for h in hs), sorted(saves))
        # Plain state_dict() records (a trainer's own round trips) keep a bounded number of snapshots.
        records = []
        for i in range(3, 9):
            run_steps(model, [opt], i, i + 1)
            records.append(opt.state_dict()["optstate"])
        snaps = dict(st.store.snapshots())
        unheld = sorted(n for n in snaps if n not in held)
        self.assertEqual(unheld, sorted(r["snapshot"] for r in records[-st.state_dict_snapshots:]))
        self.assertTrue(all(n in snaps for n in held))
        # Deleting checkpoint directories releases their snapshots at the next save.
        for d in saves[:2]:
            shutil.rmtree(d)
        gone = [n for n, hs in held.items() if any(h in saves[:2] for h in hs)]
        self.assertEqual(len(gone), 2)
        run_steps(model, [opt], 9, 10)
        self._dist_save(opt, self.path("save/iter_10"))
        snaps = dict(st.store.snapshots())
        self.assertFalse(any(n in snaps for n in gone), (gone, sorted(snaps)))
        self.assertEqual(sorted(h for hs in optstate.checkpoint.held_snapshots(st.store).values() for h in hs),
                         sorted([saves[2], self.path("save/iter_10")]))
        # A kept checkpoint still resumes from its snapshot: back to step 3 and on, as the first run went.
        loaded = self._dist_load(opt, saves[2])
        opt.load_state_dict(loaded["optimizer"])
        self.assertEqual(st.adam.param_step_count(st.shards[0].name), 3)

    def tp_run(self, tp, dp, values, tag):
        """tp x dp ranks (rank = dp rank x tp + tp rank, Megatron's order), streamed; (models, opts)."""
        models = [tp_model(values, t, tp, dp) for t in range(tp)]
        opts = [make_dist_opt(models[r % tp], r // tp, dp) for r in range(tp * dp)]
        for r, opt in enumerate(opts):
            om.stream_optimizer_state(opt, store=self.path("%s-rank%d" % (tag, r)), budget=32 << 20,
                                      tensor_parallel=(r % tp, tp), **CHUNK)
        return models, opts

    @staticmethod
    def tp_steps(models, opts, first, last):
        for step in range(first, last):
            for m in models:
                m.set_grads(step)
            schedule(opts, step)
            for opt in opts:
                ok, _, _ = opt.step()
                assert ok

    def test_reshard_between_tensor_parallel_sizes(self):
        values = tp_values(0)
        # The uninterrupted reference: one rank, 5 steps; its checkpoint at step 3.
        ref_models, ref_opts = self.tp_run(1, 1, values, "ref")
        self.tp_steps(ref_models, ref_opts, 0, 3)
        ref_dirs = om.save(ref_opts[0], self.path("ck-ref"), rank=0)
        self.assertFalse(os.path.exists(os.path.join(ref_dirs[0], om.GLOBAL_BOXES)))  # no tensor parallelism
        self.tp_steps(ref_models, ref_opts, 3, 5)
        want = tp_assemble(ref_models)
        # Tensor parallel 2 x data parallel 2 steps each element as the reference does (Adam is elementwise).
        models, opts = self.tp_run(2, 2, values, "tp2")
        fc2 = "decoder.layers.0.linear_fc2.weight"
        shards = {s.name: s for s in opts[1]._optstate.shards}  # tensor-parallel rank 1, data-parallel rank 0
        self.assertEqual((shards[fc2].tp_offset, shards[fc2].tp_global_shape), ([0, 12], [16, 24]))
        # Its data-parallel shard of the row-parallel slice ends inside a row of the slice.
        self.assertNotEqual((shards[fc2].begin + shards[fc2].numel) % 12, 0)
        self.tp_steps(models, opts, 0, 3)
        dirs = [om.save(opt, self.path("ck-tp2"), rank=r)[0] for r, opt in enumerate(opts)]
        boxes = {}  # tensor-parallel rank 1's (its data-parallel ranks 0 and 1)
        for d in (dirs[1], dirs[3]):
            with open(os.path.join(d, om.GLOBAL_BOXES)) as f:
                boxes.update(json.load(f)["tensors"])
        self.assertEqual(boxes[fc2], {"offset": [0, 12], "global_shape": [16, 24]})
        self.assertEqual(boxes["decoder.final_layernorm.weight"], {"replica": True})
        self.tp_steps(models, opts, 3, 5)
        got = tp_assemble(models)
        for n in want:
            self.assertTrue(torch.equal(got[n], want[n]), n)
        # Resume at step 3 on another layout: TP 2 x DP 2 -> TP 1 x DP 3, and TP 1 x DP 1 -> TP 2 x DP 3.
        for sources, tp, dp, tag in ((dirs, 1, 3, "to-tp1"), (ref_dirs, 2, 3, "to-tp2")):
            with self.subTest(tp=tp, dp=dp):
                new_models, new_opts = self.tp_run(tp, dp, tp_values(9), tag)  # other weights: load sets them
                dest = self.path(tag)
                os.makedirs(dest)
                self.assertEqual(optstate.reshard(sources, os.path.join(dest, "0.dense"), om.reshard_layout(new_opts)),
                                 tp * dp)
                for r, opt in enumerate(new_opts):
                    om.load(opt, dest, rank=r)
                self.tp_steps(new_models, new_opts, 3, 5)
                got = tp_assemble(new_models)
                for n in want:
                    self.assertTrue(torch.equal(got[n], want[n]), n)
                    for m in new_models[1:]:  # every tensor-parallel rank's copy of a replicated param
                        if m.params[n].shape == new_models[0].params[n].shape and n in (
                                "decoder.final_layernorm.weight", "decoder.layers.0.linear_fc2.bias"):
                            self.assertTrue(torch.equal(m.params[n], new_models[0].params[n]), n)
                ref = ref_opts[0]._optstate
                ref.adam.make_durable()
                dims = {name: dim for name, _, _, _, _, dim in TP_PARAMS}
                shapes = {name: shape for name, shape, *_ in TP_PARAMS}
                for r, opt in enumerate(new_opts):  # mains and moments: the reference's, sliced
                    st = opt._optstate
                    st.adam.make_durable()
                    for s in st.shards:
                        for f in ("main", "exp_avg", "exp_avg_sq"):
                            whole = torch.from_numpy(ref.store.read(s.name, f)).view(shapes[s.name])
                            part = _tp_slice(whole, dims[s.name], r % tp, tp).reshape(-1)[s.begin:s.begin + s.numel]
                            self.assertTrue(torch.equal(torch.from_numpy(st.store.read(s.name, f)), part),
                                            "rank %d %s %s" % (r, s.name, f))
                        self.assertEqual(st.adam.param_step_count(s.name), 5, s.name)

    def test_reshard_refuses_untileable_tensor_parallel_slices(self):
        models, opts = self.tp_run(2, 1, tp_values(0), "glu")
        opts[0].model_chunks[0].config = types.SimpleNamespace(gated_linear_unit=True)
        for st in opts[0]._optstate.shards:
            om._place_tensor_parallel(opts[0], [st], (0, 2))
        with self.assertRaisesRegex(optstate.Unimplemented, "linear_fc1.*gated linear unit"):
            om.reshard_layout(opts)
        # Its checkpoints do not place fc1's slices in a whole tensor: a reshard refuses them.
        for opt in opts[1:]:
            opt.model_chunks[0].config = opts[0].model_chunks[0].config
            for st in opt._optstate.shards:
                om._place_tensor_parallel(opt, [st], (1, 2))
        dirs = [om.save(opt, self.path("ck-glu"), rank=r)[0] for r, opt in enumerate(opts)]
        with open(os.path.join(dirs[0], om.GLOBAL_BOXES)) as f:
            self.assertNotIn("decoder.layers.0.linear_fc1.weight", json.load(f)["tensors"])
        one, one_opts = self.tp_run(1, 1, tp_values(0), "glu-one")
        with self.assertRaisesRegex(optstate.InvalidArgument, "linear_fc1.*overlap"):
            optstate.reshard(dirs, self.path("glu-out"), om.reshard_layout(one_opts))


if __name__ == "__main__":
    unittest.main()
