"""A trainer process killed with SIGKILL (between steps or while a step runs)
loses nothing committed: the store reopens at its last committed step, holds
exactly the state an uninterrupted run had after that step, and training
resumed from it continues bit for bit like the uninterrupted run.

The child (this file run as a script) trains with optstate.torch.AdamW and
reports "begin k", "step k" (opt.step() starts) and "done k" through a
pipe; the parent kills it at a chosen point, optionally a random fraction of
the previous opt.step()'s duration after "step k". The child begins each step
only when the parent lets it (a line on a second pipe), and the parent lets it
go no further than the step it is to be killed in: however late the parent
reads a report or wakes from its delay, the child cannot have run ahead, so
the committed steps a kill may leave are known. Data and
learning rates are functions of the step number, so every run sees the same
inputs. The optimizer runs with pipelined commits (commit_lag_steps 1, the
default): step k's commit may still run after opt.step() returned and is
waited for when step k+1 starts, so a kill may leave one step less than with
commits inside the step. OPTSTATE_KILL_TEST_SEED fixes the random kill points (the seed used
is printed with any failure). The same holds for optstate.torch.Lion, optstate.torch.SGD (Nesterov
momentum) and optstate.torch.Muon (Muon for the weight matrices, AdamW for the biases), whose child runs
the same loop with that optimizer."""
import os
import random
import signal
import subprocess
import sys
import time
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate
import optstate.torch as ot

STEPS = 8


def build_model(seed, kind="adamw"):
    """About 1.1M fp32 params: the big layer spans two 2 MiB chunks a field, so a step takes a while.
    For Muon, whose CPU Newton-Schulz costs ~min(rows, cols) multiply-adds an element and iteration,
    the middle layer is 128 x 1024 (a step still takes a while)."""
    torch.manual_seed(seed)
    middle = 128 if kind == "muon" else 1024
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, middle),
                               torch.nn.Tanh(), torch.nn.Linear(middle, 4))


def groups(model):
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


# optimizer kind: (constructor, its state fields besides main, or a function of the param giving them)
KINDS = {
    "adamw": (lambda gs, store: ot.AdamW(gs, store=store, lr=1e-3, **OPT_KW), ("exp_avg", "exp_avg_sq")),
    "lion": (lambda gs, store: ot.Lion(gs, store=store, lr=1e-4, **OPT_KW), ("exp_avg",)),
    "sgd": (lambda gs, store: ot.SGD(gs, store=store, lr=1e-2, momentum=0.9, nesterov=True, **OPT_KW),
            ("momentum_buffer",)),
    "muon": (lambda gs, store: ot.Muon(gs, store=store, lr=1e-2, adjust_lr_fn="match_rms_adamw", **OPT_KW),
             lambda p: ("momentum_buffer",) if p.ndim == 2 else ("exp_avg", "exp_avg_sq")),
}


def open_optimizer(model, store, kind="adamw"):
    return KINDS[kind][0](groups(model), store)


def train_step(model, opt, k, report=None):
    """Step k (1-based): its batch and learning rates depend on k alone."""
    gen = torch.Generator().manual_seed(k)
    x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 4, generator=gen)
    lr = 1e-3 / (1.0 + 0.2 * k)
    opt.param_groups[0]["lr"] = lr
    opt.param_groups[1]["lr"] = 2 * lr
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    if report is not None:
        report.write("step %d\n" % k)
    opt.step()


def child(store, fd, go_fd, kind):
    report = os.fdopen(fd, "w", buffering=1)
    go = os.fdopen(go_fd, "r")
    model = build_model(0, kind)
    opt = open_optimizer(model, store, kind)
    report.write("ready\n")
    for k in range(1, STEPS + 1):
        if go.readline().strip() != "go %d" % k:
            return  # the parent is gone
        report.write("begin %d\n" % k)
        train_step(model, opt, k, report)
        report.write("done %d\n" % k)
    opt.close()
    report.write("closed\n")


def state_of(model, opt, kind):
    """Params and every state field, by name (copies)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        fields = KINDS[kind][1](p) if callable(KINDS[kind][1]) else KINDS[kind][1]
        for field in ("main",) + fields:
            out[name + "/" + field] = opt.read_state(p, field).clone()
    return out


class KillTest(TempDirTest):
    def setUp(self):
        super().setUp()
        env_seed = os.environ.get("OPTSTATE_KILL_TEST_SEED")
        self.seed = int(env_seed) if env_seed else random.SystemRandom().randrange(1 << 30)
        self.rng = random.Random(self.seed)

    def kill_during(self, store, event, step, delay_fraction=None, kind="adamw"):
        """Runs the child until it reports `event` (and `step`), then SIGKILLs it, after delay_fraction
        of the last opt.step()'s duration when given. Returns the lines the child reported."""
        r, w = os.pipe()
        go_r, go_w = os.pipe()
        err = open(os.path.join(self.dir, "child.err"), "w")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child", store, str(w), str(go_r), kind],
                                pass_fds=(w, go_r), stderr=err, stdout=err, cwd=os.path.dirname(__file__))
        os.close(w)
        os.close(go_r)
        go = os.fdopen(go_w, "w", buffering=1)
        lines, last_step_s, begun = [], None, None
        target = event if step is None else "%s %d" % (event, step)
        # The last step the child may begin: the one it is killed in, or none after the point it is killed at.
        last_step = step if event in ("begin", "step") else (0 if step is None else step)
        with os.fdopen(r) as reader:
            for line in reader:
                line = line.strip()
                lines.append(line)
                if line.startswith("step"):
                    begun = time.monotonic()
                elif line.startswith("done") and begun is not None:
                    last_step_s = time.monotonic() - begun
                if line == "ready" or line.startswith("done"):
                    following = 1 if line == "ready" else int(line.split()[1]) + 1
                    if following <= last_step:
                        go.write("go %d\n" % following)
                if line == target:
                    if delay_fraction is not None and last_step_s is not None:
                        # A kill point, not synchronisation: somewhere inside the running step.
                        time.sleep(delay_fraction * last_step_s)
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.wait()
        go.close()
        err.close()
        with open(os.path.join(self.dir, "child.err")) as f:
            child_err = f.read()
        self.assertEqual(proc.returncode, -signal.SIGKILL,
                         "child exited before %r (seed %d); it reported %s; stderr:\n%s"
                         % (target, self.seed, lines, child_err[-3000:]))
        return lines

    def check_resume(self, label, store, allowed, kind="adamw"):
        """Reopens the killed store (a differently initialised model: the stored mains must win) and
        checks it against an uninterrupted run, at the committed step and after the remaining steps."""
        msg = "%s, seed %d" % (label, self.seed)
        model = build_model(1, kind)
        opt = open_optimizer(model, store, kind)  # no Busy: the dead child's lock is gone
        committed = opt.step_count(0)
        self.assertIn(committed, allowed, msg)
        self.assertEqual(opt.step_count(1), committed, msg)

        ref_model = build_model(0, kind)
        ref = open_optimizer(ref_model, self.path("ref-" + label), kind)
        for k in range(1, committed + 1):
            train_step(ref_model, ref, k)
        got, want = state_of(model, opt, kind), state_of(ref_model, ref, kind)
        for key in want:
            self.assertTrue(torch.equal(got[key], want[key]), "%s at committed step %d: %s differs"
                            % (msg, committed, key))
        for k in range(committed + 1, STEPS + 1):
            train_step(model, opt, k)
            train_step(ref_model, ref, k)
        got, want = state_of(model, opt, kind), state_of(ref_model, ref, kind)
        for key in want:
            self.assertTrue(torch.equal(got[key], want[key]), "%s after step %d: %s differs" % (msg, STEPS, key))
        self.assertEqual((opt.step_count(0), ref.step_count(0)), (STEPS, STEPS), msg)
        opt.close()
        ref.close()
        return committed

    def test_sigkill_then_resume_equals_uninterrupted(self):
        mid_step = self.rng.uniform(0.0, 1.0)
        trials = [
            # (label, event, step, delay fraction of a step, committed steps it may leave)
            ("before-first-step", "ready", None, None, (0,)),
            ("between-steps", "done", 4, None, (3, 4)),
            ("in-step-3", "step", 3, mid_step, (1, 2, 3)),
        ]
        k = self.rng.randint(2, STEPS - 1)
        trials.append(("in-step-%d-random" % k, "step", k, self.rng.uniform(0.0, 1.0), (k - 2, k - 1, k)))
        for label, event, step, delay, allowed in trials:
            with self.subTest(trial=label):
                store = self.path("s-" + label)
                lines = self.kill_during(store, event, step, delay)
                self.assertNotIn("closed", lines)
                committed = self.check_resume(label, store, allowed)
                sys.stderr.write("kill_test: %s: killed after %r, %d step(s) committed (seed %d)\n"
                                 % (label, lines[-1], committed, self.seed))


    def test_sigkill_then_resume_lion_sgd_and_muon(self):
        for kind in ("lion", "sgd", "muon"):
            k = self.rng.randint(2, STEPS - 1)
            trials = [("between-steps", "done", 4, None, (3, 4)),
                      ("in-step-%d-random" % k, "step", k, self.rng.uniform(0.0, 1.0), (k - 2, k - 1, k))]
            for label, event, step, delay, allowed in trials:
                with self.subTest(kind=kind, trial=label):
                    label = kind + "-" + label
                    store = self.path("s-" + label)
                    lines = self.kill_during(store, event, step, delay, kind)
                    self.assertNotIn("closed", lines)
                    committed = self.check_resume(label, store, allowed, kind)
                    sys.stderr.write("kill_test: %s: killed after %r, %d step(s) committed (seed %d)\n"
                                     % (label, lines[-1], committed, self.seed))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        unittest.main()
