"""Lightning: optimizer state beside each checkpoint file.

    trainer = Trainer(callbacks=[ModelCheckpoint(...), optstate.integrations.lightning.OptstateCheckpoints()])
    trainer.fit(model)                       # <file>.ckpt and <file>.ckpt.optstate/<store>/
    trainer.fit(model, ckpt_path=".../epoch=0-step=10.ckpt")   # any kept checkpoint, or a copy of both

OptstateCheckpoints wraps the strategy's CheckpointIO at setup: each saved checkpoint's optstate
optimizers put their state's files into <file>.optstate/ (the snapshot held by the file); a checkpoint
removed (save_top_k) takes its .optstate/ along and releases its snapshot; loading a checkpoint arms
optstate.checkpoint.resume_from(<file>.optstate) so that a copy on another node or store path resumes
from the files when the store lacks the snapshot. Both the .ckpt file and its .optstate directory are
the checkpoint: copy them together.

The files are manifest.json and tensors/<tensor>/<field>, the state once (the manifest says
"state_safetensors": false); OptstateCheckpoints(safetensors=True) adds state.safetensors, the same
bytes again. A checkpoint resumes either way."""
import os
import shutil

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

from .. import checkpoint
from . import optstate_optimizers

__all__ = ["OptstateCheckpoints", "SUFFIX"]

SUFFIX = ".optstate"


class _OptstateCheckpointIO(CheckpointIO):
    def __init__(self, inner, trainer, safetensors=False):
        self.inner, self._trainer, self.safetensors = inner, trainer, safetensors

    def _optimizers(self):
        return optstate_optimizers(self._trainer.optimizers)

    def save_checkpoint(self, ckpt, path, storage_options=None):
        self.inner.save_checkpoint(ckpt, path, storage_options=storage_options)
        path = os.fspath(path)
        states = ckpt.get("optimizer_states", [])
        for i, opt in enumerate(self._trainer.optimizers):
            if not optstate_optimizers(opt):
                continue
            sd = states[i] if i < len(states) and isinstance(states[i], dict) and "optstate" in states[i] else None
            checkpoint.save_into(optstate_optimizers(opt)[0], path + SUFFIX, holder=path, state_dict=sd,
                                 safetensors=self.safetensors)

    def load_checkpoint(self, path, *args, **kwargs):
        checkpoint.resume_from(os.fspath(path) + SUFFIX)
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path):
        self.inner.remove_checkpoint(path)
        shutil.rmtree(os.fspath(path) + SUFFIX, ignore_errors=True)
        for opt in self._optimizers():
            checkpoint.release_deleted(opt)

    def teardown(self):
        self.inner.teardown()


class OptstateCheckpoints(Callback):
    """Puts optstate optimizers' state beside each checkpoint file the Trainer saves (see the module).
    safetensors: also write state.safetensors (optstate.checkpoint.save_into's)."""

    def __init__(self, safetensors=False):
        super().__init__()
        self.safetensors = bool(safetensors)

    def setup(self, trainer, pl_module, stage):
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, _OptstateCheckpointIO):
            strategy.checkpoint_io = _OptstateCheckpointIO(strategy.checkpoint_io, trainer, self.safetensors)
        else:
            strategy.checkpoint_io.safetensors = self.safetensors
