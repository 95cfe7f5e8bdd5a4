"""optstate's state in torch.distributed.checkpoint (DCP) checkpoints.

    import torch.distributed.checkpoint as dcp
    from optstate.integrations.dcp import OptstateState

    dcp.save({"model": model.state_dict(), "optim": OptstateState(opt, ckpt_dir)}, checkpoint_id=ckpt_dir)
    ...
    dcp.load({"model": model.state_dict(), "optim": OptstateState(opt, ckpt_dir)}, checkpoint_id=ckpt_dir)

OptstateState is a DCP Stateful. When DCP saves it, each rank writes its optimizer's committed state
as an optstate checkpoint directory (optstate.checkpoint.save: the library copies the store's chunks,
checksummed, reflinked where the filesystem allows; nothing passes through Python or RAM) to
<ckpt_dir>/optstate/rank-<rank> (manifest.json and the field files, the state once; with
OptstateState(..., safetensors=True) state.safetensors too, the same bytes again), and DCP's own files carry a small record of the saving job (its
world size). When DCP loads it, each rank restores its directory (optstate.checkpoint.load: the
params take the restored fp32 mains, step counts and hyperparameters are the checkpoint's). On
another world size (or another sharding) the ranks' directories are resharded first
(optstate.reshard, into <ckpt_dir>/optstate/reshard-<ranks>-<hash>, or reshard_dir): the target
layout is the loading optimizer's own shards (each DTensor param's placement; params given shards=),
so a 2-rank FSDP2 checkpoint resumes on 1 process, or on 4, and continues as the 2-rank run would.

Why files next to DCP's rather than tensors in DCP's state dict: DCP writes and reshards only what
state_dict() hands it in memory, which would materialise 12 bytes a param (mains and moments) in RAM
on every save, the very state optstate keeps on NVMe; and per-param step counts, the store's
generation and its hyperparameters have no DTensor form. optstate's own checkpoint directories are
written by the library from the store (no RAM copy), verified chunk by chunk on load, and resharded
exactly by optstate.reshard.

checkpoint_id must be a filesystem directory (DCP's FileSystemWriter/Reader), the same for save and
load. DCP asks a Stateful for its state_dict() on load too (the template it fills); OptstateState
writes nothing then (it tells dcp.load's call from dcp.save's by its caller; called by neither, a
directory holding a complete DCP checkpoint, its .metadata, means a load). A save over an existing
checkpoint replaces its optstate directories, as DCP replaces its own files.
"""
import hashlib
import json
import os
import shutil
import sys
import uuid

from .. import checkpoint, errors

__all__ = ["OptstateState"]

_FORMAT = "optstate-dcp"
_SUBDIR = "optstate"

try:  # DCP recognises Statefuls by their methods (a runtime-checkable Protocol); subclassing is optional.
    from torch.distributed.checkpoint.stateful import Stateful as _Base
except Exception:  # torch without distributed checkpointing
    _Base = object


def _dist():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # a torch build without distributed
        pass
    return None


class OptstateState(_Base):
    """A torch.distributed.checkpoint Stateful over an optstate.torch.AdamW (see the module doc).

    opt: the optimizer. checkpoint_id: the directory given to dcp.save / dcp.load.
    reshard_dir: where a load on another world size writes the resharded checkpoints (default: under
    checkpoint_id/optstate; must be visible to every rank); a layout resharded once is reused. They
    hold no state.safetensors: they are read only by this load.
    safetensors: the rank directories a save writes carry state.safetensors too (default False)."""

    def __init__(self, opt, checkpoint_id, reshard_dir=None, safetensors=False):
        if not hasattr(opt, "_load_checkpoint"):
            raise errors.InvalidArgument("optstate.integrations.dcp.OptstateState: %r is not an "
                                         "optstate.torch optimizer" % type(opt).__name__)
        self._opt = opt
        self._dir = os.path.abspath(os.fspath(checkpoint_id))
        self._reshard_dir = None if reshard_dir is None else os.path.abspath(os.fspath(reshard_dir))
        self._safetensors = bool(safetensors)

    @property
    def _state_root(self):
        return os.path.join(self._dir, _SUBDIR)

    def state_dict(self):
        """On save: writes this rank's state to checkpoint_id/optstate/rank-<rank> and returns the record
        DCP stores. On load (the directory holds a complete DCP checkpoint): a template of that record."""
        dist = _dist()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
        loading = _called_by_dcp_load()
        if loading is None:
            loading = os.path.exists(os.path.join(self._dir, ".metadata"))
        if loading:  # the template dcp.load fills: the keys count, not the values
            return {"format": _LoadTemplate(self._dir), "format_version": 0, "world_size": 0, "global_step": 0}
        dest = checkpoint.rank_dir(self._state_root, rank)
        if not os.path.exists(dest):
            checkpoint.save(self._opt, dest, safetensors=self._safetensors)
        else:  # a save over an earlier checkpoint: the new state replaces this rank's directory whole
            new, old = ["%s.%s-%s" % (dest, what, uuid.uuid4().hex[:8]) for what in ("new", "old")]
            checkpoint.save(self._opt, new, safetensors=self._safetensors)
            os.rename(dest, old)
            os.rename(new, dest)
            shutil.rmtree(old, ignore_errors=True)
        return {"format": _FORMAT, "format_version": 1, "world_size": world,
                "global_step": int(self._opt._live().global_step)}

    def load_state_dict(self, state_dict):
        """Restores this rank's state from the checkpoint (resharded first when the saving job had
        another world size or sharding)."""
        if state_dict.get("format") != _FORMAT:
            raise errors.InvalidArgument("optstate.integrations.dcp: the DCP checkpoint %s holds no optstate "
                                         "state under this key (format %r)" % (self._dir, state_dict.get("format")))
        if int(state_dict.get("format_version", 0)) != 1:
            raise errors.Unimplemented("optstate.integrations.dcp: checkpoint %s has format version %s; this "
                                       "version reads 1" % (self._dir, state_dict.get("format_version")))
        saved_world = int(state_dict["world_size"])
        dist = _dist()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
        sources = [checkpoint.rank_dir(self._state_root, r) for r in range(saved_world)]
        missing = [s for s in sources if not os.path.isdir(s)]
        if missing:
            raise errors.NotFound("optstate.integrations.dcp: checkpoint %s was saved by %d ranks but lacks %s"
                                  % (self._dir, saved_world, ", ".join(missing[:3])))
        layout = self._target_layout(dist, world)
        if saved_world == world and self._same_layout(sources, layout, rank):
            src = sources[rank]
        else:
            src = checkpoint.rank_dir(self._resharded(dist, rank, sources, layout), rank)
        # The checkpoint is what the caller asked to resume: it replaces the store's state even when the
        # store has taken steps of its own (the replaced generation is kept as a snapshot, see
        # optstate.checkpoint.load).
        checkpoint.load(self._opt, src, force=True)

    # ---- resharding ----

    def _target_layout(self, dist, world):
        """Every rank's shards of this job (each rank's optimizer's params' boxes, gathered)."""
        mine = {}
        for name, p in zip(self._opt._names, self._opt._plist):
            global_shape, offset = self._opt._shard_of(name, p)
            local = tuple(_local_shape(p))
            if not global_shape:  # a whole tensor
                mine[name] = {"offset": [0] * len(local), "shape": list(local)}
            elif len(offset) == 1 and len(global_shape) != 1:  # a flat range of the row-major flattening
                mine[name] = {"flat": [offset[0], offset[0] + _numel(local)]}
            else:
                mine[name] = {"offset": list(offset), "shape": list(local)}
        if dist is None:
            everyone = [mine]
        else:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
        return {"format": "optstate-reshard-layout", "format_version": 1,
                "ranks": [{"rank": r, "tensors": t} for r, t in enumerate(everyone)]}

    def _same_layout(self, sources, layout, rank):
        """Whether source `rank` holds exactly this rank's shards (then it loads as it is). Decided by every
        rank alike: any difference anywhere reshards all."""
        for r, src in enumerate(sources):
            with open(os.path.join(src, "manifest.json")) as f:
                tensors = json.load(f)["tensors"]
            have = {}
            for t in tensors:
                shape = list(t["shape"])
                offset = list(t.get("shard_offset") or [0] * len(shape))
                global_shape = list(t.get("global_shape") or shape)
                if len(offset) == 1 and len(global_shape) != 1:
                    have[t["name"]] = {"flat": [offset[0], offset[0] + _numel(shape)]}
                else:
                    have[t["name"]] = {"offset": offset, "shape": shape}
            if have != layout["ranks"][r]["tensors"]:
                return False
        return True

    def _resharded(self, dist, rank, sources, layout):
        """Rank 0 reshards the sources to the layout (once per layout); every rank waits for it and gets its
        error, if any."""
        # Named by the layout and the sources' manifests: a save over the checkpoint (new sources) never
        # reuses what an earlier load resharded.
        digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode())
        for src in sources:
            with open(os.path.join(src, "manifest.json"), "rb") as f:
                digest.update(f.read())
        tag = digest.hexdigest()[:16]
        root = self._reshard_dir or self._state_root
        dest = os.path.join(root, "reshard-%d-%s" % (len(layout["ranks"]), tag))
        failure = None
        if rank == 0 and not os.path.isdir(dest):  # reshard writes dest whole or not at all
            try:
                checkpoint.reshard(sources, dest, layout, safetensors=False)  # an input to this load only
            except errors.Error as e:
                failure = "%s: %s" % (type(e).__name__, e)
        if dist is not None:
            box = [failure]
            dist.broadcast_object_list(box, src=0)
            failure = box[0]
        if failure is not None:
            raise errors.FailedPrecondition("optstate.integrations.dcp: resharding the optstate state of checkpoint "
                                            "%s (%d ranks) to this job's %d ranks into %s failed: %s"
                                            % (self._dir, len(sources), len(layout["ranks"]), dest, failure))
        return dest


class _LoadTemplate:
    """The value dcp.load replaces. Saved (a dcp.save that was taken for a load: a directory holding a
    checkpoint and no DCP caller in sight) it refuses, rather than leave a checkpoint without state."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        raise errors.FailedPrecondition(
            "optstate.integrations.dcp: OptstateState(opt, %r).state_dict() was taken for a load (the directory "
            "holds a complete DCP checkpoint and dcp.save is not among the callers), and is being saved; call "
            "dcp.save directly, or save into a new directory" % self.path)


def _called_by_dcp_load():
    """True when dcp.load (torch.distributed.checkpoint's state_dict_loader) asks for the state dict,
    False when dcp.save (or async_save) does, None when neither is a caller."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if name.endswith("distributed/checkpoint/state_dict_loader.py"):
            return True
        if name.endswith("distributed/checkpoint/state_dict_saver.py"):
            return False
        frame = frame.f_back
    return None


def _local_shape(p):
    local = getattr(p, "_local_tensor", None)
    return (local if local is not None else p).shape


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n
