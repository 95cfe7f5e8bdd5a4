"""optstate.torch.Lion and optstate.torch.SGD on the cuda backend (skipped without CUDA): params on the
GPU (bf16 model copies and fp32), two groups, params that skip steps, an LR schedule, f32 and bf16
moments, against the host backend (CPU kernels) given the same grads: the kernels are bit-identical,
so every param and every stored field must be equal bit for bit. optstate.torch.Muon likewise, within
a stated bound for its matrices (cuBLAS SGEMM against the CPU's fp64-accumulated products).

    cd tests/python && OPTSTATE_LIB=<build>/capi/liboptstate.so PYTHONPATH=../../python \\
        python3 -m unittest -v gpu_optimizers_test
"""
import unittest

import torch

from common import TempDirTest
import optstate.torch as ot

STEPS = 30
PATTERNS = {
    "always": ((129, 7), 0, lambda s, r: True),
    "every_other": ((1000,), 0, lambda s, r: s % 2 == 0),
    "late": ((5, 40), 1, lambda s, r: s > 10),
    "random": ((4097,), 1, lambda s, r: r < 0.5),
}
KW = dict(budget=64 << 20, chunk_size_bytes=2 << 20)
KINDS = {
    "lion": (ot.Lion, ({"lr": 1e-3, "weight_decay": 0.1}, {"lr": 3e-3, "betas": (0.95, 0.98)}), ("exp_avg",)),
    "sgd": (ot.SGD, ({"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                     {"lr": 0.02, "momentum": 0.8, "dampening": 0.2}), ("momentum_buffer",)),
}


def groups_of(params, per_group):
    return [dict(per_group[g], params=[params[n] for n, (_, gg, _) in PATTERNS.items() if gg == g])
            for g in (0, 1)]


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class GpuOptimizersTest(TempDirTest):
    def test_cuda_backend_equals_host_backend(self):
        for kind, (cls, per_group, fields) in KINDS.items():
            for moment_dtype in ("f32", "bf16"):
                for dtype in (torch.float32, torch.bfloat16):
                    with self.subTest(kind=kind, moment_dtype=moment_dtype, dtype=dtype):
                        self.compare(kind, cls, per_group, fields, moment_dtype, dtype)

    def compare(self, kind, cls, per_group, fields, moment_dtype, dtype):
        torch.manual_seed(0)
        init = {n: torch.randn(shape) for n, (shape, _, _) in PATTERNS.items()}
        dev = {n: t.to("cuda", dtype) for n, t in init.items()}
        host = {n: t.to(dtype) for n, t in init.items()}
        tag = "%s-%s-%s" % (kind, moment_dtype, str(dtype).split(".")[-1])
        a = cls(groups_of(dev, per_group), store=self.path("cuda-" + tag), backend="cuda",
                moment_dtype=moment_dtype, **KW)
        b = cls(groups_of(host, per_group), store=self.path("host-" + tag), backend="host",
                moment_dtype=moment_dtype, **KW)
        sa = torch.optim.lr_scheduler.LambdaLR(a, lambda k: 0.97 ** k)
        sb = torch.optim.lr_scheduler.LambdaLR(b, lambda k: 0.97 ** k)
        gen = torch.Generator().manual_seed(1)
        try:
            for s in range(1, STEPS + 1):
                draws = torch.rand(len(PATTERNS), generator=gen).tolist()
                for (name, (shape, _, has)), r in zip(PATTERNS.items(), draws):
                    g = torch.randn(shape, generator=gen).to(dtype)
                    dev[name].grad = g.to("cuda") if has(s, r) else None
                    host[name].grad = g if has(s, r) else None
                a.step()
                b.step()
                sa.step()
                sb.step()
                for name in PATTERNS:
                    self.assertTrue(torch.equal(dev[name].cpu(), host[name]), "%s %s step %d" % (tag, name, s))
            for name in PATTERNS:
                for field in ("main",) + fields:
                    self.assertTrue(torch.equal(a.read_state(dev[name], field), b.read_state(host[name], field)),
                                    "%s %s %s" % (tag, name, field))
                self.assertEqual(a.param_step_count(dev[name]), b.param_step_count(host[name]))
        finally:
            a.close()
            b.close()

    def test_muon_cuda_backend_against_host_backend(self):
        """Muon for the 2-D params, AdamW for the rest. The grads are given, so each Muon matrix's
        momentum_buffer (elementwise, one header for both builds) and every AdamW param and moment are
        bit-identical; a Muon matrix's update differs by Newton-Schulz's summation order: per step at
        most 1e-3 of the step's largest entry (kernels_gpu_test's bound), |O| <= 2, so after the steps
        |main_cuda - main_host| <= sum over its steps of 2e-3 x lr x ratio (differences only shrink
        under the weight decay), plus a bf16 ulp of the param for a bf16 model copy."""
        for moment_dtype in ("f32", "bf16"):
            for dtype in (torch.float32, torch.bfloat16):
                with self.subTest(moment_dtype=moment_dtype, dtype=dtype):
                    self.compare_muon(moment_dtype, dtype)

    def compare_muon(self, moment_dtype, dtype):
        per_group = ({"lr": 0.02, "weight_decay": 0.1}, {"lr": 0.01, "adjust_lr_fn": "match_rms_adamw"})
        torch.manual_seed(0)
        init = {n: torch.randn(shape) for n, (shape, _, _) in PATTERNS.items()}
        dev = {n: t.to("cuda", dtype) for n, t in init.items()}
        host = {n: t.to(dtype) for n, t in init.items()}
        tag = "muon-%s-%s" % (moment_dtype, str(dtype).split(".")[-1])
        a = ot.Muon(groups_of(dev, per_group), store=self.path("cuda-" + tag), backend="cuda",
                    moment_dtype=moment_dtype, **KW)
        b = ot.Muon(groups_of(host, per_group), store=self.path("host-" + tag), backend="host",
                    moment_dtype=moment_dtype, **KW)
        sa = torch.optim.lr_scheduler.LambdaLR(a, lambda k: 0.97 ** k)
        sb = torch.optim.lr_scheduler.LambdaLR(b, lambda k: 0.97 ** k)
        gen = torch.Generator().manual_seed(1)
        bound = {n: 0.0 for n in PATTERNS}
        try:
            for s in range(1, STEPS + 1):
                draws = torch.rand(len(PATTERNS), generator=gen).tolist()
                for (name, (shape, gid, has)), r in zip(PATTERNS.items(), draws):
                    g = torch.randn(shape, generator=gen).to(dtype)
                    dev[name].grad = g.to("cuda") if has(s, r) else None
                    host[name].grad = g if has(s, r) else None
                    if has(s, r) and len(shape) == 2:
                        group = b.param_groups[gid]
                        rows, cols = shape
                        ratio = (0.2 * max(rows, cols) ** 0.5 if group["adjust_lr_fn"] == "match_rms_adamw"
                                 else max(1.0, rows / cols) ** 0.5)
                        bound[name] += 2e-3 * group["lr"] * ratio
                a.step()
                b.step()
                sa.step()
                sb.step()
            for name, (shape, _, _) in PATTERNS.items():
                pa, pb = a.read_state(dev[name], "main"), b.read_state(host[name], "main")
                if len(shape) == 2:
                    self.assertLessEqual((pa - pb).abs().max().item(), bound[name], "%s %s main" % (tag, name))
                    ulp = pb.abs() * 2.0 ** -7 if dtype == torch.bfloat16 else torch.zeros_like(pb)
                    self.assertTrue(((dev[name].cpu().float() - host[name].float()).abs()
                                     <= bound[name] + ulp).all(), "%s %s param" % (tag, name))
                    fields = ("momentum_buffer",)
                else:
                    self.assertTrue(torch.equal(pa, pb), "%s %s main" % (tag, name))
                    self.assertTrue(torch.equal(dev[name].cpu(), host[name]), "%s %s param" % (tag, name))
                    fields = ("exp_avg", "exp_avg_sq")
                for field in fields:
                    self.assertTrue(torch.equal(a.read_state(dev[name], field), b.read_state(host[name], field)),
                                    "%s %s %s" % (tag, name, field))
                self.assertEqual(a.param_step_count(dev[name]), b.param_step_count(host[name]))
        finally:
            a.close()
            b.close()


if __name__ == "__main__":
    unittest.main()
