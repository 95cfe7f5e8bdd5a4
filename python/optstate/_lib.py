"""Loads liboptstate.so and declares the C ABI's signatures (<optstate/c.h>).

Where the library is looked for, in order:
  1. $OPTSTATE_LIB (a path to the library; nothing else is tried when it is set);
  2. next to this package (optstate/liboptstate.so, e.g. copied in by a wheel);
  3. a CMake build tree of the source checkout this package sits in
     (<repo>/build/*/capi/liboptstate.so);
  4. the dynamic loader's search path (an installed liboptstate.so.1).

The library's C ABI version must be at least ABI_VERSION (OPTSTATE_C_ABI_VERSION
of the <optstate/c.h> this package speaks): the version grows with every
addition, and nothing is removed.
"""
import ctypes
import glob
import os

from . import errors

ABI_VERSION = 6
_SONAME_VERSION = 1  # liboptstate.so.1 (capi/CMakeLists.txt OPTSTATE_C_SOVERSION)

_c = ctypes
_u8p = _c.c_char_p
_vp = _c.c_void_p
_errp = _c.POINTER(_c.c_void_p)
_u32 = _c.c_uint32
_u64 = _c.c_uint64
_int = _c.c_int
_dbl = _c.c_double


class StoreStats(_c.Structure):
    _fields_ = [(n, _u64) for n in (
        "latest_generation", "live_bytes", "referenced_extent_bytes", "pending_bytes",
        "lifetime_bytes_written", "generations_retained", "snapshots", "leases")]


class MemoryStats(_c.Structure):
    _fields_ = [("resident_bytes", _u64), ("peak_resident_bytes", _u64), ("budget_bytes", _u64),
                ("nvme_read_bytes", _u64), ("nvme_write_bytes", _u64), ("cache_hit_bytes", _u64),
                ("cache_bytes", _u64), ("h2d_bytes", _u64), ("d2h_bytes", _u64),
                ("io_stall_seconds", _dbl), ("pins", _u64), ("evictions", _u64)]


class StepArgs(_c.Structure):
    """optstate_adam_step_args_t: one step's inputs (see <optstate/c.h>)."""
    _fields_ = [("struct_size", _c.c_size_t), ("n", _c.c_size_t), ("ids", _c.POINTER(_u32)),
                ("grads", _c.POINTER(_vp)), ("grad_dtypes", _c.POINTER(_int)), ("numels", _c.POINTER(_u64)),
                ("params", _c.POINTER(_vp)), ("param_dtypes", _c.POINTER(_int)), ("found_inf", _vp),
                ("grad_scale", _vp)]

    def __init__(self, **fields):
        super().__init__(struct_size=_c.sizeof(StepArgs), **fields)


class RegisterArgs(_c.Structure):
    """optstate_adam_register_args_t: a registration of n params with their rules (see <optstate/c.h>)."""
    _fields_ = [("struct_size", _c.c_size_t), ("n", _c.c_size_t), ("names", _c.POINTER(_u8p)),
                ("numels", _c.POINTER(_u64)), ("groups", _c.POINTER(_u32)), ("rules", _c.POINTER(_u32)),
                ("initials", _c.POINTER(_vp)), ("initial_dtypes", _c.POINTER(_int)),
                ("ndims", _c.POINTER(_c.c_size_t)), ("shapes", _c.POINTER(_u64)),
                ("global_ndims", _c.POINTER(_c.c_size_t)), ("global_shapes", _c.POINTER(_u64)),
                ("offset_ndims", _c.POINTER(_c.c_size_t)), ("shard_offsets", _c.POINTER(_u64)),
                ("ids", _c.POINTER(_u32)), ("existed", _c.POINTER(_int))]

    def __init__(self, **fields):
        super().__init__(struct_size=_c.sizeof(RegisterArgs), **fields)


class ExportArgs(_c.Structure):
    """optstate_checkpoint_export_args_t: what a checkpoint export writes (see <optstate/c.h>)."""
    _fields_ = [("struct_size", _c.c_size_t), ("snapshot", _u8p), ("flags", _u64), ("optimizer", _vp)]

    def __init__(self, **fields):
        super().__init__(struct_size=_c.sizeof(ExportArgs), **fields)


class ExportResult(_c.Structure):
    """optstate_checkpoint_export_result_t: what a checkpoint export did (see <optstate/c.h>)."""
    _fields_ = [("struct_size", _c.c_size_t)] + [(n, _u64) for n in (
        "generation", "files", "bytes", "ram_chunks", "ram_bytes", "disk_chunks", "disk_bytes",
        "ram_mismatch_chunks")]

    def __init__(self):
        super().__init__(struct_size=_c.sizeof(ExportResult))


EXPORT_NO_SAFETENSORS = 1  # OPTSTATE_EXPORT_NO_SAFETENSORS


class ReshardArgs(_c.Structure):
    """optstate_checkpoint_reshard_args_t: what a reshard writes (see <optstate/c.h>)."""
    _fields_ = [("struct_size", _c.c_size_t), ("flags", _u64)]

    def __init__(self, **fields):
        super().__init__(struct_size=_c.sizeof(ReshardArgs), **fields)


RESHARD_NO_SAFETENSORS = 1  # OPTSTATE_RESHARD_NO_SAFETENSORS


# name: (restype, argtypes). Functions whose restype is _int and whose last
# argument is _errp return an optstate_code.
_SIGNATURES = {
    "optstate_version": (_u8p, []),
    "optstate_abi_version": (_int, []),
    "optstate_code_name": (_u8p, [_int]),
    "optstate_free": (None, [_vp]),
    "optstate_set_log_level": (_int, [_u8p, _errp]),
    # store
    "optstate_store_options_create": (_vp, []),
    "optstate_store_options_destroy": (None, [_vp]),
    "optstate_store_options_set_name": (None, [_vp, _u8p]),
    "optstate_store_options_set_chunk_size_bytes": (None, [_vp, _u64]),
    "optstate_store_options_add_data_dir": (None, [_vp, _u8p]),
    "optstate_store_options_set_retained_generations": (None, [_vp, _u32]),
    "optstate_store_options_set_direct_io": (None, [_vp, _int]),
    "optstate_store_options_set_job": (None, [_vp, _u8p]),
    "optstate_store_create": (_int, [_u8p, _vp, _c.POINTER(_vp), _errp]),
    "optstate_store_open": (_int, [_u8p, _vp, _c.POINTER(_vp), _errp]),
    "optstate_store_close": (None, [_vp]),
    "optstate_store_path": (_u8p, [_vp]),
    "optstate_store_name": (_u8p, [_vp]),
    "optstate_store_uuid": (_u8p, [_vp]),
    "optstate_store_job": (_u8p, [_vp]),
    "optstate_store_chunk_size_bytes": (_u64, [_vp]),
    "optstate_store_latest_generation": (None, [_vp, _c.POINTER(_u64), _c.POINTER(_u64)]),
    "optstate_store_group_step_count": (_u64, [_vp, _u32]),
    "optstate_store_read_field": (_int, [_vp, _u8p, _u8p, _u64, _u64, _vp, _errp]),
    "optstate_store_tensor_numel": (_int, [_vp, _u8p, _c.POINTER(_u64), _errp]),
    "optstate_store_tensor_names": (_int, [_vp, _c.POINTER(_vp), _c.POINTER(_c.c_size_t), _errp]),
    "optstate_store_snapshot_create": (_int, [_vp, _u8p, _c.POINTER(_u64), _errp]),
    "optstate_store_snapshot_release": (_int, [_vp, _u8p, _errp]),
    "optstate_store_snapshot_list": (_int, [_vp, _c.POINTER(_vp), _errp]),
    "optstate_snapshot_list_count": (_c.c_size_t, [_vp]),
    "optstate_snapshot_list_name": (_u8p, [_vp, _c.c_size_t]),
    "optstate_snapshot_list_generation": (_u64, [_vp, _c.c_size_t]),
    "optstate_snapshot_list_destroy": (None, [_vp]),
    "optstate_store_stats": (_int, [_vp, _c.POINTER(StoreStats), _errp]),
    "optstate_checkpoint_export": (_int, [_vp, _u8p, _u8p, _c.POINTER(_u64), _errp]),
    "optstate_checkpoint_export_with": (_int, [_vp, _u8p, _c.POINTER(ExportArgs), _c.POINTER(_u64), _errp]),
    "optstate_checkpoint_export2": (_int, [_vp, _u8p, _c.POINTER(ExportArgs), _c.POINTER(ExportResult), _errp]),
    "optstate_checkpoint_restore": (_int, [_vp, _u8p, _c.POINTER(_u64), _errp]),
    "optstate_checkpoint_restore2": (_int, [_vp, _u8p, _u32, _c.POINTER(_u64), _c.POINTER(_vp), _errp]),
    "optstate_store_revert": (_int, [_vp, _u8p, _c.POINTER(_u64), _c.POINTER(_vp), _errp]),
    "optstate_checkpoint_reshard": (_int, [_c.POINTER(_u8p), _c.c_size_t, _u8p, _u8p, _c.POINTER(_u32), _errp]),
    "optstate_checkpoint_reshard_with": (_int, [_c.POINTER(_u8p), _c.c_size_t, _u8p, _u8p, _c.POINTER(ReshardArgs),
                                                _c.POINTER(_u32), _errp]),
    "optstate_checkpoint_reshard_layout": (_int, [_c.POINTER(_u8p), _c.c_size_t, _u32, _u8p, _c.POINTER(_vp),
                                                  _errp]),
    # memory manager
    "optstate_mm_options_create": (_vp, []),
    "optstate_mm_options_destroy": (None, [_vp]),
    "optstate_mm_options_set_backend": (_int, [_vp, _u8p, _errp]),
    "optstate_mm_options_set_device_budget_bytes": (None, [_vp, _u64]),
    "optstate_mm_options_set_host_cache_bytes": (None, [_vp, _u64]),
    "optstate_mm_options_set_read_ahead_chunks": (None, [_vp, _u32]),
    "optstate_mm_options_set_cuda_device": (None, [_vp, _int]),
    "optstate_mm_create": (_int, [_vp, _vp, _c.POINTER(_vp), _errp]),
    "optstate_mm_destroy": (None, [_vp]),
    "optstate_mm_backend": (_u8p, [_vp]),
    "optstate_mm_release_all": (_int, [_vp, _errp]),
    "optstate_mm_stats": (None, [_vp, _c.POINTER(MemoryStats)]),
    "optstate_mm_flush": (_int, [_vp, _errp]),
    # pinned ranges
    "optstate_pin": (_int, [_vp, _u8p, _u8p, _u64, _u64, _int, _c.POINTER(_vp), _errp]),
    "optstate_pin_data": (_vp, [_vp]),
    "optstate_pin_count": (_u64, [_vp]),
    "optstate_pin_size_bytes": (_u64, [_vp]),
    "optstate_pin_dtype": (_int, [_vp]),
    "optstate_pin_stream": (_vp, [_vp]),
    "optstate_unpin": (_int, [_vp, _errp]),
    # streamed Adam
    "optstate_adam_options_create": (_vp, []),
    "optstate_adam_options_destroy": (None, [_vp]),
    "optstate_adam_options_set_grad_scale": (None, [_vp, _c.c_float]),
    "optstate_adam_options_set_cpu_threads": (None, [_vp, _int]),
    "optstate_adam_options_set_durable_every_steps": (None, [_vp, _u32]),
    "optstate_adam_options_set_commit_lag_steps": (None, [_vp, _u32]),
    "optstate_adam_options_set_moment_dtype": (_int, [_vp, _c.c_char_p, _errp]),
    "optstate_adam_options_set_rule": (_int, [_vp, _c.c_char_p, _errp]),
    "optstate_adam_options_add_rule": (_int, [_vp, _c.c_char_p, _c.c_char_p, _errp]),
    "optstate_adam_set_group_hyper": (_int, [_vp, _u32, _c.c_size_t, _c.POINTER(_c.c_char_p), _c.POINTER(_dbl),
                                             _errp]),
    "optstate_adam_get_group_hyper": (_int, [_vp, _u32, _c.POINTER(_vp), _c.POINTER(_c.POINTER(_dbl)),
                                             _c.POINTER(_c.c_size_t), _errp]),
    "optstate_adam_fields": (_int, [_vp, _c.POINTER(_vp), _c.POINTER(_c.c_size_t), _errp]),
    "optstate_adam_create": (_int, [_vp, _vp, _vp, _c.POINTER(_vp), _errp]),
    "optstate_adam_destroy": (None, [_vp]),
    "optstate_adam_set_group": (_int, [_vp, _u32, _dbl, _dbl, _dbl, _dbl, _dbl, _int, _errp]),
    "optstate_adam_get_group": (_int, [_vp, _u32] + [_c.POINTER(_dbl)] * 5 + [_c.POINTER(_int), _errp]),
    "optstate_adam_register_param": (_int, [_vp, _u8p, _u64, _u32, _vp, _int, _c.POINTER(_u64),
                                            _c.c_size_t, _c.POINTER(_u32), _c.POINTER(_int), _errp]),
    "optstate_adam_register_shard": (_int, [_vp, _u8p, _u64, _u32, _vp, _int, _c.POINTER(_u64), _c.c_size_t,
                                            _c.POINTER(_u64), _c.c_size_t, _c.POINTER(_u64), _c.c_size_t,
                                            _c.POINTER(_u32), _c.POINTER(_int), _errp]),
    "optstate_adam_register_params": (_int, [_vp, _c.c_size_t, _c.POINTER(_u8p), _c.POINTER(_u64),
                                             _c.POINTER(_u32), _c.POINTER(_vp), _c.POINTER(_int),
                                             _c.POINTER(_c.c_size_t), _c.POINTER(_u64), _c.POINTER(_c.c_size_t),
                                             _c.POINTER(_u64), _c.POINTER(_c.c_size_t), _c.POINTER(_u64),
                                             _c.POINTER(_u32), _c.POINTER(_int), _errp]),
    "optstate_adam_register_params_with": (_int, [_vp, _c.POINTER(RegisterArgs), _errp]),
    "optstate_adam_param_numel": (_int, [_vp, _u32, _c.POINTER(_u64), _errp]),
    "optstate_adam_step_with": (_int, [_vp, _c.POINTER(StepArgs), _errp]),
    "optstate_adam_set_grad_scale": (_int, [_vp, _c.c_float, _errp]),
    "optstate_adam_step": (_int, [_vp, _c.c_size_t, _c.POINTER(_u32), _c.POINTER(_vp), _c.POINTER(_int),
                                  _c.POINTER(_vp), _c.POINTER(_int), _vp, _c.c_float, _errp]),
    "optstate_adam_step2": (_int, [_vp, _c.c_size_t, _c.POINTER(_u32), _c.POINTER(_vp), _c.POINTER(_int),
                                   _c.POINTER(_u64), _c.POINTER(_vp), _c.POINTER(_int), _vp, _vp, _errp]),
    "optstate_adam_retire_param": (_int, [_vp, _u8p, _errp]),
    "optstate_adam_last_step_skipped": (_int, [_vp]),
    "optstate_adam_last_step_seconds": (_dbl, [_vp]),
    "optstate_adam_prefetch": (_int, [_vp, _errp]),
    "optstate_adam_last_step_prefetch": (None, [_vp, _c.POINTER(_u64), _c.POINTER(_u64)]),
    "optstate_adam_load_main": (_int, [_vp, _u32, _vp, _int, _errp]),
    "optstate_adam_make_durable": (_int, [_vp, _c.POINTER(_u64), _errp]),
    "optstate_adam_commit": (_int, [_vp, _c.POINTER(_u64), _errp]),
    "optstate_adam_step_count": (_u64, [_vp, _u32]),
    "optstate_adam_param_step_count": (_int, [_vp, _u8p, _c.POINTER(_u64), _errp]),
    "optstate_adam_last_generation": (_u64, [_vp]),
    "optstate_adam_global_step": (_u64, [_vp]),
    "optstate_adam_set_global_step": (None, [_vp, _u64]),
    "optstate_adam_uncommitted_steps": (_u64, [_vp]),
}


def _candidates():
    env = os.environ.get("OPTSTATE_LIB")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    found = [os.path.join(here, "liboptstate.so")]
    repo = os.path.dirname(os.path.dirname(here))  # <repo>/python/optstate -> <repo>
    found += sorted(glob.glob(os.path.join(repo, "build", "*", "capi", "liboptstate.so")))
    found.append("liboptstate.so.%d" % _SONAME_VERSION)
    return found


def _load():
    tried = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(path + " (missing)")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
            continue
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise errors.FailedPrecondition(
                    "liboptstate at %s has no %s: it is older than this package (%s); use the library "
                    "built from the same source tree" % (path, name, os.path.dirname(os.path.abspath(__file__))))
            fn.restype = restype
            fn.argtypes = argtypes
        abi = lib.optstate_abi_version()
        if abi < ABI_VERSION:
            raise errors.FailedPrecondition(
                "liboptstate at %s has C ABI version %d, this package needs %d or later" % (path, abi, ABI_VERSION))
        lib.path = path
        return lib
    raise errors.NotFound("liboptstate.so not found; set OPTSTATE_LIB to its path. Tried: " + "; ".join(tried))


lib = _load()


def set_log_level(level):
    """Sets the level of liboptstate's log (stderr, process-wide): "trace", "debug", "info", "warn",
    "error" or "off". Imported from Python the library logs warnings and errors only, unless the
    environment variable OPTSTATE_LOG_LEVEL sets the level."""
    call(lib.optstate_set_log_level, str(level).encode())


def call(fn, *args):
    """Calls a C ABI function that ends in char** errptr; raises optstate.Error on failure."""
    err = ctypes.c_void_p()
    code = fn(*args, ctypes.byref(err))
    if code != 0:
        message = ""
        if err.value:
            message = ctypes.string_at(err.value).decode("utf-8", "replace")
            lib.optstate_free(err)
        raise errors.from_code(code, message)


# A library inside a training script speaks up only when something is wrong: its [info] lines (a
# store opened, a step's timings) are for the command-line tools and for whoever asks for them.
if "OPTSTATE_LOG_LEVEL" not in os.environ:
    set_log_level("warn")
