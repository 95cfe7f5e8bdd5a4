"""Pinned ranges of the state: optstate.MemoryManager.pin over the C ABI and
optstate.torch.AdamW.pin. Values read through a pin equal the committed
state read from the store; writes through a write or read-write pin are in
the store after unpin + commit, and the next step continues from them."""
import ctypes
import unittest

import numpy as np
import torch

from common import OPT_KW, STORE_KW, TempDirTest, optstate
import optstate.torch as ot

# 2 MiB chunks hold 524288 fp32: a param of 600000 spans two chunks.
BIG = 600_000
EDGE = 524_288


def det_grad(numel, step, salt=0):
    """The gradient of a step, a function of the step number alone."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + salt))


class AdamWPinTest(TempDirTest):
    def trained(self, name="s", steps=3):
        torch.manual_seed(0)
        big = torch.nn.Parameter(torch.randn(BIG))
        small = torch.nn.Parameter(torch.randn(30, 7))
        opt = ot.AdamW([("big", big), ("small", small)], store=self.path(name), lr=1e-2, weight_decay=0.1,
                       **OPT_KW)
        for k in range(1, steps + 1):
            self.step(opt, [big, small], k)
        return opt, big, small

    def step(self, opt, params, k):
        for i, p in enumerate(params):
            p.grad = det_grad(p.numel(), k, i).view(p.shape)
        opt.step()

    def test_read_pin_equals_read_state(self):
        opt, big, small = self.trained()
        for field in ("main", "exp_avg", "exp_avg_sq"):
            ref_big, ref_small = opt.read_state(big, field), opt.read_state(small, field)
            self.assertGreater(ref_big.abs().max().item(), 0)  # a field of zeros would prove nothing
            with opt.pin(big, field) as t:
                self.assertEqual((t.shape, t.dtype, t.device), (big.shape, torch.float32, torch.device("cpu")))
                self.assertTrue(torch.equal(t, ref_big))
            # A range across the chunk edge, and a param given by its name.
            with opt.pin("big", field, EDGE - 1000, EDGE + 2000) as t:
                self.assertEqual(tuple(t.shape), (3000,))
                self.assertTrue(torch.equal(t, ref_big[EDGE - 1000:EDGE + 2000]))
            with opt.pin(small, field) as t:
                self.assertTrue(torch.equal(t, ref_small))
        # The tensor is emptied at exit: nothing is left over memory that may be unmapped.
        self.assertEqual(t.numel(), 0)
        self.assertGreaterEqual(opt.stats()["pins"], 9)

    def test_write_pin_is_committed_and_the_next_step_uses_it(self):
        opt, big, small = self.trained()
        gen, counts = opt.generation, opt.step_count()
        new_m = torch.linspace(-1, 1, BIG)
        with opt.pin(big, "exp_avg", access="write") as t:
            t.copy_(new_m)
        self.assertGreater(opt.generation, gen)
        self.assertEqual(opt.step_count(), counts)  # a write through a pin is not a training step
        self.assertTrue(torch.equal(opt.read_state(big, "exp_avg"), new_m))
        # Read-write: the range is loaded, doubled in place; the rest of the field is untouched.
        main_before = opt.read_state(big, "main").clone()
        with opt.pin(big, "main", EDGE - 10, EDGE + 10, access="readwrite") as t:
            self.assertTrue(torch.equal(t, main_before[EDGE - 10:EDGE + 10]))
            t.mul_(2)
        want = main_before.clone()
        want[EDGE - 10:EDGE + 10] *= 2
        self.assertTrue(torch.equal(opt.read_state(big, "main"), want))
        self.assertTrue(torch.equal(big.detach(), want))  # a written main is the model's weight too
        # The store holds it for a new process: closed and reopened.
        opt.close()
        store = optstate.Store(self.path("s"), **STORE_KW)
        np.testing.assert_array_equal(store.read("big", "exp_avg"), new_m.numpy())
        np.testing.assert_array_equal(store.read("big", "main"), want.numpy())
        self.assertEqual(store.group_step_count(0), counts)
        store.close()

    def test_step_after_pinned_writes_equals_independent_paths(self):
        # Optimizer A gets new mains through a write pin; optimizer B, trained alike, gets the same values
        # through its params and load_main_from_params (another code path). Their next steps must agree
        # bit for bit, in params and in the store.
        a, a_big, a_small = self.trained("a")
        b, b_big, b_small = self.trained("b")
        new_main = torch.randn(BIG, generator=torch.Generator().manual_seed(5))
        with a.pin(a_big, "main", access="write") as t:
            t.copy_(new_main)
        with torch.no_grad():
            b_big.copy_(new_main)
        b.load_main_from_params()
        self.step(a, [a_big, a_small], 4)
        self.step(b, [b_big, b_small], 4)
        self.assertTrue(torch.equal(a_big, b_big))
        for field in ("main", "exp_avg", "exp_avg_sq"):
            self.assertTrue(torch.equal(a.read_state(a_big, field), b.read_state(b_big, field)), field)
        self.assertEqual(a.step_count(), 4)

    def test_commit_false_defers_to_the_next_commit(self):
        opt, big, small = self.trained()
        gen = opt.generation
        with opt.pin(small, "exp_avg_sq", access="write", commit=False) as t:
            t.fill_(0.5)
        self.assertEqual(opt.generation, gen)
        self.assertFalse(torch.equal(opt.read_state(small, "exp_avg_sq"), torch.full((30, 7), 0.5)))
        self.assertGreater(opt.commit(), gen)
        self.assertTrue(torch.equal(opt.read_state(small, "exp_avg_sq"), torch.full((30, 7), 0.5)))
        self.assertEqual(opt.commit(), opt.generation)  # nothing pending: no new generation

    def test_bad_pins_and_pinned_steps_fail_cleanly(self):
        opt, big, small = self.trained()
        with self.assertRaises(optstate.NotFound) as cm:
            with opt.pin(big, "exp_avg_cubed"):
                pass
        self.assertIn("exp_avg_cubed", str(cm.exception))
        self.assertIn(self.path("s"), str(cm.exception))
        with self.assertRaises(optstate.InvalidArgument):
            with opt.pin(big, "main", 10, BIG + 1):
                pass
        with self.assertRaises(optstate.InvalidArgument):
            with opt.pin(big, "main", access="sideways"):
                pass
        with self.assertRaises(optstate.NotFound):
            with opt.pin(torch.zeros(3), "main"):
                pass
        with self.assertRaises(optstate.NotFound):
            with opt.pin("nope", "main"):
                pass
        # A step over a pinned param fails and commits nothing; sleep fails too.
        gen = opt.generation
        before = big.detach().clone()
        with opt.pin(big, "exp_avg", 0, 10):
            with self.assertRaises(optstate.FailedPrecondition) as cm:
                self.step(opt, [big, small], 4)
            self.assertIn("pinned", str(cm.exception))
            with self.assertRaises(optstate.FailedPrecondition):
                opt.sleep()
        self.assertEqual((opt.generation, opt.step_count()), (gen, 3))
        self.assertTrue(torch.equal(big.detach(), before))
        # Unpinned: the same step runs.
        self.step(opt, [big, small], 4)
        self.assertEqual(opt.step_count(), 4)
        # A range larger than the whole budget fails at once.
        tight = ot.AdamW([torch.nn.Parameter(torch.zeros(4 * EDGE))], store=self.path("t"),
                         **dict(OPT_KW, budget=6 << 20))
        with self.assertRaises(optstate.ResourceExhausted):
            with tight.pin("param0", "main"):
                pass
        tight.close()


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device visible to torch: the cuda backend's pins")
class CudaPinTest(TempDirTest):
    """The cuda backend: the pinned range is device memory, seen by torch through __cuda_array_interface__."""

    def test_device_pins_read_and_write(self):
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(0)
        big = torch.nn.Parameter(torch.randn(BIG, device=dev))
        half = torch.nn.Parameter(torch.randn(64, 3, device=dev).to(torch.bfloat16))
        opt = ot.AdamW([("big", big), ("half", half)], store=self.path("s"), lr=1e-2,
                       **dict(OPT_KW, backend="cuda"))
        for k in range(1, 4):
            big.grad = det_grad(BIG, k).to(dev)
            half.grad = det_grad(half.numel(), k, 1).view(64, 3).to(dev, torch.bfloat16)
            opt.step()
        for p in (big, half):
            for field in ("main", "exp_avg", "exp_avg_sq"):
                with opt.pin(p, field) as t:
                    self.assertEqual((t.device, t.dtype, t.shape), (dev, torch.float32, p.shape))
                    self.assertTrue(torch.equal(t.cpu(), opt.read_state(p, field)), field)
        main = opt.read_state(big, "main").clone()
        with opt.pin(big, "main", EDGE - 10, EDGE + 10, access="readwrite") as t:
            t.mul_(2)  # a kernel on torch's stream: finished before the range is unpinned
        main[EDGE - 10:EDGE + 10] *= 2
        self.assertTrue(torch.equal(opt.read_state(big, "main"), main))
        self.assertTrue(torch.equal(big.detach().cpu(), main))
        self.assertEqual(opt.step_count(), 3)
        opt.close()


class ManagerPinTest(TempDirTest):
    """The same through the package's thin handles (no torch on the hot path)."""

    def test_commit_right_after_a_pipelined_step_publishes_pinned_writes(self):
        """commit() while the last step's commit may still run (commit_lag_steps 1) publishes both the
        step and the chunks written through a pin since, as two generations."""
        store = optstate.Store(self.path("s"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
        adam = optstate.StreamedAdam(store, mm)
        w = np.arange(BIG, dtype=np.float32)
        pid, _ = adam.register_param("w", BIG, 0, w.ctypes.data, optstate.F32)
        g = np.ones(BIG, dtype=np.float32)
        gen0 = adam.make_durable()
        adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32])
        r = mm.pin("w", "exp_avg", EDGE, 4, access=optstate.WRITE)
        (ctypes.c_float * 4).from_address(r.data_ptr)[:] = [1.0, 2.0, 3.0, 4.0]
        r.unpin()
        self.assertEqual(adam.commit(), gen0 + 2)
        np.testing.assert_array_equal(store.read("w", "exp_avg", EDGE, 4), [1, 2, 3, 4])
        self.assertEqual(store.latest_generation(), (gen0 + 2, 1))
        store.close()

    def test_pin_write_flush_commit_and_close_with_pins_held(self):
        store = optstate.Store(self.path("s"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
        adam = optstate.StreamedAdam(store, mm)
        w = np.arange(BIG, dtype=np.float32)
        pid, _ = adam.register_param("w", BIG, 0, w.ctypes.data, optstate.F32)
        g = np.ones(BIG, dtype=np.float32)
        adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32])
        gen = adam.make_durable()  # the step's commit may still run in the background (commit_lag_steps 1)
        with mm.pin("w", "main", EDGE - 4, 8) as r:
            self.assertEqual((r.count, r.size_bytes, r.dtype, r.stream), (8, 32, optstate.F32, None))
            got = np.ctypeslib.as_array((ctypes.c_float * 8).from_address(r.data_ptr))
            np.testing.assert_array_equal(got, store.read("w", "main", EDGE - 4, 8))
        self.assertFalse(r.pinned)
        with self.assertRaises(optstate.FailedPrecondition):
            r.data_ptr
        r = mm.pin("w", "exp_avg", EDGE, 4, access=optstate.WRITE)
        (ctypes.c_float * 4).from_address(r.data_ptr)[:] = [1.0, 2.0, 3.0, 4.0]
        r.unpin()
        mm.flush()
        self.assertGreater(store.stats()["pending_bytes"], 0)  # written, not yet published
        self.assertNotEqual(list(store.read("w", "exp_avg", EDGE, 4)), [1, 2, 3, 4])
        self.assertEqual(adam.commit(), gen + 1)
        np.testing.assert_array_equal(store.read("w", "exp_avg", EDGE, 4), [1, 2, 3, 4])
        self.assertEqual(store.latest_generation(), (gen + 1, 1))  # the trainer step of the last commit
        self.assertEqual(adam.step_count(0), 1)
        # Pins still held when the store closes are released with their manager; unpin is then a no-op.
        held = mm.pin("w", "exp_avg_sq", 0, 16)
        store.close()
        self.assertFalse(held.pinned)
        held.unpin()
        with optstate.Store(self.path("s"), **STORE_KW) as again:  # the lock was released
            self.assertEqual(again.latest_generation()[0], gen + 1)

if __name__ == "__main__":
    unittest.main()
