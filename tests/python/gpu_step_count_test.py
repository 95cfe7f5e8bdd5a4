"""Per-param step counts on the cuda backend (skipped without CUDA): params on the GPU that skip
steps in patterns, against torch.optim.AdamW on float64 copies for f32 moments, and for bf16 and q8
moments the cuda backend against the host backend (CPU kernels) given the same grads.

    cd tests/python && OPTSTATE_LIB=<build>/capi/liboptstate.so PYTHONPATH=../../python \\
        python3 -m unittest -v gpu_step_count_test
"""
import math
import unittest

import torch

from common import TempDirTest
import optstate.torch as ot

STEPS = 200
# name: (shape, group, which steps have a grad)
PATTERNS = {
    "always": ((129, 7), 0, lambda s, r: True),
    "every_other": ((1000,), 0, lambda s, r: s % 2 == 0),
    "late": ((5, 40), 0, lambda s, r: s > 60),
    "random": ((4097,), 1, lambda s, r: r < 0.5),
    "rare": ((3, 11), 1, lambda s, r: r < 0.05),
}
BASE = ({"lr": 1e-3, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.01})
KW = dict(budget=64 << 20, chunk_size_bytes=2 << 20)


def groups_of(params):
    return [dict(BASE[g], params=[params[n] for n, (_, gg, _) in PATTERNS.items() if gg == g]) for g in (0, 1)]


def grads(gen, s):
    """Step s's grads (None for a param that skips it), drawn on the CPU so every run sees the same."""
    draws = torch.rand(len(PATTERNS), generator=gen).tolist()
    out = {}
    for (name, (shape, _, has)), r in zip(PATTERNS.items(), draws):
        g = torch.randn(shape, generator=gen)
        out[name] = g if has(s, r) else None
    return out


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class GpuStepCountTest(TempDirTest):
    def test_f32_moments_follow_torch_adamw(self):
        """Bound as step_count_test's (fp32 against float64, unbiased roundings): 3.5e-7 x sqrt(s)
        relative to max(1, |p|). A param bias-corrected with its group's count moves by lr x 0.36
        or more in one step."""
        dev = torch.device("cuda")
        torch.manual_seed(0)
        init = {n: torch.randn(shape) for n, (shape, _, _) in PATTERNS.items()}
        ours = {n: t.to(dev) for n, t in init.items()}
        theirs = {n: t.double().to(dev) for n, t in init.items()}
        ref = torch.optim.AdamW(groups_of(theirs), foreach=False)
        opt = ot.AdamW(groups_of(ours), store=self.path("s"), backend="cuda", **KW)
        gen = torch.Generator().manual_seed(1)
        try:
            for s in range(1, STEPS + 1):
                for name, g in grads(gen, s).items():
                    ours[name].grad = None if g is None else g.to(dev)
                    theirs[name].grad = None if g is None else g.double().to(dev)
                opt.step()
                ref.step()
                for name in PATTERNS:
                    d = ((ours[name].double() - theirs[name]).abs() / theirs[name].abs().clamp(min=1)).max().item()
                    self.assertLess(d, 3.5e-7 * math.sqrt(s), "%s step %d" % (name, s))
            for name in PATTERNS:
                q = theirs[name]
                want = int(ref.state[q]["step"].item()) if q in ref.state else 0
                self.assertEqual(opt.param_step_count(ours[name]), want, name)
            self.assertLess(opt.param_step_count(ours["rare"]), STEPS // 5)
        finally:
            opt.close()

    def _run(self, backend, moment_dtype):
        dev = torch.device("cuda" if backend == "cuda" else "cpu")
        torch.manual_seed(0)
        params = {n: torch.randn(shape).to(dev) for n, (shape, _, _) in PATTERNS.items()}
        opt = ot.AdamW(groups_of(params), store=self.path(backend + moment_dtype), backend=backend,
                       moment_dtype=moment_dtype, **KW)
        gen = torch.Generator().manual_seed(1)
        try:
            for s in range(1, STEPS + 1):
                for name, g in grads(gen, s).items():
                    params[name].grad = None if g is None else g.to(dev)
                opt.step()
            counts = {n: opt.param_step_count(params[n]) for n in PATTERNS}
            moments = {n: {k: v.cpu() for k, v in opt.state[params[n]].items()}
                       for n in PATTERNS if params[n] in opt.state}
        finally:
            opt.close()
        return {n: p.cpu() for n, p in params.items()}, counts, moments

    def _check_against_host(self, moment_dtype):
        """The cuda and host kernels compute the same math in another operation order (fused
        multiply-adds): params within 1e-5 relative to max(1, |p|) after 200 steps, the narrowed
        moments within one step of their storage's rounding (bf16: 2^-7 relative to the tensor's
        scale; q8: 2 x the map's largest gap, 0.0142, of the scale), the counts equal."""
        gpu = self._run("cuda", moment_dtype)
        cpu = self._run("host", moment_dtype)
        self.assertEqual(gpu[1], cpu[1])
        self.assertNotEqual(len(set(gpu[1].values())), 1, "the patterns give the params different counts")
        for name in PATTERNS:
            d = ((gpu[0][name].double() - cpu[0][name].double()).abs()
                 / cpu[0][name].double().abs().clamp(min=1)).max().item()
            self.assertLess(d, 1e-5, name)
        rel = 2.0 ** -7 if moment_dtype == "bf16" else 0.0142
        self.assertEqual(sorted(gpu[2]), sorted(cpu[2]))
        for name, state in cpu[2].items():
            self.assertEqual(state["step"].item(), gpu[2][name]["step"].item(), name)
            for key in ("exp_avg", "exp_avg_sq"):
                scale = state[key].abs().max().item()
                torch.testing.assert_close(gpu[2][name][key], state[key], rtol=0, atol=rel * scale,
                                           msg=lambda m: "%s %s: %s" % (name, key, m))

    def test_bf16_moments_cuda_equals_host(self):
        self._check_against_host("bf16")

    def test_q8_moments_cuda_equals_host(self):
        self._check_against_host("q8")


if __name__ == "__main__":
    unittest.main()
