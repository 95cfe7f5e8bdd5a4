"""optstate.torch.AdamW.state_dict()/load_state_dict() as a trainer uses them:
every state_dict a trainer kept resumes, bit for bit against an uninterrupted
run (fp32), on the same store (its snapshot made the head again) and on a fresh
store from the files optstate.checkpoint.save_into wrote; state_dict()'s own
snapshots stay bounded and checkpoints that are deleted release theirs."""
import io
import os
import shutil
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.checkpoint as ock
import optstate.torch as ot


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def train(model, opt, first, last):
    """Steps first..last-1, each on its own batch (a resumed run sees the same data)."""
    for step in range(first, last):
        x, y = batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def roundtrip(sd):
    """The state_dict as a trainer's checkpoint file gives it back."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    # torch 1.13's weights_only unpickler lacks floats (any optimizer's lr): only from torch 2 on.
    kw = {"weights_only": True} if int(torch.__version__.split(".")[0]) >= 2 else {}
    return torch.load(buf, **kw)


class StateDictResumeTest(TempDirTest):
    LR = 1e-2

    def setUp(self):
        super().setUp()
        model = make_model()
        opt = ot.AdamW(model.parameters(), store=self.path("ref"), lr=self.LR, **OPT_KW)
        train(model, opt, 0, 10)
        self.ref10 = weights(model)
        self.ref10_main = [opt.read_state(p, "main") for p in model.parameters()]
        self.ref10_m = [opt.read_state(p, "exp_avg_sq") for p in model.parameters()]
        train(model, opt, 10, 20)
        self.ref20 = weights(model)
        opt.close()

    def test_older_state_dict_on_the_same_store_continues_bit_for_bit(self):
        model = make_model()
        opt = ot.AdamW(model.parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        train(model, opt, 0, 10)
        sd10 = roundtrip(opt.state_dict())
        train(model, opt, 10, 20)
        head20 = opt.generation
        self.assertGreater(max_diff(weights(model), self.ref10), 1e-3)  # the test can tell them apart

        opt.load_state_dict(sd10)
        self.assertEqual(max_diff(weights(model), self.ref10), 0.0)
        for p, main, v in zip(model.parameters(), self.ref10_main, self.ref10_m):
            self.assertTrue(torch.equal(opt.read_state(p, "main"), main))
            self.assertTrue(torch.equal(opt.read_state(p, "exp_avg_sq"), v))
            self.assertEqual(opt.param_step_count(p), 10)
        self.assertEqual(opt.step_count(0), 10)
        # The head it replaced is kept.
        kept = opt.store.last_restore_snapshot
        self.assertIsNotNone(kept)
        self.assertEqual(dict(opt.store.snapshots())[kept], head20)

        train(model, opt, 10, 20)
        self.assertEqual(max_diff(weights(model), self.ref20), 0.0)
        self.assertEqual(opt.step_count(0), 20)
        opt.close()

    def test_state_dict_of_the_newest_state_loads_in_a_new_process(self):
        model = make_model()
        opt = ot.AdamW(model.parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        train(model, opt, 0, 10)
        sd10 = roundtrip(opt.state_dict())
        opt.close()
        model = make_model(5)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        gen = opt.generation
        opt.load_state_dict(sd10)
        self.assertEqual(opt.generation, gen)  # the head: nothing to change
        train(model, opt, 10, 20)
        self.assertEqual(max_diff(weights(model), self.ref20), 0.0)
        opt.close()

    def test_files_resume_on_a_fresh_store(self):
        model = make_model()
        opt = ot.AdamW(model.parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        train(model, opt, 0, 10)
        sd10 = roundtrip(opt.state_dict())
        written = ock.save_into(opt, self.path("ckpt10/optstate"), state_dict=sd10)
        self.assertTrue(os.path.isfile(os.path.join(written, "manifest.json")))
        train(model, opt, 10, 12)
        opt.close()
        shutil.copytree(self.path("ckpt10"), self.path("copied"))
        shutil.rmtree(self.path("ckpt10"))

        model = make_model(7)  # another init: the resume must overwrite it
        opt = ot.AdamW(model.parameters(), store=self.path("fresh"), lr=self.LR, **OPT_KW)
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            opt.load_state_dict(sd10)
        self.assertIn("resume_from", str(cm.exception))
        with ock.resume_from(self.path("copied/optstate")):
            opt.load_state_dict(sd10)
        self.assertEqual(max_diff(weights(model), self.ref10), 0.0)
        train(model, opt, 10, 20)
        self.assertEqual(max_diff(weights(model), self.ref20), 0.0)
        opt.close()

    def test_state_dict_snapshots_stay_bounded(self):
        model = make_model()
        opt = ot.AdamW(model.parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        names = []
        for k in range(5):
            train(model, opt, k, k + 1)
            names.append(opt.state_dict()["optstate"]["snapshot"])
            self.assertEqual(opt.state_dict()["optstate"]["snapshot"], names[-1])  # no step: the same one
        left = sorted(n for n, _ in opt.store.snapshots() if n.startswith("state-dict-"))
        self.assertEqual(left, sorted(names[-opt.state_dict_snapshots:]))
        # A released one says what to do.
        train(model, opt, 5, 6)
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"],
                                 "optstate": dict(opt.state_dict()["optstate"], generation=2,
                                                  snapshot=names[0])})
        self.assertIn(names[0], str(cm.exception))
        self.assertIn("optstate.integrations", str(cm.exception))
        opt.close()

    def test_deleted_checkpoints_release_their_snapshots(self):
        model = make_model()
        opt = ot.AdamW(model.parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        snaps = []
        for k in range(4):
            train(model, opt, k, k + 1)
            ock.save_into(opt, self.path("ck%d/optstate" % k), holder=self.path("ck%d" % k))
            snaps.append(opt.state_dict()["optstate"]["snapshot"])
            if k >= 2:  # a trainer keeping two checkpoints deletes the oldest
                shutil.rmtree(self.path("ck%d" % (k - 2)))
        ock.release_deleted(opt)
        have = {n for n, _ in opt.store.snapshots()}
        self.assertFalse(have & set(snaps[:2]), have)
        self.assertTrue(set(snaps[2:]) <= have, have)
        self.assertEqual(sorted(ock.held_snapshots(opt)), sorted(snaps[2:]))
        opt.close()


if __name__ == "__main__":
    unittest.main()
