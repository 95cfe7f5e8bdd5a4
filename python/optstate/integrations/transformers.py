"""Hugging Face Trainer: optimizer state in the Trainer's own checkpoints.

    trainer = Trainer(model=model, args=args, optimizers=(opt, None), ...)   # or optimizer_cls_and_kwargs
    optstate.integrations.transformers.install(trainer)
    trainer.train()                                       # checkpoint-N/ carry optstate/<store>/
    trainer.train(resume_from_checkpoint=".../checkpoint-10")   # any kept checkpoint, or a copy of it
    trainer.train(resume_from_checkpoint=True)            # the last checkpoint in args.output_dir

install() adds OptstateCallback (on_save: the state's files into <checkpoint>/optstate/, the
snapshot held by the checkpoint, snapshots of checkpoints that save_total_limit deleted released) and
wraps trainer.train so that, while it resumes from a checkpoint, the optimizer's load_state_dict looks
in <checkpoint>/optstate/ when the store lacks the snapshot the checkpoint's optimizer.pt names (a
copied checkpoint, a fresh store path). Only the Trainer's public surface is used: TrainerCallback's
on_save and train()'s resume_from_checkpoint argument, resolved as train() resolves it.
OptstateCallback alone (callbacks=[...]) does the saving and releasing; resuming a copied checkpoint
then needs optstate.checkpoint.resume_from(<checkpoint>/optstate) before trainer.train(...).

The files are manifest.json and tensors/<tensor>/<field>, the state once (a checkpoint's
manifest says "state_safetensors": false); install(trainer, safetensors=True) (or
OptstateCallback(safetensors=True)) adds state.safetensors, the same bytes again, for tools that
read safetensors. A checkpoint resumes either way."""
import functools
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .. import checkpoint
from . import STATE_DIR, optstate_optimizers

__all__ = ["OptstateCallback", "install", "resume_checkpoint"]


class OptstateCallback(TrainerCallback):
    """Writes each optstate optimizer's state into the checkpoint the Trainer just saved.
    safetensors: also write state.safetensors (optstate.checkpoint.save_into's)."""

    def __init__(self, safetensors=False):
        self.safetensors = bool(safetensors)

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        opts = optstate_optimizers(optimizer)
        if not opts:
            return
        ckpt = os.path.join(args.output_dir, "%s-%d" % (PREFIX_CHECKPOINT_DIR, state.global_step))
        if not os.path.isdir(ckpt):  # a trial's run directory, or a save the Trainer skipped
            for opt in opts:
                checkpoint.release_deleted(opt)
            return
        for opt in opts:
            checkpoint.save_into(opt, os.path.join(ckpt, STATE_DIR), holder=ckpt, safetensors=self.safetensors)


def resume_checkpoint(args, resume_from_checkpoint):
    """The checkpoint directory Trainer.train(resume_from_checkpoint=...) resumes from: None for None or
    False, the last checkpoint-N of args.output_dir for True (None when there is none: train() then
    raises its own error), else the path given."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        out = args.output_dir
        return get_last_checkpoint(out) if out and os.path.isdir(out) else None
    return os.fspath(resume_from_checkpoint)


def install(trainer, safetensors=False):
    """Adds OptstateCallback(safetensors) to trainer and wraps trainer.train so that a resume arms
    optstate.checkpoint.resume_from(<checkpoint>/optstate) for the optimizer's load. Returns trainer.
    Installed again, the callback takes the new safetensors."""
    installed = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, OptstateCallback)]
    for cb in installed:
        cb.safetensors = bool(safetensors)
    if not installed:
        trainer.add_callback(OptstateCallback(safetensors))
    train = trainer.train
    if getattr(train, "_optstate_armed", False):
        return trainer

    @functools.wraps(train)
    def train_armed(resume_from_checkpoint=None, *args, **kwargs):
        ckpt = resume_checkpoint(trainer.args, resume_from_checkpoint)
        if ckpt is None:
            return train(resume_from_checkpoint, *args, **kwargs)
        with checkpoint.resume_from(os.path.join(ckpt, STATE_DIR)):
            return train(resume_from_checkpoint, *args, **kwargs)

    train_armed._optstate_armed = True
    trainer.train = train_armed
    return trainer
