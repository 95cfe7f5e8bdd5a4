"""Python handles over the C ABI: Store, MemoryManager, StreamedAdam.

These are thin: each method is one C call and raises an optstate.Error
subclass on failure. Pointers are plain integers (a tensor's data_ptr(), a
numpy array's ctypes.data). Closing a Store first closes the managers and
optimizers made on it; and the C ABI finishes closing a store (or destroying a
manager) only once the handles made on it are gone, so handles a garbage
collector finalises in its own order, with the weak references that list a
store's children already cleared, are safe too (<optstate/c.h>, "Ownership
and lifetime")."""
import atexit
import ctypes
import os
import weakref

from . import errors
from ._lib import (EXPORT_NO_SAFETENSORS, ExportArgs, ExportResult, MemoryStats, RegisterArgs, StepArgs, StoreStats,
                   call, lib)

# optstate_dtype and optstate_access of <optstate/c.h> (tests/python/vocabulary_test.py checks them).
F32, BF16, F16, Q8S, Q8U, NONE = 0, 1, 2, 3, 4, 255
READ, WRITE, READ_WRITE = 0, 1, 2

_ACCESS = {"read": READ, "r": READ, "write": WRITE, "w": WRITE, "readwrite": READ_WRITE,
           "read_write": READ_WRITE, "rw": READ_WRITE}


def access_code(access):
    """READ, WRITE or READ_WRITE from a code or a name ("read", "write", "readwrite"/"rw")."""
    if isinstance(access, int) and access in (READ, WRITE, READ_WRITE):
        return access
    code = _ACCESS.get(str(access).lower()) if isinstance(access, str) else None
    if code is None:
        raise errors.InvalidArgument("access %r is none of 'read', 'write', 'readwrite' (or 0, 1, 2)" % (access,))
    return code


def _b(s):
    return os.fsencode(s) if not isinstance(s, bytes) else s


def _split_names(ptr, n):
    """n NUL-terminated names back to back at ptr (a C block), as str."""
    out, at = [], ptr
    for _ in range(n):
        raw = ctypes.string_at(at)
        out.append(raw.decode("utf-8", "surrogateescape"))
        at += len(raw) + 1
    return out


# Stores still open when the interpreter exits are closed by an exit handler, while the library and
# ctypes are still loaded: their optimizers commit what they hold and their threads stop, in the
# order close() gives, instead of whenever the interpreter's teardown reaches each handle. Only in
# the process that opened them: a forked child that exits leaves its parent's stores alone.
_open_stores = weakref.WeakSet()


@atexit.register
def _close_open_stores():
    for s in list(_open_stores):
        if s._pid != os.getpid():
            continue
        try:
            s.close()
        except Exception:  # nothing is left to report to
            pass


class _Handle:
    _what = "handle"

    def __init__(self):
        self._h = None

    def _live(self):
        if self._h is None:
            raise errors.FailedPrecondition("%s %s is closed" % (self._what, self._describe()))
        return self._h

    def _describe(self):
        return ""

    @property
    def closed(self):
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to report to
            pass


class Store(_Handle):
    """One optimizer instance of one rank on local NVMe (vfs::Store).

    create: True = create (the path must not exist or be an empty directory), False = open an
    existing store, None (default) = open it when it holds one, else create it. `created` says
    which happened.
    job: at creation, the training job (lineage) the store belongs to: every rank of one job passes
    the same id (checkpoints record it; optstate.reshard refuses to merge two jobs' ranks). None
    (default): a new uuid. An existing store keeps its job."""

    _what = "store"

    def __init__(self, path, *, create=None, name=None, chunk_size_bytes=None, data_dirs=(),
                 retained_generations=None, direct_io=True, job=None):
        super().__init__()
        self._path = os.fspath(path)
        self._children = weakref.WeakSet()
        self.last_restore_snapshot = None
        if create is None:
            create = not os.path.exists(self._path) or (os.path.isdir(self._path) and not os.listdir(self._path))
        self.created = False
        opts = lib.optstate_store_options_create()
        try:
            if name is not None:
                lib.optstate_store_options_set_name(opts, _b(name))
            if chunk_size_bytes is not None:
                lib.optstate_store_options_set_chunk_size_bytes(opts, int(chunk_size_bytes))
            for d in data_dirs or ():
                lib.optstate_store_options_add_data_dir(opts, _b(d))
            if retained_generations is not None:
                lib.optstate_store_options_set_retained_generations(opts, int(retained_generations))
            lib.optstate_store_options_set_direct_io(opts, 1 if direct_io else 0)
            if job is not None:
                lib.optstate_store_options_set_job(opts, _b(job))
            h = ctypes.c_void_p()
            fn = lib.optstate_store_create if create else lib.optstate_store_open
            call(fn, _b(self._path), opts, ctypes.byref(h))
            self._h = h.value
            self.created = bool(create)
            self._pid = os.getpid()
            _open_stores.add(self)
        finally:
            lib.optstate_store_options_destroy(opts)

    def _describe(self):
        return self._path

    def close(self):
        """Closes the optimizers and managers made on this store, then the store (releases its lock)."""
        for child in sorted(self._children, key=lambda c: c._close_order):
            child.close()
        if self._h is not None:
            lib.optstate_store_close(self._h)
            self._h = None

    @property
    def closed(self):
        return self._h is None

    @property
    def path(self):
        return lib.optstate_store_path(self._live()).decode()

    @property
    def name(self):
        return lib.optstate_store_name(self._live()).decode()

    @property
    def uuid(self):
        return lib.optstate_store_uuid(self._live()).decode()

    @property
    def job(self):
        """The training job the store belongs to; None for a store created before stores recorded one."""
        return lib.optstate_store_job(self._live()).decode() or None

    @property
    def chunk_size_bytes(self):
        return lib.optstate_store_chunk_size_bytes(self._live())

    def latest_generation(self):
        """(generation, trainer step) of the newest committed generation."""
        gen, step = ctypes.c_uint64(), ctypes.c_uint64()
        lib.optstate_store_latest_generation(self._live(), ctypes.byref(gen), ctypes.byref(step))
        return gen.value, step.value

    def group_step_count(self, group):
        return lib.optstate_store_group_step_count(self._live(), group)

    def tensor_numel(self, tensor):
        n = ctypes.c_uint64()
        call(lib.optstate_store_tensor_numel, self._live(), _b(tensor), ctypes.byref(n))
        return n.value

    def tensor_names(self):
        """The names of the store's tensors, sorted."""
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        call(lib.optstate_store_tensor_names, self._live(), ctypes.byref(buf), ctypes.byref(size))
        if not buf.value:
            return []
        try:
            raw = ctypes.string_at(buf.value, size.value)
        finally:
            lib.optstate_free(buf)
        return [n.decode("utf-8", "surrogateescape") for n in raw.split(b"\0")[:-1]]

    def read_into(self, tensor, field, out_ptr, first, count):
        """Reads count fp32 values of a field of the newest committed generation into host memory at out_ptr."""
        call(lib.optstate_store_read_field, self._live(), _b(tensor), _b(field), first, count, out_ptr)

    def read(self, tensor, field, first=0, count=None):
        """A field's values (fp32) of the newest committed generation, as a numpy array."""
        import numpy as np
        if count is None:
            count = self.tensor_numel(tensor) - first
        out = np.empty(count, dtype=np.float32)
        self.read_into(tensor, field, out.ctypes.data, first, count)
        return out

    def snapshot(self, name):
        """Pins the newest committed generation under `name`; returns that generation."""
        gen = ctypes.c_uint64()
        call(lib.optstate_store_snapshot_create, self._live(), _b(name), ctypes.byref(gen))
        return gen.value

    def release_snapshot(self, name):
        call(lib.optstate_store_snapshot_release, self._live(), _b(name))

    def snapshots(self):
        """[(name, generation), ...]"""
        lst = ctypes.c_void_p()
        call(lib.optstate_store_snapshot_list, self._live(), ctypes.byref(lst))
        try:
            n = lib.optstate_snapshot_list_count(lst)
            return [(lib.optstate_snapshot_list_name(lst, i).decode(),
                     lib.optstate_snapshot_list_generation(lst, i)) for i in range(n)]
        finally:
            lib.optstate_snapshot_list_destroy(lst)

    def export_checkpoint(self, dest, snapshot=None, safetensors=True):
        """Writes the newest committed generation (or a snapshot's) as a checkpoint directory at dest,
        byte for byte what the mount shows; returns its generation (see optstate_checkpoint_export).

        safetensors=False leaves out state.safetensors, which holds every field file's bytes again
        (the default writes the state twice): manifest.json (marked "state_safetensors": false) and
        tensors/<tensor>/<field> only, which restore_checkpoint and optstate-restore take the same way."""
        gen = ctypes.c_uint64()
        args = ExportArgs(snapshot=None if snapshot is None else _b(snapshot),
                          flags=0 if safetensors else EXPORT_NO_SAFETENSORS)
        call(lib.optstate_checkpoint_export_with, self._live(), _b(dest), ctypes.byref(args), ctypes.byref(gen))
        return gen.value

    def restore_checkpoint(self, src, force=False):
        """Imports a checkpoint directory as a new committed generation after verifying every chunk and
        the layout; returns the new generation. No manager or optimizer may be open on the store.

        A checkpoint of another store into a store that has taken steps raises
        optstate.FailedPrecondition unless force=True. When the store has taken steps, the generation
        the restore replaces is kept as a snapshot first; its name is then in
        self.last_restore_snapshot (None when none was made)."""
        live = [c for c in self._children if not c.closed]
        if live:
            raise errors.FailedPrecondition(
                "restore of %s into store %s: close its %s first (an optimizer resumes from the restored "
                "generation when it is created again)" % (os.fspath(src), self._path,
                                                          " and ".join(sorted({c._what for c in live}))))
        gen = ctypes.c_uint64()
        kept = ctypes.c_void_p()
        call(lib.optstate_checkpoint_restore2, self._live(), _b(src), 1 if force else 0, ctypes.byref(gen),
             ctypes.byref(kept))
        try:
            self.last_restore_snapshot = ctypes.string_at(kept.value).decode() if kept.value else None
        finally:
            lib.optstate_free(kept)
        return gen.value

    def revert_to_snapshot(self, name):
        """Makes snapshot `name`'s state the store's head again without copying data: a new committed
        generation whose tensors, chunk versions, step counts and hyperparameters are the snapshot's
        (optstate_store_revert). The generation it replaces is kept as a snapshot in the same commit
        (its name in self.last_restore_snapshot; None when the snapshot already was the head). No
        manager or optimizer may be open on the store. Returns the new head's generation."""
        live = [c for c in self._children if not c.closed]
        if live:
            raise errors.FailedPrecondition(
                "revert of store %s to snapshot %s: close its %s first (an optimizer resumes from the new head "
                "when it is created again)" % (self._path, name, " and ".join(sorted({c._what for c in live}))))
        gen = ctypes.c_uint64()
        kept = ctypes.c_void_p()
        call(lib.optstate_store_revert, self._live(), _b(name), ctypes.byref(gen), ctypes.byref(kept))
        try:
            self.last_restore_snapshot = ctypes.string_at(kept.value).decode() if kept.value else None
        finally:
            lib.optstate_free(kept)
        return gen.value

    def stats(self):
        s = StoreStats()
        call(lib.optstate_store_stats, self._live(), ctypes.byref(s))
        return {name: getattr(s, name) for name, _ in s._fields_}


# host_cache_bytes="auto": the C ABI's OPTSTATE_HOST_CACHE_AUTO.
HOST_CACHE_AUTO = (1 << 64) - 1


class MemoryManager(_Handle):
    """The device window of a store (memmgr::MemoryManager). backend: "auto", "host" or "cuda".

    host_cache_bytes: the pinned host cache tier (RAM as a read tier), bytes; 0 = off; "auto"
    (default): half of MemAvailable, leaving at least 4 GiB free, divided among the node's ranks.
    """

    _what = "memory manager"
    _close_order = 1

    def __init__(self, store, *, backend="auto", device_budget_bytes=2 << 30, host_cache_bytes="auto",
                 read_ahead_chunks=0, cuda_device=0):
        super().__init__()
        self.store = store
        self._pins = weakref.WeakSet()
        opts = lib.optstate_mm_options_create()
        try:
            call(lib.optstate_mm_options_set_backend, opts, _b(backend))
            lib.optstate_mm_options_set_device_budget_bytes(opts, int(device_budget_bytes))
            lib.optstate_mm_options_set_host_cache_bytes(opts, HOST_CACHE_AUTO if host_cache_bytes == "auto"
                                                         else int(host_cache_bytes))
            lib.optstate_mm_options_set_read_ahead_chunks(opts, int(read_ahead_chunks))
            lib.optstate_mm_options_set_cuda_device(opts, int(cuda_device))
            h = ctypes.c_void_p()
            call(lib.optstate_mm_create, store._live(), opts, ctypes.byref(h))
            self._h = h.value
        finally:
            lib.optstate_mm_options_destroy(opts)
        store._children.add(self)

    def _describe(self):
        return "of store " + self.store._path

    def close(self):
        for child in list(self.store._children):
            if isinstance(child, StreamedAdam) and child.mm is self:
                child.close()
        for pin in list(self._pins):
            try:
                pin.unpin()
            except errors.Error:  # a write-back the manager's destruction drops anyway
                pass
        if self._h is not None:
            lib.optstate_mm_destroy(self._h)
            self._h = None

    @property
    def backend(self):
        return lib.optstate_mm_backend(self._live()).decode()

    def release_all(self):
        """Writes dirty pages back and releases every device page (sleep)."""
        call(lib.optstate_mm_release_all, self._live())

    def flush(self):
        """Waits until every chunk written through an unpinned range is in the store's pending generation
        (a commit publishes it: StreamedAdam.commit)."""
        call(lib.optstate_mm_flush, self._live())

    def pin(self, tensor, field, first=0, count=None, access=READ):
        """Pins elements [first, first + count) of a tensor field (count None: to the end) and returns
        its PinnedRange; see optstate_pin in <optstate/c.h>. access: "read", "write" or "readwrite"."""
        code = access_code(access)
        h = self._live()
        if count is None:
            count = self.store.tensor_numel(tensor) - int(first)
        out = ctypes.c_void_p()
        call(lib.optstate_pin, h, _b(tensor), _b(field), int(first), int(count), code, ctypes.byref(out))
        pin = PinnedRange(self, out.value, tensor, field, int(first), code)
        self._pins.add(pin)
        return pin

    def stats(self):
        s = MemoryStats()
        lib.optstate_mm_stats(self._live(), ctypes.byref(s))
        return {name: getattr(s, name) for name, _ in s._fields_}


class PinnedRange:
    """A pinned range of a tensor field: `data_ptr` (a device pointer, a host pointer on the host
    backend) holds `count` elements of `dtype` (F32, BF16, F16) and stays valid until unpin().
    A context manager: unpinned on exit."""

    def __init__(self, mm, handle, tensor, field, first, access):
        self._h = handle
        self.mm = mm
        self.tensor, self.field, self.first, self.access = tensor, field, first, access
        self.count = lib.optstate_pin_count(handle)
        self.size_bytes = lib.optstate_pin_size_bytes(handle)
        self.dtype = lib.optstate_pin_dtype(handle)

    def _live(self):
        if self._h is None:
            raise errors.FailedPrecondition("pinned range %s/%s [%d, %d) of store %s is unpinned"
                                            % (self.tensor, self.field, self.first, self.first + self.count,
                                               self.mm.store._path))
        return self._h

    @property
    def pinned(self):
        return self._h is not None

    @property
    def data_ptr(self):
        ptr = lib.optstate_pin_data(self._live())
        if not ptr:
            raise errors.FailedPrecondition("pinned range %s/%s of store %s: its memory manager is closed"
                                            % (self.tensor, self.field, self.mm.store._path))
        return ptr

    @property
    def stream(self):
        """The cudaStream_t (an int) the contents are ready on, or None."""
        return lib.optstate_pin_stream(self._live()) or None

    def unpin(self):
        """Releases the range (idempotent); a written range is scheduled for write-back."""
        h, self._h = self._h, None
        if h is not None:
            self.mm._pins.discard(self)
            call(lib.optstate_unpin, h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpin()

    def __del__(self):
        try:
            self.unpin()
        except Exception:  # interpreter shutdown, or a write-back error nobody can receive
            pass


class StreamedAdam(_Handle):
    """Adam/AdamW with its state in the store (memmgr::StreamedAdam). On a store
    that holds tensors, their state, groups and step counts are restored."""

    _what = "optimizer"
    _close_order = 0

    def __init__(self, store, mm, *, grad_scale=1.0, cpu_threads=1, durable_every_steps=1, commit_lag_steps=1,
                 moment_dtype="f32", rule="adamw", rules=None):
        """rule: the update rule ("adamw", "lion", "sgd", "sgd_plain", "muon"). rules: several, as a list
        of names or (name, moment_dtype) pairs, in place of rule: a param is registered under one of them
        by its index (register_params' rules; 0 by default)."""
        super().__init__()
        self.store, self.mm = store, mm
        opts = lib.optstate_adam_options_create()
        try:
            lib.optstate_adam_options_set_grad_scale(opts, float(grad_scale))
            lib.optstate_adam_options_set_cpu_threads(opts, int(cpu_threads))
            lib.optstate_adam_options_set_durable_every_steps(opts, int(durable_every_steps))
            lib.optstate_adam_options_set_commit_lag_steps(opts, int(commit_lag_steps))
            call(lib.optstate_adam_options_set_moment_dtype, opts, str(moment_dtype).encode())
            call(lib.optstate_adam_options_set_rule, opts, str(rule).encode())
            for r in rules or ():
                name, dtype = (r, None) if isinstance(r, str) else r
                call(lib.optstate_adam_options_add_rule, opts, str(name).encode(),
                     None if dtype is None else str(dtype).encode())
            h = ctypes.c_void_p()
            call(lib.optstate_adam_create, store._live(), mm._live(), opts, ctypes.byref(h))
            self._h = h.value
        finally:
            lib.optstate_adam_options_destroy(opts)
        store._children.add(self)

    def _describe(self):
        return "on store " + self.store._path

    def close(self):
        """Writes steps held only in the host cache, commits them, and frees the optimizer."""
        if self._h is not None:
            lib.optstate_adam_destroy(self._h)
            self._h = None

    def set_group(self, group, lr, beta1, beta2, eps, weight_decay, adamw=True):
        """An AdamW group's hyperparameters (another rule's: FailedPrecondition, use set_group_hyper)."""
        call(lib.optstate_adam_set_group, self._live(), group, lr, beta1, beta2, eps, weight_decay,
             1 if adamw else 0)

    def get_group(self, group):
        """An AdamW group's hyperparameters (another rule's: FailedPrecondition, use get_group_hyper)."""
        vals = [ctypes.c_double() for _ in range(5)]
        adamw = ctypes.c_int()
        call(lib.optstate_adam_get_group, self._live(), group, *[ctypes.byref(v) for v in vals],
             ctypes.byref(adamw))
        lr, beta1, beta2, eps, wd = (v.value for v in vals)
        return dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, adamw=bool(adamw.value))

    def set_group_hyper(self, group, hyper):
        """A group's hyperparameters by the rule's names ({"lr": ..., ...}); names not given keep the
        rule's defaults."""
        names = list(hyper)
        c_names = (ctypes.c_char_p * len(names))(*[_b(n) for n in names])
        c_vals = (ctypes.c_double * len(names))(*[float(hyper[n]) for n in names])
        call(lib.optstate_adam_set_group_hyper, self._live(), group, len(names), c_names, c_vals)

    def get_group_hyper(self, group):
        """A group's hyperparameters by the rule's names, as the optimizer holds them."""
        names, vals, n = ctypes.c_void_p(), ctypes.POINTER(ctypes.c_double)(), ctypes.c_size_t()
        call(lib.optstate_adam_get_group_hyper, self._live(), group, ctypes.byref(names), ctypes.byref(vals),
             ctypes.byref(n))
        try:
            keys = _split_names(names.value, n.value)
            return {k: vals[i] for i, k in enumerate(keys)}
        finally:
            lib.optstate_free(names)
            lib.optstate_free(ctypes.cast(vals, ctypes.c_void_p))

    def fields(self):
        """The fields the update rule keeps per tensor, "main" first."""
        names, n = ctypes.c_void_p(), ctypes.c_size_t()
        call(lib.optstate_adam_fields, self._live(), ctypes.byref(names), ctypes.byref(n))
        try:
            return tuple(_split_names(names.value, n.value))
        finally:
            lib.optstate_free(names)

    def register_param(self, name, numel, group, initial_ptr=None, initial_dtype=NONE, shape=(),
                       global_shape=(), shard_offset=()):
        """Returns (id, existed): existed is True when the store already held the param (resume).
        global_shape and shard_offset: the param is that shard of a larger tensor (a box, or with a 1-D
        shape and shard_offset the flat range of the tensor's row-major flattening; docs/RESHARD.md)."""
        pid, existed = ctypes.c_uint32(), ctypes.c_int()

        def arr(v):
            return (ctypes.c_uint64 * len(v))(*[int(x) for x in v]) if v else None
        if global_shape:
            call(lib.optstate_adam_register_shard, self._live(), _b(name), int(numel), int(group),
                 initial_ptr, int(initial_dtype), arr(shape), len(shape), arr(global_shape), len(global_shape),
                 arr(shard_offset), len(shard_offset), ctypes.byref(pid), ctypes.byref(existed))
        else:
            call(lib.optstate_adam_register_param, self._live(), _b(name), int(numel), int(group),
                 initial_ptr, int(initial_dtype), arr(shape), len(shape), ctypes.byref(pid), ctypes.byref(existed))
        return pid.value, bool(existed.value)

    def register_params(self, names, numels, groups, initial_ptrs=None, initial_dtypes=None, shapes=None,
                        global_shapes=None, shard_offsets=None, rules=None):
        """register_param for many params in one call (optstate_adam_register_params): lists of one entry
        per param (shapes, global_shapes, shard_offsets: tuples, () for none; any list may be None;
        rules: each param's rule index, None = all 0). Every registration is checked before any is
        made. Returns [(id, existed)]."""
        n = len(names)
        if n == 0:
            return []
        u64, sz = ctypes.c_uint64, ctypes.c_size_t

        def dims(lists):
            if lists is None or not any(lists):
                return None, None
            flat = [int(x) for v in lists for x in v]
            return (sz * n)(*[len(v) for v in lists]), (u64 * max(1, len(flat)))(*flat)
        nd, sh = dims(shapes)
        gd, gs = dims(global_shapes)
        od, so = dims(shard_offsets)
        ids, existed = (ctypes.c_uint32 * n)(), (ctypes.c_int * n)()
        c_names = (ctypes.c_char_p * n)(*[_b(x) for x in names])
        c_numels = (u64 * n)(*[int(x) for x in numels])
        c_groups = (ctypes.c_uint32 * n)(*[int(g) for g in groups])
        c_initials = None if initial_ptrs is None else (ctypes.c_void_p * n)(*initial_ptrs)
        c_dtypes = None if initial_dtypes is None else (ctypes.c_int * n)(*[int(d) for d in initial_dtypes])
        if rules is None:
            call(lib.optstate_adam_register_params, self._live(), n, c_names, c_numels, c_groups, c_initials,
                 c_dtypes, nd, sh, gd, gs, od, so, ids, existed)
        else:
            c_rules = (ctypes.c_uint32 * n)(*[int(r) for r in rules])
            args = RegisterArgs(
                n=n, names=c_names, numels=c_numels,
                groups=c_groups, rules=c_rules, initials=c_initials, initial_dtypes=c_dtypes, ndims=nd,
                shapes=sh, global_ndims=gd, global_shapes=gs, offset_ndims=od, shard_offsets=so, ids=ids,
                existed=existed)
            call(lib.optstate_adam_register_params_with, self._live(), ctypes.byref(args))
        return [(ids[i], bool(existed[i])) for i in range(n)]

    def set_grad_scale(self, grad_scale):
        """Sets the standing gradient scale: grads are divided by it in every step given no scale of its
        own (optstate_adam_set_grad_scale). Finite and > 0."""
        call(lib.optstate_adam_set_grad_scale, self._live(), float(grad_scale))

    def step_with(self, args):
        """One step from a StepArgs (optstate_adam_step_args_t; its struct_size is already set)."""
        call(lib.optstate_adam_step_with, self._live(), ctypes.byref(args))

    def step_raw(self, n, ids, grads, grad_dtypes, params, param_dtypes, found_inf_ptr=None, grad_scale=0.0):
        """One step over n params given as ctypes arrays; grad_scale > 0 first becomes the standing scale
        (set_grad_scale), 0 keeps it."""
        if grad_scale != 0.0:
            self.set_grad_scale(grad_scale)
        self.step_with(StepArgs(n=n, ids=ids, grads=grads, grad_dtypes=grad_dtypes, params=params,
                                param_dtypes=param_dtypes, found_inf=found_inf_ptr))

    def step(self, ids, grads, grad_dtypes, params=None, param_dtypes=None, found_inf_ptr=None, grad_scale=0.0,
             numels=None, grad_scale_ptr=None):
        """One step; lists of ids, grad pointers and dtypes (and param pointers and dtypes). numels: the
        grads' element counts, checked against the registrations; grad_scale_ptr: a pointer to this step's
        scale (one float on the backend's device), for this step only; grad_scale: a float that first
        becomes the standing scale (set_grad_scale; 0 keeps it). Give one of the two scales at most."""
        n = len(ids)
        if grad_scale and grad_scale_ptr is not None:
            raise errors.InvalidArgument("StreamedAdam.step: give grad_scale or grad_scale_ptr, not both")
        c_params = c_pdt = None
        if params is not None:
            c_params = (ctypes.c_void_p * n)(*params)
            c_pdt = (ctypes.c_int * n)(*param_dtypes)
        c_ids, c_grads, c_gdt = (ctypes.c_uint32 * n)(*ids), (ctypes.c_void_p * n)(*grads), (ctypes.c_int * n)(*grad_dtypes)
        c_numels = None if numels is None else (ctypes.c_uint64 * n)(*numels)
        if grad_scale != 0.0:
            self.set_grad_scale(grad_scale)
        self.step_with(StepArgs(n=n, ids=c_ids, grads=c_grads, grad_dtypes=c_gdt, numels=c_numels, params=c_params,
                                param_dtypes=c_pdt, found_inf=found_inf_ptr, grad_scale=grad_scale_ptr))

    def step2_raw(self, n, ids, grads, grad_dtypes, numels, params, param_dtypes, found_inf_ptr=None,
                  grad_scale_ptr=None):
        """One step over n params given as ctypes arrays, with each grad's numel checked against its
        registration and an optional pointer to this step's grad scale (see optstate_adam_step_args_t)."""
        self.step_with(StepArgs(n=n, ids=ids, grads=grads, grad_dtypes=grad_dtypes, numels=numels, params=params,
                                param_dtypes=param_dtypes, found_inf=found_inf_ptr, grad_scale=grad_scale_ptr))

    def retire_param(self, name):
        """Leaves a param the store holds but this run's model lacks out of the run; its state stays in
        the store unchanged (see optstate_adam_retire_param)."""
        call(lib.optstate_adam_retire_param, self._live(), _b(name))

    @property
    def last_step_skipped(self):
        return bool(lib.optstate_adam_last_step_skipped(self._live()))

    @property
    def last_step_seconds(self):
        """Seconds the last step took inside the library."""
        return lib.optstate_adam_last_step_seconds(self._live())

    def prefetch(self):
        """Starts reading the next step's state into the host cache tier in the background and returns
        at once (see optstate_adam_prefetch)."""
        call(lib.optstate_adam_prefetch, self._live())

    @property
    def last_step_prefetch(self):
        """(hit_bytes, read_bytes): the bytes the last step found prefetched in the host cache tier, and
        the bytes the prefetches before it read."""
        hit, read = ctypes.c_uint64(), ctypes.c_uint64()
        lib.optstate_adam_last_step_prefetch(self._live(), ctypes.byref(hit), ctypes.byref(read))
        return hit.value, read.value

    def load_main(self, pid, ptr, dtype):
        call(lib.optstate_adam_load_main, self._live(), pid, ptr, dtype)

    def make_durable(self):
        gen = ctypes.c_uint64()
        call(lib.optstate_adam_make_durable, self._live(), ctypes.byref(gen))
        return gen.value

    def commit(self):
        """Commits what is pending (cached steps, registrations, chunks written through pinned ranges)
        and returns the newest committed generation; see optstate_adam_commit."""
        gen = ctypes.c_uint64()
        call(lib.optstate_adam_commit, self._live(), ctypes.byref(gen))
        return gen.value

    def export_checkpoint(self, dest, snapshot=None, safetensors=True):
        """Store.export_checkpoint of this optimizer's store, taking each chunk whose copy in the host
        cache tier holds the exported generation's bytes (checked against its checksum) from RAM and
        reading only the others from the disk: the same files. Returns a dict: generation, files,
        bytes (written), ram_chunks and ram_bytes (from RAM), disk_chunks and disk_bytes (read from the
        disk), ram_mismatch_chunks (held in RAM with newer bytes, read from the disk); see
        optstate_checkpoint_export2."""
        args = ExportArgs(snapshot=None if snapshot is None else _b(snapshot),
                          flags=0 if safetensors else EXPORT_NO_SAFETENSORS, optimizer=self._live())
        res = ExportResult()
        call(lib.optstate_checkpoint_export2, self.store._live(), _b(dest), ctypes.byref(args), ctypes.byref(res))
        return {name: getattr(res, name) for name, _ in res._fields_ if name != "struct_size"}

    def step_count(self, group):
        """Steps in which any param of the group stepped."""
        return lib.optstate_adam_step_count(self._live(), group)

    def param_step_count(self, name):
        """The param's own step count (torch's state[p]["step"]): the steps it had a gradient in, the
        count its bias correction follows; steps not yet committed included. NotFound for a name that
        is not a param of this optimizer."""
        n = ctypes.c_uint64()
        call(lib.optstate_adam_param_step_count, self._live(), _b(name), ctypes.byref(n))
        return n.value

    @property
    def last_generation(self):
        return lib.optstate_adam_last_generation(self._live())

    @property
    def global_step(self):
        return lib.optstate_adam_global_step(self._live())

    @global_step.setter
    def global_step(self, step):
        lib.optstate_adam_set_global_step(self._live(), step)

    @property
    def uncommitted_steps(self):
        return lib.optstate_adam_uncommitted_steps(self._live())
