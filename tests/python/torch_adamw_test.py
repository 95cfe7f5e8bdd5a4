"""optstate.torch.AdamW against torch.optim.AdamW and a float64 reference,
resume from the store, state_dict, found-inf, snapshots, sleep/wake."""
import io
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.torch as ot


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 4))


def two_groups(model):
    """Weights with weight decay at the default lr, biases without decay at their own lr."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 3e-3}]


def train(model, opt, steps, seed=7):
    """Steps of a regression on fixed data; an LR scheduler changes every group's lr every step."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.3 * k))
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step()
    return loss.item()


class AdamWTest(TempDirTest):
    def test_fp32_equals_torch_adamw(self):
        # Tolerance: the kernel does torch's fused-AdamW operation order; against the single-tensor
        # path (foreach=False) each step rounds differently by a few ulps: (1 - lr*wd)*p vs
        # p - (lr*wd)*p, step_size*m/denom vs step_size*(m/denom), 1 - fp32 beta2 (1.3e-5 relative
        # in v, so 6.5e-6 in the update, i.e. < 1e-7 absolute at lr 1e-2). |p| < 1 (ulp 6e-8), so 25
        # steps stay under 25 x 4 ulp = 6e-6 unless the model amplifies them; we assert 1e-5. A real
        # error (lr not followed, decay in the wrong group, wrong bias correction) moves params by
        # lr * wd * |p| ~ 1e-3 or more in one step.
        ref_model, model = make_model(0), make_model(0)
        ref = torch.optim.AdamW(two_groups(ref_model), lr=1e-2, foreach=False)
        opt = ot.AdamW(two_groups(model), store=self.path("s"), lr=1e-2, **OPT_KW)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda k: 1.0 / (1.0 + 0.3 * k))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.3 * k))
        gen = torch.Generator().manual_seed(7)
        x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
        worst = 0.0
        for _ in range(25):
            for m, o, s in ((ref_model, ref, ref_sched), (model, opt, sched)):
                o.zero_grad()
                ((m(x) - y) ** 2).mean().backward()
                o.step()
                s.step()
            for a, b in zip(ref_model.parameters(), model.parameters()):
                worst = max(worst, (a - b).abs().max().item())
            self.assertLess(worst, 1e-5)
        self.assertEqual(opt.param_groups[1]["lr"], ref.param_groups[1]["lr"])
        self.assertEqual((opt.step_count(0), opt.step_count(1)), (25, 25))
        for a, b in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(opt.read_state(b, "main"), b.detach(), rtol=0, atol=0)
            torch.testing.assert_close(opt.read_state(b, "exp_avg"), ref.state[a]["exp_avg"], rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(opt.read_state(b, "exp_avg_sq"), ref.state[a]["exp_avg_sq"],
                                       rtol=1e-4, atol=1e-12)
            self.assertEqual(opt.state[b]["step"].item(), ref.state[a]["step"].item())  # read from the store
        self.assertEqual(opt.state_dict()["state"], {})  # nothing of the state lives in torch tensors

    def test_bf16_moments_track_torch_adamw(self):
        # moment_dtype="bf16": moments stored in bf16 (exactly representable, read back decoded), and the
        # training stays close to torch's fp32-state AdamW: 25 steps at lr 1e-2 move each param by at
        # most 0.25; the moments' rounding (2^-8 relative per store, carried with weight beta) changes
        # each update by a few 2^-8, so params agree within 25 * 1e-2 * 2^-5 ~ 8e-3.
        ref_model, model = make_model(0), make_model(0)
        ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), lr=1e-2, moment_dtype="bf16", **OPT_KW)
        ref_loss = train(ref_model, ref, 25)
        loss = train(model, opt, 25)
        for a, b in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=8e-3)
            m = opt.read_state(b, "exp_avg")
            self.assertFalse((m.view(torch.int32) & 0xFFFF).any().item())
            torch.testing.assert_close(m, ref.state[a]["exp_avg"], rtol=0.05, atol=1e-3)
            with opt.pin(b, "exp_avg") as pinned:  # a pin shows the stored bf16 values
                self.assertEqual(pinned.dtype, torch.bfloat16)
                torch.testing.assert_close(pinned.float().cpu().reshape(-1), m.reshape(-1), rtol=0, atol=0)
        self.assertLess(abs(loss - ref_loss), 0.01 * ref_loss)
        opt.close()
        with self.assertRaises(optstate.InvalidArgument):  # the store holds bf16 moments
            ot.AdamW(make_model(0).parameters(), store=self.path("s"), lr=1e-2, **OPT_KW)

    def test_bf16_params_fp32_mains_against_float64(self):
        torch.manual_seed(3)
        shapes = [(300, 40), (40,), (7, 3, 5)]
        params = [torch.randn(s).to(torch.bfloat16) for s in shapes]
        ref = [(p.double(), torch.zeros(s, dtype=torch.float64), torch.zeros(s, dtype=torch.float64))
               for p, s in zip(params, shapes)]
        opt = ot.AdamW(params, store=self.path("s"), lr=1e-2, weight_decay=0.05, **OPT_KW)
        b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.05
        for step in range(1, 21):
            lr = 1e-2 / step
            opt.param_groups[0]["lr"] = lr
            grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
            for i, g in enumerate(grads):
                p64, m, v = ref[i]
                g = g.double()
                p64 = p64 * (1 - lr * wd)
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                p64 = p64 - (lr / (1 - b1 ** step)) * m / ((v.sqrt() / (1 - b2 ** step) ** 0.5) + eps)
                ref[i] = (p64, m, v)
        for p, (p64, _, _) in zip(params, ref):
            main = opt.read_state(p, "main")
            # fp32 mains: 20 steps of fp32 rounding against float64 (|p| < 5, ulp 4.8e-7).
            torch.testing.assert_close(main.double(), p64, rtol=0, atol=1e-5)
            # The bf16 param is the fp32 main rounded to nearest even, written in the same pass.
            self.assertTrue(torch.equal(p, main.to(torch.bfloat16)))
            # ... which a bf16-only optimizer could not track: the mains moved by less than a bf16 ulp.
        self.assertGreater(max((opt.read_state(p, "main").double() - p.double()).abs().max().item()
                               for p in params), 0)

    def test_resume_from_store_equals_uninterrupted(self):
        model = make_model(0)
        with ot.AdamW(two_groups(model), store=self.path("a"), lr=1e-2, **OPT_KW) as opt:
            train(model, opt, 20)
        full = [p.detach().clone() for p in model.parameters()]

        model = make_model(0)
        sched_state = None
        with ot.AdamW(two_groups(model), store=self.path("b"), lr=1e-2, **OPT_KW) as opt:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.3 * k))
            gen = torch.Generator().manual_seed(7)
            x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
            for _ in range(10):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                sched.step()
            sched_state = sched.state_dict()
            sd = opt.state_dict()
        # A fresh process would build a differently initialised model; the store's mains win.
        model = make_model(1)
        with ot.AdamW(two_groups(model), store=self.path("b"), lr=1e-2, **OPT_KW) as opt:
            # torch's resume order: the scheduler first (its constructor sets lr), then the states.
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.3 * k))
            sched.load_state_dict(sched_state)
            opt.load_state_dict(sd)
            self.assertEqual((opt.step_count(0), opt.step_count(1)), (10, 10))
            for _ in range(10):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                sched.step()
            self.assertEqual(opt.step_count(0), 20)
        for a, b in zip(full, model.parameters()):
            self.assertTrue(torch.equal(a, b.detach()))

    def test_retire_a_param_the_model_lost(self):
        """A model that lost a layer: step() refuses while the store holds its state, retire(name) keeps
        that state unchanged in the store and training goes on; the kept layers resume exactly."""
        model = make_model(0)
        with ot.AdamW(list(model.named_parameters()), store=self.path("s"), **OPT_KW) as opt:
            train(model, opt, 3)
            lost = opt.read_state(model[4].weight, "exp_avg")
        smaller = torch.nn.Sequential(*list(make_model(1))[:4])  # no last Linear ("4.weight", "4.bias")
        with ot.AdamW(list(smaller.named_parameters()), store=self.path("s"), **OPT_KW) as opt:
            for a, b in zip(smaller.parameters(), list(model.parameters())[:4]):
                self.assertTrue(torch.equal(a, b))  # resumed from the stored mains
            gen = opt.generation
            smaller(torch.ones(2, 16)).sum().backward()
            with self.assertRaises(optstate.FailedPrecondition) as cm:
                opt.step()
            self.assertIn("4.weight", str(cm.exception))
            self.assertEqual(opt.generation, gen)
            with self.assertRaises(optstate.InvalidArgument):
                opt.retire("0.weight")  # a param of this optimizer
            with self.assertRaises(optstate.NotFound):
                opt.retire("5.weight")
            opt.retire("4.weight")
            opt.retire("4.bias")
            opt.step()
            opt.step()
            self.assertEqual(opt.step_count(), 5)
            kept = torch.empty(lost.numel())
            opt.store.read_into("4.weight", "exp_avg", kept.data_ptr(), 0, lost.numel())
            self.assertTrue(torch.equal(kept.view(lost.shape), lost))

    def test_state_dict_round_trip(self):
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("s"), lr=1e-2, **OPT_KW)
        train(model, opt, 3)
        sd = opt.state_dict()
        self.assertEqual(sd["state"], {})
        meta = sd["optstate"]
        self.assertEqual(meta["store_uuid"], opt.store.uuid)
        self.assertEqual(meta["generation"], opt.store.latest_generation()[0])
        self.assertEqual(meta["step_counts"], [3, 3])
        self.assertEqual(len(meta["param_names"]), 6)
        buf = io.BytesIO()
        torch.save(sd, buf)
        self.assertLess(len(buf.getvalue()), 8192)  # metadata only, never the 12 B/param state
        buf.seek(0)
        loaded = torch.load(buf)
        opt.param_groups[0]["lr"] = 123.0
        opt.param_groups[1]["weight_decay"] = 0.5
        opt.load_state_dict(loaded)
        self.assertEqual(opt.param_groups[0]["lr"], sd["param_groups"][0]["lr"])
        self.assertEqual(opt.param_groups[1]["weight_decay"], 0.0)
        self.assertEqual(opt.state_dict()["param_groups"], sd["param_groups"])
        # A newer store state than the state_dict describes: the store reverts to the state_dict's
        # snapshot (docs/PYTHON.md); once that snapshot is released, refused, naming the generation.
        train(model, opt, 1)
        opt.load_state_dict(loaded)
        self.assertEqual([opt.step_count(0), opt.step_count(1)], [3, 3])
        train(model, opt, 1)
        opt.release_snapshot(meta["snapshot"])
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            opt.load_state_dict(loaded)
        self.assertIn("generation %d" % meta["generation"], str(cm.exception))
        # Another store's state_dict, with no files of it armed: refused, naming that store.
        other_model = make_model(0)
        with ot.AdamW(two_groups(other_model), store=self.path("t"), **OPT_KW) as other:
            with self.assertRaises(optstate.FailedPrecondition) as cm:
                other.load_state_dict(opt.state_dict())
            self.assertIn(self.path("s"), str(cm.exception))
        with self.assertRaises(optstate.InvalidArgument):
            opt.load_state_dict(torch.optim.AdamW(make_model(0).parameters()).state_dict())

    def test_found_inf_skips_the_step(self):
        model = make_model(0)
        opt = ot.AdamW(model.parameters(), store=self.path("s"), **OPT_KW)
        train(model, opt, 2)
        before = [p.detach().clone() for p in model.parameters()]
        gen = opt.generation
        for p in model.parameters():
            p.grad = torch.full_like(p, float("inf"))
        opt.step(found_inf=torch.ones(1))
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        self.assertEqual((opt.generation, opt.step_count()), (gen, 2))
        with self.assertRaises(optstate.InvalidArgument):
            opt.step(found_inf=torch.ones(2))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step(found_inf=torch.zeros(1))
        self.assertEqual(opt.step_count(), 3)
        # The library timed that step: a positive, finite number of seconds.
        self.assertTrue(0.0 < opt.last_step_seconds() < float("inf"), opt.last_step_seconds())

    def test_snapshot_sleep_wake_and_load_main(self):
        model = make_model(0)
        opt = ot.AdamW(model.named_parameters(), store=self.path("s"), **OPT_KW)
        self.assertEqual(opt.param_name(model[0].weight), "0.weight")
        train(model, opt, 2)
        gen = opt.snapshot("step2")
        self.assertEqual(opt.store.snapshots(), [("step2", gen)])
        opt.sleep()
        self.assertEqual(opt.stats()["resident_bytes"], 0)
        opt.wake()
        train(model, opt, 1)
        self.assertLessEqual(opt.stats()["peak_resident_bytes"], 64 << 20)
        # Weights loaded into the model behind the optimizer's back: load_main_from_params adopts them.
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.25)
        opt.load_main_from_params()
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.param_groups[0]["weight_decay"] = 0.0
        opt.step()
        for p in model.parameters():
            # Zero grad, moments decayed: the step moves the new 0.25 by far less than it did before.
            torch.testing.assert_close(opt.read_state(p, "main"), torch.full_like(p, 0.25), rtol=0, atol=1e-2)
        opt.release_snapshot("step2")
        self.assertEqual(opt.store.snapshots(), [])

    def test_prefetch_changes_no_result_and_serves_the_step(self):
        # Two identical runs with a host cache tier; one prefetches on every forward (and once more,
        # waited for, before its first step: sleep() waits for a prefetch to end, so the first step
        # finds the whole state in RAM). Params and state are equal bit for bit.
        tier = dict(OPT_KW, host_cache_bytes=64 << 20)
        ref_model, model = make_model(0), make_model(0)
        ref = ot.AdamW(two_groups(ref_model), store=self.path("ref"), lr=1e-2, **tier)
        opt = ot.AdamW(two_groups(model), store=self.path("s"), lr=1e-2, **tier)
        handle = opt.prefetch_on_forward(model)
        opt.prefetch()
        opt.prefetch()  # a second call while one runs does nothing
        opt.sleep()
        opt.wake()
        state_bytes = 12 * sum(p.numel() for p in model.parameters())
        gen = torch.Generator().manual_seed(7)
        x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)
        for k in range(4):
            for m, o in ((ref_model, ref), (model, opt)):
                o.zero_grad()
                ((m(x) - y) ** 2).mean().backward()
                o.step()
            if k == 0:
                self.assertEqual(opt.last_step_prefetch(), (state_bytes, state_bytes))
            self.assertEqual(ref.last_step_prefetch(), (0, 0))
            for a, b in zip(ref_model.parameters(), model.parameters()):
                self.assertTrue(torch.equal(a, b))
        handle.remove()
        for a, b in zip(ref_model.parameters(), model.parameters()):
            for field in ("main", "exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(ref.read_state(a, field), opt.read_state(b, field)))
        opt.prefetch()  # with no step following: close stops it
        opt.close()
        ref.close()


if __name__ == "__main__":
    unittest.main()
