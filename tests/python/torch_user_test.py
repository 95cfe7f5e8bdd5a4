"""optstate.torch.AdamW where torch users' habits meet a store: weights loaded
into the model behind the optimizer's back, copies and wrappers of the
optimizer object, a store path that is an empty directory, renamed params."""
import copy
import gc
import os
import pickle
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.torch as ot


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def train(model, opt, steps, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class ParamsChangedOutsideTest(TempDirTest):
    LR = 1e-2

    def newer_store_and_old_weights(self):
        """A store trained 10 steps and the model's weights after its first step (an older checkpoint)."""
        model = make_model(0)
        opt = ot.AdamW(model.named_parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        train(model, opt, 1)
        old = weights(model)
        train(model, opt, 9)
        opt.close()
        return old

    def test_loaded_weights_refuse_the_step_until_the_mains_follow(self):
        old = self.newer_store_and_old_weights()
        model = make_model(1)
        opt = ot.AdamW(model.named_parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        store_weights = weights(model)  # the resume copied the store's mains into the model
        gap = max((store_weights[k] - old[k]).abs().max().item() for k in old)
        self.assertGreater(gap, 5 * self.LR)  # else the test could not tell the two apart
        gen_before = opt.generation

        model.load_state_dict(old)
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            train(model, opt, 1)
        msg = str(cm.exception)
        self.assertIn("0.weight", msg)
        self.assertIn("load_main_from_params", msg)
        self.assertIn(self.path("s"), msg)
        # Nothing was written: the params are the loaded ones, the store is where it was.
        for k, v in weights(model).items():
            self.assertTrue(torch.equal(v, old[k]), k)
        self.assertEqual(opt.generation, gen_before)
        self.assertEqual(opt.step_count(0), 10)

        opt.load_main_from_params()
        train(model, opt, 1)
        # One AdamW step moves each element by at most about lr (|m / sqrt(v)| <= 1 after bias
        # correction, plus decay lr * wd * |p|): from the loaded weights, not from the store's.
        for k, v in weights(model).items():
            self.assertLess((v - old[k]).abs().max().item(), 1.5 * self.LR, k)
        self.assertEqual(opt.step_count(0), 11)
        main = opt.read_state(model[0].weight, "main")
        self.assertTrue(torch.equal(main, model[0].weight.detach()))
        opt.close()

    def test_replaced_param_memory_is_detected(self):
        model = make_model(0)
        opt = ot.AdamW(model.named_parameters(), store=self.path("s"), lr=self.LR, **OPT_KW)
        train(model, opt, 2)
        model[2].bias.data = torch.full_like(model[2].bias, 0.5)  # new memory, version counter kept
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            train(model, opt, 1)
        self.assertIn("2.bias", str(cm.exception))
        self.assertNotIn("0.weight", str(cm.exception))
        opt.close()

    def test_same_values_written_again_and_own_steps_pass(self):
        # Writes that leave each param equal to its main (a trainer loading the current weights
        # again, the resume's own copy, the step's own writes) are no change.
        for dtype in (torch.float32, torch.bfloat16):
            with self.subTest(dtype=dtype):
                model = make_model(0).to(dtype)
                store = self.path("s-%s" % str(dtype).split(".")[1])
                opt = ot.AdamW(model.named_parameters(), store=store, lr=self.LR, **OPT_KW)
                train_typed(model, opt, 3, dtype)
                model.load_state_dict(weights(model))
                train_typed(model, opt, 2, dtype)
                self.assertEqual(opt.step_count(0), 5)
                opt.close()
                model2 = make_model(1).to(dtype)
                opt2 = ot.AdamW(model2.named_parameters(), store=store, lr=self.LR, **OPT_KW)
                train_typed(model2, opt2, 1, dtype)
                self.assertEqual(opt2.step_count(0), 6)
                opt2.close()


def train_typed(model, opt, steps, dtype):
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 8, generator=gen).to(dtype), torch.randn(16, 4, generator=gen).to(dtype)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


class CopyAndOwnershipTest(TempDirTest):
    def test_deepcopy_and_pickle_say_why_and_what_instead(self):
        model = make_model(0)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), **OPT_KW)
        for what, fn in (("deep-copied", copy.deepcopy), ("pickled", pickle.dumps)):
            with self.subTest(what=what):
                with self.assertRaises(TypeError) as cm:
                    fn(opt)
                msg = str(cm.exception)
                self.assertIn(what, msg)
                self.assertIn(self.path("s"), msg)
                self.assertIn("state_dict", msg)
                self.assertIn("optstate.checkpoint.save", msg)
        train(model, opt, 1)  # the failed copies changed nothing
        opt.close()

    def test_a_wrapper_sharing_the_dict_closes_nothing(self):
        # What Lightning's LightningOptimizer does: an object of a subclass of the optimizer's class
        # with a copy of its __dict__; it is collected while the optimizer trains on.
        model, ref_model = make_model(0), make_model(0)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), **OPT_KW)
        ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
        wrapper = object.__new__(type("Wrapped", (type(opt),), {}))
        wrapper.__dict__ = opt.__dict__.copy()
        train(model, wrapper, 1)
        train(ref_model, ref, 1)
        del wrapper
        gc.collect()
        train(model, opt, 2)
        train(ref_model, ref, 2)
        for (k, p), r in zip(model.named_parameters(), ref_model.parameters()):
            self.assertTrue(torch.allclose(p, r, rtol=0, atol=1e-6), k)
        self.assertEqual(opt.step_count(0), 3)
        alias = copy.copy(opt)  # a shallow copy is one more such view
        del alias
        gc.collect()
        train(model, opt, 1)
        # The optimizer itself is the owner: once it is gone the store is closed (no Busy).
        store = opt.store
        del opt
        gc.collect()
        self.assertTrue(store.closed)
        opt = ot.AdamW(make_model(1).parameters(), store=self.path("s"), **OPT_KW)
        self.assertEqual(opt.step_count(0), 4)
        opt.close()


class StorePathTest(TempDirTest):
    def test_an_empty_directory_is_a_new_store(self):
        os.mkdir(self.path("s"))
        model = make_model(0)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), **OPT_KW)
        self.assertTrue(opt.store.created)
        uuid = opt.store.uuid
        train(model, opt, 2)
        opt.close()
        opt = ot.AdamW(make_model(1).parameters(), store=self.path("s"), **OPT_KW)  # resumes
        self.assertFalse(opt.store.created)
        self.assertEqual((opt.store.uuid, opt.step_count(0)), (uuid, 2))
        opt.close()

    def test_a_failed_construction_removes_only_what_it_created(self):
        bad = [torch.zeros(4, dtype=torch.int64)]  # refused after the store is created
        with self.assertRaises(optstate.InvalidArgument):
            ot.AdamW(bad, store=self.path("new"), **OPT_KW)
        self.assertFalse(os.path.exists(self.path("new")))

        os.mkdir(self.path("empty"))
        with self.assertRaises(optstate.InvalidArgument):
            ot.AdamW(bad, store=self.path("empty"), **OPT_KW)
        self.assertEqual(os.listdir(self.path("empty")), [])

        os.mkdir(self.path("data-old"))
        with open(self.path("data-old/keep"), "w") as f:
            f.write("x")
        with self.assertRaises(optstate.InvalidArgument):
            ot.AdamW(bad, store=self.path("d"), data_dirs=[self.path("data-old"), self.path("data-new")],
                     **OPT_KW)
        self.assertEqual(sorted(os.listdir(self.dir)), ["data-old", "empty"])
        self.assertEqual(os.listdir(self.path("data-old")), ["keep"])

        model = make_model(0)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), **OPT_KW)
        train(model, opt, 1)
        gen = opt.generation
        opt.close()
        with self.assertRaises(optstate.InvalidArgument):
            ot.AdamW(bad, store=self.path("s"), **OPT_KW)
        opt = ot.AdamW(make_model(0).parameters(), store=self.path("s"), **OPT_KW)
        self.assertEqual((opt.generation, opt.step_count(0)), (gen, 1))
        opt.close()


class Wrapped(torch.nn.Module):
    """A wrapper that names its model's params "module.<name>", as DDP does."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


class RenamedParamsTest(TempDirTest):
    def store_of(self, named):
        model = make_model(0)
        opt = ot.AdamW(model.named_parameters() if named else model.parameters(), store=self.path("s"), **OPT_KW)
        train(model, opt, 2)
        gen, names = opt.generation, opt.store.tensor_names()
        opt.close()
        return gen, names

    def assert_store_unchanged(self, gen, names):
        s = optstate.Store(self.path("s"), create=False)
        self.assertEqual((s.latest_generation()[0], s.tensor_names()), (gen, names))
        s.close()

    def test_a_prefix_added_or_removed_is_refused_at_construction(self):
        gen, names = self.store_of(named=True)
        self.assertEqual(names, ["0.bias", "0.weight", "2.bias", "2.weight"])
        model = Wrapped(make_model(1))
        with self.assertRaises(optstate.InvalidArgument) as cm:
            ot.AdamW(model.named_parameters(), store=self.path("s"), **OPT_KW)
        msg = str(cm.exception)
        self.assertIn("module.0.weight", msg)
        self.assertIn("strip 'module.'", msg)
        self.assertIn(self.path("s"), msg)
        self.assert_store_unchanged(gen, names)
        # The way out the message names: the model's names without the prefix resume the store.
        opt = ot.AdamW(model.module.named_parameters(), store=self.path("s"), **OPT_KW)
        self.assertEqual(opt.step_count(0), 2)
        opt.close()

        model = Wrapped(make_model(0))  # a store written by a wrapped model, an unwrapped one resuming
        opt = ot.AdamW(model.named_parameters(), store=self.path("s2"), **OPT_KW)
        train(model, opt, 1)
        opt.close()
        with self.assertRaises(optstate.InvalidArgument) as cm:
            ot.AdamW(make_model(1).named_parameters(), store=self.path("s2"), **OPT_KW)
        self.assertIn("add 'module.'", str(cm.exception))

    def test_unnamed_against_named_is_refused_at_construction(self):
        gen, names = self.store_of(named=False)
        self.assertEqual(names, ["param0", "param1", "param2", "param3"])
        with self.assertRaises(optstate.InvalidArgument) as cm:
            ot.AdamW(make_model(1).named_parameters(), store=self.path("s"), **OPT_KW)
        self.assertIn("unnamed", str(cm.exception))
        self.assert_store_unchanged(gen, names)

    def test_fewer_params_need_retire_and_more_are_new(self):
        gen, names = self.store_of(named=True)
        # A renamed head ("2." -> "head."): refused, with the near names; retire= lets the new head in.
        model = make_model(1)
        named = [(n.replace("2.", "head."), p) for n, p in model.named_parameters()]
        with self.assertRaises(optstate.InvalidArgument) as cm:
            ot.AdamW(named, store=self.path("s"), **OPT_KW)
        self.assertIn("2.weight", str(cm.exception))
        self.assert_store_unchanged(gen, names)
        opt = ot.AdamW(named, store=self.path("s"), retire=["2.weight", "2.bias"], **OPT_KW)
        train(model, opt, 1)
        self.assertEqual(opt.store.tensor_names(), ["0.bias", "0.weight", "2.bias", "2.weight", "head.bias",
                                                    "head.weight"])
        opt.close()
        # A model with an extra param whose other names all match: the extra one is new (growth).
        model = make_model(1)
        extra = torch.nn.Parameter(torch.zeros(4))
        opt = ot.AdamW(list(model.named_parameters()) + [("extra", extra)], store=self.path("s"),
                       retire=["head.weight", "head.bias"], **OPT_KW)
        self.assertEqual(opt.step_count(0), 3)
        opt.close()


if __name__ == "__main__":
    unittest.main()
