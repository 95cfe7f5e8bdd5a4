"""Per-param step counts, as torch.optim.AdamW keeps them: a param whose grad is None in a step keeps
its state and its count, and its next update is bias-corrected with its own count. optstate.torch.AdamW
against torch.optim.AdamW (float64 params) over 1000 steps of params that skip steps in patterns, in
two groups with an LR scheduler and a close and reopen of the store in the middle; opt.state[p] as
torch's; an unused Linear with zero_grad(set_to_none=True) stays bit-unchanged; bf16 and q8 moments
follow each param's own count (each step against an fp64 update of the stored state)."""
import collections.abc
import math
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.torch as ot

STEPS = 1000
REOPEN_AT = 500
LATE_AFTER = 300

# name: (shape, group, which steps have a grad)
PATTERNS = {
    "always": ((33, 7), 0, lambda s, r: True),
    "every_other": ((19,), 0, lambda s, r: s % 2 == 0),
    "late": ((5, 4), 0, lambda s, r: s > LATE_AFTER),
    "random": ((64,), 1, lambda s, r: r < 0.5),
    "rare": ((3, 11), 1, lambda s, r: r < 0.05),
    "never": ((3, 3), 1, lambda s, r: False),
}
BASE = ({"lr": 1e-3, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.01})
LAMBDAS = [lambda k: 1.0 / (1.0 + 0.002 * k), lambda k: 0.999 ** k]


def groups_of(params):
    return [dict(BASE[g], params=[params[n] for n, (_, gg, _) in PATTERNS.items() if gg == g]) for g in (0, 1)]


class PerParamStepCountTest(TempDirTest):
    def make_opt(self, params, **kw):
        return ot.AdamW(groups_of(params), store=self.path("s"), **dict(OPT_KW, **kw))

    def check_state(self, opt, ref, ours, theirs, where):
        """opt.state against torch's: the same params have state, the same step, moments within bound.

        Bound: the store's fp32 moments against torch's float64 ones. exp_avg is an EMA with weight
        0.9 of per-step fp32 roundings (2^-24 relative each), so it stays within ~10 ulps of its
        scale; exp_avg_sq's EMA (weight 0.999) carries each step's rounding for ~1000 steps, but the
        roundings are unbiased: ~sqrt(1000) x 2^-24 = 2e-6 of its scale. Asserted: 1e-6 x the
        tensor's scale for exp_avg, 1e-5 for exp_avg_sq. A wrong bias correction changes no moment,
        but the params (checked in the loop) at once; a wrong "step" is an exact mismatch."""
        self.assertEqual(len(opt.state), len(ref.state), where)
        for name in PATTERNS:
            p, q = ours[name], theirs[name]
            self.assertEqual(p in opt.state, q in ref.state, "%s %s" % (name, where))
            if q not in ref.state:
                self.assertEqual(len(opt.state[p]), 0, name)
                self.assertEqual(opt.param_step_count(p), 0, name)
                continue
            mine, want = opt.state[p], ref.state[q]
            self.assertEqual(sorted(mine), sorted(want), name)
            step = mine["step"]
            self.assertIsInstance(step, torch.Tensor)
            self.assertEqual(step.dtype, want["step"].dtype, name)
            self.assertEqual(step.shape, want["step"].shape, name)
            self.assertEqual(step.item(), want["step"].item(), "%s %s" % (name, where))
            self.assertEqual(opt.param_step_count(p), int(want["step"].item()), name)
            for key, rel in (("exp_avg", 1e-6), ("exp_avg_sq", 1e-5)):
                got, exp = mine[key], want[key]
                self.assertEqual(got.dtype, torch.float32)
                self.assertEqual(got.shape, p.shape)
                scale = exp.abs().max().item()
                torch.testing.assert_close(got.double(), exp, rtol=0, atol=rel * scale,
                                           msg=lambda m: "%s %s %s: %s" % (name, key, where, m))

    def test_params_skipping_steps_follow_torch_adamw_over_1000_steps(self):
        torch.manual_seed(0)
        init = {n: torch.randn(shape) for n, (shape, _, _) in PATTERNS.items()}
        ours = {n: t.clone() for n, t in init.items()}
        theirs = {n: t.double().clone() for n, t in init.items()}
        ref = torch.optim.AdamW(groups_of(theirs), foreach=False)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, LAMBDAS)
        opt = self.make_opt(ours)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS)
        gen = torch.Generator().manual_seed(1)
        # Params: fp32 against float64. Each step rounds a param twice (decay, update) at 2^-24
        # relative (6e-8); the roundings are unbiased, so after s steps they stay within a few sigma
        # of a random walk: asserted 3.5e-7 x sqrt(s) x max(1, |p|) (1.1e-5 at step 1000; about half
        # of that was seen). A param bias-corrected with its group's count instead of its own moves
        # by lr x 0.36 or more in that one step (> 1e-4 here).
        worst = 0.0
        group_steps = [0, 0]  # steps in which any param of the group had a grad
        try:
            for s in range(1, STEPS + 1):
                draws = torch.rand(len(PATTERNS), generator=gen).tolist()
                stepped = set()
                for (name, (shape, group, has)), r in zip(PATTERNS.items(), draws):
                    g = torch.randn(shape, generator=gen)
                    ours[name].grad = g if has(s, r) else None
                    theirs[name].grad = g.double() if has(s, r) else None
                    if has(s, r):
                        stepped.add(group)
                for group in stepped:
                    group_steps[group] += 1
                opt.step()
                ref.step()
                sched.step()
                ref_sched.step()
                for name in PATTERNS:
                    d = ((ours[name].double() - theirs[name]).abs() / theirs[name].abs().clamp(min=1)).max().item()
                    worst = max(worst, d)
                self.assertLess(worst, 3.5e-7 * math.sqrt(s), "step %d" % s)
                if s == LATE_AFTER:
                    # "late" has had no grad yet: no state, as in torch, and its param is untouched.
                    self.assertNotIn(ours["late"], opt.state)
                    self.assertTrue(torch.equal(ours["late"], init["late"]))
                if s == REOPEN_AT:
                    self.check_state(opt, ref, ours, theirs, "before reopen")
                    opt.close()
                    opt = self.make_opt(ours)  # resumes: the store holds every param's count
                    for group, base in zip(opt.param_groups, BASE):
                        group["initial_lr"] = base["lr"]
                    sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS, last_epoch=s - 1)
                    self.assertEqual([g["lr"] for g in opt.param_groups], [g["lr"] for g in ref.param_groups])
                    self.check_state(opt, ref, ours, theirs, "after reopen")
            self.check_state(opt, ref, ours, theirs, "after %d steps" % STEPS)
            self.assertTrue(torch.equal(ours["never"], init["never"]))
            # The counts really differ per param (the test covers what it says).
            counts = {n: opt.param_step_count(ours[n]) for n in PATTERNS}
            self.assertEqual(counts["always"], STEPS)
            self.assertEqual(counts["every_other"], STEPS // 2)
            self.assertEqual(counts["late"], STEPS - LATE_AFTER)
            self.assertEqual(counts["never"], 0)
            self.assertLess(counts["rare"], STEPS // 10)
            self.assertEqual([opt.step_count(0), opt.step_count(1)], group_steps)
            self.assertLess(group_steps[1], STEPS)
        finally:
            opt.close()

    def test_state_mapping_is_read_only_and_torch_machinery_still_works(self):
        torch.manual_seed(0)
        ours = {n: torch.randn(shape) for n, (shape, _, _) in PATTERNS.items()}
        with self.make_opt(ours) as opt:
            self.assertEqual(len(opt.state), 0)
            self.assertEqual(list(opt.state), [])
            for name in ("always", "late"):
                ours[name].grad = torch.ones_like(ours[name])
            opt.step()
            self.assertEqual(len(opt.state), 2)
            self.assertEqual(set(map(id, opt.state)), {id(ours["always"]), id(ours["late"])})
            self.assertIn(ours["always"], opt.state)
            self.assertNotIn(ours["random"], opt.state)
            st = opt.state[ours["always"]]
            self.assertEqual(list(st), ["step", "exp_avg", "exp_avg_sq"])
            self.assertEqual(st["step"].item(), 1.0)
            # A copy: changing it changes nothing in the store.
            m = st["exp_avg"]
            m.zero_()
            self.assertGreater(opt.state[ours["always"]]["exp_avg"].abs().max().item(), 0)
            for write in (lambda: opt.state[ours["always"]].__setitem__("step", torch.tensor(3.0)),
                          lambda: opt.state.__setitem__(ours["always"], {}),
                          lambda: opt.state[ours["always"]].__delitem__("exp_avg"),
                          lambda: opt.state.__delitem__(ours["always"])):
                with self.assertRaises(TypeError) as cm:
                    write()
                self.assertIn("store", str(cm.exception))
            with self.assertRaises(KeyError):
                opt.state[torch.zeros(2)]
            # torch.optim.Optimizer's own machinery over the mapping.
            repr(opt)
            repr(opt.state)
            opt.zero_grad()
            opt.zero_grad(set_to_none=True)
            sd = opt.state_dict()
            self.assertEqual(sd["state"], {})  # never the state itself
            opt.load_state_dict(sd)
            self.assertIsInstance(opt.state, collections.abc.Mapping)
            self.assertNotIsInstance(opt.state, dict)
            self.assertEqual(opt.state[ours["always"]]["step"].item(), 1.0)
            opt.add_param_group({"params": [torch.randn(4)], "lr": 1e-2})
            self.assertEqual(len(opt.state), 2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            ours["always"].grad = torch.ones_like(ours["always"])
            opt.step()
            sched.step()
            self.assertEqual(opt.state[ours["always"]]["step"].item(), 2.0)
            self.assertEqual(opt.state[ours["late"]]["step"].item(), 1.0)
        with self.assertRaises(optstate.FailedPrecondition):
            len(opt.state)

    def test_unused_linear_with_set_to_none_stays_bit_unchanged(self):
        # A model with a head that the loss stops using: zero_grad(set_to_none=True) leaves its grads
        # None (torch 1.13's default fills zeros, which would step it: decay and moments move). Its
        # param, exp_avg, exp_avg_sq and step count stay bit for bit what they were, as in
        # torch.optim.AdamW, under weight decay 0.1; when it is used again, its update is torch's.
        def model():
            torch.manual_seed(0)
            return torch.nn.ModuleDict({"body": torch.nn.Linear(8, 8), "used": torch.nn.Linear(8, 2),
                                        "unused": torch.nn.Linear(8, 2)})

        mine, theirs = model(), model()
        opt = ot.AdamW(list(mine.named_parameters()), store=self.path("u"), lr=1e-2, weight_decay=0.1, **OPT_KW)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        gen = torch.Generator().manual_seed(2)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen)

        def step(m, o, heads):
            o.zero_grad(set_to_none=True)
            h = torch.tanh(m["body"](x))
            sum(((m[k](h) - y) ** 2).mean() for k in heads).backward()
            o.step()

        try:
            for _ in range(5):  # every head has state
                step(mine, opt, ("used", "unused"))
                step(theirs, ref, ("used", "unused"))
            frozen = {n: (p.detach().clone(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"],
                          opt.state[p]["step"].item())
                      for n, p in mine.named_parameters() if n.startswith("unused")}
            for _ in range(7):  # the unused head gets no grad
                step(mine, opt, ("used",))
                step(theirs, ref, ("used",))
                for n, p in mine.named_parameters():
                    if not n.startswith("unused"):
                        continue
                    self.assertIsNone(p.grad, n)
                    param, m, v, count = frozen[n]
                    self.assertTrue(torch.equal(p.detach(), param), n)
                    self.assertTrue(torch.equal(opt.state[p]["exp_avg"], m), n)
                    self.assertTrue(torch.equal(opt.state[p]["exp_avg_sq"], v), n)
                    self.assertEqual(opt.state[p]["step"].item(), count, n)
                    self.assertEqual(opt.read_state(p, "main").view(-1).tolist(), param.view(-1).tolist(), n)
            for (n, p), q in zip(mine.named_parameters(), theirs.parameters()):
                self.assertEqual(opt.state[p]["step"].item(), ref.state[q]["step"].item(), n)
            for _ in range(3):  # used again: bias-corrected with its own count (5 + 1), as torch does
                step(mine, opt, ("used", "unused"))
                step(theirs, ref, ("used", "unused"))
            for (n, p), q in zip(mine.named_parameters(), theirs.parameters()):
                # Tolerance as test_fp32_equals_torch_adamw in torch_adamw_test (fp32 vs fp32, a few
                # ulps a step); a group-count bias correction moves the head by ~1e-3 in one step.
                torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5, msg=lambda m: n + ": " + m)
                self.assertEqual(opt.state[p]["step"].item(), ref.state[q]["step"].item(), n)
            self.assertEqual(opt.param_step_count("unused.weight"), 8)
            self.assertEqual(opt.param_step_count("used.weight"), 15)
        finally:
            opt.close()

    def _moments_follow_own_count(self, moment_dtype, moment_rel):
        """Each step, each param that has a grad is checked against an fp64 update of the state stored
        before it, bias-corrected with its own count: main within fp32 rounding (the kernel updates
        main from the unrounded moments), the stored moments within their dtype's bound
        (docs/MOMENTS.md: bf16 2^-8 relative; q8 half the map's gap x the block's absmax <= 0.0071 x
        absmax) of that update."""
        torch.manual_seed(0)
        names = ["always", "every_other", "late", "random"]
        ours = {n: torch.randn(PATTERNS[n][0]) for n in names}
        gs = [dict(BASE[0], params=[ours[n] for n in names if PATTERNS[n][1] == 0]),
              dict(BASE[1], params=[ours[n] for n in names if PATTERNS[n][1] == 1])]
        b1, b2, eps = 0.9, 0.999, 1e-8
        gen = torch.Generator().manual_seed(3)
        late = 20
        with ot.AdamW(gs, store=self.path(moment_dtype), moment_dtype=moment_dtype, **OPT_KW) as opt:
            for s in range(1, 61):
                draws = torch.rand(len(names), generator=gen).tolist()
                before = {}
                for name, r in zip(names, draws):
                    p = ours[name]
                    has = PATTERNS[name][2](s, r) if name != "late" else s > late
                    p.grad = torch.randn(p.shape, generator=gen) if has else None
                    if has:
                        st = opt.state[p]
                        count = st["step"].item() if len(st) else 0.0
                        m = st["exp_avg"].double() if len(st) else torch.zeros(p.shape, dtype=torch.float64)
                        v = st["exp_avg_sq"].double() if len(st) else torch.zeros(p.shape, dtype=torch.float64)
                        before[name] = (opt.read_state(p, "main").double(), m, v, count + 1)
                opt.step()
                for name, (w, m, v, count) in before.items():
                    p = ours[name]
                    group = opt.param_groups[PATTERNS[name][1]]
                    lr, wd = group["lr"], group["weight_decay"]
                    g = p.grad.double()
                    m = b1 * m + (1 - b1) * g
                    v = b2 * v + (1 - b2) * g * g
                    bc1, bc2 = 1 - b1 ** count, 1 - b2 ** count
                    w = w * (1 - lr * wd) - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
                    st = opt.state[p]
                    self.assertEqual(st["step"].item(), count, "%s step %d" % (name, s))
                    # main: fp32 rounding of the decay and the update (a few ulps of |w| <= 4).
                    torch.testing.assert_close(opt.read_state(p, "main").double(), w, rtol=0, atol=2e-6,
                                               msg=lambda e: "%s step %d: %s" % (name, s, e))
                    for key, exact in (("exp_avg", m), ("exp_avg_sq", v)):
                        torch.testing.assert_close(st[key].double(), exact, rtol=0,
                                                   atol=moment_rel * 1.001 * exact.abs().max().item() + 1e-30,
                                                   msg=lambda e: "%s %s step %d: %s" % (name, key, s, e))
            self.assertEqual(opt.param_step_count(ours["late"]), 60 - late)

    def test_bf16_moments_follow_each_params_own_count(self):
        self._moments_follow_own_count("bf16", 2.0 ** -8)

    def test_q8_moments_follow_each_params_own_count(self):
        self._moments_follow_own_count("q8", 0.0071)


if __name__ == "__main__":
    unittest.main()
