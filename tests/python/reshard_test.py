"""optstate.reshard over the C ABI: a one-rank checkpoint split over two ranks
and joined again (without state.safetensors) gives back its field files byte
for byte, the joined one loads and training continues as from the original,
and a missing rank is refused with nothing written."""
import hashlib
import json
import os
import subprocess
import sys
import unittest

import torch

from common import HANG_LIMIT_S, OPT_KW, TempDirTest, optstate, safetensors_of
import optstate.checkpoint as ckpt
import optstate.torch as ot
from torch_adamw_test import make_model, two_groups


def field_files(root):
    """{path under tensors/: sha256} of a checkpoint directory's field files."""
    out = {}
    for d, _, names in os.walk(os.path.join(root, "tensors")):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


class ReshardTest(TempDirTest):
    def setUp(self):
        super().setUp()
        gen = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)

    def steps(self, model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            ((model(self.x) - self.y) ** 2).mean().backward()
            opt.step()

    def test_split_and_join_is_byte_identical_and_resumes(self):
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("a"), lr=1e-2, **OPT_KW)
        self.steps(model, opt, 3)
        ckpt.save(opt, self.path("ck1"))

        layout = ckpt.reshard_layout([self.path("ck1")], ranks=2, split="rows")
        self.assertEqual(layout["format"], "optstate-reshard-layout")
        self.assertEqual(len(layout["ranks"]), 2)
        self.assertEqual(optstate.reshard([self.path("ck1")], self.path("ck2"), layout), 2)
        two = [ckpt.rank_dir(self.path("ck2"), r) for r in range(2)]
        for d in two:  # by default with state.safetensors, as an export
            self.assertEqual(safetensors_of(d), (True, None), d)

        # Joined without state.safetensors: the field files alone, the manifest saying so.
        joined = ckpt.reshard_layout(two, ranks=1)
        self.assertEqual(optstate.reshard(list(reversed(two)), self.path("ck3"), joined, safetensors=False), 1)
        self.assertEqual(field_files(self.path("ck1")), field_files(ckpt.rank_dir(self.path("ck3"), 0)))
        self.assertEqual(safetensors_of(ckpt.rank_dir(self.path("ck3"), 0)), (False, False))
        self.assertEqual(sorted(os.listdir(ckpt.rank_dir(self.path("ck3"), 0))), ["manifest.json", "tensors"])

        # The joined checkpoint resumes exactly as the original does.
        self.steps(model, opt, 2)
        want = [p.detach().clone() for p in model.parameters()]
        opt.close()
        model2 = make_model(1)
        opt2 = ot.AdamW(two_groups(model2), store=self.path("b"), lr=1e-2, **OPT_KW)
        ckpt.load(opt2, ckpt.rank_dir(self.path("ck3"), 0))
        self.steps(model2, opt2, 2)
        # model2's params took the restored mains at load; after the same 2 steps they equal model's.
        for p, w in zip(model2.parameters(), want):
            self.assertTrue(torch.equal(p.detach(), w))
        opt2.close()

    def test_missing_rank_is_refused_and_nothing_written(self):
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("a"), lr=1e-2, **OPT_KW)
        self.steps(model, opt, 1)
        ckpt.save(opt, self.path("ck1"))
        opt.close()
        layout = ckpt.reshard_layout([self.path("ck1")], ranks=2)
        optstate.reshard([self.path("ck1")], self.path("ck2"), layout)
        with self.assertRaises(optstate.InvalidArgument) as cm:
            optstate.reshard([ckpt.rank_dir(self.path("ck2"), 0)], self.path("ck3"),
                             ckpt.reshard_layout([self.path("ck1")], ranks=1))
        self.assertIn("in no shard", str(cm.exception))
        self.assertFalse(os.path.exists(self.path("ck3")))
        with self.assertRaises(optstate.InvalidArgument):
            optstate.reshard(self.path("ck1"), self.path("ck3"), layout)


class TensorParallel(torch.nn.Module):
    """The parameters of a tensor-parallel MLP block: fc1 column-parallel (weight and bias split along
    the output dimension), fc2 row-parallel (weight split along the input dimension, no bias)."""

    def __init__(self, shapes=None):
        super().__init__()
        shapes = shapes or {"fc1.weight": (24, 16), "fc1.bias": (24,), "fc2.weight": (4, 24)}
        self.fc1 = torch.nn.Module()
        self.fc2 = torch.nn.Module()
        self.fc1.weight = torch.nn.Parameter(torch.zeros(shapes["fc1.weight"]))
        self.fc1.bias = torch.nn.Parameter(torch.zeros(shapes["fc1.bias"]))
        self.fc2.weight = torch.nn.Parameter(torch.zeros(shapes["fc2.weight"]))


TP_DIMS = {"fc1.*": 0, "fc2.weight": 1}
GLOBAL = {"fc1.weight": (24, 16), "fc1.bias": (24,), "fc2.weight": (4, 24)}


def tp_shards(ranks):
    """Per rank {name: (offset, shape)}: the even split of each param along its TP_DIMS dimension."""
    out = []
    for r in range(ranks):
        parts = {}
        for name, g in GLOBAL.items():
            d = 0 if name.startswith("fc1") else 1
            lo, hi = g[d] * r // ranks, g[d] * (r + 1) // ranks
            off, shape = [0] * len(g), list(g)
            off[d], shape[d] = lo, hi - lo
            parts[name] = (tuple(off), tuple(shape))
        out.append(parts)
    return out


def box(t, off, shape):
    return t[tuple(slice(o, o + n) for o, n in zip(off, shape))]


class TensorParallelReshardTest(TempDirTest):
    """A 2-rank tensor-parallel run (each rank an AdamW over its shards) resharded to 3 ranks by rules
    from the model and continued equals one uninterrupted run of the whole parameters, bit for bit."""
    K, J = 3, 2

    def setUp(self):
        super().setUp()
        gen = torch.Generator().manual_seed(5)
        self.init = {n: torch.randn(g, generator=gen) * 0.3 for n, g in GLOBAL.items()}
        self.x, self.y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)

    def grads(self, full):
        """Gradients of the block's loss at the whole parameters `full` (tensors by name)."""
        w = {n: t.detach().clone().requires_grad_(True) for n, t in full.items()}
        h = torch.tanh(self.x @ w["fc1.weight"].t() + w["fc1.bias"])
        ((h @ w["fc2.weight"].t() - self.y) ** 2).mean().backward()
        return {n: t.grad for n, t in w.items()}

    def groups(self, params):
        """Weights with decay, the bias without at its own lr (named params)."""
        return [{"params": [(n, p) for n, p in params.items() if n.endswith("weight")], "weight_decay": 0.1},
                {"params": [(n, p) for n, p in params.items() if n.endswith("bias")], "weight_decay": 0.0,
                 "lr": 3e-3}]

    def make_rank(self, path, parts, values=None):
        params = {n: torch.nn.Parameter(box(self.init[n], *parts[n]).clone() if values is None
                                        else torch.zeros(parts[n][1])) for n in parts}
        shards = {n: (GLOBAL[n], parts[n][0]) for n in parts}
        opt = ot.AdamW(self.groups(params), store=path, lr=1e-2, shards=shards, job="reshard-test", **OPT_KW)
        return params, opt

    def step_ranks(self, ranks, step_count):
        for _ in range(step_count):
            full = {}
            for n, g in GLOBAL.items():
                t = torch.zeros(g)
                for params, parts, _ in ranks:
                    box(t, *parts[n]).copy_(params[n].detach())
                full[n] = t
            g = self.grads(full)
            for params, parts, opt in ranks:
                for n, p in params.items():
                    p.grad = box(g[n], *parts[n]).contiguous()
                opt.step()

    def moments(self, ranks):
        """{name/field: whole tensor} assembled from the ranks' stores."""
        out = {}
        for params, parts, opt in ranks:
            for n, p in params.items():
                for field in ("main", "exp_avg", "exp_avg_sq"):
                    t = out.setdefault(n + "/" + field, torch.zeros(GLOBAL[n]))
                    v = torch.empty(p.numel(), dtype=torch.float32)
                    opt.store.read_into(n, field, v.data_ptr(), 0, p.numel())
                    box(t, *parts[n]).copy_(v.view(parts[n][1]))
        return out

    def test_two_tp_ranks_resharded_to_three_continue_bit_for_bit(self):
        # The uninterrupted run: one rank holding every parameter whole.
        params, opt = self.make_rank(self.path("whole"), tp_shards(1)[0])
        ref = [(params, tp_shards(1)[0], opt)]
        self.step_ranks(ref, self.K + self.J)
        opt.commit()
        want = self.moments(ref)
        opt.close()

        # Two tensor-parallel ranks for K steps, saved.
        two = []
        for r, parts in enumerate(tp_shards(2)):
            params, opt = self.make_rank(self.path("a%d" % r), parts)
            two.append((params, parts, opt))
        self.step_ranks(two, self.K)
        srcs = []
        for r, (_, _, opt) in enumerate(two):
            srcs.append(self.path("ck%d" % r))
            ckpt.save(opt, srcs[-1])
            opt.close()

        # The layout for 3 ranks from the model's sharding rules, resharded.
        layout = ot.layout_from_model(TensorParallel(), srcs, 3, dims=TP_DIMS)
        self.assertEqual(layout["ranks"][1]["tensors"]["fc2.weight"], {"offset": [0, 8], "shape": [4, 8]})
        self.assertEqual(optstate.reshard(srcs, self.path("ck3"), layout), 3)

        # Three ranks register their shards, load their checkpoints, continue J steps.
        three = []
        for r, parts in enumerate(tp_shards(3)):
            params, opt = self.make_rank(self.path("b%d" % r), parts, values="zeros")
            ckpt.load(opt, ckpt.rank_dir(self.path("ck3"), r))
            three.append((params, parts, opt))
        self.step_ranks(three, self.J)
        for _, _, opt in three:
            opt.commit()
        got = self.moments(three)
        for _, _, opt in three:
            opt.close()
        self.assertEqual(sorted(got), sorted(want))
        for key in want:
            self.assertTrue(torch.equal(got[key], want[key]), key)
        self.assertNotEqual(float(want["fc1.weight/exp_avg"].abs().sum()), 0.0)

    def test_rules_callables_and_bad_rules(self):
        two = []
        for r, parts in enumerate(tp_shards(2)):
            params, opt = self.make_rank(self.path("a%d" % r), parts)
            two.append((params, parts, opt))
        self.step_ranks(two, 1)
        srcs = []
        for r, (_, _, opt) in enumerate(two):
            srcs.append(self.path("ck%d" % r))
            ckpt.save(opt, srcs[-1])
            opt.close()
        self.assertEqual(ckpt.global_shapes(srcs), {n: tuple(g) for n, g in GLOBAL.items()})
        # The same rules as a dict, as a string, and as a callable give the same layout.
        by_dict = ckpt.reshard_layout(srcs, 3, {"fc1.*": 0, "fc2.weight": "columns"})
        by_text = ckpt.reshard_layout(srcs, 3, "fc1.*=rows,fc2.weight=dim1")
        self.assertEqual(by_dict, by_text)

        def fn(name, shape, rank, ranks):
            off, n = tp_shards(ranks)[rank][name]
            return off, n
        self.assertEqual(ckpt.reshard_layout(srcs, 3, fn), by_dict)
        # Flat ranges of the 2-D weights (by a rule, and the same by a callable) reshard and come
        # back byte for byte.
        flat = ckpt.reshard_layout(srcs, 2, "fc1.bias=rows,*=flat")
        self.assertEqual(flat["ranks"][1]["tensors"]["fc1.weight"], {"flat": [192, 384]})

        def flat_fn(name, shape, rank, ranks):
            n = 1
            for s in shape:
                n *= s
            return range(n * rank // ranks, n * (rank + 1) // ranks)
        self.assertEqual(ckpt.reshard_layout(srcs, 2, flat_fn)["ranks"][1]["tensors"]["fc2.weight"],
                         {"flat": [48, 96]})
        optstate.reshard(srcs, self.path("flat"), flat)
        back = ckpt.reshard_layout(srcs, 2, TP_DIMS)
        optstate.reshard([ckpt.rank_dir(self.path("flat"), r) for r in range(2)], self.path("back"), back)
        for r in range(2):
            self.assertEqual(field_files(srcs[r]), field_files(ckpt.rank_dir(self.path("back"), r)))
        # Bad rules name what is wrong.
        for split, words in (("replicate", ["replicate", "exactly one rank"]),
                             ("fc1.*=dim0", ["no split rule matches", "fc2.weight"]),
                             ("fc9.*=rows,*=rows", ["fc9.*", "matches no tensor"]),
                             ("*=diagonal", ["diagonal"])):
            with self.assertRaises(optstate.InvalidArgument) as cm:
                ckpt.reshard_layout(srcs, 3, split)
            for w in words:
                self.assertIn(w, str(cm.exception))
        with self.assertRaises(optstate.InvalidArgument) as cm:
            ot.layout_from_model(TensorParallel(), srcs, 3, dims={"fc1.*": 0})
        self.assertIn("fc2.weight", str(cm.exception))
        self.assertIn("dims", str(cm.exception))


def job_worker(rank, world, init_file, store_template, out):
    """One rank of a torch.distributed job (gloo): an AdamW with no job given, one step, a checkpoint."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    torch.manual_seed(rank)
    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = ot.AdamW([("w", w)], store=store_template, lr=1e-2, shards={"w": ((4 * world, 8), (4 * rank, 0))},
                   **OPT_KW)
    w.grad = torch.ones_like(w)
    opt.step()
    ckpt.save(opt, os.path.join(out, "rank%d" % rank))
    with open(os.path.join(out, "job%d.json" % rank), "w") as f:
        json.dump({"job": opt.store.job}, f)
    opt.close()
    dist.destroy_process_group()


@unittest.skipUnless(hasattr(torch, "distributed") and torch.distributed.is_available(),
                     "torch %s has no torch.distributed" % torch.__version__)
class DistributedJobTest(TempDirTest):
    def run_job(self, name, world=2):
        out = self.path(name)
        os.mkdir(out)
        init = self.path(name + ".init")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "job-worker", str(r), str(world), init,
                                   os.path.join(out, "store-{rank}"), out], cwd=os.path.dirname(__file__))
                 for r in range(world)]
        for p in procs:
            self.assertEqual(p.wait(timeout=HANG_LIMIT_S), 0)
        jobs = []
        for r in range(world):
            with open(os.path.join(out, "job%d.json" % r)) as f:
                jobs.append(json.load(f)["job"])
        return [os.path.join(out, "rank%d" % r) for r in range(world)], jobs

    def test_ranks_agree_on_one_job_and_two_jobs_do_not_mix(self):
        a, jobs_a = self.run_job("a")
        b, jobs_b = self.run_job("b")
        self.assertEqual(len(set(jobs_a)), 1, jobs_a)  # rank 0's id, broadcast
        self.assertEqual(len(set(jobs_b)), 1, jobs_b)
        self.assertNotEqual(jobs_a[0], jobs_b[0])
        layout = ckpt.reshard_layout(a, 1)
        self.assertEqual(optstate.reshard(a, self.path("joined"), layout), 1)
        with open(os.path.join(ckpt.rank_dir(self.path("joined"), 0), "manifest.json")) as f:
            self.assertEqual(json.load(f)["job"], jobs_a[0])
        # Same step, generation, groups and layout, another job: refused, naming both.
        with self.assertRaises(optstate.InvalidArgument) as cm:
            optstate.reshard([a[0], b[1]], self.path("mixed"), layout)
        for word in (a[0], b[1], jobs_a[0], jobs_b[0], "not of one job"):
            self.assertIn(word, str(cm.exception))
        self.assertFalse(os.path.exists(self.path("mixed")))
        # A store made without torch.distributed is a job of its own; a reopened store keeps its job.
        with ot.AdamW([("w", torch.nn.Parameter(torch.zeros(3)))], store=self.path("solo"), **OPT_KW) as o:
            solo = o.store.job
        self.assertNotIn(solo, jobs_a + jobs_b)
        with ot.AdamW([("w", torch.nn.Parameter(torch.zeros(3)))], store=self.path("solo"), job="other",
                      **OPT_KW) as o:
            self.assertEqual(o.store.job, solo)
        with ot.AdamW([("w", torch.nn.Parameter(torch.zeros(3)))], store=self.path("named"), job="job-7",
                      **OPT_KW) as o:
            self.assertEqual(o.store.job, "job-7")


@unittest.skipUnless(hasattr(torch, "distributed") and torch.distributed.is_available() and
                     ot._has_dtensor(), "torch %s has no DTensor (torch >= 2)" % torch.__version__)
class DTensorLayoutTest(TempDirTest):
    def test_shard_placements_give_the_dimensions(self):
        from torch.distributed._tensor import Replicate, Shard

        model = TensorParallel()
        model.fc1.weight.placements = (Shard(0),)
        model.fc1.bias.placements = (Shard(0),)
        model.fc2.weight.placements = (Shard(1),)
        self.assertEqual(ot._shard_dim("fc2.weight", model.fc2.weight), 1)
        model.fc1.bias.placements = (Replicate(),)
        with self.assertRaises(optstate.Unimplemented):
            ot._shard_dim("fc1.bias", model.fc1.bias)


class DocsTensorParallelExampleTest(TempDirTest):
    """docs/PYTHON.md's "Another number of ranks" example on a small model that has fc2.bias (a
    row-parallel layer's bias: whole on every rank, its state owned by rank 0): the same shards, params
    and dims with 4096/1024/2048 scaled to 16/8/8. Two ranks step and save, layout_from_model and
    reshard make three ranks' checkpoints, and each resharded field equals the sources' elements."""
    F, D, H = 16, 8, 8  # the docs' 4096, 1024, 2048

    def test_example_runs_on_a_model_with_fc2_bias(self):
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "PYTHON.md")) as f:
            docs = f.read()
        # What this test runs is what the docs say.
        for line in ('params = [(n, p) for n, p in model.named_parameters() if n in shards or r == 0]',
                     'layout = optstate.torch.layout_from_model(model, srcs, 3, dims={"fc1.*": 0, '
                     '"fc2.weight": 1})'):
            self.assertIn(line, docs)
        F, D, H = self.F, self.D, self.H
        srcs = []
        torch.manual_seed(3)
        for r in range(2):
            model = torch.nn.Sequential()
            model.fc1 = torch.nn.Linear(D, H)  # column-parallel: rank r's rows of fc1
            model.fc2 = torch.nn.Linear(H, D)  # row-parallel: rank r's columns of fc2, the bias whole
            shards = {"fc1.weight": ((F, D), (H * r, 0)), "fc1.bias": ((F,), (H * r,)),
                      "fc2.weight": ((D, F), (0, H * r))}
            params = [(n, p) for n, p in model.named_parameters() if n in shards or r == 0]
            # One job: the docs run it under torch.distributed, which agrees on one; here the ranks are
            # simulated in one process and name theirs.
            opt = ot.AdamW(params, store=self.path("s%d" % r), shards=shards, job="docs-example", **OPT_KW)
            for _, p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            srcs.append(self.path("ck%d" % r))
            ckpt.save(opt, srcs[-1])
            opt.close()
        layout = ot.layout_from_model(model, srcs, 3, dims={"fc1.*": 0, "fc2.weight": 1})
        self.assertEqual(layout["ranks"][0]["tensors"]["fc2.bias"], {"offset": [0], "shape": [D]})
        for r in (1, 2):
            self.assertNotIn("fc2.bias", layout["ranks"][r]["tensors"])
        self.assertEqual(optstate.reshard(srcs, self.path("ck3"), layout), 3)

        def read(d, name, field="main"):
            with open(os.path.join(d, "tensors", name, field), "rb") as f:
                return torch.frombuffer(bytearray(f.read()), dtype=torch.float32)

        new = [ckpt.rank_dir(self.path("ck3"), r) for r in range(3)]
        for field in ("main", "exp_avg", "exp_avg_sq"):
            self.assertTrue(torch.equal(read(new[0], "fc2.bias", field), read(srcs[0], "fc2.bias", field)))
            old = torch.cat([read(srcs[r], "fc1.bias", field) for r in range(2)])
            self.assertTrue(torch.equal(torch.cat([read(new[r], "fc1.bias", field) for r in range(3)]), old))
            old = torch.cat([read(srcs[r], "fc2.weight", field).view(D, H) for r in range(2)], dim=1)
            got = torch.cat([read(new[r], "fc2.weight", field).view(D, -1) for r in range(3)], dim=1)
            self.assertTrue(torch.equal(got, old))


if __name__ == "__main__":
    if sys.argv[1:2] == ["job-worker"]:
        job_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
    else:
        unittest.main()
