"""Lightning Trainer.fit (automatic optimization, a closure) with ModelCheckpoint
and optstate.integrations.lightning, and accelerate's save_state/load_state
with optstate.integrations.accelerate: resumed from an earlier checkpoint (and
from a copy on a fresh store path), each against the uninterrupted run, bit
for bit (fp32, CPU). Their checkpoints hold the state once (no
state.safetensors) unless the adapter is given safetensors=True."""
import os
import shutil
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate, safetensors_of  # noqa: F401  (common puts the package on the path)
import optstate.torch as ot

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError:  # the oldest supported torch runs without it
    pl = None
if pl is not None:
    import optstate.integrations.lightning as osl

try:
    import accelerate
except ImportError:
    accelerate = None
if accelerate is not None:
    import optstate.integrations.accelerate as osa

LR = 1e-2


def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def dataset(n=80):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


if pl is not None:
    class Module(pl.LightningModule):
        def __init__(self, store):
            super().__init__()
            self.net, self.store = make_net(), store

        def training_step(self, batch, _):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return ot.AdamW(self.net.named_parameters(), store=self.store, lr=LR, **OPT_KW)

        def train_dataloader(self):
            # 5 batches an epoch: the checkpoints every 5 steps end epochs, so a resume starts the next
            # epoch where the uninterrupted run did (the loader itself is not resumable mid-epoch).
            return torch.utils.data.DataLoader(dataset(20), batch_size=4, shuffle=False)


@unittest.skipIf(pl is None, "lightning is not installed")
class LightningTest(TempDirTest):
    def fit(self, store, out, ckpt_path=None, check=None, safetensors=None, **ckpt_kw):
        """safetensors: OptstateCheckpoints' argument (None: its default)."""
        module = Module(store)
        ckpt_kw = ckpt_kw or {"save_top_k": -1}
        trainer = pl.Trainer(max_steps=20, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, deterministic=True,
                             callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=5, **ckpt_kw),
                                        osl.OptstateCheckpoints() if safetensors is None
                                        else osl.OptstateCheckpoints(safetensors=safetensors)])
        trainer.fit(module, ckpt_path=ckpt_path)
        opts = optstate.integrations.optstate_optimizers(trainer.optimizers)
        if check is not None:
            check(opts[0])
        for opt in opts:
            opt.close()
        return weights(module)

    def test_save_top_k_releases_removed_checkpoints_snapshots(self):
        def check(opt):
            files = sorted(f for f in os.listdir(self.path("out")) if f.endswith(".ckpt"))
            self.assertEqual(len(files), 2, files)
            self.assertTrue(all("step=15" in f or "step=20" in f for f in files), files)
            sidecars = sorted(f for f in os.listdir(self.path("out")) if f.endswith(osl.SUFFIX))
            self.assertEqual(sidecars, [f + osl.SUFFIX for f in files])
            named = {torch.load(os.path.join(self.path("out"), f), weights_only=False)["optimizer_states"][0]
                     ["optstate"]["snapshot"] for f in files}
            self.assertEqual({n for n, _ in opt.store.snapshots()}, named)

        self.fit(self.path("s"), self.path("out"), check=check, save_top_k=2, monitor="step", mode="max")

    def test_resume_from_the_step_10_checkpoint(self):
        ref = self.fit(self.path("ref"), self.path("ref_out"))
        final = self.fit(self.path("s"), self.path("out"))
        self.assertEqual(max_diff(final, ref), 0.0)
        ckpts = sorted(f for f in os.listdir(self.path("out")) if f.endswith(".ckpt"))
        step10 = [f for f in ckpts if "step=10" in f]
        self.assertEqual(len(step10), 1, ckpts)
        path10 = os.path.join(self.path("out"), step10[0])
        # The state once: the field files, no state.safetensors, and the manifest says so.
        self.assertEqual(safetensors_of(os.path.join(path10 + osl.SUFFIX, "s")), (False, False))

        # The store is at step 20: the step-10 checkpoint makes its snapshot the head again.
        resumed = self.fit(self.path("s"), self.path("out_b"), ckpt_path=path10)
        self.assertEqual(max_diff(resumed, ref), 0.0)

        # A copy of the checkpoint (file and its .optstate) on a fresh store path.
        os.makedirs(self.path("copied"))
        shutil.copy(path10, self.path("copied/c.ckpt"))
        shutil.copytree(path10 + osl.SUFFIX, self.path("copied/c.ckpt") + osl.SUFFIX)
        copied = self.fit(self.path("fresh"), self.path("out_c"), ckpt_path=self.path("copied/c.ckpt"))
        self.assertEqual(max_diff(copied, ref), 0.0)

    def test_safetensors_option(self):
        """OptstateCheckpoints(safetensors=True): every checkpoint's files carry state.safetensors too."""
        self.fit(self.path("s"), self.path("out"), safetensors=True)
        sidecars = [f for f in os.listdir(self.path("out")) if f.endswith(osl.SUFFIX)]
        self.assertEqual(len(sidecars), 4, sidecars)
        for f in sidecars:
            self.assertEqual(safetensors_of(os.path.join(self.path("out"), f, "s")), (True, None), f)


@unittest.skipIf(accelerate is None, "accelerate is not installed")
class AccelerateTest(TempDirTest):
    def run_steps(self, acc, model, opt, first, last):
        data = list(torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=False))
        for x, y in data[first:last]:
            opt.zero_grad()
            acc.backward(((model(x) - y) ** 2).mean())
            opt.step()

    def setup_run(self, store, **install_kw):
        acc = accelerate.Accelerator(cpu=True)
        net = make_net()
        opt = ot.AdamW(net.named_parameters(), store=store, lr=LR, **OPT_KW)
        net, popt = acc.prepare(net, opt)
        osa.install(acc, **install_kw)
        return acc, net, popt, opt

    def test_load_state_of_an_earlier_save(self):
        acc, net, popt, opt = self.setup_run(self.path("ref"))
        self.run_steps(acc, net, popt, 0, 15)
        ref = weights(net)
        opt.close()

        acc, net, popt, opt = self.setup_run(self.path("s"))
        self.run_steps(acc, net, popt, 0, 10)
        acc.save_state(self.path("state10"))
        # The state once: the field files, no state.safetensors, and the manifest says so.
        self.assertEqual(safetensors_of(self.path("state10/optstate/s")), (False, False))
        self.run_steps(acc, net, popt, 10, 15)
        acc.load_state(self.path("state10"))
        self.assertEqual(opt.step_count(0), 10)
        self.run_steps(acc, net, popt, 10, 15)
        self.assertEqual(max_diff(weights(net), ref), 0.0)
        opt.close()

        # A copy on a fresh store path.
        shutil.copytree(self.path("state10"), self.path("copied"))
        acc, net, popt, opt = self.setup_run(self.path("fresh"))
        acc.load_state(self.path("copied"))
        self.run_steps(acc, net, popt, 10, 15)
        self.assertEqual(max_diff(weights(net), ref), 0.0)
        opt.close()

    def test_safetensors_option(self):
        """install(accelerator, safetensors=True): the saved state carries state.safetensors too."""
        acc, net, popt, opt = self.setup_run(self.path("s"), safetensors=True)
        self.run_steps(acc, net, popt, 0, 5)
        acc.save_state(self.path("state5"))
        self.assertEqual(safetensors_of(self.path("state5/optstate/s")), (True, None))
        opt.close()


if __name__ == "__main__":
    unittest.main()
