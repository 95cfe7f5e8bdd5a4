"""accelerate: optimizer state in Accelerator.save_state()'s directory.

    accelerator = Accelerator(project_config=ProjectConfiguration(..., total_limit=2))
    model, opt = accelerator.prepare(model, opt)
    optstate.integrations.accelerate.install(accelerator)
    accelerator.save_state(dir)      # dir/optstate/<store>/ carries the state
    accelerator.load_state(dir)      # any kept state, or a copy of it on a fresh store path

install() registers a save_state pre-hook (each prepared optstate optimizer's state into
<dir>/optstate/, the snapshot held by <dir>, snapshots of deleted states released) and a load_state
pre-hook (arms optstate.checkpoint.resume_from(<dir>/optstate) for the optimizers' load).

The files are manifest.json and tensors/<tensor>/<field>, the state once (the manifest says
"state_safetensors": false); install(accelerator, safetensors=True) adds state.safetensors, the same
bytes again. A saved state loads either way."""
import os

from .. import checkpoint
from . import STATE_DIR, optstate_optimizers

__all__ = ["install"]


def install(accelerator, safetensors=False):
    """Registers the hooks on accelerator; returns their handles (save, load). safetensors: also write
    state.safetensors (optstate.checkpoint.save_into's)."""

    def save_pre(models, weights, output_dir):
        for opt in optstate_optimizers(accelerator._optimizers):
            checkpoint.save_into(opt, os.path.join(output_dir, STATE_DIR), holder=output_dir,
                                 safetensors=safetensors)

    def load_pre(models, input_dir):
        checkpoint.resume_from(os.path.join(input_dir, STATE_DIR))

    return (accelerator.register_save_state_pre_hook(save_pre),
            accelerator.register_load_state_pre_hook(load_pre))
