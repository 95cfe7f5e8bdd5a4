"""optstate.reshard over the C ABI: a one-rank checkpoint split over two ranks
and joined again gives back its field files byte for byte, the joined one
loads and training continues as from the original, and a missing rank is
refused with nothing written."""
import hashlib
import os
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.checkpoint as ckpt
import optstate.torch as ot
from torch_adamw_test import make_model, two_groups


def field_files(root):
    """{path under tensors/: sha256} of a checkpoint directory's field files."""
    out = {}
    for d, _, names in os.walk(os.path.join(root, "tensors")):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


class ReshardTest(TempDirTest):
    def setUp(self):
        super().setUp()
        gen = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)

    def steps(self, model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            ((model(self.x) - self.y) ** 2).mean().backward()
            opt.step()

    def test_split_and_join_is_byte_identical_and_resumes(self):
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("a"), lr=1e-2, **OPT_KW)
        self.steps(model, opt, 3)
        ckpt.save(opt, self.path("ck1"))

        layout = ckpt.reshard_layout([self.path("ck1")], ranks=2, split="rows")
        self.assertEqual(layout["format"], "optstate-reshard-layout")
        self.assertEqual(len(layout["ranks"]), 2)
        self.assertEqual(optstate.reshard([self.path("ck1")], self.path("ck2"), layout), 2)
        two = [ckpt.rank_dir(self.path("ck2"), r) for r in range(2)]
        self.assertTrue(all(os.path.isfile(os.path.join(d, "manifest.json")) for d in two))

        joined = ckpt.reshard_layout(two, ranks=1)
        self.assertEqual(optstate.reshard(list(reversed(two)), self.path("ck3"), joined), 1)
        self.assertEqual(field_files(self.path("ck1")), field_files(ckpt.rank_dir(self.path("ck3"), 0)))

        # The joined checkpoint resumes exactly as the original does.
        self.steps(model, opt, 2)
        want = [p.detach().clone() for p in model.parameters()]
        opt.close()
        model2 = make_model(1)
        opt2 = ot.AdamW(two_groups(model2), store=self.path("b"), lr=1e-2, **OPT_KW)
        ckpt.load(opt2, ckpt.rank_dir(self.path("ck3"), 0))
        self.steps(model2, opt2, 2)
        # model2's params took the restored mains at load; after the same 2 steps they equal model's.
        for p, w in zip(model2.parameters(), want):
            self.assertTrue(torch.equal(p.detach(), w))
        opt2.close()

    def test_missing_rank_is_refused_and_nothing_written(self):
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("a"), lr=1e-2, **OPT_KW)
        self.steps(model, opt, 1)
        ckpt.save(opt, self.path("ck1"))
        opt.close()
        layout = ckpt.reshard_layout([self.path("ck1")], ranks=2)
        optstate.reshard([self.path("ck1")], self.path("ck2"), layout)
        with self.assertRaises(optstate.InvalidArgument) as cm:
            optstate.reshard([ckpt.rank_dir(self.path("ck2"), 0)], self.path("ck3"),
                             ckpt.reshard_layout([self.path("ck1")], ranks=1))
        self.assertIn("in no shard", str(cm.exception))
        self.assertFalse(os.path.exists(self.path("ck3")))
        with self.assertRaises(optstate.InvalidArgument):
            optstate.reshard(self.path("ck1"), self.path("ck3"), layout)


if __name__ == "__main__":
    unittest.main()
