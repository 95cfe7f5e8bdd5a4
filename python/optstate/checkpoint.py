"""Checkpoint directories: save an optimizer's committed state to a directory and load it back.

    optstate.checkpoint.save(opt, "/ckpt/step1000/rank0")   # after opt.step()
    optstate.checkpoint.load(opt, "/ckpt/step1000/rank0")   # resume from it

A checkpoint directory is what the mount shows for a snapshot
(<mount>/<store>/snapshots/<name>/: manifest.json, state.safetensors,
tensors/<tensor>/{main,exp_avg,exp_avg_sq}), byte for byte, so `cp -r` from the
mount, save() and optstate-restore are interchangeable. The library copies
the bytes (verifying every chunk's checksum); they never pass through Python.

`opt` is an optstate.torch.AdamW or an optstate.Store (no torch needed).
"""
import os

from . import errors
from .core import Store

__all__ = ["save", "load"]


def save(opt, dest, name=None):
    """Commits what is pending and writes the newest committed generation to the directory dest
    (which must not exist, or be empty; its parent must exist). dest appears only when complete.

    name: also keep that generation as the store's snapshot `name` (visible in the mount under
    snapshots/<name>/); without it the generation is held by a reader lease while it is copied and
    nothing is left behind in the store. Returns the generation written."""
    dest = os.fspath(dest)
    if isinstance(opt, Store):
        store = opt
    else:
        _optimizer(opt, "save").commit()
        store = opt.store
    if name is not None:
        store.snapshot(name)
    return store.export_checkpoint(dest, snapshot=name)


def load(opt, src):
    """Restores the checkpoint directory src into opt's store as a new committed generation (every
    chunk verified against the manifest; a checkpoint of another layout or a damaged one raises an
    optstate.Error naming the tensor, field, file or chunk, and the store keeps its state). An
    optstate.torch.AdamW then resumes from it: its params take the restored fp32 mains, and step
    counts and hyperparameters are the checkpoint's. A Store must have no optimizer open on it.
    Returns the new generation."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise errors.NotFound("optstate.checkpoint.load: %s is not a directory" % src)
    if isinstance(opt, Store):
        return opt.restore_checkpoint(src)
    return _optimizer(opt, "load")._load_checkpoint(src)


def _optimizer(opt, what):
    if not hasattr(opt, "_load_checkpoint"):
        raise errors.InvalidArgument("optstate.checkpoint.%s: %r is neither an optstate.torch.AdamW nor an "
                                     "optstate.Store" % (what, type(opt).__name__))
    return opt
