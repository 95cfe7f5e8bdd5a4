"""torch's real GradScaler with optstate.torch.AdamW on a GPU (skipped without
CUDA): fp16 autocast training, one forced inf step, and every other step
against torch.optim.AdamW(foreach=False) given the same unscaled gradients.

    cd tests/python && OPTSTATE_LIB=<build>/capi/liboptstate.so PYTHONPATH=../../python \\
        python3 -m unittest -v gpu_amp_test
"""
import unittest

import torch

from common import TempDirTest
import optstate.torch as ot


def make_scaler():
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        try:
            return torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, growth_interval=1000)
        except TypeError:  # torch.amp.GradScaler without a device argument
            pass
    return torch.cuda.amp.GradScaler(init_scale=2.0 ** 16, growth_interval=1000)


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class GpuAmpTest(TempDirTest):
    def test_grad_scaler_inf_step_and_reference(self):
        """Tolerance 1e-5 absolute on params of magnitude < 1: the kernel's operation order differs
        from torch's single-tensor AdamW by a few fp32 ulps a step (torch_adamw_test), 30 steps.
        Unscaling is exact (the scale is a power of two), so the grads the two optimizers see are
        the same values."""
        dev = torch.device("cuda")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                    torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dev)
        ref_params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.01, foreach=False)
        opt = ot.AdamW(list(model.named_parameters()), store=self.path("s"), backend="cuda", budget=64 << 20,
                       chunk_size_bytes=2 << 20, lr=1e-3, weight_decay=0.01)
        scaler = make_scaler()
        gen = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(128, 64, device=dev, generator=gen)
        y = torch.randn(128, 8, device=dev, generator=gen)
        worst, skipped = 0.0, 0
        for step in range(30):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            hook = None
            if step == 5:  # one overflow, as a real fp16 run meets it
                hook = model[0].weight.register_hook(lambda g: g * float("inf"))
            scaler.scale(loss).backward()
            if hook is not None:
                hook.remove()
            scale = scaler.get_scale()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            finite = all(torch.isfinite(g).all().item() for g in grads)
            before = [p.detach().clone() for p in model.parameters()]
            gen_before, count_before = opt.generation, opt.step_count()
            scaler.step(opt)
            scaler.update()
            if not finite:
                skipped += 1
                self.assertTrue(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
                self.assertEqual((opt.generation, opt.step_count()), (gen_before, count_before))
                self.assertEqual(scaler.get_scale(), scale / 2)
                continue
            for rp, g in zip(ref_params, grads):
                rp.grad = g / scale  # exact: a power of two
            ref.step()
            worst = max(worst, max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref_params)))
            self.assertLess(worst, 1e-5, "step %d" % step)
        self.assertEqual(skipped, 1)
        self.assertEqual(opt.step_count(), 29)
        self.assertEqual(scaler.get_scale(), 2.0 ** 15)  # halved once; no growth within 1000 steps
        print("GradScaler + optstate AdamW: 29 steps, 1 skipped, max |param - reference| = %.3g" % worst)
        opt.close()


if __name__ == "__main__":
    unittest.main()
