"""optstate.torch.Muon (Muon for the 2-D params, AdamW for the rest, in one optimizer) against a plain
torch Muon + AdamW written here from the papers (Keller Jordan's Muon post and reference muon.py with
torch.optim.Muon's eps and lr adjustments; Loshchilov & Hutter's AdamW), in float64: 25 steps with two
groups of their own hyperparameters, an LR schedule, params that skip steps, a close and reopen of the
store in the middle, opt.state[p] as the reference's. With a current torch, also against
torch.optim.Muon + torch.optim.AdamW (whose Newton-Schulz runs in bf16). And what it refuses: a matrix
the device budget cannot hold (named), a non-2-D param in a use_muon group (named)."""
import math
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
from optimizers_test import PATTERNS, Run, STEPS, groups_of
import optstate.torch as ot

COEFFS = (3.4445, -4.7750, 2.0315)


def ref_newton_schulz(u, coeffs, steps, eps):
    """Keller Jordan's zeropower_via_newtonschulz5 in float64, with torch.optim.Muon's eps (the norm
    clamped below at eps): the short side first, X / max(||X||_F, eps), then steps of A = X X^T,
    B = b A + c A A, X = a X + B X."""
    a, b, c = coeffs
    x = u.double()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        am = x @ x.T
        x = a * x + (b * am + c * am @ am) @ x
    return x.T if tall else x


def lr_ratio(adjust, rows, cols):
    if adjust in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(rows / cols)


class RefMuonAdamW(torch.optim.Optimizer):
    """Muon for the params a group's use_muon selects (None: the 2-D ones), AdamW for the rest:
    Muon: m = mu m + (1 - mu) g; u = (1 - mu) g + mu m (Nesterov) or m; p = p (1 - lr wd) - lr ratio NS(u).
    AdamW: m, v EMAs with adamw_betas; p = p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + adamw_eps).
    A param without a grad is skipped and keeps its state (and its AdamW step count)."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=COEFFS,
                 eps=1e-7, ns_steps=5, adjust_lr_fn=None, adamw_betas=(0.9, 0.95), adamw_eps=1e-8):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                                      use_muon=None))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                use = group["use_muon"] if group["use_muon"] is not None else p.ndim == 2
                if use:
                    mu = group["momentum"]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    m = state["momentum_buffer"]
                    m.mul_(mu).add_(g, alpha=1 - mu)
                    u = (1 - mu) * g + mu * m if group["nesterov"] else m
                    o = ref_newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"])
                    p.mul_(1 - lr * wd)
                    p.add_(o, alpha=-lr * lr_ratio(group["adjust_lr_fn"], p.shape[0], p.shape[1]))
                else:
                    b1, b2 = group["adamw_betas"]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    state["step"] += 1
                    k = state["step"].item()
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    m.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    p.mul_(1 - lr * wd)
                    denom = (v.sqrt() / math.sqrt(1 - b2 ** k)).add_(group["adamw_eps"])
                    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** k))


class MuonRun(Run):
    def check_state(self, keys, where):
        """Every key of the reference's state[p] (Muon params: momentum_buffer; AdamW params: step,
        exp_avg, exp_avg_sq) within 1e-5 of the tensor's scale (fp32 against float64); no others."""
        for name in PATTERNS:
            p, q = self.ours[name], self.theirs[name]
            want_state = self.ref.state[q] if q in self.ref.state else {}
            got_keys = set(self.opt.state[p]) if p in self.opt.state else set()
            self.test.assertEqual(got_keys, set(want_state), "%s %s" % (name, where))
            for key, want in want_state.items():
                got = self.opt.state[p][key]
                if key == "step":
                    self.test.assertEqual(float(got), float(want), "%s step %s" % (name, where))
                    continue
                self.test.assertEqual(got.shape, p.shape)
                scale = max(want.abs().max().item(), 1e-3)
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * scale,
                                           msg=lambda m: "%s %s %s: %s" % (name, key, where, m))


class MuonTest(TempDirTest):
    """Bound: Newton-Schulz in fp32 (the CPU kernel accumulates its dot products in fp64) against
    float64: the quintic's slope at zero (a = 3.4445 per iteration, ~140x over 4-5 iterations) amplifies
    the fp32 rounding of its input (2^-24 relative) in the orthogonalised update to a few 1e-6 of its
    entries (|O| <= ~1); a param moves by lr x ratio x O per step (<= 0.05), so a step adds well under
    1e-6 x max(1, |p|); AdamW params as in optimizers_test. Asserted 4e-6 x sqrt(s). A wrong lr
    adjustment (e.g. Keller's ratio 2.17 for the 33x7 matrix where Moonlight's is 1.15), Nesterov term,
    eps or weight decay moves a param by > 1e-3 at once."""

    PER_GROUP = ({"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "adjust_lr_fn": None,
                  "adamw_betas": (0.9, 0.95), "adamw_eps": 1e-8},
                 {"lr": 0.01, "weight_decay": 0.0, "momentum": 0.9, "nesterov": False, "ns_steps": 4,
                  "adjust_lr_fn": "match_rms_adamw", "adamw_betas": (0.8, 0.99), "adamw_eps": 1e-6})

    def test_muon_and_adamw_follow_the_papers(self):
        store = self.path("muon")
        run = MuonRun(self, lambda ps: ot.Muon(groups_of(ps, self.PER_GROUP), store=store, **OPT_KW),
                      lambda ps: RefMuonAdamW(groups_of(ps, self.PER_GROUP)))
        worst = run.run(lambda s: 4e-6 * math.sqrt(s), ())
        self.assertGreater(worst, 0.0)  # compared something

    def test_spectral_adjustment_bf16_moment_and_use_muon(self):
        """adjust_lr_fn "spectral_unclamped", a 2-D param sent to AdamW by use_muon=False, and the
        momentum stored as bf16 (each step's update then differs from an f32 one by the buffer's
        rounding: 2^-8 relative, so the bound is looser)."""
        torch.manual_seed(5)
        w, e, b = (torch.nn.Parameter(torch.randn(12, 30)), torch.nn.Parameter(torch.randn(16, 4)),
                   torch.nn.Parameter(torch.randn(30)))
        mine = [t.detach().clone().requires_grad_(True) for t in (w, e, b)]
        ref_ps = [t.detach().double().clone().requires_grad_(True) for t in (w, e, b)]
        groups = lambda ps: [{"params": [ps[0], ps[2]]}, {"params": [ps[1]], "use_muon": False, "lr": 1e-3}]
        kw = dict(lr=0.02, weight_decay=0.05, adjust_lr_fn="spectral_unclamped")
        for moments, bound in (("f32", 4e-6), ("bf16", 4e-3)):
            with self.subTest(moment_dtype=moments):
                ps = [t.detach().clone().requires_grad_(True) for t in mine]
                rs = [t.detach().clone().requires_grad_(True) for t in ref_ps]
                opt = ot.Muon(groups(ps), store=self.path("s-" + moments), moment_dtype=moments, **kw, **OPT_KW)
                ref = RefMuonAdamW(groups(rs), **kw)
                try:
                    gen = torch.Generator().manual_seed(2)
                    for s in range(1, 11):
                        for p, r in zip(ps, rs):
                            g = torch.randn(p.shape, generator=gen)
                            p.grad, r.grad = g, g.double()
                        opt.step()
                        ref.step()
                        for p, r in zip(ps, rs):
                            torch.testing.assert_close(p.detach().double(), r.detach(), rtol=0,
                                                       atol=bound * math.sqrt(s) * max(1.0, r.abs().max().item()))
                    self.assertEqual(set(opt.state[ps[0]]), {"momentum_buffer"})
                    self.assertEqual(set(opt.state[ps[1]]), {"step", "exp_avg", "exp_avg_sq"})
                    self.assertEqual(set(opt.state[ps[2]]), {"step", "exp_avg", "exp_avg_sq"})
                    stored = opt.read_state(ps[0], "momentum_buffer")
                    if moments == "bf16":
                        self.assertTrue(torch.equal(stored, stored.bfloat16().float()), "stored as bf16")
                finally:
                    opt.close()

    @unittest.skipUnless(hasattr(torch.optim, "Muon"), "torch.optim.Muon needs torch >= 2.9")
    def test_against_torch_optim_muon(self):
        """torch.optim.Muon for the matrices, torch.optim.AdamW for the rest, same hyperparameters and
        grads: torch's Newton-Schulz runs in bf16 (8 bits of mantissa), ours in fp32, so the updates of a
        matrix agree to ~1% of their size; asserted: after 25 steps each param within 3% of how far it
        moved, and the momentum buffers (elementwise, fp32 on both sides) within 1e-6 of their scale.
        A wrong lr adjustment, Nesterov term or weight decay is off by 10% or more."""
        torch.manual_seed(7)
        shapes = {"w1": (48, 16), "w2": (16, 40), "b": (40,)}
        init = {n: torch.randn(s) * 0.1 for n, s in shapes.items()}
        ours = {n: t.clone().requires_grad_(True) for n, t in init.items()}
        theirs = {n: t.clone().requires_grad_(True) for n, t in init.items()}
        for adjust in ("original", "match_rms_adamw"):
            with self.subTest(adjust_lr_fn=adjust):
                for d in (ours, theirs):
                    for n in d:
                        d[n] = init[n].clone().requires_grad_(True)
                hp = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=adjust)
                opt = ot.Muon([ours["w1"], ours["w2"], ours["b"]], store=self.path("t-" + adjust),
                              adamw_betas=(0.9, 0.95), adamw_eps=1e-8, **hp, **OPT_KW)
                muon = torch.optim.Muon([theirs["w1"], theirs["w2"]], **hp)
                adamw = torch.optim.AdamW([theirs["b"]], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
                try:
                    gen = torch.Generator().manual_seed(3)
                    for _ in range(25):
                        for n, s in shapes.items():
                            g = torch.randn(s, generator=gen)
                            ours[n].grad, theirs[n].grad = g.clone(), g.clone()
                        opt.step()
                        muon.step()
                        adamw.step()
                    for n in shapes:
                        moved = (theirs[n].detach() - init[n]).abs().max().item()
                        diff = (ours[n].detach() - theirs[n].detach()).abs().max().item()
                        self.assertLess(diff, 0.03 * moved, n)
                    for n in ("w1", "w2"):
                        want = muon.state[theirs[n]]["momentum_buffer"]
                        torch.testing.assert_close(opt.state[ours[n]]["momentum_buffer"], want, rtol=0,
                                                   atol=1e-6 * want.abs().max().item())
                finally:
                    opt.close()

    def test_state_dict_and_checkpoint_resume_bit_for_bit(self):
        """load_state_dict of an earlier state_dict (the store reverts to that generation, the params
        take its mains, the groups its hyperparameters) and optstate.checkpoint save/load into a fresh
        store both continue exactly as the run did from there: params and both rules' state equal bit
        for bit after the same further steps."""
        import optstate.checkpoint
        torch.manual_seed(11)
        shapes = [(16, 8), (8,), (8, 24)]
        params = [torch.randn(s).requires_grad_(True) for s in shapes]
        groups = lambda ps: [{"params": ps[:2], "lr": 0.02}, {"params": ps[2:], "lr": 0.01,
                                                                  "adjust_lr_fn": "match_rms_adamw"}]
        grads = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * k + i)) for i, s in enumerate(shapes)]
                 for k in range(6)]

        def step(opt, ps, k):
            for p, g in zip(ps, grads[k]):
                p.grad = g.clone()
            opt.step()

        def snapshot(opt, ps):
            out = [p.detach().clone() for p in ps]
            for p in ps:
                out += [opt.state[p][k].clone() if k != "step" else torch.tensor(float(opt.state[p][k]))
                        for k in sorted(opt.state[p])]
            return out

        opt = ot.Muon(groups(params), store=self.path("sd"), **OPT_KW)
        try:
            for k in range(3):
                step(opt, params, k)
            sd = opt.state_dict()
            self.assertEqual(sd["param_groups"][1]["adjust_lr_fn"], "match_rms_adamw")
            optstate.checkpoint.save(opt, self.path("ckpt"))
            opt.param_groups[0]["lr"] = 0.5  # changed after the state_dict: load_state_dict restores 0.02
            for k in range(3, 6):
                step(opt, params, k)
            want = snapshot(opt, params)
            opt.load_state_dict(sd)
            self.assertEqual(opt.param_groups[0]["lr"], 0.02)
            opt.param_groups[0]["lr"] = 0.5
            for k in range(3, 6):
                step(opt, params, k)
            got = snapshot(opt, params)
            self.assertEqual(len(got), len(want))
            for i, (a, b) in enumerate(zip(got, want)):
                self.assertTrue(torch.equal(a, b), "after load_state_dict: tensor %d differs" % i)
        finally:
            opt.close()
        fresh = [torch.zeros(s).requires_grad_(True) for s in shapes]
        opt2 = ot.Muon(groups(fresh), store=self.path("fresh"), **OPT_KW)
        try:
            optstate.checkpoint.load(opt2, self.path("ckpt"))
            opt2.param_groups[0]["lr"] = 0.5
            for k in range(3, 6):
                step(opt2, fresh, k)
            got = snapshot(opt2, fresh)
            for i, (a, b) in enumerate(zip(got, want)):
                self.assertTrue(torch.equal(a, b), "after checkpoint.load: tensor %d differs" % i)
        finally:
            opt2.close()

    def test_budget_names_the_matrix_that_does_not_fit(self):
        # 4 MiB a field (main, momentum_buffer) and 10 MiB of Newton-Schulz scratch: more than 12 MiB.
        big = torch.nn.Parameter(torch.randn(2048, 512))
        small = torch.nn.Parameter(torch.randn(64, 64))
        kw = dict(OPT_KW, budget=12 << 20)
        with self.assertRaises(optstate.ResourceExhausted) as cm:
            ot.Muon([("layer.small", small), ("layer.big", big)], store=self.path("b"), **kw)
        self.assertIn("layer.big", str(cm.exception))
        self.assertNotIn("layer.small", str(cm.exception))

    def test_use_muon_needs_matrices_and_arguments(self):
        v = torch.nn.Parameter(torch.randn(10))
        with self.assertRaisesRegex(optstate.InvalidArgument, "ln.weight.*use_muon"):
            ot.Muon([{"params": [("ln.weight", v)], "use_muon": True}], store=self.path("u"), **OPT_KW)
        w = torch.nn.Parameter(torch.randn(4, 4))
        with self.assertRaisesRegex(optstate.InvalidArgument, "Adjust learning rate"):
            ot.Muon([w], store=self.path("a"), adjust_lr_fn="rms", **OPT_KW)
        with self.assertRaisesRegex(optstate.InvalidArgument, "momentum"):
            ot.Muon([w], store=self.path("m"), momentum=-0.1, **OPT_KW)


if __name__ == "__main__":
    unittest.main()
