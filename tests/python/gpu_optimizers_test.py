"""optstate.torch.Lion and optstate.torch.SGD on the cuda backend (skipped without CUDA): params on the
GPU (bf16 model copies and fp32), two groups, params that skip steps, an LR schedule, f32 and bf16
moments, against the host backend (CPU kernels) given the same grads: the kernels are bit-identical,
so every param and every stored field must be equal bit for bit.

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


if __name__ == "__main__":
    unittest.main()
