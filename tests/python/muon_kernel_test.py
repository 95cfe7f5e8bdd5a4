"""Muon's kernel (liboptstate_kernels_capi.so: MuonStepCpu, and MuonStepCuda where a GPU is visible)
against a plain torch Muon written here from Keller Jordan's reference (muon.py:
zeropower_via_newtonschulz5 and muon_update, momentum as an EMA with Nesterov, NS5 with his quintic
coefficients, p *= 1 - lr wd, then p -= lr x update) with both shape scales (Keller's
sqrt(max(1, rows/cols)) and Moonlight's 0.2 sqrt(max(rows, cols))). 25 steps of two matrices (one
tall, one wide) with their own lr and weight decay, an LR schedule, a matrix that skips steps; the
reference runs in float64."""
import ctypes
import math
import os
import unittest

import torch

LIB = os.environ.get("OPTSTATE_KERNELS_LIB")
STEPS = 25
F32, BF16 = 0, 1
NONE = 255


def zeropower_via_newtonschulz5(g, steps=5, eps=1e-7):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        am = x @ x.T
        bm = b * am + c * am @ am
        x = a * x + bm @ x
    return x.T if tall else x


def muon_update(grad, momentum, beta, nesterov, scale):
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp(momentum, beta) if nesterov else momentum.clone()
    update = zeropower_via_newtonschulz5(update)
    rows, cols = grad.shape
    if scale == "keller":
        return update * max(1.0, rows / cols) ** 0.5
    return update * 0.2 * math.sqrt(max(rows, cols))


def load():
    lib = ctypes.CDLL(LIB)
    vp, u64, dbl, i = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_double, ctypes.c_int
    lib.optstate_muon_workspace_bytes.restype = u64
    lib.optstate_muon_workspace_bytes.argtypes = [u64, u64]
    common = [vp, vp, i, vp, i, vp, i, vp, u64, u64, dbl, dbl, i, dbl, i, i, ctypes.c_float, vp]
    lib.optstate_muon_step_cpu.restype = i
    lib.optstate_muon_step_cpu.argtypes = common + [i]
    lib.optstate_muon_step.restype = i
    lib.optstate_muon_step.argtypes = common + [vp]
    lib.optstate_kernels_cuda_built.restype = i
    return lib


@unittest.skipIf(not LIB, "OPTSTATE_KERNELS_LIB is not set (ctest sets it)")
class MuonKernelTest(unittest.TestCase):
    # name: (shape, lr, weight decay, which steps have a grad)
    MATRICES = {
        "tall": ((48, 20), 0.02, 0.1, lambda s: True),
        "wide": ((16, 40), 0.05, 0.0, lambda s: s % 3 != 0),
    }

    def run_case(self, scale, nesterov, device):
        lib = load()
        gen = torch.Generator().manual_seed(5)
        ours, ref, ours_m, ref_m, ws = {}, {}, {}, {}, {}
        for name, (shape, _, _, _) in self.MATRICES.items():
            init = 0.1 * torch.randn(shape, generator=gen)
            ours[name] = init.clone().to(device)
            ref[name] = init.double()
            ours_m[name] = torch.zeros(shape, device=device)
            ref_m[name] = torch.zeros(shape, dtype=torch.float64)
            nbytes = lib.optstate_muon_workspace_bytes(*shape)
            ws[name] = torch.empty(nbytes // 8 + 32, dtype=torch.float64, device=device)
        worst = 0.0
        for s in range(1, STEPS + 1):
            lr_factor = 1.0 / (1.0 + 0.1 * s)  # the schedule
            for name, (shape, lr, wd, has) in self.MATRICES.items():
                g = torch.randn(shape, generator=gen) + 0.5 * torch.randn(shape[0], 1, generator=gen)
                if not has(s):
                    continue
                lr_s = lr * lr_factor
                gd = g.to(device)
                # The workspace must be 256-byte aligned: offset into the allocation.
                base = ws[name].data_ptr()
                aligned = (base + 255) // 256 * 256
                args = (ours[name].data_ptr(), ours_m[name].data_ptr(), F32, gd.data_ptr(), F32, None, NONE, None,
                        shape[0], shape[1], lr_s, 0.95, 1 if nesterov else 0, wd, 5,
                        1 if scale == "keller" else 0, 1.0, aligned)
                if device == "cpu":
                    self.assertEqual(lib.optstate_muon_step_cpu(*args, 2), 0)
                else:
                    stream = torch.cuda.current_stream().cuda_stream
                    self.assertEqual(lib.optstate_muon_step(*args, stream), 0)
                    torch.cuda.synchronize()
                u = muon_update(g.double(), ref_m[name], 0.95, nesterov, scale)
                ref[name].mul_(1 - lr_s * wd).add_(u, alpha=-lr_s)
                # Bound: the update's largest entry is ~lr x scale (0.02-0.2 here); fp32 state against
                # float64 differs by ~1e-6 of it per step, 2.6e-5 after 25 (NS5 amplifies the rounding of small singular
                # directions), a wrong coefficient, scale or momentum form by O(1) of it.
                step = lr_s * (max(1.0, shape[0] / shape[1]) ** 0.5 if scale == "keller"
                               else 0.2 * math.sqrt(max(shape)))
                d = (ours[name].cpu().double() - ref[name]).abs().max().item() / step
                worst = max(worst, d)
                self.assertLess(d, 3e-4 * math.sqrt(s), "%s step %d (%s, nesterov %s, %s)"
                                % (name, s, scale, nesterov, device))
                torch.testing.assert_close(ours_m[name].cpu().double(), ref_m[name], rtol=1e-5, atol=1e-6)
        return worst

    def test_cpu_kernel_follows_keller_jordans_muon(self):
        for scale in ("keller", "moonlight"):
            for nesterov in (True, False):
                with self.subTest(scale=scale, nesterov=nesterov):
                    self.run_case(scale, nesterov, "cpu")

    @unittest.skipIf(not torch.cuda.is_available(), "no GPU visible")
    def test_cuda_kernel_follows_keller_jordans_muon(self):
        if not load().optstate_kernels_cuda_built():
            self.skipTest("the library was built without CUDA")
        for scale in ("keller", "moonlight"):
            with self.subTest(scale=scale):
                self.run_case(scale, True, "cuda")


if __name__ == "__main__":
    unittest.main()
