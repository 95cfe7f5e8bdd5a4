"""optstate.megatron: Megatron-core's DistributedOptimizer with its state in optstate stores.

    optimizer = get_megatron_optimizer(config, model_chunks)
    optstate.megatron.stream_optimizer_state(optimizer, store="/nvme/optstate/rank{rank}",
                                             budget=2 << 30, moment_dtype="bf16")

Megatron's distributed optimizer keeps, per data-parallel rank, fp32 main copies of its shard of
every parameter and an inner Adam's two moments of them: 12 bytes a parameter of the shard. After
the call each DistributedOptimizer of the chain (dense, expert) keeps that state in an optstate
store of its own, `<store>/<index>.<dense|expert>`, and streams it through a device window of
at most its part of `budget` bytes during the step. What changes and what does not:

- Megatron's own step runs unchanged up to the update: the grad buffer's reduce-scatter, this
  rank's grad shards as the mains' `.grad` (a view of the grad buffer when grads are reduced in
  fp32, or in 16 bits without a grad scaler: the step reads bf16 grads in place; Megatron's fp32
  copy otherwise), the grad scaler's unscale and found-inf check (a step with inf/nan is
  skipped by Megatron before it reaches the update), grad-norm clipping. The update itself (the
  inner Adam's step and the copy of the mains into the param buffer) is optstate's streamed,
  fused step: it reads each shard's grad, updates main and moments in the store and writes the
  updated param (bf16, fp16 or fp32) into the param buffer's shard in the same pass; then
  Megatron's param all-gather runs as before.
- lr, betas, eps and weight decay are read from the inner optimizer's param groups at every step,
  so Megatron's OptimizerParamScheduler (lr and wd multipliers, no-decay groups) works unchanged.
  Adam or AdamW as Megatron chose (config.decoupled_weight_decay).
- Native fp32 params (a MoE router's expert_bias) are streamed like the others; their "param" is
  the fp32 shard itself.
- Every shard is recorded as the flat range [begin, begin + numel) of its param's row-major
  flattening, with the param's shape (on this rank) as the global shape; with tensor parallelism
  a checkpoint's global-boxes.json places each slice in the whole tensor, so optstate.reshard can
  move the state between data- and tensor-parallel sizes (docs/MEGATRON.md).
- reload_model_params() loads the mains from the model's params (or a state dict's tensors).
- sharded_state_dict()/state_dict() carry, per rank and sub-optimizer, the store's identity and a
  snapshot of the committed generation of that moment (plus the param groups and grad scaler);
  Megatron's dist_checkpointing.save also writes that state's files into the checkpoint directory
  (<ckpt>/optstate/<sub>/rank-<r>: manifest.json and the field files, the state once, or with
  stream_optimizer_state(..., safetensors=True) state.safetensors too; the snapshot held until the
  directory is deleted);
  load_state_dict() brings the store back to that snapshot, or restores the files (a copy on
  another node, a fresh store): a same-topology resume is exact.
  save(optimizer, dir) / load(optimizer, dir) write and read the state itself as optstate
  checkpoint directories (portable, reshardable).
- offload_to_cpu()/restore_from_cpu() (colocated RL) release the device window / do nothing:
  the state's home is the store.

The fp32 mains' GPU memory is freed: `param.main_param`, which code outside the optimizer reads
(Megatron-LM's --log-params-norm, QK-clip), raises optstate.FailedPrecondition on any use instead
of reading freed memory. Unsupported configurations raise optstate.Unimplemented.
"""
import contextlib
import ctypes
import json
import os
import shutil
import uuid
import weakref

import torch

from . import checkpoint, errors
from .core import F32, MemoryManager, Store, StreamedAdam
from .integrations import STATE_DIR
from .torch import _DTYPES, _agreed_job, _rank

__all__ = ["stream_optimizer_state", "streamed_states", "shard_layout", "save", "load", "reshard_layout",
           "gather_reshard_layout", "shard_ranges", "sleep", "wake", "checkpoint_saved", "checkpoint_loaded",
           "FORMAT", "STATE_DIR"]

FORMAT = "optstate-megatron"
FORMAT_VERSION = 1
GLOBAL_BOXES = "global-boxes.json"  # vfs::kGlobalBoxesFileName

# The streamed states of this process by store uuid: checkpoint_saved finds the store of a record.
_LIVE = weakref.WeakValueDictionary()

def _world_size():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


# ---- the layout: a DistributedOptimizer's shards as store tensors ----

class Shard:
    """One param shard this rank's optimizer owns: a store tensor.

    name: the param's name (model.named_parameters(), "module." prefixes stripped; "chunk<i>." in
    front with several model chunks). group: index of the inner optimizer's param group. begin,
    numel: the flat range of the param's row-major flattening. global_shape: the param's shape.
    main: Megatron's main param of the shard (its .grad is the step's grad). param: the shard's
    memory in the param buffer (what the step writes). model_param: the whole param."""

    __slots__ = ("name", "group", "begin", "numel", "global_shape", "main", "param", "model_param", "own_main", "id",
                 "tp_offset", "tp_global_shape", "replica", "untileable")

    def __init__(self, name, group, begin, numel, global_shape, main, param, model_param, own_main):
        self.name, self.group, self.begin, self.numel = name, group, begin, numel
        self.global_shape, self.main, self.param, self.model_param = global_shape, main, param, model_param
        self.own_main = own_main  # a 16-bit param's fp32 main (freed once in the store), not an fp32 param's shard
        self.id = None
        # With tensor parallelism (_place_tensor_parallel): the param's slice as the box [tp_offset,
        # tp_offset + global_shape) of a tensor of tp_global_shape; or a replica (a param every
        # tensor-parallel rank holds whole, on a rank other than the first); or untileable (a
        # slice that is no box of one tensor: strided partitions, a gated linear unit's fc1).
        self.tp_offset = self.tp_global_shape = None
        self.replica = False
        self.untileable = None

    def __repr__(self):
        return "Shard(%s, group %d, flat [%d, %d) of %s)" % (self.name, self.group, self.begin,
                                                            self.begin + self.numel, list(self.global_shape))


def _param_names(dist_opt):
    chunks = list(getattr(dist_opt, "model_chunks", ()) or ())
    names = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            while name.startswith("module."):
                name = name[len("module."):]
            names.setdefault(p, ("chunk%d." % i if len(chunks) > 1 else "") + name)
    return names


def shard_layout(dist_opt, tensor_parallel=None):
    """The shards a DistributedOptimizer's rank owns, in the inner optimizer's order, as [Shard].

    Megatron's ranges are the source of truth: for each param, "param" is the rank's part of it
    (a flat range of its flattening) and "gbuf_world_in_bucket" where that part lies in its bucket's
    param buffer. tensor_parallel: (rank, size) of this rank's tensor-parallel group (default: from
    Megatron's parallel_state)."""
    names = _param_names(dist_opt)
    shards = []
    for model_groups, main_groups, own_main in (
            (dist_opt.model_float16_groups, dist_opt.shard_fp32_from_float16_groups, True),
            (dist_opt.model_fp32_groups, dist_opt.shard_fp32_groups, False)):
        for gid, (model_group, main_group) in enumerate(zip(model_groups, main_groups)):
            for model_param, main in zip(model_group, main_group):
                ranges = dist_opt._get_model_param_range_map(model_param)
                prange, world = ranges["param"], ranges["gbuf_world_in_bucket"]
                if prange.size != world.size or main is None or main.numel() != prange.size:
                    raise errors.Internal("optstate.megatron: the shard of %s has inconsistent ranges (param %s, "
                                          "buffer %s, main %s)" % (names.get(model_param), prange, world,
                                                                   None if main is None else main.numel()))
                gbuf_index, _, bucket_id = dist_opt.model_param_gbuf_map[model_param]
                param_data = dist_opt.buffers[gbuf_index].buckets[bucket_id].param_data
                view = param_data.view(-1)[world.start:world.end]
                name = names.get(model_param)
                if name is None:
                    raise errors.InvalidArgument("optstate.megatron: a param of shape %s is in the optimizer but in "
                                                 "none of its model chunks' named_parameters()"
                                                 % (tuple(model_param.shape),))
                shards.append(Shard(name, gid, int(prange.start), int(prange.size), tuple(model_param.shape),
                                    main, view, model_param, own_main))
    seen = set()
    for s in shards:
        if s.name in seen:
            raise errors.InvalidArgument("optstate.megatron: two shards of param %s on one rank" % s.name)
        seen.add(s.name)
    _place_tensor_parallel(dist_opt, shards, tensor_parallel)
    return shards


def _tensor_parallel_position(dist_opt):
    """(rank, size) of this rank in its tensor-parallel group (the expert tensor-parallel group for an
    expert optimizer), from Megatron's parallel_state; (0, 1) where it is not initialized."""
    try:
        from megatron.core import parallel_state as ps
        if not ps.model_parallel_is_initialized():
            return 0, 1
        groups = dist_opt.optimizer.param_groups
        if groups and all(g.get("is_expert_parallel", False) for g in groups):
            return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return 0, 1


def _place_tensor_parallel(dist_opt, shards, tensor_parallel):
    """Each shard's place in the whole (tensor-parallel) tensor, from the param's tensor-parallel
    attributes (tensor_model_parallel, partition_dim, partition_stride, as Megatron's layers set them):
    a split param's slice on rank t of T is the box at t x its extent in partition_dim of a tensor T
    times as large there (Megatron's own checkpoints concatenate the slices so); a param held whole
    by every tensor-parallel rank is the first rank's, a replica on the others."""
    rank, size = tensor_parallel if tensor_parallel is not None else _tensor_parallel_position(dist_opt)
    if size <= 1:
        return
    glu = any(getattr(getattr(c, "config", None), "gated_linear_unit", False)
              for c in getattr(dist_opt, "model_chunks", ()) or ())
    for s in shards:
        p = s.model_param
        if not getattr(p, "tensor_model_parallel", False):
            s.replica = rank > 0
            continue
        dim, stride = int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1))
        if stride != 1:
            s.untileable = "partition_stride %d" % stride
        elif glu and ".linear_fc1." in s.name:
            s.untileable = "a gated linear unit's fc1, whose slices hold a part of each half"
        shape = list(s.global_shape)
        if not 0 <= dim < len(shape):
            raise errors.InvalidArgument("optstate.megatron: param %s has partition_dim %d and shape %s"
                                         % (s.name, dim, shape))
        s.tp_offset = [0] * len(shape)
        s.tp_offset[dim] = rank * shape[dim]
        shape[dim] *= size
        s.tp_global_shape = shape


# ---- refusals ----

def _dist_optimizers(optimizer):
    """The DistributedOptimizers of a Megatron optimizer (a ChainedOptimizer or one of them)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for i, sub in enumerate(subs):
        if not isinstance(sub, DistributedOptimizer):
            raise errors.Unimplemented(
                "optstate.megatron: optimizer %d of the chain is a %s; optstate streams Megatron's "
                "DistributedOptimizer only (OptimizerConfig(use_distributed_optimizer=True) and a "
                "DistributedDataParallelConfig with use_distributed_optimizer=True)" % (i, type(sub).__name__))
    return subs


def _check_supported(index, dist_opt):
    from megatron.core.fp8_utils import is_float8tensor
    config = dist_opt.config
    where = "optimizer %d of the chain" % index

    def refuse(what, why):
        raise errors.Unimplemented("optstate.megatron: %s: %s is not supported (%s)" % (where, what, why))
    if getattr(config, "optimizer", "adam") != "adam":
        refuse("optimizer=%r" % config.optimizer, "optstate streams Adam/AdamW state")
    if getattr(config, "use_precision_aware_optimizer", False):
        refuse("use_precision_aware_optimizer", "optstate keeps the fp32 mains and chooses the moments' dtype itself: "
               "pass moment_dtype=\"bf16\" instead")
    if getattr(config, "optimizer_cpu_offload", False):
        refuse("optimizer_cpu_offload", "the state's home is the store; the two are exclusive")
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        refuse("reuse_grad_buf_for_mxfp8_param_ag", "MXFP8 param all-gather copies the mains through another path")
    if getattr(dist_opt.ddp_config, "use_megatron_fsdp", False):
        refuse("use_megatron_fsdp", "Megatron FSDP keeps its mains in its own buffers")
    for group in dist_opt.model_float16_groups + dist_opt.model_fp32_groups:
        for p in group:
            if is_float8tensor(p):
                refuse("fp8 params (%s)" % type(p).__name__, "their update is a data-parallel collective "
                       "quantization of the whole mains, which a streamed step does not hold at once")
    inner = dist_opt.optimizer
    cls = type(inner).__name__
    if not (isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or cls == "FusedAdam"):
        refuse("inner optimizer %s" % cls, "optstate's step is Adam/AdamW")
    for g in inner.param_groups:
        if g.get("amsgrad") or g.get("maximize"):
            refuse("amsgrad/maximize", "optstate's step is plain Adam/AdamW")
        if "bias_correction" in g and not g["bias_correction"]:
            refuse("bias_correction=False", "optstate's step always corrects bias")
    if any(len(s) for s in inner.state.values()):
        raise errors.FailedPrecondition(
            "optstate.megatron: %s has already taken a step or loaded state (its inner %s holds moments); "
            "call stream_optimizer_state right after get_megatron_optimizer, before training or loading a "
            "checkpoint" % (where, cls))


# ---- one DistributedOptimizer's stream ----

class StreamedState:
    """The optstate store of one DistributedOptimizer: registration, the step, reload, save/load, sleep."""

    def __init__(self, dist_opt, store, sub_name, shards, budget, moment_dtype, backend, host_cache_bytes,
                 commit_lag_steps, cpu_threads, direct_grads=True, safetensors=False):
        """Takes the opened `store` (closes it on failure)."""
        self.dist_opt, self.store, self.sub_name, self.shards = dist_opt, store, sub_name, shards
        self._direct_grads = direct_grads
        # Whether checkpoint_saved writes state.safetensors beside the field files.
        self.safetensors = bool(safetensors)
        # Megatron's clip coefficient for the next step's 16-bit grads (_install_clip_hook), and the
        # one-float tensor that hands it to the step as its grad scale.
        self._clip_coeff = 1.0
        self._clip_scale = None
        # The optimizer and this object reference each other (its bound methods), so they go to the
        # cyclic collector together, which would finalize the store, manager and optimizer handles in
        # any order. The finalizer holds them (it outlives the cycle) and closes the store, which closes
        # the optimizer and the manager first.
        self._live_handles = [store]
        self._finalizer = weakref.finalize(self, _close_quietly, store, self._live_handles)
        self.rank = _rank()
        try:
            self.device = shards[0].param.device
            self._cuda = self.device.type == "cuda"
            if backend == "auto":
                backend = "cuda" if self._cuda else "host"
            self._mm_kw = dict(backend=backend, device_budget_bytes=int(budget), host_cache_bytes=host_cache_bytes,
                               cuda_device=self.device.index if self.device.index is not None else 0)
            self._adam_kw = dict(moment_dtype=moment_dtype, commit_lag_steps=commit_lag_steps,
                                 cpu_threads=cpu_threads)
            self._check_names()
            self._hyper = {}
            self._open()
        except BaseException:
            self.store.close()
            raise

    def _check_names(self):
        stored = set(self.store.tensor_names())
        if not stored:
            return
        mine = {s.name for s in self.shards}
        if stored != mine:
            only_store, only_model = sorted(stored - mine), sorted(mine - stored)
            raise errors.FailedPrecondition(
                "optstate.megatron: store %s holds the state of other shards than this rank's %s owns (store "
                "only: %s; this rank only: %s): another model or another layout (a different data/tensor/pipeline "
                "parallel size: reshard the checkpoint, docs/MEGATRON.md); nothing was written"
                % (self.store._path, self.sub_name, only_store[:4], only_model[:4]))

    def _open(self):
        """Creates the manager and optimizer on the store and registers the shards. A new store takes
        Megatron's fp32 mains; a store that holds them (resume) writes its mains into the param buffer."""
        self.mm = MemoryManager(self.store, **self._mm_kw)
        self.adam = StreamedAdam(self.store, self.mm, **self._adam_kw)
        self._live_handles[:] = [self.store, self.mm, self.adam]
        self._sync()
        # A store that holds every shard (resume, restore) ignores the initial mains: none are read (the
        # freed mains would need an fp32 copy of every shard on the device).
        holds_all = bool(self.shards) and set(self.store.tensor_names()) == {s.name for s in self.shards}
        initials = None if holds_all else [self._initial(s) for s in self.shards]  # alive through registration
        got = self.adam.register_params(
            [s.name for s in self.shards], [s.numel for s in self.shards], [s.group for s in self.shards],
            None if initials is None else [t.data_ptr() for t in initials], [F32] * len(self.shards),
            [(s.numel,) for s in self.shards], [s.global_shape for s in self.shards],
            [(s.begin,) for s in self.shards])
        existed = [e for _, e in got]
        if any(existed) and not all(existed):
            missing = [s.name for s, e in zip(self.shards, existed) if not e]
            raise errors.FailedPrecondition("optstate.megatron: store %s lacks the shards of %s"
                                            % (self.store._path, missing[:4]))
        for s, (pid, _) in zip(self.shards, got):
            s.id = pid
        if all(existed):
            self._mains_to_params()
        else:
            self.adam.make_durable()
        self._free_mains()
        self._ids = (ctypes.c_uint32 * len(self.shards))(*[s.id for s in self.shards])
        self._numels = (ctypes.c_uint64 * len(self.shards))(*[s.numel for s in self.shards])
        self._pdt = (ctypes.c_int * len(self.shards))(*[_DTYPES[s.param.dtype] for s in self.shards])
        self.resumed = all(existed)
        _LIVE[self.store.uuid] = self

    @staticmethod
    def _initial(s):
        """A shard's initial main (fp32; the store records the dtype it was registered with):
        Megatron's fp32 main while it has memory, else the param shard in fp32."""
        if s.own_main and s.main.untyped_storage().size() > 0:
            return s.main.detach()
        return s.param.detach().float().contiguous()

    def _free_mains(self):
        """The fp32 mains live in the store now: their GPU memory goes (the tensors keep their shape,
        which Megatron's grad copy and clipping check, and hold no storage; the optimizer only sets and
        reads their .grad). model_param.main_param, which code outside the optimizer reads (params-norm
        logging, QK-clip), becomes a tensor that raises optstate.FailedPrecondition on any use, rather
        than one that would read freed memory."""
        for s in self.shards:
            if s.own_main and s.main.untyped_storage().size() > 0:
                s.main.untyped_storage().resize_(0)
            if s.own_main and getattr(s.model_param, "main_param", None) is s.main:
                s.model_param.main_param = _main_in_store(s, self.store._path)
        self._read_grad_buffer_directly()

    def _read_grad_buffer_directly(self):
        """Where Megatron reduces grads in 16 bits (grad_reduce_in_fp32=False) and has no grad scaler (bf16
        without loss scaling), the step reads each shard's grad in the grad buffer itself: the shard's
        main param becomes a storage-less tensor of the grad buffer's dtype, whose .grad is the buffer's
        shard (_copy_model_grads_to_main_grads), instead of Megatron's fp32 copy of it (4 bytes a param
        of the shard every step). Megatron's grad norm and zero count read those 16-bit grads; its
        clipping, which takes fp32 grads only, hands its coefficient to the step instead of scaling them
        in place (_install_clip_hook; docs/MEGATRON.md: the bound)."""
        if not self._direct_grads or self.dist_opt.grad_scaler is not None:
            return
        swap = {}
        for s in self.shards:
            g = getattr(s.model_param, "main_grad", None)
            if not s.own_main or g is None or g.dtype not in (torch.bfloat16, torch.float16) or s.main.dtype == g.dtype:
                continue
            stub = torch.empty(s.numel, dtype=g.dtype, device=s.main.device)
            stub.untyped_storage().resize_(0)
            # The tensor-parallel and sharing attributes Megatron's grad norm reads from the main params.
            for k, v in s.main.__dict__.items():
                setattr(stub, k, v)
            stub._optstate_clip_to = weakref.ref(self)
            swap[id(s.main)] = stub
            s.main = stub
        if not swap:
            return
        _install_clip_hook()
        for groups in (self.dist_opt.shard_fp32_from_float16_groups,):
            for group in groups:
                group[:] = [swap.get(id(p), p) for p in group]
        for group in self.dist_opt.optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]

    def _sync(self):
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _mains_to_params(self):
        """Writes the store's committed mains (cast) into the param buffer's shards."""
        for s in self.shards:
            main = torch.empty(s.numel, dtype=torch.float32)
            self.store.read_into(s.name, "main", main.data_ptr(), 0, s.numel)
            s.param.copy_(main.to(s.param.device))
        self._sync()

    def close(self):
        """Commits what is pending and closes the store (the optimizer and manager first)."""
        self._finalizer()

    # -- the step --

    def _send_hyper(self):
        adamw = bool(getattr(self.dist_opt.config, "decoupled_weight_decay", True))
        inner = self.dist_opt.optimizer
        if type(inner).__name__ == "FusedAdam" and hasattr(inner, "adam_w_mode"):
            adamw = bool(inner.adam_w_mode)
        elif isinstance(inner, torch.optim.AdamW):
            adamw = True
        elif isinstance(inner, torch.optim.Adam):
            adamw = False
        for gid, group in enumerate(inner.param_groups):
            beta1, beta2 = group["betas"]
            h = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                 adamw)
            if self._hyper.get(gid) != h:
                self.adam.set_group(gid, *h[:5], adamw=adamw)
                self._hyper[gid] = h

    def step(self):
        """One streamed step over every shard; the grads are the mains' .grad as Megatron left them."""
        n = len(self.shards)
        grads = (ctypes.c_void_p * n)()
        gdt = (ctypes.c_int * n)()
        # The param buffer's address is read at every step: a trainer that offloads and reallocates the
        # model's buffers (colocated RL) moves it.
        params = (ctypes.c_void_p * n)(*[s.param.data_ptr() for s in self.shards])
        for i, s in enumerate(self.shards):
            g = s.main.grad
            if g is None:
                raise errors.FailedPrecondition("optstate.megatron: the shard of %s has no grad (step() without "
                                                "prepare_grads?)" % s.name)
            if g.dtype not in _DTYPES or not g.is_contiguous() or g.numel() != s.numel or g.device != self.device:
                raise errors.InvalidArgument("optstate.megatron: the grad of the shard of %s is %s %s on %s "
                                             "(contiguous: %s); expected %d contiguous elements on %s"
                                             % (s.name, g.dtype, tuple(g.shape), g.device, g.is_contiguous(),
                                                s.numel, self.device))
            grads[i] = g.data_ptr()
            gdt[i] = _DTYPES[g.dtype]
        self._send_hyper()
        scale_ptr = None
        coeff, self._clip_coeff = self._clip_coeff, 1.0  # this step's clipping only
        if coeff != 1.0:  # the kernel multiplies the grads by 1 / scale: by Megatron's clip coefficient
            if self._clip_scale is None:
                self._clip_scale = torch.empty(1, dtype=torch.float32, device=self.device)
            self._clip_scale.fill_(1.0 / coeff)
            scale_ptr = self._clip_scale.data_ptr()
        self._sync()  # the optimizer's streams read the grads
        self.adam.step2_raw(n, self._ids, grads, gdt, self._numels, params, self._pdt, grad_scale_ptr=scale_ptr)

    # -- mains from the model --

    def reload_model_params(self, sources=None):
        """Replaces the mains with the model params' values (or, given {model_param: tensor}, those
        tensors'), as Megatron's _copy_model_params_to_main_params; moments and step counts stay."""
        self._sync()
        for s in self.shards:
            src = s.model_param if sources is None else sources[s.model_param]
            shard = src.detach().reshape(-1)[s.begin:s.begin + s.numel]
            if shard.dtype not in _DTYPES:
                shard = shard.float()
            shard = shard.to(self.device).contiguous()
            self._sync()
            self.adam.load_main(s.id, shard.data_ptr(), _DTYPES[shard.dtype])
        self.adam.make_durable()
        self._mains_to_params()

    # -- checkpoints --

    # Snapshots that snapshot() made and no checkpoint holds (a checkpoint directory that
    # checkpoint_saved wrote holds its own until deleted): the newest this many are kept.
    state_dict_snapshots = 2

    def snapshot(self):
        """Commits what is pending and pins it as snapshot "state-dict-<generation>"; the record a
        checkpoint keeps. Older such snapshots that no checkpoint directory holds are released beyond
        the newest state_dict_snapshots (optstate.checkpoint.pin_state_dict_snapshot)."""
        gen = self.adam.make_durable()
        name = checkpoint.pin_state_dict_snapshot(self.store, gen, self.state_dict_snapshots)
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "store": os.path.abspath(self.store._path),
                "store_name": self.store.name, "store_uuid": self.store.uuid, "job": self.store.job,
                "generation": gen, "snapshot": name, "sub_optimizer": self.sub_name, "rank": self.rank,
                "shards": len(self.shards)}

    def _files_for(self, record):
        """The checkpoint directory that checkpoint_saved wrote for record (under the root that
        checkpoint_loaded noted in it, or a root armed with optstate.checkpoint.resume_from), or None."""
        roots = [record["files_root"]] if record.get("files_root") else []
        roots += list(reversed(checkpoint._resume_roots))
        for root in roots:
            d = rank_dir(root, record.get("sub_optimizer", self.sub_name), record.get("rank", self.rank))
            if checkpoint._manifest_matches(d, record) is not None:
                return d
        return None

    def restore(self, record):
        """Brings the store back to the state a snapshot() record names and the param buffer to its
        mains: from the store's own snapshot while it holds it, else from the files checkpoint_saved
        wrote into the checkpoint (a copy on another node, a fresh store path)."""
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise errors.InvalidArgument("optstate.megatron: %s: the checkpoint's optimizer entry is %r, not an "
                                         "optstate-megatron record (a checkpoint written without optstate?)"
                                         % (self.sub_name, type(record).__name__))
        self.adam.make_durable()
        same_store = record.get("store_uuid") == self.store.uuid
        if same_store and self.store.latest_generation()[0] == record["generation"]:
            self._mains_to_params()
            return
        snaps = dict(self.store.snapshots())
        if not (same_store and snaps.get(record["snapshot"]) == record["generation"]):
            files = self._files_for(record)
            if files is not None:
                self.restore_dir(files, force=True)
                return
            if same_store:
                raise errors.NotFound(
                    "optstate.megatron: store %s no longer holds snapshot %s (generation %d) that the checkpoint "
                    "refers to, and no checkpoint directory with its files was found (%s/<sub>/rank-<r> under "
                    "the loaded checkpoint, or a root armed with optstate.checkpoint.resume_from)"
                    % (self.store._path, record["snapshot"], record["generation"], STATE_DIR))
            raise errors.FailedPrecondition(
                "optstate.megatron: the checkpoint's %s state is in store %s (uuid %s), this rank's store is %s "
                "(uuid %s), and the checkpoint carries no files of it (%s/%s/rank-%05d under a checkpoint "
                "directory that dist_checkpointing.save wrote while the optimizer streamed, or a root armed "
                "with optstate.checkpoint.resume_from); a directory optstate.megatron.save wrote loads with "
                "optstate.megatron.load(optimizer, dir), resharded first when the topology differs"
                % (self.sub_name, record.get("store"), record.get("store_uuid"), self.store._path, self.store.uuid,
                   STATE_DIR, record.get("sub_optimizer", self.sub_name), record.get("rank", self.rank)))
        tmp = "%s.restore-%s" % (os.path.abspath(self.store._path), uuid.uuid4().hex[:8])
        try:
            self.store.export_checkpoint(tmp, snapshot=record["snapshot"], safetensors=False)  # read once, here
            self.restore_dir(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def restore_dir(self, src, force=False):
        """Restores an optstate checkpoint directory into the store and resumes from it."""
        self.adam.make_durable()
        self._sync()
        self.adam.close()
        self.mm.close()
        self.store.restore_checkpoint(src, force=force)
        self._check_names()
        self._hyper = {}
        self._open()
        self._mains_to_params()

    def sleep(self):
        self.adam.make_durable()
        self.mm.release_all()


# ---- wiring into Megatron ----

def _bind(dist_opt, state):
    from types import MethodType

    def step_with_ready_grads(self):
        timers = self.config.timers
        if timers is not None:
            timers("optimizer-inner-step", log_level=1).start(barrier=self.config.barrier_with_L1_time)
        state.step()
        if timers is not None:
            timers("optimizer-inner-step").stop()
            timers("params-all-gather", log_level=1).start(barrier=self.config.barrier_with_L1_time)
        # As DistributedOptimizer.step_with_ready_grads: without overlap, all-gather the params now;
        # with it, the next forward's hooks do.
        if not self.ddp_config.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
        if timers is not None:
            timers("params-all-gather").stop()
        return True

    def reload_model_params(self, state_dict=None):
        sources = self._build_model_param_to_state_dict_param_map(state_dict) if state_dict is not None else None
        state.reload_model_params(sources)

    def _common(self):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        scaler = self.grad_scaler.state_dict() if self.grad_scaler is not None else None
        return groups, scaler

    def state_dict(self):
        groups, scaler = _common(self)
        return {"param_groups": groups, "grad_scaler": scaler, "optstate": state.snapshot()}

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, **kwargs):
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        groups, scaler = _common(self)
        record = {} if is_loading else state.snapshot()  # loading: a template, its data is read
        return {"param_groups": groups, "grad_scaler": scaler,
                "optstate": ShardedObject("optimizer.optstate.%s" % state.sub_name, record, (_world_size(),),
                                          (_rank(),), replica_id=0)}

    def load_state_dict(self, sd):
        if "optstate" not in sd:
            raise errors.InvalidArgument("optstate.megatron: %s: the optimizer state being loaded has no optstate "
                                         "record (keys %s): a checkpoint written without optstate"
                                         % (state.sub_name, sorted(sd)[:6]))
        for group, saved in zip(self.optimizer.param_groups, sd.get("param_groups") or ()):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])
        state.restore(sd["optstate"])

    def _copy_model_params_to_main_params(self, state_dict=None):
        reload_model_params(self, state_dict)

    def _copy_main_params_to_model_params(self):
        state.adam.make_durable()
        state._mains_to_params()

    def _copy_model_grads_to_main_grads(self):
        # As Megatron's, but a shard whose main has the grad buffer's dtype takes the buffer's shard
        # itself (StreamedState._read_grad_buffer_directly), not an fp32 copy.
        for s in state.shards:
            g = s.model_param.main_grad.view(-1)[s.begin:s.begin + s.numel]
            s.main.grad = g if g.dtype == s.main.dtype else g.float()

    def refuse(what):
        def method(self, *args, **kwargs):
            raise errors.Unimplemented(
                "optstate.megatron: %s of %s reads the optimizer state from GPU tensors, which live in store %s: "
                "checkpoint with the torch_dist format (sharded_state_dict) or optstate.megatron.save/load"
                % (what, state.sub_name, state.store._path))
        method.__name__ = what
        return method

    def offload_to_cpu(self):
        state.sleep()

    def restore_from_cpu(self):
        pass

    refusals = [refuse(n) for n in ("save_parameter_state", "load_parameter_state", "get_parameter_state_dp_zero",
                                    "load_parameter_state_from_dp_zero", "get_parameter_state_dp_reshardable",
                                    "load_parameter_state_from_dp_reshardable")]
    for fn in [step_with_ready_grads, reload_model_params, state_dict, sharded_state_dict, load_state_dict,
               offload_to_cpu, restore_from_cpu, _copy_model_params_to_main_params,
               _copy_main_params_to_model_params, _copy_model_grads_to_main_grads] + refusals:
        setattr(dist_opt, fn.__name__, MethodType(fn, dist_opt))
    dist_opt._optstate = state


class _MainInStore(torch.Tensor):
    """model_param.main_param of a streamed shard: any torch operation on it raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        what = next((a._optstate_what for a in args if isinstance(a, _MainInStore)), "a streamed main")
        raise errors.FailedPrecondition(
            "optstate.megatron: %s: the fp32 main of this shard lives in an optstate store, not in GPU memory "
            "(read it with optstate.megatron.streamed_states(optimizer)[i].store.read(name, \"main\"); "
            "change it with optimizer.reload_model_params())" % what)


def _main_in_store(shard, path):
    with torch._C.DisableTorchFunctionSubclass():
        t = torch.Tensor._make_subclass(_MainInStore, torch.empty(0, dtype=torch.float32, device=shard.param.device))
    t._optstate_what = "param %s, flat [%d, %d) (store %s)" % (shard.name, shard.begin, shard.begin + shard.numel, path)
    return t


def _close_quietly(store, handles):
    try:
        store.close()
    except Exception:  # interpreter shutdown: nothing left to report to
        pass
    del handles[:]


def _check_shards(index, shards):
    if not shards:
        raise errors.Internal("optstate.megatron: optimizer %d of the chain owns no shard" % index)
    device = shards[0].param.device
    for s in shards:
        if s.param.dtype not in _DTYPES:
            raise errors.Unimplemented("optstate.megatron: param %s has dtype %s; optstate writes float32, "
                                       "bfloat16 or float16 params" % (s.name, s.param.dtype))
        if s.param.device != device:
            raise errors.InvalidArgument("optstate.megatron: param %s is on %s, the others on %s"
                                         % (s.name, s.param.device, device))


def _split_budget(budget, numels, chunk_sizes, moment_dtype, paths):
    """Each store's part of the device budget: by its share of the elements, at least the one slice in
    flight a step needs (chunks of main and of each moment field: 3 with f32 moments, 4 with bf16,
    8 with q8, as StreamedAdam counts them)."""
    per_slice = {"f32": 3, "bf16": 4, "q8": 8}.get(str(moment_dtype), 8)
    floors = [per_slice * c for c in chunk_sizes]
    if sum(floors) > budget:
        raise errors.ResourceExhausted(
            "optstate.megatron: budget %d bytes is below what %d stores need at least (%s bytes: the chunks of "
            "main and of each moment field of one slice in flight per store, chunks of %s bytes; stores %s)"
            % (budget, len(paths), " + ".join(str(f) for f in floors), chunk_sizes, paths))
    if len(numels) == 1:
        return [budget]
    spare = budget - sum(floors)
    total = max(1, sum(numels))
    page = 2 << 20
    return [f + (spare * n // total) // page * page for f, n in zip(floors, numels)]


def _sub_name(index, dist_opt):
    groups = dist_opt.optimizer.param_groups
    expert = bool(groups) and all(g.get("is_expert_parallel", False) for g in groups)
    instance = getattr(dist_opt, "distributed_optimizer_instance_id", 0) or 0
    return "%d.%s%s" % (index, "expert" if expert else "dense", ".instance%d" % instance if instance else "")


def stream_optimizer_state(optimizer, store, budget=2 << 30, moment_dtype="f32", *, backend="auto",
                           host_cache_bytes="auto", job=None, chunk_size_bytes=None, data_dirs=None,
                           commit_lag_steps=1, cpu_threads=None, tensor_parallel=None, direct_grads=True,
                           safetensors=False):
    """Moves the fp32 mains and Adam moments of every DistributedOptimizer in `optimizer` (what
    get_megatron_optimizer returned) into optstate stores and streams its steps through them.

    store: this rank's directory ("{rank}" is replaced by torch.distributed's rank); each
      sub-optimizer of the chain gets `<store>/<index>.<dense|expert>`. A store that already holds
      the shards (a restart) resumes: its mains are written into the param buffer.
    budget: device bytes all the stores' windows may use together (split by their sizes).
    moment_dtype: "f32", "bf16" or "q8" (docs/MOMENTS.md). backend: "auto", "cuda" or "host".
    job: the training job's id for new stores (default: one id agreed over torch.distributed).
    tensor_parallel: (rank, size) of this rank's tensor-parallel group, where the shards' places in
      the whole tensors come from (default: Megatron's parallel_state).
    direct_grads: with 16-bit grad buffers and no grad scaler, the step reads the grads in the grad
      buffer instead of Megatron's fp32 copy of them (docs/MEGATRON.md); False: Megatron's copy.
    safetensors: the state's files that dist_checkpointing.save puts into a checkpoint directory
      (checkpoint_saved) carry state.safetensors too, the field files' bytes again; default False:
      manifest.json and the field files, the state once. A checkpoint loads either way.
    Returns [StreamedState], one per streamed sub-optimizer (also `dist_opt._optstate`).
    Call it right after get_megatron_optimizer, before any step or checkpoint load."""
    subs = _dist_optimizers(optimizer)
    active = []
    for i, sub in enumerate(subs):
        if getattr(sub, "is_stub_optimizer", False):
            continue
        if hasattr(sub, "_optstate"):
            raise errors.FailedPrecondition("optstate.megatron: optimizer %d of the chain already streams its state "
                                            "through store %s" % (i, sub._optstate.store._path))
        _check_supported(i, sub)
        active.append((i, sub))
    if job is None:
        job = _agreed_job()
    base = os.fspath(store).replace("{rank}", str(_rank()))
    if cpu_threads is None:
        cpu_threads = max(1, min(4, torch.get_num_threads()))
    layouts = [shard_layout(sub, tensor_parallel) for _, sub in active]
    for (i, _), shards in zip(active, layouts):
        _check_shards(i, shards)
    stores, states = [], []
    try:
        for i, sub in active:
            name = _sub_name(i, sub)
            path = os.path.join(base, name)
            os.makedirs(base, exist_ok=True)
            stores.append(Store(path, name=name, chunk_size_bytes=chunk_size_bytes, data_dirs=data_dirs or (),
                                job=job))
        budgets = _split_budget(int(budget), [sum(s.numel for s in shards) for shards in layouts],
                                [st.chunk_size_bytes for st in stores], moment_dtype, [st._path for st in stores])
        for (i, sub), shards, st, part in zip(active, layouts, stores, budgets):
            states.append(StreamedState(sub, st, _sub_name(i, sub), shards, part, moment_dtype, backend,
                                        host_cache_bytes, commit_lag_steps, cpu_threads, direct_grads,
                                        safetensors))
    except BaseException:
        for st in stores:
            with contextlib.suppress(Exception):
                st.close()
        raise
    for (_, sub), st in zip(active, states):
        _bind(sub, st)
    _install_checkpoint_hooks()
    return states


def streamed_states(optimizer):
    """The StreamedState of each streamed sub-optimizer of `optimizer`."""
    return [sub._optstate for sub in getattr(optimizer, "chained_optimizers", [optimizer]) if hasattr(sub, "_optstate")]


def _states(optimizer):
    states = streamed_states(optimizer)
    if not states:
        raise errors.FailedPrecondition("optstate.megatron: the optimizer does not stream its state "
                                        "(call stream_optimizer_state first)")
    return states


def sleep(optimizer):
    """Commits and releases every device page of the streamed state (colocated RL: the GPU is
    the rollout's until the next step); the store on NVMe is the state's home, nothing is copied."""
    for st in _states(optimizer):
        st.sleep()


def wake(optimizer):
    """Counterpart of sleep(): the next step maps the pages it needs again, so nothing is done."""
    _states(optimizer)


def rank_dir(dest, sub_name, rank):
    """Where save() puts a rank's checkpoint of one sub-optimizer: <dest>/<sub>/rank-<rank:05d>."""
    return os.path.join(os.fspath(dest), sub_name, "rank-%05d" % rank)


def save(optimizer, dest, rank=None, safetensors=True):
    """Writes each streamed sub-optimizer's committed state as an optstate checkpoint directory
    (rank_dir(dest, sub, rank)), with tensor parallelism its global-boxes.json (where each slice lies
    in the whole tensor, which optstate.reshard reads); returns the directories. Every rank calls it.
    rank: default torch.distributed's. safetensors: as optstate.checkpoint.save's (False: no
    state.safetensors, the state written once)."""
    out = []
    for st in _states(optimizer):
        st.adam.make_durable()
        d = rank_dir(dest, st.sub_name, _rank() if rank is None else rank)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        st.store.export_checkpoint(d, safetensors=safetensors)
        _write_global_boxes(d, st.shards)
        out.append(d)
    return out


def _write_global_boxes(d, shards):
    """d/global-boxes.json: each tensor-parallel slice's box in its whole tensor, each replica marked
    (docs/RESHARD.md); nothing without tensor parallelism. Written whole or not at all."""
    tensors = {}
    for s in shards:
        if s.replica:
            tensors[s.name] = {"replica": True}
        elif s.tp_offset is not None and not s.untileable:
            # An untileable slice is left as the rank holds it: the tensor-parallel ranks' slices then
            # overlap, and a reshard refuses them rather than misplace their elements.
            tensors[s.name] = {"offset": list(s.tp_offset), "global_shape": list(s.tp_global_shape)}
    if not tensors:
        return
    path = os.path.join(d, GLOBAL_BOXES)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": "optstate-global-boxes", "format_version": 1, "tensors": tensors}, f, indent=1,
                  sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(optimizer, src, force=False, rank=None):
    """Restores what save() wrote under src (or optstate.reshard wrote to <src>/<sub>, with
    reshard_layout's layout) into each streamed sub-optimizer's store and resumes from it: the
    param buffer takes the mains. rank: default torch.distributed's."""
    for st in _states(optimizer):
        st.restore_dir(rank_dir(src, st.sub_name, _rank() if rank is None else rank), force=force)


def shard_ranges(optimizer, sub_name=None):
    """{tensor name: {"flat": [begin, end]}} of this rank's shards of one streamed sub-optimizer (the
    only one, or the one named sub_name): its part of a reshard layout. With tensor parallelism a
    split param's entry has "within": its slice's box in the whole tensor (the range is of the
    slice), and a param held whole by every tensor-parallel rank is a "replica" on all but the first."""
    states = _states(optimizer) if any(hasattr(s, "_optstate") for s in
                                       getattr(optimizer, "chained_optimizers", [optimizer])) else None
    if states is None:  # not streamed (yet): the layout of its DistributedOptimizers
        subs = [(_sub_name(i, d), d) for i, d in enumerate(_dist_optimizers(optimizer))
                if not getattr(d, "is_stub_optimizer", False)]
        shards = {name: shard_layout(d) for name, d in subs}
    else:
        shards = {st.sub_name: st.shards for st in states}
    if sub_name is None:
        if len(shards) != 1:
            raise errors.InvalidArgument("optstate.megatron: the optimizer has sub-optimizers %s; name one"
                                         % sorted(shards))
        sub_name = next(iter(shards))
    if sub_name not in shards:
        raise errors.NotFound("optstate.megatron: no sub-optimizer %s (there are %s)" % (sub_name, sorted(shards)))
    out = {}
    for s in shards[sub_name]:
        entry = {"flat": [s.begin, s.begin + s.numel]}
        if s.untileable:
            raise errors.Unimplemented(
                "optstate.megatron: param %s: its tensor-parallel slices are no boxes of one tensor (%s); "
                "resharding to another tensor-parallel size does not support it" % (s.name, s.untileable))
        if s.tp_offset is not None:
            entry["within"] = {"offset": list(s.tp_offset), "shape": list(s.global_shape)}
        if s.replica:
            entry["replica"] = True
        out[s.name] = entry
    return out


def reshard_layout(optimizers, sub_name=None):
    """The optstate.reshard layout that gives each rank of a topology its shards of one
    sub-optimizer, from `optimizers`, one per rank in rank order (in a distributed job:
    gather_reshard_layout)."""
    per_rank = [shard_ranges(o, sub_name) for o in optimizers]
    return {"format": "optstate-reshard-layout", "format_version": 1,
            "ranks": [{"rank": r, "tensors": t} for r, t in enumerate(per_rank)]}


def gather_reshard_layout(optimizer, sub_name=None, group=None):
    """reshard_layout over torch.distributed: every rank of `group` passes its own optimizer (a
    collective); every rank gets the whole layout, ranks in their order in the group. group: None
    (the default group) with data and tensor parallelism; with pipeline parallelism, the ranks of
    one pipeline stage (its tensor x data-parallel ranks): each stage reshards its own ranks, and
    each rank loads the output of its index in that group."""
    mine = shard_ranges(optimizer, sub_name)
    size = torch.distributed.get_world_size(group) if group is not None else _world_size()
    gathered = [None] * size
    torch.distributed.all_gather_object(gathered, mine, group=group)
    return {"format": "optstate-reshard-layout", "format_version": 1,
            "ranks": [{"rank": r, "tensors": t} for r, t in enumerate(gathered)]}


# ---- the state's files in Megatron's own checkpoints ----
#
# Megatron's dist_checkpointing.save(sharded_state_dict, checkpoint_dir) (what Megatron-LM's
# save_checkpoint calls for torch_dist) has no hook of its own, so stream_optimizer_state wraps it and
# dist_checkpointing.load: a save writes the files of the snapshot each of this process's optstate
# records names into <checkpoint_dir>/optstate/<sub>/rank-<rank:05d> (optstate.checkpoint.save_into:
# the snapshot is then held by checkpoint_dir, and released once that directory is deleted), and a
# load notes that root in the records it returns, so load_state_dict restores from those files when
# the store lacks the snapshot (the checkpoint copied to another node, a fresh store path).


def _records(obj, out=None, depth=0):
    """The optstate-megatron records in a (sharded) state dict, in order."""
    out = [] if out is None else out
    if depth > 32:
        return out
    if isinstance(obj, dict):
        if obj.get("format") == FORMAT and "store_uuid" in obj:
            out.append(obj)
            return out
        for v in obj.values():
            _records(v, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _records(v, out, depth + 1)
    elif type(obj).__name__ == "ShardedObject":
        _records(getattr(obj, "data", None), out, depth + 1)
    return out


def checkpoint_saved(sharded_state_dict, checkpoint_dir):
    """Writes the state that the optstate records in sharded_state_dict (this process's
    optimizer.sharded_state_dict() or state_dict()) name into checkpoint_dir/optstate/<sub>/rank-<r>
    and records each snapshot as held by checkpoint_dir; snapshots of checkpoint directories deleted
    since are released. Called by the wrapped dist_checkpointing.save; call it yourself after saving
    a state_dict() elsewhere. The directories carry state.safetensors only where the store's
    stream_optimizer_state was given safetensors=True. Returns the directories written."""
    root = os.path.join(os.fspath(checkpoint_dir), STATE_DIR)
    out = []
    for rec in _records(sharded_state_dict):
        st = _LIVE.get(rec["store_uuid"])
        if st is None:
            raise errors.FailedPrecondition(
                "optstate.megatron: the checkpoint being saved to %s names store %s (uuid %s), which no optimizer "
                "of this process streams through" % (checkpoint_dir, rec.get("store"), rec["store_uuid"]))
        dest = rank_dir(root, rec["sub_optimizer"], rec["rank"])
        out.append(checkpoint.save_into(st.store, root, holder=checkpoint_dir, state_dict={"optstate": rec},
                                        dest=dest, safetensors=st.safetensors))
        _write_global_boxes(dest, st.shards)
    return out


def checkpoint_loaded(state_dict, checkpoint_dir):
    """Notes checkpoint_dir/optstate in the optstate records of a state dict loaded from
    checkpoint_dir, where load_state_dict finds their files when the store lacks the snapshot. Called
    by the wrapped dist_checkpointing.load. Returns state_dict."""
    root = os.path.abspath(os.path.join(os.fspath(checkpoint_dir), STATE_DIR))
    for rec in _records(state_dict):
        rec["files_root"] = root
    return state_dict


def _install_clip_hook():
    """Megatron clips by scaling the main grads in place with clip_grad_by_total_norm_fp32, which takes
    fp32 grads only. For the 16-bit grads a streamed step reads in the grad buffer
    (StreamedState._read_grad_buffer_directly) the coefficient goes to that step as its grad scale
    instead (the kernel multiplies in fp32, so the clipped grads are not rounded to 16 bits); every
    other param is clipped by Megatron's own function as before."""
    import functools
    from megatron.core.optimizer import optimizer as megatron_optimizer
    inner = megatron_optimizer.clip_grad_by_total_norm_fp32
    if getattr(inner, "_optstate_hook", False):
        return

    @functools.wraps(inner)
    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        rest, owners = [], {}
        for p in parameters:
            ref = getattr(p, "_optstate_clip_to", None)
            state = ref() if ref is not None and not use_decoupled_grad else None
            if state is None:
                rest.append(p)
            elif p.grad is not None:
                owners[id(state)] = state
        if rest or not owners:
            inner(rest, max_norm, total_norm, use_decoupled_grad)
        coeff = float(max_norm) / (float(total_norm) + 1.0e-6)  # as Megatron's
        for state in owners.values():
            state._clip_coeff = min(coeff, 1.0)

    clip._optstate_hook = True
    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip


def _install_checkpoint_hooks():
    import functools
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    if getattr(serialization.save, "_optstate_hook", False):
        return
    inner_save, inner_load = serialization.save, serialization.load

    @functools.wraps(inner_save)
    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        records = _records(sharded_state_dict)  # before the save takes the state dict apart
        result = inner_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if records:
            checkpoint_saved(records, checkpoint_dir)
        return result

    @functools.wraps(inner_load)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = inner_load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        checkpoint_loaded(result[0] if isinstance(result, tuple) else result, checkpoint_dir)
        return result

    save._optstate_hook = load._optstate_hook = True
    for module in (serialization, dist_checkpointing):
        module.save, module.load = save, load
