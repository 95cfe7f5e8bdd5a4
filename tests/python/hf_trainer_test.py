"""Hugging Face Trainer with optstate.torch.AdamW and
optstate.integrations.transformers: 20 steps saving every 5, resumed from an
earlier checkpoint while the store is at step 20, from a checkpoint copied to a
fresh store path, and with save_total_limit: each against the uninterrupted run,
bit for bit (fp32, CPU, a 2-layer GPT-2 from a config). The checkpoints hold the
state once (no state.safetensors) unless install(trainer, safetensors=True), and
a checkpoint with state.safetensors resumes as well."""
import os
import shutil
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate, safetensors_of  # noqa: F401  (common puts the package on the path)

try:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError:  # the oldest supported torch runs without it
    transformers = None
if transformers is not None:
    import optstate.integrations.transformers

import optstate.torch as ot

LR = 1e-3
STEPS = 20


def make_model():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (64, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@unittest.skipIf(transformers is None, "transformers is not installed")
class HfTrainerTest(TempDirTest):
    def args(self, out, **kw):
        return TrainingArguments(output_dir=out, max_steps=STEPS, save_steps=5, save_strategy="steps",
                                 per_device_train_batch_size=4, learning_rate=LR, weight_decay=0.0,
                                 logging_steps=100, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                                 disable_tqdm=True, **kw)

    def trainer(self, mode, store, out, install_kw=None, **kw):
        """A Trainer whose optimizer is optstate's: made by the test (mode "optimizers") or by the Trainer
        (mode "cls"); installed with the adapter (install_kw: install's keyword arguments)."""
        model = make_model()
        if mode == "optimizers":
            opt = ot.AdamW(model.named_parameters(), store=store, lr=LR, weight_decay=0.0, **OPT_KW)
            t = Trainer(model=model, args=self.args(out, **kw), train_dataset=Data(), optimizers=(opt, None))
        else:
            t = Trainer(model=model, args=self.args(out, **kw), train_dataset=Data(),
                        optimizer_cls_and_kwargs=(ot.AdamW, dict(store=store, lr=LR, weight_decay=0.0, **OPT_KW)))
        optstate.integrations.transformers.install(t, **(install_kw or {}))
        return t, model

    def close(self, t):
        for opt in optstate.integrations.optstate_optimizers(t.optimizer):
            opt.close()

    _ref = None  # the uninterrupted run's final weights, made once for the class

    def reference(self):
        """The uninterrupted run (param groups and names do not change AdamW's elementwise math, so one
        serves both ways of giving the Trainer the optimizer)."""
        if HfTrainerTest._ref is None:
            t, model = self.trainer("optimizers", self.path("ref"), self.path("ref_out"))
            t.train()
            HfTrainerTest._ref = weights(model)
            self.close(t)
        return HfTrainerTest._ref

    def check_mode(self, mode):
        ref = self.reference()

        # A run of 20 steps; its store stays at step 20.
        t, model = self.trainer(mode, self.path("s"), self.path("out"))
        t.train()
        self.assertEqual(max_diff(weights(model), ref), 0.0)
        self.close(t)
        for step in (5, 10, 15, 20):  # the state once: the field files, no state.safetensors, and the manifest says so
            self.assertEqual(safetensors_of(self.path("out/checkpoint-%d/optstate/s" % step)), (False, False), step)

        # Resume from checkpoint-10 while the store is at step 20.
        t, model = self.trainer(mode, self.path("s"), self.path("out_b"))
        t.train(resume_from_checkpoint=self.path("out/checkpoint-10"))
        self.assertEqual(max_diff(weights(model), ref), 0.0)
        self.close(t)

        # A copy of checkpoint-10 on a fresh store path (another node).
        shutil.copytree(self.path("out/checkpoint-10"), self.path("copied"))
        t, model = self.trainer(mode, self.path("fresh"), self.path("out_c"))
        t.train(resume_from_checkpoint=self.path("copied"))
        self.assertEqual(max_diff(weights(model), ref), 0.0)
        self.close(t)

    def test_install_wraps_only_public_api_and_resumes_the_last_checkpoint(self):
        """install() adds its callback and wraps train(), the Trainer's public entry point; no private
        Trainer method is replaced (a transformers release that renames one changes nothing), and
        resume_from_checkpoint=True resumes the last checkpoint of a copied output directory on a fresh
        store path, as the uninterrupted run."""
        ref = self.reference()
        t, model = self.trainer("optimizers", self.path("s"), self.path("out"))
        t.train()
        self.close(t)
        shutil.copytree(self.path("out"), self.path("copy"))
        for step in (15, 20):  # the copy's last checkpoint is checkpoint-10
            shutil.rmtree(self.path("copy/checkpoint-%d" % step))
        model = make_model()
        opt = ot.AdamW(model.named_parameters(), store=self.path("fresh"), lr=LR, weight_decay=0.0, **OPT_KW)
        t = Trainer(model=model, args=self.args(self.path("copy")), train_dataset=Data(), optimizers=(opt, None))
        before = set(vars(t))
        optstate.integrations.transformers.install(t)
        optstate.integrations.transformers.install(t)  # twice: one callback, one wrapper
        self.assertEqual(set(vars(t)) - before, {"train"})
        self.assertEqual(sum(isinstance(cb, optstate.integrations.transformers.OptstateCallback)
                             for cb in t.callback_handler.callbacks), 1)
        t.train(resume_from_checkpoint=True)
        self.assertEqual(max_diff(weights(model), ref), 0.0)
        self.assertTrue(os.path.isfile(self.path("copy/checkpoint-20/optstate/fresh/manifest.json")))
        self.close(t)

    def test_safetensors_option_and_checkpoints_with_it_resume(self):
        """install(trainer, safetensors=True) puts state.safetensors into every checkpoint (the manifest
        without "state_safetensors"); such a checkpoint (what the adapter wrote by default before it
        wrote the state once) resumes on a fresh store path through the default install, bit for bit."""
        ref = self.reference()
        t, model = self.trainer("optimizers", self.path("s"), self.path("out"), install_kw=dict(safetensors=True))
        t.train()
        self.close(t)
        for step in (5, 10, 15, 20):
            self.assertEqual(safetensors_of(self.path("out/checkpoint-%d/optstate/s" % step)), (True, None), step)
        shutil.copytree(self.path("out/checkpoint-10"), self.path("copied"))
        t, model = self.trainer("optimizers", self.path("fresh"), self.path("out_c"))
        t.train(resume_from_checkpoint=self.path("copied"))
        self.assertEqual(max_diff(weights(model), ref), 0.0)
        self.assertEqual(safetensors_of(self.path("out_c/checkpoint-20/optstate/fresh")), (False, False))
        self.close(t)

    def test_optimizers_argument(self):
        self.check_mode("optimizers")

    def test_optimizer_cls_and_kwargs(self):
        self.check_mode("cls")

    def test_save_total_limit_releases_deleted_checkpoints_snapshots(self):
        t, model = self.trainer("optimizers", self.path("s"), self.path("out"), save_total_limit=2)
        t.train()
        opt, = optstate.integrations.optstate_optimizers(t.optimizer)
        kept = sorted(d for d in os.listdir(self.path("out")) if d.startswith("checkpoint-"))
        self.assertEqual(kept, ["checkpoint-15", "checkpoint-20"])
        named = set()
        for d in kept:
            sd = torch.load(os.path.join(self.path("out"), d, "optimizer.pt"), weights_only=True)
            named.add(sd["optstate"]["snapshot"])
        have = {n for n, _ in opt.store.snapshots()}
        self.assertEqual(have, named)  # the deleted checkpoints' snapshots are gone, nothing else is left
        self.close(t)


if __name__ == "__main__":
    unittest.main()
