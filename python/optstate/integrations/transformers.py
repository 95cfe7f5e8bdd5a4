"""Hugging Face Trainer: optimizer state in the Trainer's own checkpoints.

    trainer = Trainer(model=model, args=args, optimizers=(opt, None), ...)   # or optimizer_cls_and_kwargs
    optstate.integrations.transformers.install(trainer)
    trainer.train()                                       # checkpoint-N/ carry optstate/<store>/
    trainer.train(resume_from_checkpoint=".../checkpoint-10")   # any kept checkpoint, or a copy of it

install() adds OptstateCallback (on_save: the state's files into <checkpoint>/optstate/, the
snapshot held by the checkpoint, snapshots of checkpoints that save_total_limit deleted released) and
makes the Trainer's optimizer load look in <checkpoint>/optstate/ when the store lacks the snapshot
the checkpoint's optimizer.pt names (a copied checkpoint, a fresh store path). OptstateCallback alone
(callbacks=[...]) does the saving and releasing; resuming a copied checkpoint then needs
optstate.checkpoint.resume_from(<checkpoint>/optstate) before trainer.train(...)."""
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .. import checkpoint
from . import STATE_DIR, optstate_optimizers

__all__ = ["OptstateCallback", "install"]


class OptstateCallback(TrainerCallback):
    """Writes each optstate optimizer's state into the checkpoint the Trainer just saved."""

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
            checkpoint.save_into(opt, os.path.join(ckpt, STATE_DIR), holder=ckpt)


def install(trainer):
    """Adds OptstateCallback to trainer and arms optstate.checkpoint.resume_from(<checkpoint>/optstate)
    around the Trainer's optimizer load on resume. Returns trainer."""
    if not any(isinstance(cb, OptstateCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(OptstateCallback())
    load = trainer._load_optimizer_and_scheduler
    if getattr(load, "_optstate_armed", False):
        return trainer

    def load_optimizer_and_scheduler(ckpt, *args, **kwargs):
        if ckpt is None:
            return load(ckpt, *args, **kwargs)
        with checkpoint.resume_from(os.path.join(ckpt, STATE_DIR)):
            return load(ckpt, *args, **kwargs)

    load_optimizer_and_scheduler._optstate_armed = True
    trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
    return trainer
