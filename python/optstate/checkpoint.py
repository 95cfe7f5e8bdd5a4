"""Checkpoint directories: save an optimizer's committed state to a directory and load it back.

    optstate.checkpoint.save(opt, "/ckpt/step1000/rank0")   # after opt.step()
    optstate.checkpoint.load(opt, "/ckpt/step1000/rank0")   # resume from it

A checkpoint directory is what the mount shows for a snapshot
(<mount>/<store>/snapshots/<name>/: manifest.json, state.safetensors,
tensors/<tensor>/{main,exp_avg,exp_avg_sq}), byte for byte, so `cp -r` from the
mount, save() and optstate-restore are interchangeable. state.safetensors holds
the field files' bytes again: save(..., safetensors=False) writes the state once. The library copies
the bytes (verifying every chunk's checksum); they never pass through Python.

`opt` is an optstate.torch optimizer (AdamW, Lion, SGD) or an optstate.Store (no torch needed).

Resuming on another number of ranks (docs/RESHARD.md):

    layout = optstate.checkpoint.reshard_layout(old_rank_dirs, ranks=3, split="rows")
    optstate.reshard(old_rank_dirs, "/ckpt/step1000-3ranks", layout)
    # rank r then loads "/ckpt/step1000-3ranks/rank-0000r"
"""
import contextlib
import ctypes
import errno
import json
import os
import re
import shutil

from . import errors
from ._lib import RESHARD_NO_SAFETENSORS, ReshardArgs, call, lib
from .core import Store, StreamedAdam

__all__ = ["save", "load", "reshard", "reshard_layout", "global_shapes", "rank_dir", "save_into", "resume_from",
           "hold", "release_deleted", "held_snapshots", "pin_state_dict_snapshot"]


def save(opt, dest, name=None, safetensors=True):
    """Commits what is pending and writes the newest committed generation to the directory dest
    (which must not exist, or be empty; missing parent directories are created). dest appears only
    when complete.

    name: also keep that generation as the store's snapshot `name` (visible in the mount under
    snapshots/<name>/); without it the generation is held by a reader lease while it is copied and
    nothing is left behind in the store. If the save fails, the snapshot it made is released again
    (a retry with the same name works). Returns the generation written.

    An optimizer's save writes the chunks of that generation that its host cache tier holds from RAM
    (each checked against the generation's checksum) and reads only the rest from the disk;
    opt.last_checkpoint_export then counts them (ram_chunks, disk_chunks, ...).

    safetensors: write state.safetensors too (the default: the mount's layout, byte for byte). It
    holds every field file's bytes again, so the checkpoint is twice the state, twice the bytes to
    write; safetensors=False writes manifest.json and tensors/<tensor>/<field> only, which load()
    restores the same way (every chunk checked against the manifest)."""
    dest = os.fspath(dest)
    if isinstance(opt, Store):
        store = opt
    else:
        _optimizer(opt, "save").commit()
        store = opt.store
    export = _exporter(opt, store)
    parent = os.path.dirname(os.path.abspath(dest))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        cls = errors.NoSpace if e.errno == errno.ENOSPC else errors.IoError
        raise cls("optstate.checkpoint.save: cannot create the parent directory %s of %s: %s"
                  % (parent, dest, e.strerror or e)) from e
    if name is None:
        return export(dest, safetensors=safetensors)
    store.snapshot(name)
    try:
        return export(dest, snapshot=name, safetensors=safetensors)
    except BaseException:
        try:
            store.release_snapshot(name)
        except errors.Error:
            pass  # the export's error is the one to report
        raise


def load(opt, src, force=False):
    """Restores the checkpoint directory src into opt's store as a new committed generation (every
    chunk verified against the manifest; a checkpoint of another layout or a damaged one raises an
    optstate.Error naming the tensor, field, file or chunk, and the store keeps its state). An
    optstate.torch.AdamW then resumes from it: its params take the restored fp32 mains, and step
    counts and hyperparameters are the checkpoint's. A Store must have no optimizer open on it.

    A checkpoint of another store into a store that has taken steps raises optstate.FailedPrecondition
    (it would replace that store's training state) unless force=True. Whenever the store has taken
    steps, the generation the load replaces is kept as a snapshot "pre-restore-<generation>-<ms>"
    first (its name: opt.store.last_restore_snapshot; release it when no longer needed).
    Returns the new generation."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise errors.NotFound("optstate.checkpoint.load: %s is not a directory" % src)
    if isinstance(opt, Store):
        return opt.restore_checkpoint(src, force=force)
    return _optimizer(opt, "load")._load_checkpoint(src, force=force)


def _exporter(opt, store):
    """The export that save() and save_into() run: an optimizer's takes the chunks its host cache tier
    holds from RAM (only the rest is read from the disk) and leaves what it did in
    opt.last_checkpoint_export (see optstate.StreamedAdam.export_checkpoint); a Store's reads every
    chunk from the disk. Returns the generation written."""
    if isinstance(opt, StreamedAdam):
        adam_of = lambda: opt  # noqa: E731
    elif hasattr(opt, "_live") and not isinstance(opt, Store):
        adam_of = opt._live  # an optstate.torch optimizer: its StreamedAdam, or FailedPrecondition once closed
    else:
        return store.export_checkpoint

    def export(dest, snapshot=None, safetensors=True):
        done = adam_of().export_checkpoint(dest, snapshot=snapshot, safetensors=safetensors)
        opt.last_checkpoint_export = done
        return done["generation"]
    return export


def _optimizer(opt, what):
    if not hasattr(opt, "_load_checkpoint"):
        raise errors.InvalidArgument("optstate.checkpoint.%s: %r is neither an optstate.torch optimizer (AdamW, Lion, "
                                     "SGD) nor an optstate.Store" % (what, type(opt).__name__))
    return opt


def _sources(sources, what):
    if isinstance(sources, (str, bytes, os.PathLike)):
        raise errors.InvalidArgument("optstate.%s: sources is one path; give a list of the ranks' checkpoint "
                                     "directories" % what)
    paths = [os.fsencode(os.fspath(s)) for s in sources]
    return (ctypes.c_char_p * len(paths))(*paths), len(paths)


def reshard_layout(sources, ranks, split="rows"):
    """A target layout (a dict, the JSON schema of docs/RESHARD.md) that places every tensor of the
    checkpoints `sources` on `ranks` ranks, by `split`:

      - a rule string, "[PATTERN=]KIND": KIND "rows" (dimension 0), "columns" (the last dimension;
        1-D tensors along dimension 0), "dimN" or "flat" (even flat ranges of the row-major
        flattening), each tensor split evenly; several rules separated by commas, the first whose
        glob PATTERN (fnmatch: "*" matches "/" too) matches a tensor's name wins;
      - a dict {pattern: kind} (an int N means "dimN"), first match wins in the dict's order, e.g.
        {"*.qkv.weight": 0, "*.proj.weight": 1, "*": "rows"};
      - a callable(name, global_shape, rank, ranks) returning rank's part of that tensor: None (no
        part), {"offset": [...], "shape": [...]} or (offset, shape) for a box, {"flat": [begin, end]}
        or range(begin, end) for a flat range.
    A tensor no rule matches, or a pattern that matches no tensor, raises optstate.InvalidArgument.
    "replicate" is not a layout: every element's optimizer state is owned by exactly one rank."""
    if callable(split):
        return _layout_from_callable(sources, int(ranks), split)
    if isinstance(split, dict):
        rules = []
        for pattern, kind in split.items():
            kind = "dim%d" % kind if isinstance(kind, int) and not isinstance(kind, bool) else str(kind)
            if "," in pattern or "\n" in pattern:
                raise errors.InvalidArgument("optstate.checkpoint.reshard_layout: pattern %r holds a comma or a "
                                             "newline (they separate rules)" % pattern)
            rules.append("%s=%s" % (pattern, kind))
        split = "\n".join(rules)
    arr, n = _sources(sources, "checkpoint.reshard_layout")
    out = ctypes.c_void_p()
    call(lib.optstate_checkpoint_reshard_layout, arr, n, int(ranks), str(split).encode(), ctypes.byref(out))
    try:
        return json.loads(ctypes.string_at(out.value).decode("utf-8"))
    finally:
        lib.optstate_free(out)


def global_shapes(sources):
    """{tensor name: global shape (a tuple)} of the checkpoints `sources` (their manifests, checked as
    optstate.reshard checks them)."""
    whole = reshard_layout(sources, 1, "rows")
    return {name: tuple(box["shape"]) for name, box in whole["ranks"][0]["tensors"].items()}


def _layout_from_callable(sources, ranks, fn):
    shapes = global_shapes(sources)
    out = []
    for r in range(ranks):
        tensors = {}
        for name, shape in shapes.items():
            part = fn(name, shape, r, ranks)
            if part is None:
                continue
            if isinstance(part, range):
                if part.step != 1:
                    raise errors.InvalidArgument("optstate.checkpoint.reshard_layout: rank %d of tensor %s: a "
                                                 "flat range has step 1, not %d" % (r, name, part.step))
                part = {"flat": [part.start, part.stop]}
            elif isinstance(part, tuple) and len(part) == 2:
                part = {"offset": [int(x) for x in part[0]], "shape": [int(x) for x in part[1]]}
            elif not isinstance(part, dict):
                raise errors.InvalidArgument("optstate.checkpoint.reshard_layout: rank %d of tensor %s: the split "
                                             "callable returned %r; expected None, (offset, shape), a dict or a "
                                             "range" % (r, name, part))
            tensors[name] = part
        out.append({"rank": r, "tensors": tensors})
    # The C++ side checks the tiling when the layout is used (optstate.reshard).
    return {"format": "optstate-reshard-layout", "format_version": 1, "ranks": out}


def reshard(sources, dest, layout, safetensors=True):
    """Reshards the checkpoint directories `sources` (one per old rank, any order) into one checkpoint
    per rank of `layout` (a dict as reshard_layout returns, a JSON string, or a path to a JSON file),
    written as dest/rank-00000, ... all at once or not at all; each loads with load() or
    optstate-restore. Refuses (optstate.InvalidArgument, nothing written) sources that do not tile
    every tensor exactly once or disagree on step or hyperparameters, and layouts that do not tile;
    a damaged source chunk raises optstate.Corruption. Returns the number of ranks written.

    safetensors: as save()'s: write each rank's state.safetensors too (the default); False writes
    manifest.json (marked "state_safetensors": false) and the field files only, the state once."""
    if isinstance(layout, dict):
        text = json.dumps(layout)
    elif isinstance(layout, (str, os.PathLike)) and os.path.isfile(os.fspath(layout)):
        with open(os.fspath(layout)) as f:
            text = f.read()
    else:
        text = layout
    arr, n = _sources(sources, "reshard")
    ranks = ctypes.c_uint32()
    args = ReshardArgs(flags=0 if safetensors else RESHARD_NO_SAFETENSORS)
    call(lib.optstate_checkpoint_reshard_with, arr, n, text.encode("utf-8"), os.fsencode(os.fspath(dest)),
         ctypes.byref(args), ctypes.byref(ranks))
    return ranks.value


def rank_dir(dest, rank):
    """The checkpoint directory of `rank` under a reshard's dest."""
    return os.path.join(os.fspath(dest), "rank-%05d" % rank)


# ---- checkpoints a trainer keeps ------------------------------------------------------------------
#
# A trainer saves opt.state_dict() in its checkpoint and calls load_state_dict() on resume. The
# state_dict names an O(1) snapshot of the state it describes (optstate.torch.AdamW.state_dict), so
# every checkpoint the trainer keeps resumes on the node that wrote it. Three pieces make the rest
# work, and each framework's adapter (optstate.integrations) only calls them at its extension points:
#
#   save_into(opt, root, holder)   the snapshot's files into root/<store name>/ (a checkpoint
#                                  directory copied to another node carries the state), and the
#                                  snapshot recorded as held by `holder` (the checkpoint directory
#                                  or file the trainer keeps);
#   release_deleted(opt)           releases each snapshot whose holders are all gone (the trainer
#                                  deleted those checkpoints: save_total_limit, save_top_k), so disk
#                                  use stays bounded; save_into runs it at every save;
#   resume_from(root)              where load_state_dict looks for the files when the store lacks
#                                  the snapshot (a fresh store, another node).
#
# The holders are recorded in <store>/checkpoint-holders.json (name -> list of holder paths),
# replaced atomically (write, fsync, rename, fsync of the directory).

HOLDERS_FILE = "checkpoint-holders.json"
_resume_roots = []  # armed by resume_from, newest last


def _store_of(opt):
    return opt if isinstance(opt, Store) else opt.store


def _holders_path(store):
    return os.path.join(store.path, HOLDERS_FILE)


def held_snapshots(opt):
    """{snapshot name: [holder paths]} of opt's store (opt: an optimizer or an optstate.Store)."""
    path = _holders_path(_store_of(opt))
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise errors.Corruption("optstate.checkpoint: %s is unreadable (%s); remove it to forget which "
                                "checkpoints hold which snapshots (those snapshots then stay until released "
                                "by hand)" % (path, e)) from e
    return {k: list(v) for k, v in data.get("snapshots", {}).items()}


def _write_holders(store, held):
    path = _holders_path(store)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"format": 1, "snapshots": held}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _add_holder(held, snapshot, holder):
    """Adds holder to held[snapshot]; True when that changed held."""
    holder = os.path.abspath(os.fspath(holder))
    holders = held.setdefault(snapshot, [])
    if holder in holders:
        return False
    holders.append(holder)
    return True


def hold(opt, snapshot, holder):
    """Records that the checkpoint `holder` (a directory or file path) holds snapshot `snapshot` of
    opt's store: release_deleted keeps the snapshot while any of its holders exists."""
    store = _store_of(opt)
    held = held_snapshots(store)
    if _add_holder(held, snapshot, holder):
        _write_holders(store, held)


def release_deleted(opt):
    """Releases every snapshot recorded by hold() whose holders no longer exist, and forgets holders
    that are gone; returns the names released. A snapshot that is held but no longer in the store is
    forgotten. Snapshots that optimizer.state_dict() made ("state-dict-<generation>") and no checkpoint
    holds are released too when older than the newest held one: where checkpoints hold their
    state_dicts' snapshots, the others were a framework's own round trips (accelerate's device
    placement calls state_dict() and load_state_dict() at prepare)."""
    store = _store_of(opt)
    return _release_deleted(store, held_snapshots(store), changed=False)


def _release_deleted(store, held, changed):
    """release_deleted over the holders `held` (changed: held differs from the file already); the
    holders file is written once, if anything changed."""
    if not held:
        if changed:
            _write_holders(store, held)
        return []
    existing = dict(store.snapshots())
    released = []
    newest_held = max((existing[n] for n in held if n in existing), default=0)
    for name, gen in existing.items():
        if name not in held and name.startswith("state-dict-") and gen < newest_held:
            store.release_snapshot(name)
            released.append(name)
    for name in list(held):
        alive = [h for h in held[name] if os.path.exists(h)]
        if alive == held[name] and name in existing:
            continue
        changed = True
        if alive and name in existing:
            held[name] = alive
            continue
        del held[name]
        if name in existing:
            store.release_snapshot(name)
            released.append(name)
    if changed:
        _write_holders(store, held)
    return released


_STATE_DICT_SNAPSHOT = re.compile(r"^state-dict-(\d+)$")


def pin_state_dict_snapshot(store, gen, keep):
    """Snapshot "state-dict-<gen>" of store's committed generation gen (made if missing), the one a
    state_dict() names; of the older state_dict() snapshots that no checkpoint holds (hold), the newest
    keep - 1 stay and the others are released, so a trainer that calls state_dict() every step holds
    a bounded number. Returns the snapshot's name."""
    name = "state-dict-%d" % gen
    snaps = dict(store.snapshots())
    if name not in snaps:
        snaps[name] = store.snapshot(name)
    held = held_snapshots(store)
    free = sorted((g, n) for n, g in snaps.items() if _STATE_DICT_SNAPSHOT.match(n) and n not in held and n != name)
    for _, n in free[:max(0, len(free) - max(0, int(keep) - 1))]:
        store.release_snapshot(n)
    return name


def files_dir(root, store_name):
    """Where save_into puts a store's files under root."""
    return os.path.join(os.fspath(root), store_name)


def save_into(opt, root, holder=None, state_dict=None, dest=None, safetensors=True):
    """Writes the state that opt.state_dict() (or the given state_dict of opt) describes into
    root/<store name>/ (or `dest`: a checkpoint directory as save() writes it), records its snapshot
    as held by `holder` (default: root) and releases the snapshots of checkpoints deleted since
    (release_deleted). Nothing is written when that directory already holds that generation of the
    store. Returns the directory written. opt: an optimizer, or the optstate.Store whose snapshot
    `state_dict` ({"optstate": {store_name, store_uuid, generation, snapshot}}) names.
    safetensors: as save()'s (False: no state.safetensors, the state written once)."""
    sd = state_dict if state_dict is not None else opt.state_dict()
    meta = sd["optstate"]
    store = _store_of(opt)
    dest = os.fspath(dest) if dest is not None else files_dir(root, meta["store_name"])
    if _manifest_matches(dest, meta) is None:
        if os.path.lexists(dest):
            shutil.rmtree(dest) if os.path.isdir(dest) and not os.path.islink(dest) else os.unlink(dest)
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        _exporter(opt, store)(dest, snapshot=meta["snapshot"], safetensors=safetensors)
    held = held_snapshots(store)
    changed = _add_holder(held, meta["snapshot"], holder if holder is not None else root)
    _release_deleted(store, held, changed)  # one write of the holders file for both
    return dest


def _manifest_matches(dest, meta):
    """dest when it holds the checkpoint of meta's store and generation, else None."""
    try:
        with open(os.path.join(dest, "manifest.json")) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    store = m.get("store") if isinstance(m.get("store"), dict) else {}
    if store.get("uuid") == meta.get("store_uuid") and m.get("generation") == meta.get("generation"):
        return dest
    return None


class resume_from:
    """Arms load_state_dict to look in root/<store name>/ (as save_into wrote it) for the state a
    state_dict describes when the optimizer's store lacks its snapshot (a checkpoint directory copied to
    another node or a fresh store path). As a context manager it is armed inside the block; called
    plainly it stays armed for this process (the latest roots are searched first)."""

    def __init__(self, *roots):
        self._roots = [os.fspath(r) for r in roots]
        _resume_roots.extend(self._roots)
        del _resume_roots[:-16]  # a long run arms one per resume: keep the latest

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for r in self._roots:
            with contextlib.suppress(ValueError):
                _resume_roots.remove(r)


def _find_files(meta):
    """The newest armed root's files of meta's store and generation, or None."""
    for root in reversed(_resume_roots):
        found = _manifest_matches(files_dir(root, meta.get("store_name", "")), meta)
        if found:
            return found
    return None
