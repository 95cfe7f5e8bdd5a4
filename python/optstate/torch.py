"""optstate.torch.AdamW (and Lion, SGD, Muon): torch.optim.Optimizers whose state lives on NVMe.

    opt = optstate.torch.AdamW(model.parameters(), store="/nvme/optstate/rank{rank}.dense",
                               budget=2 << 30, lr=1e-4, weight_decay=0.1)

The fp32 main weights, exp_avg and exp_avg_sq of every parameter live in an
optstate store (12 bytes a parameter) and are streamed through a device
window of `budget` bytes during step(); the parameters themselves (fp32, bf16
or fp16) are updated in place in the same pass. Nothing of the state is kept
in torch tensors: `opt.state[p]` is a read-only mapping that reads "step",
"exp_avg" and "exp_avg_sq" from the store when they are looked up (copies), and
state_dict() holds only the store's identity, generation, step counts,
hyperparameters and the name of an O(1) snapshot of that generation, so
load_state_dict() of any state_dict a trainer kept makes it the head again
(optstate.integrations carries the state into frameworks' checkpoints).

Param groups work as in torch.optim.AdamW: lr, betas, eps and weight_decay
are read from param_groups at every step, so torch.optim.lr_scheduler works
unchanged. Parameters whose .grad is None in a step keep their state and their
step count, as in torch: each param's bias correction follows its own count.

Mixed precision: torch's GradScaler works unchanged (`scaler.step(opt)`).
The optimizer declares `_step_supports_amp_scaling`, so GradScaler does not
unscale the gradients in a pass of its own: it hands the step its scale and
found-inf tensors (the `grad_scale` / `found_inf` attributes on torch >= 2.0,
the `grad_scaler=` argument before), and the step divides the gradients by the
scale inside the fused kernel, reading both flags on the device (no host
synchronisation). A step whose found_inf is nonzero changes and commits
nothing. step(found_inf=..., grad_scale=...) takes the same two inputs
directly.

Resume: a store that already holds a parameter keeps its state; the
parameter is then overwritten with the stored fp32 main (cast to its dtype),
so training continues exactly where the last committed step left it. A param
written outside the optimizer afterwards (model.load_state_dict) makes step()
raise optstate.FailedPrecondition until load_main_from_params() makes the
store follow it: the step would overwrite it with its main.

Checkpoints: optstate.checkpoint.save(opt, dir) writes the committed state as
the directory the mount shows for a snapshot; optstate.checkpoint.load(opt,
dir) restores one and resumes from it.

Resharding (another number of ranks, another tensor-parallel split):
layout_from_model(model, sources, ranks, dims) gives optstate.reshard the
target layout from the model's sharding, and AdamW(..., shards=...) records
where each shard lies in its whole tensor. docs/RESHARD.md.

DTensor params (FSDP2's fully_shard, torch >= 2): each rank steps its local
shard in place, and the store records the shard's place in the global tensor
from its placements (no shards= entry). optstate.integrations.dcp saves and
loads the state with torch.distributed.checkpoint. docs/PYTHON.md.

Lion and SGD (with momentum) are the same machinery with another update rule and one moment
("exp_avg", "momentum_buffer"): 8 bytes a parameter instead of 12. Muon steps the 2-D params with
Muon (a whole matrix at a time) and the rest with AdamW, in one optimizer. docs/PYTHON.md.

Each rank and optimizer instance needs a store of its own: `{rank}` in the
path is replaced by torch.distributed's rank (0 when not initialised). A
second optimizer or process opening a store in use gets optstate.Busy.
"""
import collections.abc
import contextlib
import ctypes
import difflib
import fnmatch
import json
import os
import re
import shutil
import uuid
import weakref

import torch

from . import checkpoint, errors
from .core import BF16, F16, F32, READ, MemoryManager, Store, StreamedAdam, access_code

__all__ = ["AdamW", "Lion", "Muon", "SGD", "layout_from_model"]

_DTYPES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}
_TORCH_DTYPES = {code: dt for dt, code in _DTYPES.items()}
# __cuda_array_interface__ has no bfloat16: such a range is described as int16 and viewed as bfloat16.
_CAI_TYPESTR = {F32: ("<f4", torch.float32), F16: ("<f2", torch.float16), BF16: ("<i2", torch.int16)}


def _dtype_code(dtype, what):
    code = _DTYPES.get(dtype)
    if code is None:
        raise errors.InvalidArgument("%s has dtype %s; optstate takes float32, bfloat16 or float16" % (what, dtype))
    return code


def _agreed_job():
    """The job id every rank of a torch.distributed job gives its store when the caller gives none: rank
    0's fresh uuid, broadcast (a collective: every rank constructs its AdamW). None without
    torch.distributed: the store then makes its own."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
    except Exception:  # a torch build without distributed
        return None
    box = [str(uuid.uuid4()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _import_dtensor():
    """torch's DTensor class (FSDP2's and tensor parallelism's params), or None on a torch without it."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):  # >= 2.4, 2.0-2.3
        try:
            return getattr(__import__(module, fromlist=["DTensor"]), "DTensor")
        except Exception:  # torch 1.13, or a build without distributed
            continue
    return None


_DTensor = _import_dtensor()


def _is_dtensor(t):
    return _DTensor is not None and isinstance(t, _DTensor)


def _local(t):
    """The tensor whose memory holds the elements of a param or grad that this rank steps: a DTensor's
    local shard (its local tensor, stepped in place), a plain tensor itself; None stays None."""
    if _DTensor is not None and isinstance(t, _DTensor):
        return t._local_tensor
    return t


def _dtensor_box(name, p):
    """(global_shape, shard_offset) of a DTensor param's local shard, from its placements on its mesh:
    the box its state covers in the global tensor, as the store records it (optstate.reshard moves it).
    Every mesh dimension must shard it (Shard(dim); FSDP2's fully_shard shards dim 0, unevenly when the
    mesh size does not divide it, as torch.chunk does): a Replicate or Partial placement gives several
    ranks the same elements (their state would have several owners) and a strided shard is no box."""
    placements = tuple(p.placements)
    for d, pl in enumerate(placements):
        if type(pl).__name__ != "Shard":
            raise errors.Unimplemented(
                "optstate.torch.AdamW: param %s (global shape %s) has placement %r on mesh dimension %d "
                "(placements %s); optstate steps DTensor params sharded on every mesh dimension (Shard(dim), "
                "as FSDP2's fully_shard on a 1-D mesh makes them): every element's state has one owner"
                % (name, tuple(p.shape), pl, d, placements))
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # torch >= 2.4
    except ImportError:
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    local = p._local_tensor
    if tuple(local_shape) != tuple(local.shape):
        raise errors.InvalidArgument("optstate.torch.AdamW: param %s (global shape %s, placements %s): its local "
                                     "tensor has shape %s, its placements give %s" %
                                     (name, tuple(p.shape), placements, tuple(local.shape), tuple(local_shape)))
    return tuple(int(x) for x in p.shape), tuple(int(x) for x in offset)


def _rank():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # a torch build without distributed
        pass
    return 0


class _StreamedOptimizer(torch.optim.Optimizer):
    """The machinery of every optstate.torch optimizer: a torch.optim.Optimizer over one store and
    one streamed engine with one update rule (AdamW, Lion, SGD) or several (Muon: Muon and AdamW). A
    subclass gives the rule's C name (_rule) or the rules' (_rules, each param's by _param_rule), their
    hyperparameters from a param group (_rule_hyper) and back (_group_from_hyper), and its state keys
    (_STATE_KEYS or _state_keys: what torch's optimizer of that name keeps in state[p])."""

    # torch's GradScaler: hand the step the scale and found-inf instead of unscaling the grads.
    _step_supports_amp_scaling = True
    _STATE_KEYS = ()

    @property
    def _label(self):
        return "optstate.torch." + type(self).__name__

    def _rule(self):
        raise NotImplementedError

    def _rule_hyper(self, group):
        """The rule's hyperparameters (names as the store keeps them) from a param group."""
        raise NotImplementedError

    def _group_from_hyper(self, group, h):
        """Sets a param group's entries from the rule's stored hyperparameters (a restore)."""
        raise NotImplementedError

    def _rules(self):
        """Several rules in one optimizer: [(name, moment_dtype)], a param's rule its index
        (_param_rule); None (default): the one rule _rule names."""
        return None

    def _param_rule(self, name, p, group):
        """The index in _rules() of the rule that steps param p (named name) of group (a param group
        dict)."""
        return 0

    def _state_keys(self, index):
        """The keys of opt.state[p] for the registered param at index (once it has stepped)."""
        return self._STATE_KEYS

    def __init__(self, params, store, budget, defaults, *, backend="auto", host_cache_bytes="auto",
                 chunk_size_bytes=None, data_dirs=None, store_name=None, cpu_threads=None, durable_every_steps=1,
                 commit_lag_steps=1, read_ahead_chunks=0, cuda_device=None, moment_dtype="f32", shards=None,
                 retire=(), job=None):
        self._handles = None
        if shards is not None and not callable(shards) and not isinstance(shards, dict):
            raise errors.InvalidArgument(self._label + ": shards is a %s; give a dict {name: (global_shape, "
                                         "shard_offset)} or a callable(name, param)" % type(shards).__name__)
        self._shards = shards
        path = os.fspath(store).replace("{rank}", str(_rank()))
        if cuda_device is None:
            cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        if job is None:
            job = _agreed_job()
        before = _StorePaths(path, data_dirs or ())
        self._store = Store(path, name=store_name, chunk_size_bytes=chunk_size_bytes, data_dirs=data_dirs or (),
                            job=job)
        self._owner = _StoreOwner(self._store)
        try:
            # Kept to create the manager and optimizer again on the same store (checkpoint load).
            self._mm_kw = dict(backend=backend, device_budget_bytes=budget, host_cache_bytes=host_cache_bytes,
                               read_ahead_chunks=read_ahead_chunks, cuda_device=cuda_device)
            self._mm = MemoryManager(self._store, **self._mm_kw)
            self._cuda = self._mm.backend == "cuda"
            self._device = torch.device("cuda", cuda_device) if self._cuda else torch.device("cpu")
            if cpu_threads is None:
                cpu_threads = 1 if self._cuda else max(1, min(4, torch.get_num_threads()))
            self._adam_kw = dict(cpu_threads=cpu_threads, durable_every_steps=durable_every_steps,
                                 commit_lag_steps=commit_lag_steps, moment_dtype=moment_dtype, rule=self._rule(),
                                 rules=self._rules())
            self._adam = StreamedAdam(self._store, self._mm, **self._adam_kw)
            self._handles = (self._adam, self._mm, self._store)
            # Per registered param, in registration order (the step's array order).
            self._plist, self._numels, self._names, self._ids, self._pgroup = [], [], [], [], []
            self._prule = []           # rule index of each (_param_rule)
            self._by_tensor = {}       # id(tensor) -> index in _plist
            self._given_names = {}     # id(tensor) -> name from (name, tensor) input
            self._hyper = {}           # group index -> hyperparameters last sent
            self._batch_key = None     # what the step arrays were validated and built for (step())
            self._constructing = True
            self._new_registrations = False
            groups = self._take_names(params)
            retire = [retire] if isinstance(retire, str) else list(retire)
            self._check_names(groups, retire)
            super().__init__(groups, defaults)
            self.state = _OptimizerState(self)
            for name in retire:
                self.retire(name)
            self._constructing = False
            self._commit_registrations()
            self._remember_params()
        except BaseException:
            uuid = None
            if self._store.created:
                with contextlib.suppress(errors.Error):
                    uuid = self._store.uuid
            self.close()
            if uuid is not None:  # a store this constructor created holds nothing anyone has seen
                before.remove_created(uuid)
            raise


    # ---- construction ----

    def _take_names(self, params):
        """Accepts (name, tensor) pairs anywhere torch accepts tensors; records the names."""
        if isinstance(params, torch.Tensor):
            raise errors.InvalidArgument("params argument given to the optimizer should be an iterable of "
                                         "Tensors or dicts, but got " + torch.typename(params))
        groups = list(params)
        if not groups:
            raise errors.InvalidArgument("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        return [self._strip_names(dict(g)) for g in groups]

    def _strip_names(self, group):
        ps = group["params"]
        if isinstance(ps, torch.Tensor):
            ps = [ps]
        tensors = []
        for p in ps:
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor):
                name, p = p
                self._given_names[id(p)] = str(name)
            tensors.append(p)
        group["params"] = tensors
        return group

    def _check_names(self, groups, retire):
        """Refuses, before anything is written, a model whose param names and the store's both have
        names the other lacks (a renamed model: registering would add its params as new tensors and
        leave the store's untrained). The model may have more params than the store (new params) or,
        with the missing ones retired, fewer."""
        stored = self._store.tensor_names()
        if not stored:
            return
        model, index = [], 0
        for g in groups:
            for p in g["params"]:
                model.append(self._given_names.get(id(p), "param%d" % index))
                index += 1
        model_set, stored_set = set(model), set(stored)
        unknown = [n for n in retire if n not in stored_set]
        if unknown:
            raise errors.NotFound(self._label + ": retire names %s, which store %s does not hold"
                                  % (_few(unknown), self._store._path))
        store_only = [n for n in stored if n not in model_set and n not in retire]
        model_only = [n for n in model if n not in stored_set]
        if store_only and model_only:
            raise errors.InvalidArgument(_name_mismatch(self._store._path, store_only, model_only, stored_set,
                                                        model_set))

    def add_param_group(self, param_group):
        """Adds a group and registers its params in the store (resume: their stored state is kept)."""
        if self._handles is None:
            raise errors.FailedPrecondition(self._label + ": the optimizer is closed")
        param_group = self._strip_names(dict(param_group))
        seen = set()
        for i, p in enumerate(param_group["params"]):
            if not isinstance(p, torch.Tensor):
                raise errors.InvalidArgument(self._label + ": param %d of the group is a %s, not a Tensor"
                                             % (i, torch.typename(p)))
            if id(p) in self._by_tensor or id(p) in seen:
                name = self._names[self._by_tensor[id(p)]] if id(p) in self._by_tensor else "param %d" % i
                raise errors.InvalidArgument(self._label + ": %s (shape %s) is registered twice; a tensor "
                                             "may appear once in one param group" % (name, tuple(p.shape)))
            seen.add(id(p))
        gid = len(self.param_groups)
        for i, p in enumerate(param_group["params"]):
            self._check_param(p, self._given_names.get(id(p), "param %d of group %d" % (i, gid)))
        super().add_param_group(param_group)
        group = self.param_groups[gid]
        self._send_hyper(gid, group)
        self._register_all(group["params"], gid)
        if not self._constructing:
            self._commit_registrations()
            self._remember_params()

    def _commit_registrations(self):
        """Commits newly registered params (their initial mains) at once as a generation of their own,
        so that a process that dies before its first step resumes with them; step counts and the
        trainer step stay as they were."""
        if not self._new_registrations:
            return
        self._adam.make_durable()
        self._new_registrations = False

    def _check_param(self, p, name):
        if _is_dtensor(p):
            global_shape, offset = _dtensor_box(name, p)  # refuses placements optstate cannot step
            placements, p = tuple(p.placements), _local(p)
            if p.numel() == 0:
                raise errors.InvalidArgument(
                    self._label + ": param %s (global shape %s, placements %s) has an empty local shard on "
                    "rank %d (offset %s): its sharded dimension has fewer elements than the mesh has ranks. "
                    "optstate keeps state only for elements a rank holds; give fully_shard a shard_placement_fn "
                    "that shards it along a larger dimension, or step it with another optimizer"
                    % (name, global_shape, placements, _rank(), offset))
        _dtype_code(p.dtype, self._label + ": param " + name)
        if p.is_sparse:
            raise errors.InvalidArgument(self._label + ": param %s is sparse" % name)
        if not p.is_contiguous():
            raise errors.InvalidArgument(self._label + ": param %s (shape %s, stride %s) is not contiguous; "
                                         "optstate updates params in place through their memory"
                                         % (name, tuple(p.shape), p.stride()))
        if p.device != self._device:
            raise errors.InvalidArgument(self._label + ": param %s is on %s; the %s backend of store %s "
                                         "needs params on %s" % (name, p.device, self._mm.backend,
                                                                 self._store._path, self._device))
        if p.numel() == 0:
            raise errors.InvalidArgument(self._label + ": param %s has no elements" % name)

    def _register_all(self, params, gid):
        """Registers a group's params in one C call (a model of thousands of small tensors registers
        as fast as a few large ones); as _register for each, in order."""
        names, seen = [], set(self._names)
        for i, p in enumerate(params):
            name = self._given_names.get(id(p), "param%d" % (len(self._plist) + i))
            if name in seen:
                raise errors.InvalidArgument(self._label + ": two params are named %s" % name)
            seen.add(name)
            names.append(name)
        shards = [self._shard_of(name, p) for name, p in zip(names, params)]
        shards_here = [_local(p) for p in params]  # a DTensor's local shard: the elements stepped here
        rules = None
        if self._rules() is not None:
            rules = [self._param_rule(name, p, self.param_groups[gid]) for name, p in zip(names, params)]
        got = self._adam.register_params(names, [t.numel() for t in shards_here], [gid] * len(params),
                                         [t.data_ptr() for t in shards_here], [_DTYPES[t.dtype] for t in shards_here],
                                         [tuple(t.shape) for t in shards_here], [g for g, _ in shards],
                                         [o for _, o in shards], rules=rules)
        for i, (name, p, local, (pid, existed)) in enumerate(zip(names, params, shards_here, got)):
            if existed:  # resume: the model continues from the stored fp32 main
                self._copy_main_to(name, p)
            else:
                self._new_registrations = True
            self._by_tensor[id(p)] = len(self._plist)
            self._plist.append(p)
            self._numels.append(local.numel())
            self._names.append(name)
            self._ids.append(pid)
            self._pgroup.append(gid)
            self._prule.append(0 if rules is None else rules[i])
        self._batch_key = None

    def _shard_of(self, name, p):
        """(global_shape, shard_offset) of a param: from its placements when it is a DTensor (FSDP2's
        fully_shard), else from the shards argument; ((), ()) for a whole tensor."""
        placed = _dtensor_box(name, p) if _is_dtensor(p) else None
        if self._shards is None:
            return placed or ((), ())
        g = self._shards(name, p) if callable(self._shards) else self._shards.get(name)
        if g is None:
            return placed or ((), ())
        try:
            global_shape, offset = g
            given = tuple(int(x) for x in global_shape), tuple(int(x) for x in offset)
        except (TypeError, ValueError):
            raise errors.InvalidArgument(self._label + ": shards gives %r for param %s; expected "
                                         "(global_shape, shard_offset)" % (g, name)) from None
        if placed is not None and given != placed:
            raise errors.InvalidArgument(self._label + ": shards gives (global shape %s, offset %s) for param "
                                         "%s, a DTensor whose placements %s put its local shard at offset %s of "
                                         "global shape %s; leave DTensor params out of shards" %
                                         (given[0], given[1], name, tuple(p.placements), placed[1], placed[0]))
        return given

    def _copy_main_to(self, name, p):
        p = _local(p)
        main = torch.empty(p.numel(), dtype=torch.float32)
        self._store.read_into(name, "main", main.data_ptr(), 0, p.numel())
        with torch.no_grad():
            p.copy_(main.view(p.shape))

    # ---- params changed outside the optimizer ----

    def _param_marks(self):
        """Each param's version counter (torch bumps it on every in-place write through the tensor:
        load_state_dict, copy_, init, an in-place op under no_grad) and data pointer (`p.data = t`)."""
        plist = [_local(p) for p in self._plist]  # a DTensor's local tensor may be replaced (FSDP2's lazy init)
        return [p._version for p in plist], [p.data_ptr() for p in plist]

    def _remember_params(self):
        """Records the params as they are now, when they equal the store's mains (after construction,
        a step, load_main_from_params, a resume). The step's own writes go through raw pointers and bump
        no version counter, so what is recorded stays valid across steps."""
        self._marks = self._param_marks()

    def _check_changed_params(self, versions, ptrs):
        """Called by step() when a param's version or memory changed since it was recorded: a param whose
        values now differ from its fp32 main (cast to its dtype) raises before anything is written,
        since the step would overwrite it with the main; one whose values are the same (the same
        weights loaded again, a framework's in-place copy) is recorded again. Reads the changed params'
        mains, once per such change."""
        old_versions, old_ptrs = self._marks
        changed = [i for i in range(len(versions)) if versions[i] != old_versions[i] or ptrs[i] != old_ptrs[i]]
        differ = []
        if changed:
            self._adam.make_durable()  # the mains as the last step left them
            if self._cuda:
                torch.cuda.current_stream(self._device).synchronize()
            for i in changed:
                p = _local(self._plist[i])
                main = torch.empty(p.numel(), dtype=torch.float32)
                self._store.read_into(self._names[i], "main", main.data_ptr(), 0, p.numel())
                if not torch.equal(p.detach(), main.to(device=p.device, dtype=p.dtype).view(p.shape)):
                    differ.append(self._names[i])
        if differ:
            raise errors.FailedPrecondition(
                self._label + ": %d param(s) %s were changed outside the optimizer (e.g. by "
                "model.load_state_dict) and now differ from their fp32 mains in store %s (generation %d, "
                "step %d); a step would overwrite them with the store's mains. If the params are the ones to "
                "train on, call opt.load_main_from_params() first (the store's mains take the params' values; "
                "moments and step counts are kept); to resume the checkpoint the params came from, load its "
                "optimizer state too (optstate.checkpoint.load(opt, dir), or the store at that snapshot)"
                % (len(differ), _few(differ), self._store._path, self._adam.last_generation,
                   self._adam.global_step))
        self._marks = (versions, ptrs)

    # ---- the step ----

    def _send_hyper(self, gid, group):
        h = self._rule_hyper(group)
        if self._hyper.get(gid) != h:
            self._adam.set_group_hyper(gid, h)
            self._hyper[gid] = h

    def _build_batch(self, grads):
        """Validates the grads and builds the step's arrays (reused while the grads stay the same tensors)."""
        sel = []
        for i, (param, g) in enumerate(zip(self._plist, grads)):
            if g is None:
                continue
            name = self._names[i]
            p = _local(param)  # grads holds a DTensor grad's local tensor
            if _is_dtensor(param):
                placements = getattr(param.grad, "placements", None)
                if placements is None or tuple(placements) != tuple(param.placements):
                    raise errors.InvalidArgument(self._label + ": grad of %s has placements %s, the param %s; "
                                                 "each rank steps its local shard with the grad of the same shard"
                                                 % (name, placements, tuple(param.placements)))
            if g.is_sparse:
                raise errors.InvalidArgument(self._label + ": grad of %s is sparse" % name)
            _dtype_code(g.dtype, self._label + ": grad of " + name)
            if g.shape != p.shape:
                raise errors.InvalidArgument(self._label + ": grad of %s has shape %s, the param %s"
                                             % (name, tuple(g.shape), tuple(p.shape)))
            if not g.is_contiguous():
                raise errors.InvalidArgument(self._label + ": grad of %s (stride %s) is not contiguous"
                                             % (name, g.stride()))
            if g.device != self._device:
                raise errors.InvalidArgument(self._label + ": grad of %s is on %s, expected %s"
                                             % (name, g.device, self._device))
            self._check_param(param, name)
            if p.numel() != self._numels[i]:
                raise errors.InvalidArgument(self._label + ": param %s now has %d elements, registered with %d"
                                             % (name, p.numel(), self._numels[i]))
            sel.append(i)
        n = len(sel)
        self._sel = sel
        self._n = n
        self._c_ids = (ctypes.c_uint32 * n)(*[self._ids[i] for i in sel])
        self._c_numels = (ctypes.c_uint64 * n)(*[grads[i].numel() for i in sel])
        self._c_gdt = (ctypes.c_int * n)(*[_DTYPES[grads[i].dtype] for i in sel])
        self._c_pdt = (ctypes.c_int * n)(*[_DTYPES[self._plist[i].dtype] for i in sel])
        self._c_grads = (ctypes.c_void_p * n)()
        self._c_params = (ctypes.c_void_p * n)()

    @torch.no_grad()
    def step(self, closure=None, *, found_inf=None, grad_scale=None, **kwargs):
        """One AdamW step over every param that has a grad: one C call, one committed generation.

        found_inf: optional float32 tensor of one element (on the params' device); nonzero skips the
        step (nothing changes, nothing is committed). grad_scale: optional float32 tensor of one
        element on the params' device (or a positive number): the grads are divided by it for this
        step. Without them, the `found_inf` / `grad_scale` attributes that torch's GradScaler sets
        before step() (and deletes after it) are used, as torch's fused AdamW does; set by hand, they
        apply to every step until deleted. grad_scaler: given by GradScaler of torch < 2.0."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._handles is None:
            raise errors.FailedPrecondition(self._label + ": the optimizer is closed")
        scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(self._label + ".step() got unexpected keyword arguments %s" % sorted(kwargs))
        if scaler is not None:
            found_inf, grad_scale = self._amp_inputs_of(scaler)
        else:
            if found_inf is None:
                found_inf = getattr(self, "found_inf", None)
            if grad_scale is None:
                grad_scale = getattr(self, "grad_scale", None)
        versions, ptrs = self._param_marks()
        if versions != self._marks[0] or ptrs != self._marks[1]:
            self._check_changed_params(versions, ptrs)
        for gid, group in enumerate(self.param_groups):
            self._send_hyper(gid, group)
        grads = [_local(p.grad) for p in self._plist]
        # What the cached arrays were validated and built for: which params have grads, and each grad's
        # and param's shape, strides, dtype and device. Any change rebuilds (and revalidates) them; new
        # memory alone (a trainer that sets grads to None allocates them again each step) only has its
        # pointers copied. The strides count: an allocator may hand a new grad the very memory of a
        # validated one (torch 2's does), and a transposed view of it has the same pointer, shape and dtype.
        key = [None if g is None else (g.shape, g.stride(), g.dtype, g.device, p.shape, p.stride(), p.dtype, p.device)
               for p, g in zip(map(_local, self._plist), grads)]
        if key != self._batch_key:
            self._build_batch(grads)
            self._batch_key = key
        sel = self._sel
        self._c_grads[:] = [grads[i].data_ptr() for i in sel]
        self._c_params[:] = [ptrs[i] for i in sel]
        found_ptr = self._flag_ptr(found_inf, "found_inf") if found_inf is not None else None
        if grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
            if not float(grad_scale) > 0 or float(grad_scale) == float("inf"):
                raise errors.InvalidArgument(self._label + ": grad_scale %r is not a finite number > 0"
                                             % (grad_scale,))
            grad_scale = torch.full((1,), float(grad_scale), dtype=torch.float32, device=self._device)
        scale_ptr = self._flag_ptr(grad_scale, "grad_scale") if grad_scale is not None else None
        if self._cuda:  # the optimizer's streams read the grads and flags: they must be complete
            torch.cuda.current_stream(self._device).synchronize()
        self._adam.step2_raw(self._n, self._c_ids, self._c_grads, self._c_gdt, self._c_numels, self._c_params,
                             self._c_pdt, found_ptr, scale_ptr)
        # The attributes stay: GradScaler deletes them after step() returns (as for torch's fused AdamW,
        # which only reads them); resetting them here would make its next `scale * opt.grad_scale` fail.
        return loss

    def _flag_ptr(self, t, what):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1 or t.device != self._device:
            raise errors.InvalidArgument(self._label + ": %s must be one float32 element on %s, got %s"
                                         % (what, self._device, _describe(t)))
        return t.data_ptr()

    def _amp_inputs_of(self, scaler):
        """(found_inf, grad_scale) from a GradScaler of torch < 2.0, which passes itself to step() instead
        of setting attributes; mirrors what torch >= 2.0's GradScaler.step sets."""
        state = scaler._per_optimizer_states[id(self)]
        unscaled = getattr(state["stage"], "name", "") == "UNSCALED"
        if not unscaled:
            scaler._check_inf_per_device(self)  # the finite check without unscaling (inv scale 1)
        scale = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else scaler._scale
        found = sum(t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values())
        return found, (None if unscaled else scale)

    # ---- state ----

    # Snapshots that state_dict() made and no checkpoint holds (optstate.checkpoint.hold): the newest
    # this many are kept, older ones released at the next state_dict().
    state_dict_snapshots = 2

    def state_dict(self):
        """Torch's shape ({"state", "param_groups"}) with an empty "state" plus "optstate": the store's
        identity, the committed generation, step counts, param names and the name of a snapshot of that
        generation (never the state itself).

        Waits for the last step's commit, then pins the newest committed generation as snapshot
        "state-dict-<generation>" (O(1); the same one again while no step ran), so that
        load_state_dict() of this state_dict can make it the store's head again later. Snapshots of
        checkpoints that a trainer keeps are held by them (optstate.checkpoint.save_into, the adapters in
        optstate.integrations) until the trainer deletes those checkpoints; of the others, the newest
        `state_dict_snapshots` (default 2) are kept and older ones released here."""
        view, self.__dict__["state"] = self.state, {}  # torch's state_dict copies opt.state: keep it empty
        try:
            sd = super().state_dict()
        finally:
            self.__dict__["state"] = view
        adam = self._live()
        adam.make_durable()
        gen, _ = self._store.latest_generation()
        snap = self._state_dict_snapshot(gen)
        sd["optstate"] = {
            "format": 2,
            "store_path": self._store.path,
            "store_name": self._store.name,
            "store_uuid": self._store.uuid,
            "generation": gen,
            "snapshot": snap,
            "global_step": adam.global_step,
            "step_counts": [adam.step_count(g) for g in range(len(self.param_groups))],
            "param_names": list(self._names),
        }
        return sd

    def _state_dict_snapshot(self, gen):
        """Snapshot "state-dict-<gen>" of the newest committed generation gen (made if missing); releases
        the older state_dict() snapshots that no checkpoint holds beyond the newest state_dict_snapshots."""
        return checkpoint.pin_state_dict_snapshot(self._store, gen, self.state_dict_snapshots)

    def load_state_dict(self, state_dict):
        """Makes the store's state the one state_dict describes, with the same params, and loads its
        hyperparameters:

          - the store's newest committed generation: nothing to change;
          - an older state of this store whose snapshot (named in state_dict) it still holds: the store's
            head becomes that snapshot's state again (the head it replaces is kept as a snapshot, its
            name in opt.store.last_restore_snapshot), the params take its fp32 mains, and step counts
            and hyperparameters are as at that checkpoint: training continues exactly as it did from
            there;
          - otherwise (a fresh store, another node, a released snapshot): from the checkpoint files
            that optstate.checkpoint.save_into wrote under a root armed with
            optstate.checkpoint.resume_from (the adapters in optstate.integrations do both), restored
            with force (the head it replaces is kept as a snapshot); without such files
            optstate.FailedPrecondition says what to do."""
        adam = self._live()
        adam.make_durable()  # the last step's commit may still be running
        meta = state_dict.get("optstate")
        if meta is None:
            raise errors.InvalidArgument(self._label + ".load_state_dict: not a state_dict of " + self._label
                                         + " (no 'optstate' entry)")
        if list(meta["param_names"]) != self._names:
            raise errors.InvalidArgument(
                self._label + ".load_state_dict: state_dict has %d params %s, this optimizer %d %s"
                % (len(meta["param_names"]), _few(meta["param_names"]), len(self._names), _few(self._names)))
        gen, _ = self._store.latest_generation()
        same_store = meta.get("store_uuid") == self._store.uuid
        if not (same_store and meta["generation"] == gen):
            snap = meta.get("snapshot")
            snaps = dict(self._store.snapshots()) if snap else {}
            if same_store and snap and snaps.get(snap) == meta["generation"]:
                self._revert_to_snapshot(snap)
            elif (files := checkpoint._find_files(meta)) is not None:
                self._load_checkpoint(files, force=True)
            else:
                where = ("generation %d of this store (snapshot %s), which it no longer holds"
                         % (meta["generation"], snap) if same_store and snap else
                         "generation %d of this store, which is at generation %d" % (meta["generation"], gen)
                         if same_store else
                         "store %s (%s, uuid %s), generation %d; this optimizer uses store %s (uuid %s)"
                         % (meta.get("store_path"), meta.get("store_name"), meta.get("store_uuid"),
                            meta["generation"], self._store.path, self._store.uuid))
                raise errors.FailedPrecondition(
                    self._label + ".load_state_dict: state_dict is of %s. Resume through the framework "
                    "adapter (optstate.integrations: it saves the state's files into each checkpoint and "
                    "restores them), or save them with optstate.checkpoint.save_into(opt, dir) and call "
                    "optstate.checkpoint.resume_from(dir) before load_state_dict; a checkpoint directory "
                    "loads with optstate.checkpoint.load(opt, dir)" % where)
        counts = [self._adam.step_count(g) for g in range(len(self.param_groups))]
        if list(meta["step_counts"]) != counts:
            raise errors.FailedPrecondition(self._label + ".load_state_dict: step counts %s in state_dict, "
                                            "%s in store %s" % (meta["step_counts"], counts, self._store.path))
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._hyper.clear()

    def __setstate__(self, state):
        # torch's load_state_dict rebuilds state through here; optstate's state stays in the store and
        # opt.state stays the view of it.
        state = dict(state)
        state.pop("state", None)
        super().__setstate__(state)
        self.__dict__["state"] = _OptimizerState(self)

    # ---- store operations ----

    def _live(self):
        if self._handles is None:
            raise errors.FailedPrecondition(self._label + ": the optimizer is closed")
        return self._adam

    @property
    def store(self):
        """The optstate.Store (path, uuid, snapshots, read(...))."""
        return self._store

    def step_count(self, group=0):
        """Steps in which any param of the group stepped (each param's bias correction follows its own
        count: param_step_count)."""
        return self._live().step_count(group)

    def param_step_count(self, param):
        """A param's own step count (a tensor or its name in the store): the steps it had a grad in,
        as torch's state[p]["step"] counts them."""
        adam = self._live()
        _, name = self._param_of(param)
        return adam.param_step_count(name)

    def _state_value(self, index, key):
        """opt.state[p][key] of the param at index: "step" as torch's AdamW keeps it (a 0-dim float
        tensor), "exp_avg" / "exp_avg_sq" read from the store (fp32, the param's shape and device)."""
        adam = self._live()
        name, param = self._names[index], self._plist[index]
        if key == "step":
            return torch.tensor(float(adam.param_step_count(name)))
        adam.make_durable()  # the last step's commit may still be running
        p = _local(param)
        out = torch.empty(p.numel(), dtype=torch.float32)
        self._store.read_into(name, key, out.data_ptr(), 0, p.numel())
        out = out.view(p.shape).to(p.device)
        if _is_dtensor(param):  # as torch's AdamW keeps a DTensor param's moments: a DTensor of its placements
            return _DTensor.from_local(out, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
        return out

    def last_step_seconds(self):
        """Seconds the last step() spent inside the library (pipeline and commit), for overhead checks."""
        return self._live().last_step_seconds

    def prefetch(self):
        """Starts reading the next step's state into the host cache tier (host_cache_bytes) in the
        background and returns at once, so that the next step() finds it in RAM instead of reading it
        from disk while forward/backward run. A hint: results are bit-identical with and without it;
        calling it twice, before sleep(), before a step that fails or with no step following is safe;
        without a host cache tier it does nothing. The next step() (and snapshot, state_dict, close)
        stops it and keeps what it read. See prefetch_on_forward for calling it automatically."""
        self._live().prefetch()

    def prefetch_on_forward(self, module):
        """Calls prefetch() whenever module's forward starts (a forward pre-hook: the earliest point
        of a training step, so the reads overlap the whole forward and backward). Returns the hook's
        handle; handle.remove() stops it. Extra forwards (gradient accumulation, evaluation) only
        repeat the hint: a prefetch already running is not restarted."""
        self._live()

        def hook(_module, _inputs):
            if self._handles is not None:
                self._adam.prefetch()

        return module.register_forward_pre_hook(hook)

    def last_step_prefetch(self):
        """(hit_bytes, read_bytes): bytes of state the last step found in RAM because a prefetch read
        them there, and bytes the prefetches before that step read."""
        return self._live().last_step_prefetch

    @property
    def generation(self):
        """The newest committed generation of the store (waits for the last step's commit)."""
        adam = self._live()
        adam.make_durable()
        return adam.last_generation

    def param_name(self, p):
        """The name of a param in the store."""
        return self._names[self._by_tensor[id(p)]]

    def snapshot(self, name):
        """Makes the state durable and pins the newest committed generation as snapshot `name`
        (visible under <mount>/<store>/snapshots/<name>/); returns its generation."""
        self._live().make_durable()
        return self._store.snapshot(name)

    def retire(self, name):
        """Leaves a param that the store holds but the model no longer has (given by its name in the
        store) out of training: its state stays in the store, unchanged in every later generation.
        Until then step() fails (optstate.FailedPrecondition naming such params), so state is never
        dropped silently."""
        adam = self._live()
        if name in self._names:
            raise errors.InvalidArgument(self._label + ".retire: %s is a param of this optimizer (store %s); "
                                         "only a param the model no longer has can be retired"
                                         % (name, self._store._path))
        adam.retire_param(name)

    def release_snapshot(self, name):
        self._live()
        self._store.release_snapshot(name)

    def sleep(self):
        """Releases every device page the state uses (the store on NVMe is its home: nothing to back up)."""
        self._live()
        self._mm.release_all()

    def wake(self):
        """Counterpart of sleep(): pages are mapped again by the next step, so nothing is needed."""
        self._live()

    def load_main_from_params(self):
        """Replaces every param's fp32 main with the param's current values (after the model's weights
        were loaded separately); moments and step counts are kept."""
        adam = self._live()
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()
        for i, p in enumerate(self._plist):
            self._check_param(p, self._names[i])
            adam.load_main(self._ids[i], _local(p).data_ptr(), _DTYPES[p.dtype])
        self._remember_params()

    def store_fields(self):
        """The fields the optimizer keeps per param in its store, "main" first (AdamW: exp_avg and
        exp_avg_sq; Lion: exp_avg; SGD: momentum_buffer when it has momentum; Muon: those of both its
        rules, momentum_buffer, exp_avg and exp_avg_sq, each param holding its own rule's)."""
        return self._live().fields()

    def read_state(self, p, field):
        """A copy (fp32, CPU, p's shape; a DTensor's local shard's) of a param's "main" or a state field
        (store_fields()) as committed. For tests and inspection; it materialises that one tensor."""
        name = self.param_name(p)
        self._live().make_durable()  # the last step's commit may still be running
        p = _local(p)
        out = torch.empty(p.numel(), dtype=torch.float32)
        self._store.read_into(name, field, out.data_ptr(), 0, p.numel())
        return out.view(p.shape)

    def _param_of(self, param):
        """(index, name) of a registered param given as a tensor or its name in the store."""
        if isinstance(param, str):
            if param not in self._names:
                raise errors.NotFound(self._label + ": no param named %s in store %s (%d params: %s)"
                                      % (param, self._store._path, len(self._names), _few(self._names)))
            index = self._names.index(param)
        else:
            index = self._by_tensor.get(id(param))
            if index is None:
                raise errors.NotFound(self._label + ": the tensor (shape %s) is not a param of this optimizer "
                                      "(store %s)" % (tuple(getattr(param, "shape", ())), self._store._path))
        return index, self._names[index]

    @contextlib.contextmanager
    def pin(self, param, field="main", start=0, stop=None, *, access="read", commit=True):
        """Pins elements [start, stop) of a param's "main", "exp_avg" or "exp_avg_sq" and yields a torch
        tensor over that memory (on the params' device; the param's shape when the whole param is
        pinned, else 1-D); unpinned when the block exits, and the tensor is emptied then.

            with opt.pin(p, "exp_avg_sq", 0, 1024) as v:
                print(v.max())

        param: a param tensor or its name in the store. access: "read" (contents loaded; writes to it
        are never stored), "write" (contents undefined until written) or "readwrite"; a written range
        is written back at exit and, with commit=True (default), committed as a generation of its own
        that keeps the step counts; a written "main" is then copied into the param too. While a range
        of a param is pinned, step() over that param and sleep() fail; pin between steps. The range
        counts against the budget while pinned."""
        code = access_code(access)
        adam = self._live()
        index, name = self._param_of(param)
        p, numel = self._plist[index], self._numels[index]
        stop = numel if stop is None else stop
        if not 0 <= start < stop <= numel:
            raise errors.InvalidArgument(self._label + ".pin: range [%s, %s) of param %s (store %s) is empty "
                                         "or outside its %d elements" % (start, stop, name, self._store._path, numel))
        if self._cuda:  # the range is loaded on the manager's stream; torch's pending work must not race it
            torch.cuda.current_stream(self._device).synchronize()
        pinned = self._mm.pin(name, field, start, stop - start, code)
        view = None
        try:
            view = self._tensor_over(pinned)
            if start == 0 and stop == numel:
                view = view.view(_local(p).shape)
            yield view
            if self._cuda:  # kernels the caller queued on the range finish before it is unpinned
                torch.cuda.current_stream(self._device).synchronize()
        finally:
            if view is not None:
                view.set_()  # the memory may be unmapped once unpinned: leave no tensor over it
            pinned.unpin()
        if code != READ and commit:
            adam.commit()
            if field == "main":
                self._copy_main_to(name, p)
                self._remember_params()

    def _load_checkpoint(self, src, force=False):
        """optstate.checkpoint.load: restores src into this optimizer's store and resumes from it (params
        take the restored fp32 mains; step counts and hyperparameters are the checkpoint's)."""
        return self._with_store_closed(lambda: self._store.restore_checkpoint(src, force=force))

    def _revert_to_snapshot(self, name):
        """load_state_dict of an older state: the store's head becomes snapshot `name`'s state again (the
        head it replaces kept as a snapshot) and the optimizer resumes from it."""
        return self._with_store_closed(lambda: self._store.revert_to_snapshot(name))

    def _with_store_closed(self, change):
        """Runs change() (a restore or revert of the store's head) with this optimizer's manager and
        optimizer closed, then creates them again on the new head: params take its fp32 mains, step
        counts and hyperparameters are its."""
        adam = self._live()
        adam.make_durable()
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()
        # The store takes a restore only with no optimizer or manager on it (their caches would be stale).
        self._handles = None
        adam.close()
        self._mm.close()
        try:
            gen = change()
        finally:
            self._reopen()
        for gid, group in enumerate(self.param_groups):
            self._group_from_hyper(group, self._adam.get_group_hyper(gid))
        self._hyper.clear()
        return gen

    def _reopen(self):
        """Creates the manager and optimizer again on the store and registers the params in their order;
        each param takes the store's fp32 main."""
        try:
            self._mm = MemoryManager(self._store, **self._mm_kw)
            self._adam = StreamedAdam(self._store, self._mm, **self._adam_kw)
            self._handles = (self._adam, self._mm, self._store)
            for i, param in enumerate(self._plist):
                p = _local(param)
                global_shape, offset = self._shard_of(self._names[i], param)
                [(pid, existed)] = self._adam.register_params(
                    [self._names[i]], [p.numel()], [self._pgroup[i]], [p.data_ptr()], [_DTYPES[p.dtype]],
                    [tuple(p.shape)], [global_shape], [offset],
                    rules=None if self._rules() is None else [self._prule[i]])
                self._ids[i] = pid
                if existed:
                    self._copy_main_to(self._names[i], p)
                else:
                    self._new_registrations = True
            self._commit_registrations()
            self._hyper.clear()
            self._batch_key = None
            self._remember_params()
        except BaseException:
            self.close()
            raise

    def _tensor_over(self, pinned):
        if pinned.dtype not in _TORCH_DTYPES:
            raise errors.Unimplemented(self._label + ".pin: field %s of %s is stored as dtype code %d, "
                                       "which has no torch dtype here" % (pinned.field, pinned.tensor, pinned.dtype))
        if not self._cuda:
            buf = (ctypes.c_char * pinned.size_bytes).from_address(pinned.data_ptr)
            return torch.frombuffer(buf, dtype=_TORCH_DTYPES[pinned.dtype], count=pinned.count)
        typestr, as_dtype = _CAI_TYPESTR[pinned.dtype]
        t = torch.as_tensor(_CudaArray(pinned.data_ptr, pinned.count, typestr), device=self._device)
        return t.view(_TORCH_DTYPES[pinned.dtype]) if as_dtype != _TORCH_DTYPES[pinned.dtype] else t

    def commit(self):
        """Commits what is pending (chunks written through pin(..., commit=False), registrations, steps
        held in the host cache) and returns the newest committed generation."""
        return self._live().commit()

    def stats(self):
        """Device memory (resident, peak <= budget) and I/O counters of the memory manager."""
        self._live()
        return self._mm.stats()

    def close(self):
        """Commits what the host cache holds, frees the optimizer and closes the store (releases its lock)."""
        handles, self._handles = self._handles, None
        if handles is None:
            store = getattr(self, "_store", None)
            if store is not None:
                store.close()
            return
        store = handles[2]
        store.close()  # closes the optimizer and manager first

    # No __del__: the store is closed by _StoreOwner's finalizer once no object holds the owner, so that
    # an object sharing this one's __dict__ (a framework's wrapper) closes nothing when it is collected.

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPYABLE % ("pickled", type(self).__name__, self._store._path))

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPYABLE % ("deep-copied", type(self).__name__, self._store._path))

    def __copy__(self):
        # A shallow copy is another view of this optimizer (the same store, owner and param groups).
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AdamW(_StreamedOptimizer):
    """AdamW (decoupled weight decay; adamw=False gives Adam with L2) with its state in an optstate store.

    Arguments as torch.optim.AdamW, plus:
      store: the store's directory (str or PathLike); "{rank}" is replaced by the rank.
             Created when missing or an empty directory, reopened (resume) when it holds a store.
      budget: device bytes the state may occupy during step() (hard cap). Default 2 GiB.
      backend: "auto" (cuda when a GPU is visible), "cuda" or "host" (CPU tensors).
      host_cache_bytes: pinned host cache tier (steps read the state from RAM, write to disk);
             0 = off; "auto" (default): half of MemAvailable, at least 4 GiB left free, per local rank,
             shared by every optimizer of the process that uses "auto".
      chunk_size_bytes, data_dirs, store_name: for a new store (see optstate.Store).
      job: for a new store, the training job it belongs to (optstate.Store's job; checkpoints record
             it and optstate.reshard merges only one job's ranks). None (default): with torch.distributed
             initialised, one id for all ranks (rank 0's new uuid, broadcast: construction is then a
             collective); otherwise a new uuid. A reopened store keeps its job.
      cpu_threads: threads of the host backend's kernel. durable_every_steps: see <optstate/c.h>.
      commit_lag_steps: 1 (default): step() returns once the params are updated and the step's commit
             completes in the background until the next call; 0: step() returns once committed.
             See <optstate/c.h>.
      moment_dtype: "f32" (default), "bf16" or "q8": how exp_avg and exp_avg_sq are stored (bf16: 8 instead
             of 12 bytes per param read and written per step; updated in fp32, rounded to nearest even,
             relative error <= 2^-8 per step; q8: ~6.03 bytes, 8-bit codes with one fp32 absmax per 256
             elements, error <= half the map's gap x the block's absmax per step). Fixed when the store's
             params are first registered; a store holding the other dtype raises optstate.InvalidArgument.
             docs/MOMENTS.md.
      params may also be (name, tensor) pairs (e.g. model.named_parameters()); names are the
      tensors' names in the store. Otherwise they are "param<i>" in the order given.
      shards: where each param lies in the whole tensor when the model is sharded (tensor or data
             parallelism), so that optstate.reshard can move its state to another number of ranks:
             a dict {name: (global_shape, shard_offset)} or a callable(name, param) returning that
             or None (a whole tensor). shard_offset is a box's offset, or for a 1-D param of a
             tensor of higher rank (a flat-buffer shard) (begin,): the flat range
             [begin, begin + numel) of the tensor's row-major flattening. docs/RESHARD.md.
             A DTensor param needs no entry: its placements give it (an entry must agree with them).
      retire: names of params the store holds and the model no longer has, retired at once (see
             retire()). The params' names are compared with the store's first: when both have names
             the other lacks (a renamed or wrapped model), optstate.InvalidArgument lists them and
             nothing is written.
    """

    _STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")

    def __init__(self, params, store, budget=2 << 30, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, *, amsgrad=False, maximize=False, adamw=True, foreach=None, fused=None,
                 capturable=False, differentiable=False, **kw):
        if not 0.0 <= float(lr):
            raise errors.InvalidArgument("Invalid learning rate: {}".format(lr))
        if not 0.0 <= eps:
            raise errors.InvalidArgument("Invalid epsilon value: {}".format(eps))
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise errors.InvalidArgument("Invalid beta parameters: {}".format(betas))
        if not 0.0 <= weight_decay:
            raise errors.InvalidArgument("Invalid weight_decay value: {}".format(weight_decay))
        for flag, value in (("amsgrad", amsgrad), ("maximize", maximize), ("capturable", capturable),
                            ("differentiable", differentiable)):
            if value:
                raise errors.Unimplemented("optstate.torch.AdamW: %s=True is not supported" % flag)
        self._adamw = bool(adamw)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=False, foreach=None, capturable=False, differentiable=False, fused=None)
        super().__init__(params, store, budget, defaults, **kw)

    def _rule(self):
        return "adamw"

    def _rule_hyper(self, group):
        beta1, beta2 = group["betas"]
        return {"lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]), "adamw": 1.0 if self._adamw else 0.0}

    def _group_from_hyper(self, group, h):
        group["lr"], group["betas"] = h["lr"], (h["beta1"], h["beta2"])
        group["eps"], group["weight_decay"] = h["eps"], h["weight_decay"]


class Lion(_StreamedOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with its state in an optstate
    store: one moment, so 8 bytes a parameter are read and written per step (6 with moment_dtype="bf16")
    instead of AdamW's 12. Per element, with g the gradient and m the moment "exp_avg":

        p = p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g

    (sign(0) = 0). Arguments: lr (default 1e-4), betas ((0.9, 0.99)), weight_decay (0, decoupled), and the
    keyword arguments of optstate.torch.AdamW that are not Adam's (store, budget, backend, chunk_size_bytes,
    moment_dtype "f32" or "bf16", shards, ...). opt.state[p] holds "exp_avg". A param without a grad in a
    step keeps its state."""

    _STATE_KEYS = ("exp_avg",)

    def __init__(self, params, store, budget=2 << 30, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **kw):
        if not 0.0 <= float(lr):
            raise errors.InvalidArgument("Invalid learning rate: {}".format(lr))
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise errors.InvalidArgument("Invalid beta parameters: {}".format(betas))
        if not 0.0 <= weight_decay:
            raise errors.InvalidArgument("Invalid weight_decay value: {}".format(weight_decay))
        super().__init__(params, store, budget, dict(lr=lr, betas=betas, weight_decay=weight_decay), **kw)

    def _rule(self):
        return "lion"

    def _rule_hyper(self, group):
        beta1, beta2 = group["betas"]
        return {"lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
                "weight_decay": float(group["weight_decay"])}

    def _group_from_hyper(self, group, h):
        group["lr"], group["betas"], group["weight_decay"] = h["lr"], (h["beta1"], h["beta2"]), h["weight_decay"]


class SGD(_StreamedOptimizer):
    """SGD with momentum, as torch.optim.SGD (momentum, dampening, weight_decay as L2, nesterov, maximize),
    with its state in an optstate store: the fp32 main and, when any group has momentum, the
    "momentum_buffer" (f32 or bf16: moment_dtype), 8 bytes a parameter read and written per step (4
    without momentum). A param's first step starts its buffer as its gradient, as torch's does; a
    param without a grad keeps its state. Arguments as torch.optim.SGD's after store and budget (see
    optstate.torch.AdamW for the keyword arguments of the store and the engine). An optimizer made
    with momentum 0 in every group keeps no buffer, and a group set to momentum later raises
    optstate.InvalidArgument at step()."""

    def __init__(self, params, store, budget=2 << 30, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False, fused=None, **kw):
        if not 0.0 <= float(lr):
            raise errors.InvalidArgument("Invalid learning rate: {}".format(lr))
        if momentum < 0.0:
            raise errors.InvalidArgument("Invalid momentum value: {}".format(momentum))
        if weight_decay < 0.0:
            raise errors.InvalidArgument("Invalid weight_decay value: {}".format(weight_decay))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise errors.InvalidArgument("Nesterov momentum requires a momentum and zero dampening")
        if differentiable:
            raise errors.Unimplemented("optstate.torch.SGD: differentiable=True is not supported")
        if not isinstance(params, torch.Tensor):
            params = list(params)
        # The buffer is a field of every tensor of the store: kept when any group has momentum.
        self._buffer = momentum != 0 or any(isinstance(g, dict) and g.get("momentum", 0) != 0 for g in params)
        self._STATE_KEYS = ("momentum_buffer",) if self._buffer else ()
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=None, differentiable=False, fused=None)
        super().__init__(params, store, budget, defaults, **kw)

    def _rule(self):
        return "sgd" if self._buffer else "sgd_plain"

    def _rule_hyper(self, group):
        return {"lr": float(group["lr"]), "momentum": float(group["momentum"]),
                "dampening": float(group["dampening"]), "weight_decay": float(group["weight_decay"]),
                "nesterov": 1.0 if group["nesterov"] else 0.0, "maximize": 1.0 if group["maximize"] else 0.0}

    def _group_from_hyper(self, group, h):
        for k in ("lr", "momentum", "dampening", "weight_decay"):
            group[k] = h[k]
        group["nesterov"], group["maximize"] = h["nesterov"] != 0, h["maximize"] != 0


class Muon(_StreamedOptimizer):
    """Muon (Keller Jordan 2024; "Muon is Scalable for LLM Training", Liu et al. 2025) for the 2-D params
    and AdamW for the rest, in one optimizer with its state in an optstate store, as Moonlight's and
    Megatron-core's Muon do. A Muon param is stepped as torch.optim.Muon steps it:

        buf = buf.lerp(g, 1 - momentum);  u = g.lerp(buf, momentum) if nesterov else buf
        O = Newton-Schulz(u)   (ns_steps iterations with ns_coefficients, u / max(||u||_F, eps) first,
                                 computed in fp32)
        p = p * (1 - lr * weight_decay) - adjusted_lr * O

    with adjusted_lr lr * sqrt(max(1, rows / cols)) for adjust_lr_fn None or "original" (Keller Jordan's),
    lr * 0.2 * sqrt(max(rows, cols)) for "match_rms_adamw" (Moonlight's: the update's RMS matches
    AdamW's, so one lr and weight_decay serve both kinds of param) and lr * sqrt(rows / cols) for
    "spectral_unclamped". Its state is "momentum_buffer" (f32 or bf16: moment_dtype), 8 bytes a param
    read and written per step (6 with bf16). A matrix is one unit of work (Newton-Schulz needs all of
    it): the budget must hold the largest Muon matrix's fields and Newton-Schulz scratch (about 16 B an
    element plus 8 B x min(rows, cols)^2), else optstate.ResourceExhausted names it.

    The other params are stepped by AdamW (decoupled weight decay) with the group's lr and weight_decay
    and its adamw_betas (default (0.9, 0.95)) and adamw_eps (1e-8); their state is torch.optim.AdamW's
    ("step", "exp_avg", "exp_avg_sq").

    Which params are Muon's: a group's "use_muon" True (all of them: each must be 2-D) or False (none);
    None (default): those with p.ndim == 2. As in Moonlight, embeddings and the output head are 2-D but
    usually belong to AdamW: put them in a group with use_muon=False (and its own lr when
    adjust_lr_fn is "original": one group's lr serves both kinds of its params).

    Arguments as torch.optim.Muon's (lr 1e-3, weight_decay 0.1, momentum 0.95, nesterov True,
    ns_coefficients, eps 1e-7, ns_steps 5, adjust_lr_fn None) after store and budget, then adamw_betas
    and adamw_eps, and the keyword arguments of optstate.torch.AdamW that are not Adam's (backend,
    chunk_size_bytes, moment_dtype "f32" or "bf16" for both rules, shards, ...). A param without a grad
    in a step keeps its state."""

    _MUON, _ADAMW = 0, 1
    _ADJUST = {None: 0.0, "original": 0.0, "match_rms_adamw": 1.0, "spectral_unclamped": 2.0}

    def __init__(self, params, store, budget=2 << 30, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 adamw_betas=(0.9, 0.95), adamw_eps=1e-8, **kw):
        if not 0.0 <= float(lr):
            raise errors.InvalidArgument("Learning rate should be >= 0 but is: {}".format(lr))
        if not 0.0 <= momentum:
            raise errors.InvalidArgument("momentum should be >= 0 but is: {}".format(momentum))
        if not 0.0 <= weight_decay:
            raise errors.InvalidArgument("weight decay should be >= 0 but is: {}".format(weight_decay))
        if adjust_lr_fn not in self._ADJUST:
            raise errors.InvalidArgument("Adjust learning rate function {} is not supported".format(adjust_lr_fn))
        if len(tuple(ns_coefficients)) != 3:
            raise errors.InvalidArgument("Coefficients must be a tuple of exactly 3 values")
        if not 0 <= int(ns_steps) < 100 or int(ns_steps) != ns_steps:
            raise errors.InvalidArgument("ns_steps must be an integer in [0, 100), not {}".format(ns_steps))
        if not 0.0 <= adamw_betas[0] < 1.0 or not 0.0 <= adamw_betas[1] < 1.0:
            raise errors.InvalidArgument("Invalid adamw_betas: {}".format(adamw_betas))
        if not 0.0 < adamw_eps:
            raise errors.InvalidArgument("Invalid adamw_eps: {}".format(adamw_eps))
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
                        use_muon=None)
        super().__init__(params, store, budget, defaults, **kw)

    def _rule(self):
        return "muon"

    def _rules(self):
        return ["muon", "adamw"]  # indices _MUON and _ADAMW, both with the optimizer's moment_dtype

    def _param_rule(self, name, p, group):
        use = group.get("use_muon")
        if use is None:
            return self._MUON if p.ndim == 2 else self._ADAMW
        if use and p.ndim != 2:
            raise errors.InvalidArgument(
                self._label + ": param %s has shape %s but its group has use_muon=True; Muon steps 2-D "
                "matrices only (put it in a group with use_muon=False or None)" % (name, tuple(p.shape)))
        return self._MUON if use else self._ADAMW

    def _state_keys(self, index):
        return ("momentum_buffer",) if self._prule[index] == self._MUON else ("step", "exp_avg", "exp_avg_sq")

    def _rule_hyper(self, group):
        a, b, c = group["ns_coefficients"]
        beta1, beta2 = group["adamw_betas"]
        adjust = group["adjust_lr_fn"]
        if adjust not in self._ADJUST:
            raise errors.InvalidArgument(self._label + ": adjust_lr_fn %r is not one of original, "
                                         "match_rms_adamw, spectral_unclamped" % (adjust,))
        return {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]),
                "momentum": float(group["momentum"]), "nesterov": 1.0 if group["nesterov"] else 0.0,
                "ns_eps": float(group["eps"]), "ns_steps": float(group["ns_steps"]), "ns_a": float(a),
                "ns_b": float(b), "ns_c": float(c), "adjust_lr_fn": self._ADJUST[adjust],
                "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["adamw_eps"]), "adamw": 1.0}

    def _group_from_hyper(self, group, h):
        for k in ("lr", "weight_decay", "momentum"):
            group[k] = h[k]
        group["nesterov"], group["eps"], group["ns_steps"] = h["nesterov"] != 0, h["ns_eps"], int(h["ns_steps"])
        group["ns_coefficients"] = (h["ns_a"], h["ns_b"], h["ns_c"])
        if self._ADJUST.get(group.get("adjust_lr_fn"), -1) != h["adjust_lr_fn"]:
            group["adjust_lr_fn"] = {0.0: "original", 1.0: "match_rms_adamw", 2.0: "spectral_unclamped"}.get(
                h["adjust_lr_fn"], "original")
        group["adamw_betas"], group["adamw_eps"] = (h["beta1"], h["beta2"]), h["eps"]


def _read_only(what):
    raise TypeError("optstate.torch.AdamW: %s is read-only: the optimizer's state lives in its store; "
                    "change it through opt.pin(p, field, access=\"readwrite\") or optstate.checkpoint.load"
                    % what)


class _ParamState(collections.abc.MutableMapping):
    """opt.state[p]: a param's state as torch's optimizer of the same name keeps it (AdamW: "step",
    "exp_avg", "exp_avg_sq"; SGD: "momentum_buffer"; Lion: "exp_avg"; Muon: "momentum_buffer" for its
    matrices, AdamW's keys for the rest), read from the store when a value is looked up (a copy; keys
    and len() need no read). Empty while the param has taken no step (torch creates a param's state at its first step
    with a grad). Read-only, except that storing back the very tensor a lookup returned is accepted
    and changes nothing (frameworks that move optimizer state to a device, e.g. Lightning's
    _optimizer_to_device, store each value back)."""

    def __init__(self, opt, index):
        self._opt, self._index = opt, index
        self._given = {}  # key -> the tensor the last lookup returned

    def _keys(self):
        opt = self._opt
        return opt._state_keys(self._index) if opt._live().param_step_count(opt._names[self._index]) > 0 else ()

    def __getitem__(self, key):
        if key not in self._keys():
            raise KeyError(key)
        value = self._opt._state_value(self._index, key)
        self._given[key] = value
        return value

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())

    def __setitem__(self, key, value):
        if self._given.get(key) is value and value is not None:
            return
        _read_only("opt.state[p][%r]" % (key,))

    def __delitem__(self, key):
        _read_only("opt.state[p][%r]" % (key,))

    def __repr__(self):
        return "<optstate state of param %s: %s>" % (self._opt._names[self._index], list(self._keys()))


class _OptimizerState(collections.abc.Mapping):
    """opt.state: param -> _ParamState for every param that has state (has taken a step), in
    registration order, as torch's optimizers key it. Read-only: the state lives in the store."""

    def __init__(self, opt):
        # A weak reference: a cycle would leave the optimizer to the cyclic GC, which finalizes the
        # store, manager and optimizer handles in any order; without one they close as the
        # optimizer's last reference goes.
        self._ref = weakref.ref(opt)

    @property
    def _opt(self):
        opt = self._ref()
        if opt is None:
            raise errors.FailedPrecondition("optstate.torch.AdamW: the optimizer of this state is gone")
        return opt

    def _index(self, p):
        return self._opt._by_tensor.get(id(p)) if isinstance(p, torch.Tensor) else None

    def __getitem__(self, p):
        index = self._index(p)
        if index is None:
            raise KeyError(p)
        return _ParamState(self._opt, index)

    def __contains__(self, p):
        index = self._index(p)
        return index is not None and len(_ParamState(self._opt, index)) > 0

    def __iter__(self):
        opt = self._opt
        adam = opt._live()
        return iter([p for p, name in zip(list(opt._plist), list(opt._names)) if adam.param_step_count(name) > 0])

    def __len__(self):
        return sum(1 for _ in self)

    def __setitem__(self, p, value):
        _read_only("opt.state")

    def __delitem__(self, p):
        _read_only("opt.state")

    def __repr__(self):
        opt = self._ref()
        if opt is None or opt._handles is None:
            return "<optstate state of a closed optimizer>"
        return "<optstate state of %d params in store %s>" % (len(self), opt._store.path)


def _name_mismatch(path, store_only, model_only, stored_set, model_set):
    """The message for a model whose param names and store `path`'s differ on both sides."""
    def listed(names, others):
        shown = []
        for n in names[:8]:
            near = difflib.get_close_matches(n, others, n=1, cutoff=0.6)
            shown.append(n + (" (near %s)" % near[0] if near else ""))
        return "[" + ", ".join(shown) + (", ... %d in all" % len(names) if len(names) > 8 else "") + "]"
    hint = ""
    s0, m0 = store_only[0], model_only[0]
    for m in model_only:  # the model's names carry a prefix the store's lack (a wrapper: DDP's "module.")
        if m.endswith(s0) and len(m) > len(s0):
            prefix = m[:-len(s0)]
            if all(prefix + s in model_set for s in store_only):
                hint = (" Every store name missing from the model is a model name with %r in front: strip %r "
                        "from the model's names (e.g. give model.module.named_parameters())." % (prefix, prefix))
                break
    if not hint:
        for s in store_only:  # the store's names carry a prefix the model's lack
            if s.endswith(m0) and len(s) > len(m0):
                prefix = s[:-len(m0)]
                if all(prefix + m in stored_set for m in model_only):
                    hint = (" Every model name missing from the store is a store name without %r: add %r to "
                            "the model's names (e.g. wrap the model as when the store was written)."
                            % (prefix, prefix))
                    break
    if not hint and all(re.fullmatch(r"param[0-9]+", n) for n in store_only):
        hint = (" The store's params are unnamed (param<i>, by position): give the params as then (e.g. "
                "model.parameters()), or restore a checkpoint into a store of their names.")
    elif not hint and all(re.fullmatch(r"param[0-9]+", n) for n in model_only):
        hint = " The model's params are given unnamed (param<i>): give model.named_parameters()."
    return ("optstate.torch.AdamW: the params of store %s and the model's are named differently; registering "
            "them would add the model's as new params and leave the store's untrained, so nothing was "
            "written. Store only (%d): %s; model only (%d): %s.%s If store params are really gone from the "
            "model, pass retire=[their names] (their state stays in the store, unchanged)."
            % (path, len(store_only), listed(store_only, model_only), len(model_only),
               listed(model_only, store_only), hint))


_NOT_COPYABLE = ("optstate.torch.AdamW cannot be %s (%s): its state lives in store %s, which one optimizer "
                 "object owns; a copy would be a second writer of it. Save the state with opt.state_dict() "
                 "(the store's identity and generation, for a trainer's checkpoint) or "
                 "optstate.checkpoint.save(opt, dir) (the state itself), and restore it into an optimizer on a "
                 "store of its own with optstate.checkpoint.load")


class _StorePaths:
    """What existed of a store's directory and data directories before the store was created, so that
    a constructor that fails after creating it removes what it created and nothing else."""

    def __init__(self, path, data_dirs):
        self.path = os.path.abspath(path)
        self.path_existed = os.path.isdir(self.path)
        self.data_dirs = [(os.path.abspath(d), os.path.isdir(d)) for d in data_dirs]

    def remove_created(self, uuid):
        for d, existed in self.data_dirs:
            if d == self.path or d.startswith(self.path + os.sep):
                continue
            for suffix in (".chunks", ".owner"):  # the data file and its owner record
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, uuid + suffix))
            if not existed:
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        if self.path_existed:  # it was an empty directory: it stays, empty
            for entry in os.listdir(self.path):
                full = os.path.join(self.path, entry)
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(full)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


class _StoreOwner:
    """The one owner of an optimizer's store (and through it of its manager and optimizer handles): the
    store is closed when the last object holding the owner is gone. The optimizer's __dict__ holds it,
    so an object that shares a copy of that __dict__ (Lightning's LightningOptimizer) keeps the store
    open while it lives and closes nothing when it is collected."""

    __slots__ = ("__weakref__",)

    def __init__(self, store):
        weakref.finalize(self, _close_quietly, store)


def _close_quietly(store):
    try:
        store.close()
    except Exception:  # interpreter shutdown: nothing left to report to
        pass


class _CudaArray:
    """A device range as __cuda_array_interface__ (version 2: the contents are ready when pinned)."""

    def __init__(self, ptr, count, typestr):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 2}


def _describe(t):
    if isinstance(t, torch.Tensor):
        return "%s %s on %s" % (t.dtype, tuple(t.shape), t.device)
    return type(t).__name__


def _few(names):
    return "[" + ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") + "]"


def _shard_dim(name, p):
    """The dimension a DTensor param is sharded along on its mesh (torch >= 2), or None for a plain
    tensor. A replicated DTensor, or one sharded on several mesh dimensions, raises."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return None
    dims = [pl.dim for pl in placements if getattr(pl, "is_shard", lambda: False)()]
    if len(dims) == 1:
        return dims[0]
    if not dims:
        raise errors.Unimplemented(
            "optstate.torch.layout_from_model: param %s is replicated (placements %s): every element's "
            "optimizer state must be owned by exactly one rank; give it a dimension in dims" % (name, placements))
    raise errors.Unimplemented("optstate.torch.layout_from_model: param %s is sharded on %d mesh dimensions "
                               "(placements %s); give its split in dims" % (name, len(dims), placements))


def layout_from_model(model, sources, ranks, dims=None):
    """The target layout (for optstate.reshard) that splits the state of the checkpoints `sources` over
    `ranks` ranks as `model` is sharded on the new topology: each param (model.named_parameters(), the
    names the optimizer was given) along its sharded dimension, a DTensor param as its Shard(dim)
    placement splits it on a mesh of `ranks` ranks (torch.chunk's split, FSDP2's: pieces of
    ceil(size / ranks), the last ones smaller or absent), another param evenly. The dimension comes from the
    param itself when it is a DTensor (torch >= 2: its Shard(dim) placement), else from dims, a dict
    {param name glob pattern: dimension} (first match wins; a dimension may also be "columns", "rows"
    or "flat"), e.g. {"*.qkv.weight": 0, "*.proj.weight": 1, "*.bias": 0}. A param neither gives
    raises optstate.InvalidArgument; a replicated one optstate.Unimplemented (its state must have one
    owner). A plain param that no pattern matches, that the model holds whole (its shape is the
    tensor's global shape) and that one source alone holds (e.g. a tensor-parallel row-parallel
    layer's bias, which each rank holds whole and one rank's optimizer steps) stays whole, on rank 0. Rank r of the new topology
    then registers its shards with AdamW(..., shards=...)."""
    rules, whole, shapes, chunked = {}, {}, None, {}
    for name, p in model.named_parameters():
        kind = _shard_dim(name, p)
        if kind is not None:
            chunked[name] = (tuple(int(x) for x in p.shape), kind)
        if kind is None:
            for pattern, d in (dims or {}).items():
                if fnmatch.fnmatchcase(name, pattern):
                    kind = d
                    break
        if kind is None:
            if shapes is None:
                shapes = checkpoint.global_shapes(sources)
                owners = {}  # tensor name -> how many sources hold a part of it
                for src in sources:
                    with open(os.path.join(os.fsdecode(os.fspath(src)), "manifest.json")) as f:
                        for t in json.load(f)["tensors"]:
                            owners[t["name"]] = owners.get(t["name"], 0) + 1
            if shapes.get(name) == tuple(p.shape) and owners.get(name) == 1:
                whole[name] = tuple(p.shape)
                kind = "flat"  # any rule: replaced by the whole tensor on rank 0 below
            else:
                why = ("torch %s has no DTensor" % torch.__version__ if not _has_dtensor()
                       else "it is not a DTensor")
                raise errors.InvalidArgument("optstate.torch.layout_from_model: param %s (shape %s; global shape %s "
                                             "in the sources): no sharded dimension (%s, and no pattern of dims "
                                             "matches it)" % (name, tuple(p.shape), shapes.get(name), why))
        # The name as an exact fnmatch pattern.
        rules[re.sub(r"([\\*?\[])", r"\\\1", name)] = kind
    layout = checkpoint.reshard_layout(sources, ranks, split=rules)
    for name, shape in whole.items():
        for rank in layout["ranks"]:
            rank["tensors"].pop(name, None)
        layout["ranks"][0]["tensors"][name] = {"offset": [0] * len(shape), "shape": list(shape)}
    for name, (shape, dim) in chunked.items():
        for rank in layout["ranks"]:
            box = _chunk_box(shape, dim, rank["rank"], int(ranks))
            if box is None:  # torch.chunk leaves this rank no piece: no state here
                rank["tensors"].pop(name, None)
            else:
                rank["tensors"][name] = box
    return layout


def _chunk_box(shape, dim, rank, ranks):
    """Rank's piece of a tensor of `shape` that Shard(dim) splits over `ranks` ranks (torch.chunk's
    split, which DTensor and FSDP2 use), as a layout box; None when the piece is empty."""
    size = shape[dim]
    full = -(-size // ranks)
    begin = min(rank * full, size)
    end = min(begin + full, size)
    if end <= begin:
        return None
    offset = [0] * len(shape)
    offset[dim] = begin
    piece = list(shape)
    piece[dim] = end - begin
    return {"offset": offset, "shape": piece}


def _has_dtensor():
    try:
        from torch.distributed._tensor import DTensor  # noqa: F401  (torch >= 2.0)
        return True
    except Exception:
        return False
