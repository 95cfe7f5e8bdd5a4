"""optstate.torch.SGD against torch.optim.SGD, and optstate.torch.Lion against a plain torch Lion written
here from the paper (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2 with
decoupled weight decay), 25 steps each: two groups with their own hyperparameters, an LR schedule, params
that skip steps (torch keeps their state), a close and reopen of the store in the middle, opt.state[p] as
the reference's. The references run in float64; ours keeps fp32 mains. Lion and SGD with bf16 moments
are checked step by step against an fp64 update of the stored state."""
import json
import math
import os
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.checkpoint  # noqa: F401  (optstate.checkpoint.save/load)
import optstate.torch as ot

STEPS = 25
REOPEN_AT = 12

# name: (shape, group, which steps have a grad)
PATTERNS = {
    "always": ((33, 7), 0, lambda s, r: True),
    "every_other": ((19,), 0, lambda s, r: s % 2 == 0),
    "late": ((5, 4), 0, lambda s, r: s > 10),
    "random": ((64,), 1, lambda s, r: r < 0.5),
    "never": ((3, 3), 1, lambda s, r: False),
}
LAMBDAS = [lambda k: 1.0 / (1.0 + 0.05 * k), lambda k: 0.97 ** k]


class RefLion(torch.optim.Optimizer):
    """Lion as the paper's Algorithm 2: c = b1 m + (1 - b1) g; p = p (1 - lr wd) - lr sign(c);
    m = b2 m + (1 - b2) g. A param without a grad is skipped and keeps its state."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                c = beta1 * m + (1 - beta1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def groups_of(params, per_group):
    return [dict(per_group[g], params=[params[n] for n, (_, gg, _) in PATTERNS.items() if gg == g])
            for g in (0, 1)]


class Run:
    """Ours (fp32) and the reference (float64) from the same start, stepped with the same grads."""

    def __init__(self, test, make_ours, make_ref):
        torch.manual_seed(0)
        self.test = test
        self.init = {n: torch.randn(shape) for n, (shape, _, _) in PATTERNS.items()}
        self.ours = {n: t.clone() for n, t in self.init.items()}
        self.theirs = {n: t.double().clone() for n, t in self.init.items()}
        self.make_ours = make_ours
        self.opt = make_ours(self.ours)
        self.ref = make_ref(self.theirs)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, LAMBDAS)
        self.ref_sched = torch.optim.lr_scheduler.LambdaLR(self.ref, LAMBDAS)
        self.gen = torch.Generator().manual_seed(1)

    def run(self, bound, state_keys):
        """STEPS steps; after each, every param within bound(s) x max(1, |p|) of the reference."""
        worst = 0.0
        try:
            for s in range(1, STEPS + 1):
                draws = torch.rand(len(PATTERNS), generator=self.gen).tolist()
                for (name, (shape, _, has)), r in zip(PATTERNS.items(), draws):
                    g = torch.randn(shape, generator=self.gen)
                    self.ours[name].grad = g if has(s, r) else None
                    self.theirs[name].grad = g.double() if has(s, r) else None
                self.opt.step()
                self.ref.step()
                self.sched.step()
                self.ref_sched.step()
                for name in PATTERNS:
                    d = ((self.ours[name].double() - self.theirs[name]).abs()
                         / self.theirs[name].abs().clamp(min=1)).max().item()
                    worst = max(worst, d)
                self.test.assertLess(worst, bound(s), "step %d" % s)
                if s == REOPEN_AT:
                    self.check_state(state_keys, "before reopen")
                    self.opt.close()
                    self.opt = self.make_ours(self.ours)  # resumes from the store
                    for group, ref_group in zip(self.opt.param_groups, self.ref.param_groups):
                        group["initial_lr"] = ref_group["initial_lr"]
                    self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, LAMBDAS, last_epoch=s - 1)
                    self.test.assertEqual([g["lr"] for g in self.opt.param_groups],
                                          [g["lr"] for g in self.ref.param_groups])
                    self.check_state(state_keys, "after reopen")
            self.check_state(state_keys, "after %d steps" % STEPS)
            self.test.assertTrue(torch.equal(self.ours["never"], self.init["never"]))
            self.test.assertEqual(self.opt.param_step_count(self.ours["always"]), STEPS)
            self.test.assertEqual(self.opt.param_step_count(self.ours["every_other"]), STEPS // 2)
            self.test.assertEqual(self.opt.param_step_count(self.ours["never"]), 0)
        finally:
            self.opt.close()
        return worst

    def check_state(self, keys, where):
        """opt.state[p][key] for the reference's state keys: within 1e-5 of the tensor's scale (fp32
        against float64 over <= 25 steps); a param the reference has no state for has none here."""
        for name in PATTERNS:
            p, q = self.ours[name], self.theirs[name]
            if q not in self.ref.state or not self.ref.state[q]:
                self.test.assertEqual(len(self.opt.state[p]) if p in self.opt.state else 0, 0, name)
                continue
            for key in keys:
                got, want = self.opt.state[p][key], self.ref.state[q][key]
                self.test.assertEqual(got.dtype, torch.float32)
                self.test.assertEqual(got.shape, p.shape)
                scale = max(want.abs().max().item(), 1e-3)
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * scale,
                                           msg=lambda m: "%s %s %s: %s" % (name, key, where, m))


class SgdTest(TempDirTest):
    """Bound: each step rounds a param and the buffer at 2^-24 relative; with momentum 0.9 a rounding
    lives in the buffer for ~10 steps. Asserted 1e-6 x sqrt(s) x max(1, |p|); a wrong first step
    (dampening applied), Nesterov term or weight decay moves a param by lr x |g| >= 1e-3 at once."""

    CONFIGS = [
        ("nesterov", dict(momentum=0.9, nesterov=True), ({"lr": 0.05, "weight_decay": 0.01},
                                                        {"lr": 0.1, "weight_decay": 0.0})),
        ("dampening", dict(momentum=0.8, dampening=0.3), ({"lr": 0.05, "weight_decay": 0.0},
                                                         {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.5})),
        ("plain", dict(momentum=0.0), ({"lr": 0.05, "weight_decay": 0.01}, {"lr": 0.1})),
        ("maximize", dict(momentum=0.9, maximize=True), ({"lr": 0.05}, {"lr": 0.01, "weight_decay": 0.1})),
    ]

    def test_sgd_follows_torch_sgd(self):
        for label, kw, per_group in self.CONFIGS:
            with self.subTest(config=label):
                store = self.path("sgd-" + label)
                run = Run(self, lambda ps: ot.SGD(groups_of(ps, per_group), store=store, **dict(OPT_KW, **kw)),
                          lambda ps: torch.optim.SGD(groups_of(ps, per_group), foreach=False, **kw))
                keys = ("momentum_buffer",) if kw["momentum"] else ()
                run.run(lambda s: 1e-6 * math.sqrt(s), keys)

    def test_sgd_state_and_arguments(self):
        p = torch.nn.Parameter(torch.ones(4))
        with self.assertRaisesRegex(optstate.InvalidArgument, "Nesterov"):
            ot.SGD([p], store=self.path("n"), momentum=0.9, dampening=0.1, nesterov=True, **OPT_KW)
        with self.assertRaisesRegex(optstate.InvalidArgument, "learning rate"):
            ot.SGD([p], store=self.path("lr"), lr=-1.0, **OPT_KW)
        opt = ot.SGD([p], store=self.path("s"), lr=0.5, momentum=0.9, **OPT_KW)
        try:
            self.assertEqual(opt.defaults["momentum"], 0.9)
            p.grad = torch.full((4,), 2.0)
            opt.step()
            # First step: the buffer is the gradient itself, as torch's.
            self.assertTrue(torch.equal(opt.state[p]["momentum_buffer"], torch.full((4,), 2.0)))
            self.assertTrue(torch.equal(p.detach(), torch.zeros(4)))
            self.assertEqual(opt.store_fields(), ("main", "momentum_buffer"))
        finally:
            opt.close()
        plain = ot.SGD([p], store=self.path("plain"), lr=0.5, **OPT_KW)
        try:
            self.assertEqual(plain.store_fields(), ("main",))  # 4 bytes per param: no buffer
            with self.assertRaisesRegex(optstate.InvalidArgument, "momentum_buffer"):
                plain.param_groups[0]["momentum"] = 0.9
                p.grad = torch.ones(4)
                plain.step()
        finally:
            plain.close()


class LionTest(TempDirTest):
    """Bound: each step rounds a param twice (decay, update) at 2^-24 relative; 1e-6 x sqrt(s) x
    max(1, |p|) is asserted. A sign taken of the wrong quantity (the new moment instead of the
    interpolation) or a coupled weight decay moves a param by 2 lr = 2e-3 in one step."""

    PER_GROUP = ({"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.99)},
                 {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.95, 0.98)})

    def test_lion_follows_the_paper(self):
        store = self.path("lion")
        run = Run(self, lambda ps: ot.Lion(groups_of(ps, self.PER_GROUP), store=store, **OPT_KW),
                  lambda ps: RefLion(groups_of(ps, self.PER_GROUP)))
        run.run(lambda s: 1e-6 * math.sqrt(s), ("exp_avg",))

    def test_lion_keeps_one_moment(self):
        p = torch.nn.Parameter(torch.ones(8))
        opt = ot.Lion([p], store=self.path("s"), lr=0.5, **OPT_KW)
        try:
            self.assertEqual(opt.store_fields(), ("main", "exp_avg"))
            p.grad = torch.tensor([1.0, -1.0, 0.0, 2.0, -2.0, 0.5, -0.5, 0.0])
            opt.step()
            self.assertTrue(torch.equal(p.detach(), torch.tensor([0.5, 1.5, 1.0, 0.5, 1.5, 0.5, 1.5, 1.0])))
            self.assertTrue(torch.allclose(opt.state[p]["exp_avg"], 0.01 * p.grad, rtol=1e-6, atol=0))
        finally:
            opt.close()


class CheckpointHyperparametersTest(TempDirTest):
    """A checkpoint of a Lion or SGD store whose manifest holds a hyperparameter out of that name's range
    (edited by hand; its own checksum and job removed, as in manifests written before they existed) is
    refused by the load with optstate.InvalidArgument naming the manifest, the store, the group and the
    name; the store keeps its state and the optimizer steps on."""

    CASES = (
        ("sgd", dict(momentum=0.9), {"momentum": -0.5}, "hyperparameter momentum = -0.5"),
        ("sgd", dict(momentum=0.9), {"nesterov": True, "dampening": 0.25}, "nesterov = true needs momentum > 0"),
        ("sgd", dict(momentum=0.9, nesterov=True), {"momentum": 0.0}, "nesterov = true needs momentum > 0"),
        ("lion", dict(), {"beta2": 1.0}, "hyperparameter beta2 = 1"),
        ("lion", dict(), {"weight_decay": -0.1}, "hyperparameter weight_decay = -0.1"),
    )

    def test_out_of_range_values_are_refused_by_name(self):
        for i, (kind, kw, edit, want) in enumerate(self.CASES):
            with self.subTest(kind=kind, edit=edit):
                p = torch.nn.Parameter(torch.ones(16))
                make = ot.SGD if kind == "sgd" else ot.Lion
                name = "%s%d" % (kind, i)
                opt = make([p], store=self.path(name), lr=0.5, **dict(OPT_KW, **kw))
                try:
                    p.grad = torch.full((16,), 0.25)
                    opt.step()
                    ckpt = self.path("ckpt%d" % i)
                    optstate.checkpoint.save(opt, ckpt)
                    path = os.path.join(ckpt, "manifest.json")
                    with open(path) as f:
                        m = json.load(f)
                    m.pop("manifest_xxh3")
                    m.pop("job", None)
                    m["groups"][0]["hyper"].update(edit)
                    with open(path, "w") as f:
                        json.dump(m, f)
                    before = p.detach().clone()
                    with self.assertRaises(optstate.InvalidArgument) as cm:
                        optstate.checkpoint.load(opt, ckpt, force=True)
                    msg = str(cm.exception)
                    for part in (path, "store " + name, "group 0", want):
                        self.assertIn(part, msg)
                    opt.step()  # the optimizer and its store are as they were
                    self.assertFalse(torch.equal(p.detach(), before))
                finally:
                    opt.close()


class OtherOptimizerTest(TempDirTest):
    """A store keeps the fields of the optimizer that wrote it. SGD with momentum's store (a
    momentum_buffer per tensor) opened by an SGD without momentum (no buffer) raises
    optstate.InvalidArgument naming the store and the field (and the tensor once the last step's
    momentum was 0: the tensors are checked, not the group); the store is left as it was: the momentum
    SGD resumes on it bit for bit as a run on another store that was never interrupted (and within fp32
    rounding of torch.optim.SGD in float64). Lion <-> AdamW and Muon <-> AdamW likewise: each way is
    refused naming the store, the tensor and the field (or both rules) and changes nothing."""

    SGD_KW = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)

    def expect_refused(self, make, error, parts):
        with self.assertRaises(error) as cm:
            opt = make()
            opt.close()  # not reached when refused
        self.assertIsInstance(cm.exception, optstate.Error)
        for part in parts:
            self.assertIn(part, str(cm.exception))

    def test_sgd_momentum_store_refused_without_momentum_and_resumes(self):
        torch.manual_seed(0)
        init = torch.randn(37, 5)
        grads = [torch.randn(37, 5) for _ in range(6)]
        store, other = self.path("sgd"), self.path("uninterrupted")
        w, u = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
        theirs = torch.nn.Parameter(init.double().clone())
        ref = torch.optim.SGD([theirs], foreach=False, **self.SGD_KW)
        ours = ot.SGD([("w", u)], store=other, **dict(OPT_KW, **self.SGD_KW))

        def step_both(opt, s):
            w.grad, u.grad, theirs.grad = grads[s].clone(), grads[s].clone(), grads[s].double()
            opt.step()
            ours.step()
            ref.step()

        def plain():
            return ot.SGD([("w", w)], store=store, lr=0.05, **OPT_KW)

        try:
            opt = ot.SGD([("w", w)], store=store, **dict(OPT_KW, **self.SGD_KW))
            for s in range(2):
                step_both(opt, s)
            opt.close()
            # The group's momentum 0.9 needs the buffer the new optimizer would not keep.
            self.expect_refused(plain, optstate.InvalidArgument, (store, "momentum_buffer"))
            opt = ot.SGD([("w", w)], store=store, **dict(OPT_KW, **self.SGD_KW))
            opt.param_groups[0]["momentum"] = 0.0  # steps on without momentum, the buffer kept
            ours.param_groups[0]["momentum"] = ref.param_groups[0]["momentum"] = 0.0
            opt.param_groups[0]["nesterov"] = ours.param_groups[0]["nesterov"] = False
            ref.param_groups[0]["nesterov"] = False
            step_both(opt, 2)
            opt.close()
            for group in (ours.param_groups[0], ref.param_groups[0]):  # as the reopened optimizer's
                group.update(momentum=0.9, nesterov=True)
            self.expect_refused(plain, optstate.InvalidArgument, (store, "'w'", "momentum_buffer"))
            opt = ot.SGD([("w", w)], store=store, **dict(OPT_KW, **self.SGD_KW))
            try:
                self.assertEqual(opt.param_step_count(w), 3)
                for s in range(3, 6):
                    step_both(opt, s)
                self.assertTrue(torch.equal(w.detach(), u.detach()))
                self.assertTrue(torch.equal(opt.state[w]["momentum_buffer"], ours.state[u]["momentum_buffer"]))
                torch.testing.assert_close(w.detach().double(), theirs.detach(), rtol=0, atol=1e-5)
            finally:
                opt.close()
        finally:
            ours.close()

    def test_lion_adamw_and_muon_adamw_refuse_each_others_stores(self):
        def lion(ps, store):
            return ot.Lion(ps, store=store, lr=1e-3, **OPT_KW)

        def adamw(ps, store):
            return ot.AdamW(ps, store=store, lr=1e-3, **OPT_KW)

        def muon(ps, store):
            return ot.Muon(ps, store=store, lr=1e-3, **OPT_KW)

        cases = (  # written by, opened by, error, what the message names besides the store and tensor
            ("lion-adamw", lion, adamw, optstate.AlreadyExists, ("exp_avg_sq",)),
            ("adamw-lion", adamw, lion, optstate.InvalidArgument, ("exp_avg_sq",)),
            ("muon-adamw", muon, adamw, optstate.AlreadyExists, ("exp_avg", "exp_avg_sq")),
            ("adamw-muon", adamw, muon, optstate.InvalidArgument, ("AdamW", "Muon")),
        )
        for label, first, second, error, names in cases:
            with self.subTest(case=label):
                store = self.path(label)
                torch.manual_seed(0)
                w = torch.nn.Parameter(torch.randn(6, 4))
                opt = first([("w", w)], store)
                for _ in range(2):
                    w.grad = torch.randn(6, 4)
                    opt.step()
                opt.close()
                before = w.detach().clone()
                self.expect_refused(lambda: second([("w", w)], store), error, (store, "'w'") + names)
                self.assertTrue(torch.equal(w.detach(), before))
                # The writer resumes on it: the main it stepped, its step count.
                opt = first([("w", w)], store)
                try:
                    self.assertEqual(opt.param_step_count(w), 2)
                    self.assertTrue(torch.equal(w.detach(), before))
                    w.grad = torch.randn(6, 4)
                    opt.step()
                    self.assertEqual(opt.param_step_count(w), 3)
                finally:
                    opt.close()


class Bf16MomentTest(TempDirTest):
    """bf16 moments: each step against an fp64 update of the stored (bf16) state: main within fp32
    rounding, the stored moment within half a bf16 ulp of the fp64 one."""

    def test_bf16_moment_each_step(self):
        torch.manual_seed(3)
        for kind in ("lion", "sgd"):
            with self.subTest(kind=kind):
                p = torch.nn.Parameter(torch.randn(5000))
                field = "exp_avg" if kind == "lion" else "momentum_buffer"
                if kind == "lion":
                    opt = ot.Lion([p], store=self.path(kind), lr=1e-2, weight_decay=0.1, moment_dtype="bf16",
                                  **OPT_KW)
                else:
                    opt = ot.SGD([p], store=self.path(kind), lr=0.05, momentum=0.9, weight_decay=0.01,
                                 moment_dtype="bf16", **OPT_KW)
                try:
                    for s in range(1, 6):
                        g = torch.randn(5000)
                        main0 = p.detach().double()
                        m0 = opt.read_state(p, field).double() if s > 1 else torch.zeros(5000, dtype=torch.float64)
                        stored = opt.read_state(p, field)
                        self.assertTrue(torch.equal(stored, stored.bfloat16().float()), "stored as bf16")
                        p.grad = g
                        opt.step()
                        gd = g.double()
                        if kind == "lion":
                            c = 0.9 * m0 + 0.1 * gd
                            want_p = main0 * (1 - 1e-3) - 1e-2 * torch.sign(c)
                            want_m = 0.99 * m0 + 0.01 * gd
                            m_mag = 0.99 * m0.abs() + 0.01 * gd.abs()
                        else:
                            gw = gd + 0.01 * main0
                            want_m = gw if s == 1 else 0.9 * m0 + gw
                            want_p = main0 - 0.05 * want_m
                            m_mag = gw.abs() + 0.9 * m0.abs()
                        got_m = opt.read_state(p, field).double()
                        self.assertTrue(((got_m - want_m).abs() <= 2 ** -8 * want_m.abs() + 1e-6 * m_mag).all(),
                                        "%s step %d moment" % (kind, s))
                        torch.testing.assert_close(p.detach().double(), want_p, rtol=0, atol=1e-6 * 4)
                finally:
                    opt.close()


if __name__ == "__main__":
    unittest.main()
