"""Every bad input to optstate.torch.AdamW is an optstate.Error subclass whose
message names the thing, and it changes and commits nothing."""
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.torch as ot


class ErrorsTest(TempDirTest):
    def assert_error(self, cls, fn, *needles):
        with self.assertRaises(cls) as cm:
            fn()
        self.assertIsInstance(cm.exception, optstate.Error)
        for n in needles:
            self.assertIn(n, str(cm.exception))
        return cm.exception

    def test_bad_params(self):
        good = torch.zeros(4, 6)
        self.assert_error(optstate.InvalidArgument,
                          lambda: ot.AdamW([("w", good), ("t", torch.zeros(6, 4).t())], store=self.path("a"),
                                           **OPT_KW), "param t", "not contiguous")
        self.assert_error(optstate.InvalidArgument,
                          lambda: ot.AdamW([("w", torch.zeros(3, dtype=torch.float64))], store=self.path("b"),
                                           **OPT_KW), "param w", "torch.float64")
        self.assert_error(optstate.InvalidArgument,
                          lambda: ot.AdamW([("w", good), ("again", good)], store=self.path("c"), **OPT_KW),
                          "registered twice")
        self.assert_error(optstate.InvalidArgument,
                          lambda: ot.AdamW([{"params": [good]}, {"params": [good]}], store=self.path("d"),
                                           **OPT_KW), "param0", "registered twice")
        self.assert_error(optstate.InvalidArgument, lambda: ot.AdamW([good], store=self.path("e"), lr=-1, **OPT_KW),
                          "learning rate")
        self.assert_error(optstate.Unimplemented,
                          lambda: ot.AdamW([good], store=self.path("f"), amsgrad=True, **OPT_KW), "amsgrad")
        # A failed construction released its store: it opens again.
        ot.AdamW([good], store=self.path("a"), **OPT_KW).close()

    def test_add_param_group_twice(self):
        a, b = torch.zeros(3), torch.zeros(5)
        opt = ot.AdamW([a], store=self.path("s"), **OPT_KW)
        self.assert_error(optstate.InvalidArgument, lambda: opt.add_param_group({"params": [b, a]}),
                          "param0", "registered twice")
        opt.add_param_group({"params": [b], "lr": 0.5})
        self.assertEqual(opt.param_name(b), "param1")

    def test_bad_grads_commit_nothing(self):
        w = torch.ones(4, 6)
        opt = ot.AdamW([("w", w)], store=self.path("s"), **OPT_KW)
        w.grad = torch.ones(4, 6)
        opt.step()
        gen, before = opt.generation, w.clone()
        w.grad.data = torch.ones(5, 6)  # torch's own setter refuses a wrong shape; .data does not
        self.assert_error(optstate.InvalidArgument, opt.step, "grad of w", "(5, 6)", "(4, 6)")
        w.grad = torch.ones(4, 6)
        w.grad.data = torch.ones(4, 6, dtype=torch.float64)
        self.assert_error(optstate.InvalidArgument, opt.step, "grad of w", "torch.float64")
        w.grad = torch.ones(6, 4).t()
        self.assert_error(optstate.InvalidArgument, opt.step, "grad of w", "not contiguous")
        self.assertEqual((opt.generation, opt.step_count()), (gen, 1))
        self.assertTrue(torch.equal(w, before))
        w.grad = torch.ones(4, 6)
        opt.step()
        self.assertEqual(opt.step_count(), 2)

    def test_grads_over_validated_memory_are_checked_again(self):
        # The memory of a grad that was validated, seen through other strides (a transposed view has
        # the same pointer, shape and dtype), or holding another shape: checked again, refused.
        w = torch.ones(4, 6)
        opt = ot.AdamW([("w", w)], store=self.path("s"), **OPT_KW)
        flat = torch.ones(24)
        w.grad = flat.view(4, 6)
        opt.step()
        gen, before = opt.generation, w.clone()
        w.grad = flat.view(6, 4).t()
        self.assertEqual(w.grad.data_ptr(), flat.data_ptr())
        self.assert_error(optstate.InvalidArgument, opt.step, "grad of w", "not contiguous")
        self.assertEqual((opt.generation, opt.step_count()), (gen, 1))
        self.assertTrue(torch.equal(w, before))
        w.grad = flat.view(4, 6)
        opt.step()
        self.assertEqual(opt.step_count(), 2)
        opt.close()

    def test_busy_and_closed_store(self):
        opt = ot.AdamW([torch.zeros(3)], store=self.path("rank{rank}.dense"), **OPT_KW)
        self.assertEqual(opt.store.path, self.path("rank0.dense"))
        e = self.assert_error(optstate.Busy,
                              lambda: ot.AdamW([torch.zeros(3)], store=self.path("rank{rank}.dense"), **OPT_KW),
                              self.path("rank0.dense"))
        self.assertEqual(e.code, 5)
        # A second instance (e.g. the experts' optimizer) gets its own store.
        ot.AdamW([torch.zeros(3)], store=self.path("rank{rank}.expert"), **OPT_KW).close()
        opt.close()
        self.assert_error(optstate.FailedPrecondition, opt.step, "closed")
        self.assert_error(optstate.FailedPrecondition, lambda: opt.snapshot("x"), "closed")
        ot.AdamW([torch.zeros(3)], store=self.path("rank{rank}.dense"), **OPT_KW).close()

    def test_layout_mismatch_on_resume_names_store_and_param(self):
        with ot.AdamW([("w", torch.zeros(10))], store=self.path("s"), **OPT_KW) as opt:
            opt.param_groups[0]["params"][0].grad = torch.ones(10)
            opt.step()
        self.assert_error(optstate.InvalidArgument,
                          lambda: ot.AdamW([("w", torch.zeros(12))], store=self.path("s"), **OPT_KW),
                          "w", self.path("s"), "10", "12")


if __name__ == "__main__":
    unittest.main()
