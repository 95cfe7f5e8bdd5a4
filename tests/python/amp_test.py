"""Loss scaling (torch's GradScaler contract) on CPU: GradScaler itself runs only
with CUDA here, so these tests hand the optimizer what GradScaler.step hands a
`_step_supports_amp_scaling` optimizer: the `grad_scale` / `found_inf`
attributes (torch >= 2.0) or itself as `grad_scaler=` (torch < 2.0).
tests/python/gpu_amp_test.py runs the real GradScaler on a GPU."""
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.torch as ot
from torch_adamw_test import make_model, two_groups


def grads_of(model, x, y):
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


class _Stage:
    def __init__(self, name):
        self.name = name


class FakeScalerV1:
    """The parts of torch < 2.0's GradScaler that a step given grad_scaler= uses, in plain torch
    (its own _check_inf_per_device needs a CUDA kernel)."""

    def __init__(self, opt, scale, stage="READY"):
        self._scale = torch.full((1,), scale, dtype=torch.float32)
        self._per_optimizer_states = {id(opt): {"stage": _Stage(stage), "found_inf_per_device": {}}}
        self.checked = 0

    def _check_inf_per_device(self, opt):
        self.checked += 1
        found = torch.zeros(1)
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    found.fill_(1.0)
        self._per_optimizer_states[id(opt)]["found_inf_per_device"] = {found.device: found}

    def _get_scale_async(self):
        return self._scale


class AmpTest(TempDirTest):
    def setUp(self):
        super().setUp()
        gen = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)

    def test_declares_amp_scaling_without_a_grad_scaler_parameter(self):
        # torch >= 2.0's GradScaler sets the attributes only when step() has no `grad_scaler` parameter.
        import inspect
        self.assertTrue(ot.AdamW._step_supports_amp_scaling)
        self.assertNotIn("grad_scaler", inspect.signature(ot.AdamW.step).parameters)

    def test_scaled_steps_equal_unscaled_steps_bit_for_bit(self):
        """Grads scaled by 2**k with opt.grad_scale = 2**k (as GradScaler sets it) step exactly as the
        unscaled grads do; both follow torch.optim.AdamW within the fp32 tolerance of
        torch_adamw_test (1e-5: operation order differs by a few ulps a step)."""
        scaled_model, plain_model, ref_model = make_model(0), make_model(0), make_model(0)
        scaled = ot.AdamW(two_groups(scaled_model), store=self.path("scaled"), lr=1e-2, **OPT_KW)
        plain = ot.AdamW(two_groups(plain_model), store=self.path("plain"), lr=1e-2, **OPT_KW)
        ref = torch.optim.AdamW(two_groups(ref_model), lr=1e-2, foreach=False)
        for k in (16, 10, 3, 0, 12, 7):
            g = grads_of(ref_model, self.x, self.y)
            ref.step()
            for p, gi in zip(plain_model.parameters(), g):
                p.grad = gi.clone()
            plain.step()
            for p, gi in zip(scaled_model.parameters(), g):
                p.grad = gi * 2.0 ** k
            scaled.grad_scale = torch.full((1,), 2.0 ** k)
            scaled.found_inf = torch.zeros(1)
            scaled.step()
            del scaled.grad_scale, scaled.found_inf  # what GradScaler.step does after step()
        for a, b, r in zip(scaled_model.parameters(), plain_model.parameters(), ref_model.parameters()):
            self.assertTrue(torch.equal(a, b))
            for field in ("main", "exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(scaled.read_state(a, field), plain.read_state(b, field)), field)
            torch.testing.assert_close(a, r, rtol=0, atol=1e-5)
        self.assertEqual(scaled.step_count(0), 6)

    def test_found_inf_skips_and_commits_nothing(self):
        model = make_model(0)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), **OPT_KW)
        for p, g in zip(model.parameters(), grads_of(model, self.x, self.y)):
            p.grad = g
        opt.step()
        before = [p.detach().clone() for p in model.parameters()]
        mains = [opt.read_state(p, "exp_avg_sq") for p in model.parameters()]
        gen = opt.generation
        for p in model.parameters():
            p.grad[...] = float("inf")
        opt.grad_scale, opt.found_inf = torch.full((1,), 1024.0), torch.ones(1)
        opt.step()
        del opt.grad_scale
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        self.assertEqual((opt.generation, opt.step_count(), opt.store.latest_generation()[0]), (gen, 1, gen))
        for p, m in zip(model.parameters(), mains):
            self.assertTrue(torch.equal(opt.read_state(p, "exp_avg_sq"), m))
        # A flag that is not one float32 element on the params' device is refused, nothing committed.
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        for bad in (torch.zeros(2), torch.zeros(1, dtype=torch.float64), 3):
            opt.found_inf = bad
            with self.assertRaises(optstate.InvalidArgument) as cm:
                opt.step()
            self.assertIn("found_inf", str(cm.exception))
        opt.found_inf = None
        for bad in (0.0, -1.0, float("inf"), torch.zeros(1)):
            with self.assertRaises(optstate.InvalidArgument) as cm:
                opt.step(grad_scale=bad)
            self.assertIn("grad_scale", str(cm.exception))
        self.assertEqual((opt.generation, opt.step_count()), (gen, 1))

    def test_torch_before_2_contract_grad_scaler_argument(self):
        """torch < 2.0's GradScaler passes itself: the step checks the grads (without unscaling them),
        divides by the scaler's scale, and skips on inf; after a user's unscale_ it does not scale."""
        a_model, b_model = make_model(0), make_model(0)
        a = ot.AdamW(a_model.parameters(), store=self.path("a"), lr=1e-2, **OPT_KW)
        b = ot.AdamW(b_model.parameters(), store=self.path("b"), lr=1e-2, **OPT_KW)
        g = grads_of(a_model, self.x, self.y)
        for p, gi in zip(a_model.parameters(), g):
            p.grad = gi * 256.0
        scaler = FakeScalerV1(a, 256.0)
        a.step(grad_scaler=scaler)
        self.assertEqual(scaler.checked, 1)
        for p, gi in zip(b_model.parameters(), g):
            p.grad = gi.clone()
        b.step()
        self.assertTrue(all(torch.equal(x, y) for x, y in zip(a_model.parameters(), b_model.parameters())))
        # Already unscaled by the user (stage UNSCALED): no scale, the recorded found_inf decides.
        scaler = FakeScalerV1(a, 256.0, stage="UNSCALED")
        scaler._per_optimizer_states[id(a)]["found_inf_per_device"] = {torch.device("cpu"): torch.ones(1)}
        gen = a.generation
        a.step(grad_scaler=scaler)
        self.assertEqual((a.generation, scaler.checked), (gen, 0))
        # An inf grad found by the check skips the step.
        a_model[0].weight.grad[0, 0] = float("inf")
        a.step(grad_scaler=FakeScalerV1(a, 256.0))
        self.assertEqual((a.generation, a.step_count()), (gen, 1))
        with self.assertRaises(TypeError):
            a.step(no_such_argument=1)


if __name__ == "__main__":
    unittest.main()
