"""Adapters that plug optstate's optimizers into trainer frameworks' own checkpoints.

Each is a thin layer over one design (optstate.checkpoint, "checkpoints a trainer keeps"):

  - optimizer.state_dict() names an O(1) snapshot of the state it describes, so a trainer's
    optimizer.pt (or Lightning checkpoint, or accelerate state) of any step it kept resumes:
    load_state_dict() makes that snapshot the store's head again;
  - at each save the adapter writes the snapshot's files into the framework's checkpoint
    (<checkpoint>/optstate/<store name>/, or <file>.optstate/<store name>/ beside a Lightning
    checkpoint file) and records the snapshot as held by that checkpoint;
  - checkpoints the framework deletes (save_total_limit, save_top_k, total_limit) release their
    snapshots at the next save (optstate.checkpoint.release_deleted): disk use stays bounded;
  - on resume the adapter arms optstate.checkpoint.resume_from(<checkpoint>/optstate), so a
    checkpoint copied to another node or a fresh store path restores from its files when the store
    lacks the snapshot.

    optstate.integrations.transformers.install(trainer)          # Hugging Face Trainer
    optstate.integrations.accelerate.install(accelerator)        # accelerate save_state/load_state
    Trainer(callbacks=[optstate.integrations.lightning.OptstateCheckpoints()])   # Lightning

torch.distributed.checkpoint (FSDP2) has its Stateful in optstate.integrations.dcp.

docs/PYTHON.md has a section per framework.
"""

__all__ = ["optstate_optimizers", "STATE_DIR"]

# The subdirectory of a framework's checkpoint directory that holds the optimizers' files.
STATE_DIR = "optstate"


def _is_optstate(opt):
    return hasattr(opt, "_load_checkpoint") and hasattr(opt, "state_dict_snapshots")


def optstate_optimizers(*optimizers):
    """The optstate optimizers among `optimizers` (each may be wrapped by a framework: accelerate's
    AcceleratedOptimizer, Lightning's LightningOptimizer, a list of them), each once."""
    out, seen = [], set()

    def visit(o, depth=0):
        if o is None or depth > 8:
            return
        if isinstance(o, (list, tuple)):
            for x in o:
                visit(x, depth + 1)
            return
        if _is_optstate(o):
            if id(o) not in seen:
                seen.add(id(o))
                out.append(o)
            return
        for attr in ("optimizer", "_optimizer"):
            inner = getattr(o, attr, None)
            if inner is not None and inner is not o:
                visit(inner, depth + 1)
                return

    visit(list(optimizers))
    return out
