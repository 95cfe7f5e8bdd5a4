"""FSDP2 (fully_shard, DTensor params) with optstate.torch.AdamW on two gloo processes (CPU), and
torch.distributed.checkpoint through optstate.integrations.dcp: against torch.optim.AdamW on the
unsharded model, the stores' shard geometry against the placements, a DCP save/load resume on two
processes and a resume on one process through reshard, each against the uninterrupted run. The
ranks' directories and the reshard's output hold the state once (no state.safetensors) unless
OptstateState(..., safetensors=True)."""
import json
import os
import unittest

import torch

from common import OPT_KW, TempDirTest, optstate, safetensors_of  # noqa: F401  (common puts the package on sys.path)
import optstate.torch as ot

try:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    HAVE_FSDP2 = dist.is_available()
except ImportError:  # torch before fully_shard (2.6)
    HAVE_FSDP2 = False
if HAVE_FSDP2:
    from optstate.integrations.dcp import OptstateState

WORLD = 2
STEPS = 20
SAVE_AT = 10
BATCH = 8  # each of the WORLD ranks trains on its BATCH / WORLD rows of a step's batch
LR, WD = 1e-2, 0.1


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 9)    # weight (9, 6), bias (9,): dim 0 odd, shards of 5 and 4 rows
        self.down = torch.nn.Linear(9, 6)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(6, 5)  # the root's own params: (5, 6) and (5,), split 3 / 2

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model():
    torch.manual_seed(0)
    return Net()


def groups(model):
    """Weights with decay, biases without and at their own lr (two param groups)."""
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if n.endswith("weight")], "weight_decay": WD},
            {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 3 * LR}]


def batch(k):
    gen = torch.Generator().manual_seed(1000 + k)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 5, generator=gen)


def train_step(model, opt, k, rows):
    x, y = batch(k)
    opt.zero_grad()
    ((model(x[rows]) - y[rows]) ** 2).mean().backward()  # FSDP2 averages the ranks' gradients
    opt.step()


def shard(model):
    mesh = init_device_mesh("cpu", (WORLD,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def final_state(model, opt):
    """{name: (param, exp_avg, exp_avg_sq, step)} of the whole tensors (collectives for DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        whole = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (p.detach(), st["exp_avg"],
                                                                                 st["exp_avg_sq"])]
        out[name] = tuple(t.clone() for t in whole) + (float(st["step"]),)
    return out


def manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return {t["name"]: t for t in json.load(f)["tensors"]}


def worker(rank, tmp):
    """Rank `rank` of two: the uninterrupted run (saving a DCP checkpoint at step SAVE_AT), then, with
    a new model, optimizer and store, the resume from that checkpoint."""
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"), rank=rank,
                            world_size=WORLD)
    try:
        for phase in ("train", "resume"):
            run_phase(rank, tmp, phase)
        check_refusals(rank, tmp)
    finally:
        dist.destroy_process_group()


def run_phase(rank, tmp, phase):
    os.makedirs(os.path.join(tmp, phase), exist_ok=True)
    model = shard(make_model())
    opt = ot.AdamW(groups(model), store=os.path.join(tmp, phase, "rank{rank}"), lr=LR, host_cache_bytes=0,
                   **OPT_KW)
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    ck = os.path.join(tmp, "dcp-step%d" % SAVE_AT)
    first = 0
    if phase == "resume":
        dcp.load({"model": model.state_dict(), "optim": OptstateState(opt, ck)}, checkpoint_id=ck)
        first = SAVE_AT
    report = {}
    for k in range(first, STEPS):
        if phase == "train" and k == SAVE_AT:
            dcp.save({"model": model.state_dict(), "optim": OptstateState(opt, ck)}, checkpoint_id=ck)
            report["geometry"] = check_geometry(model, ck, rank)
        train_step(model, opt, k, rows)
    state = final_state(model, opt)
    report["step_count"] = opt.step_count(0)
    opt.close()
    if rank == 0:
        torch.save({"state": state, "report": report}, os.path.join(tmp, phase + ".pt"))


def check_refusals(rank, tmp):
    """What optstate refuses of DTensor params, each rank's error message written to refused-<rank>.json:
    a param whose local shard is empty (1 row on 2 ranks: rank 1 holds none) and a replicated one."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    out = {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 1))  # weight (1, 6), bias (1,): nothing on rank 1
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    for what, params in (("empty", model.named_parameters()),
                         ("replicated", [("w", torch.nn.Parameter(distribute_tensor(
                             torch.ones(4, 3), init_device_mesh("cpu", (WORLD,)), [Replicate()])))])):
        try:
            ot.AdamW(params, store=os.path.join(tmp, "refused-%s-%d" % (what, rank)), **OPT_KW).close()
            out[what] = None
        except optstate.Error as e:
            out[what] = [type(e).__name__, str(e), os.path.exists(os.path.join(tmp, "refused-%s-%d" % (what, rank)))]
    with open(os.path.join(tmp, "refused-%d.json" % rank), "w") as f:
        json.dump(out, f)


def check_geometry(model, ck, rank):
    """The shard each rank's store records (its exported manifest) is its params' placement box; rank 0
    also checks layout_from_model on the sharded model against what the ranks' stores hold."""
    mine = manifest(os.path.join(ck, "optstate", "rank-%05d" % rank))
    checked = 0
    for name, p in model.named_parameters():
        local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        t = mine[name]
        assert tuple(t["global_shape"]) == tuple(p.shape), (name, t)
        assert tuple(t["shard_offset"]) == tuple(offset), (name, t, offset)
        assert tuple(t["shape"]) == tuple(local_shape) == tuple(p.to_local().shape), (name, t, local_shape)
        checked += 1
    layout = None
    if rank == 0:
        sources = [os.path.join(ck, "optstate", "rank-%05d" % r) for r in range(WORLD)]
        layout = ot.layout_from_model(model, sources, WORLD)
        for r, src in enumerate(sources):
            held = {n: {"offset": t["shard_offset"], "shape": t["shape"]} for n, t in manifest(src).items()}
            assert layout["ranks"][r]["tensors"] == held, (r, layout["ranks"][r], held)
        # On 4 ranks FSDP2 would split 9 rows as torch.chunk does (3, 3, 3 and none), not evenly (3, 2, 2, 2).
        four = ot.layout_from_model(model, sources, 4)
        for name, p in model.named_parameters():
            pieces = torch.arange(p.shape[0]).chunk(4)
            for r in range(4):
                want = None
                if r < len(pieces) and len(pieces[r]):
                    want = {"offset": [int(pieces[r][0])] + [0] * (p.dim() - 1),
                            "shape": [len(pieces[r])] + list(p.shape[1:])}
                assert four["ranks"][r]["tensors"].get(name) == want, (name, r, four["ranks"][r], want)
    return {"checked": checked, "layout": layout}


@unittest.skipUnless(HAVE_FSDP2, "needs torch with FSDP2 (fully_shard) and torch.distributed")
class Fsdp2Test(TempDirTest):
    def run_ranks(self):
        mp.spawn(worker, args=(self.dir,), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(self.dir, phase + ".pt")) for phase in ("train", "resume")]

    def reference(self):
        """torch.optim.AdamW on the unsharded model, each step on the whole batch (the mean of the ranks'
        means: the ranks' row counts are equal)."""
        model = make_model()
        named = list(model.named_parameters())
        opt = torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": WD},
                                 {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0,
                                  "lr": 3 * LR}], lr=LR, foreach=False)
        for k in range(STEPS):
            train_step(model, opt, k, slice(None))
        return {n: (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], float(opt.state[p]["step"]))
                for n, p in named}

    def single_process_resume(self):
        """World size 1, no process group: the unsharded model and a fresh store load the 2-rank DCP
        checkpoint (DCP reshards the model, optstate.reshard the optimizer state) and continue."""
        model = make_model()
        opt = ot.AdamW(groups(model), store=self.path("one"), lr=LR, host_cache_bytes=0, **OPT_KW)
        ck = self.path("dcp-step%d" % SAVE_AT)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # nothing of the fresh model survives the load
        opt.load_main_from_params()
        dcp.load({"model": model.state_dict(), "optim": OptstateState(opt, ck)}, checkpoint_id=ck)
        self.assertEqual(opt.step_count(0), SAVE_AT)
        for k in range(SAVE_AT, STEPS):
            train_step(model, opt, k, slice(None))
        out = final_state(model, opt)
        self.assertEqual(opt.step_count(0), STEPS)
        opt.close()
        return out

    def assert_close_rel(self, got, want, rel, what):
        """max |got - want| <= rel * max |want| for each tensor (params, moments); step counts equal."""
        self.assertEqual(sorted(got), sorted(want))
        for name in want:
            for i, field in enumerate(("param", "exp_avg", "exp_avg_sq")):
                a, b = got[name][i], want[name][i]
                self.assertEqual(tuple(a.shape), tuple(b.shape), (what, name, field))
                err, scale = (a - b).abs().max().item(), b.abs().max().item()
                self.assertLessEqual(err, rel * scale, "%s: %s %s differs by %g (max |x| %g)"
                                     % (what, name, field, err, scale))
            self.assertEqual(got[name][3], want[name][3], (what, name, "step"))

    def assert_equal_bits(self, got, want, what):
        self.assertEqual(sorted(got), sorted(want))
        for name in want:
            for i, field in enumerate(("param", "exp_avg", "exp_avg_sq")):
                self.assertTrue(torch.equal(got[name][i], want[name][i]), "%s: %s %s differs by %g"
                                % (what, name, field, (got[name][i] - want[name][i]).abs().max().item()))
            self.assertEqual(got[name][3], want[name][3], (what, name, "step"))

    def test_fsdp2_against_torch_adamw_and_dcp_resume(self):
        train, resumed = self.run_ranks()
        report = train["report"]
        self.assertEqual(report["step_count"], STEPS)
        self.assertEqual(report["geometry"]["checked"], 10)
        self.assertEqual(report["geometry"]["layout"]["ranks"][1]["tensors"]["blocks.0.up.weight"],
                         {"offset": [5, 0], "shape": [4, 6]})  # 9 rows over 2 ranks: 5 and 4
        # Tolerance: optstate's kernel and torch's single-tensor AdamW round differently by a few ulps
        # a step (torch_adamw_test), and FSDP2's gradient is the mean of the ranks' means, rounded
        # otherwise than the whole batch's mean; 1e-6 of the largest element over 20 steps. A real
        # error (a shard stepped with another shard's grad, an offset off by a row, a missed step)
        # moves params by ~lr = 1e-2.
        self.assert_close_rel(train["state"], self.reference(), 1e-6, "fsdp2 vs torch.optim.AdamW")
        # DCP save at step 10 (in the run above), load into fresh stores on two ranks, 10 more steps:
        # the same computation as the uninterrupted run, so the same bits.
        self.assertEqual(resumed["report"]["step_count"], STEPS)
        self.assert_equal_bits(resumed["state"], train["state"], "2-rank DCP resume vs uninterrupted")
        # One process: each step on the whole batch instead of the two ranks' halves averaged (the
        # gradients round differently: within 1e-6, not bit for bit), state resharded 2 -> 1 exactly.
        self.assert_close_rel(self.single_process_resume(), train["state"], 1e-6, "1-process resume via reshard")
        # The ranks' directories and the 1-rank reshard of them (a scratch input of that load): the
        # field files without state.safetensors, their manifests saying so.
        root = self.path("dcp-step%d/optstate" % SAVE_AT)
        resharded = [d for d in os.listdir(root) if d.startswith("reshard-1-")]
        self.assertEqual(len(resharded), 1, os.listdir(root))
        for d in ["rank-%05d" % r for r in range(WORLD)] + [os.path.join(resharded[0], "rank-00000")]:
            self.assertEqual(safetensors_of(os.path.join(root, d)), (False, False), d)
        # Refused with the param named, and the store the constructor created removed again.
        refused = []
        for r in range(WORLD):
            with open(self.path("refused-%d.json" % r)) as f:
                refused.append(json.load(f))
        self.assertIsNone(refused[0]["empty"])  # rank 0 holds the row
        kind, msg, left = refused[1]["empty"]
        self.assertEqual(kind, "InvalidArgument")
        self.assertIn("param 0.weight (global shape (1, 6)", msg)
        self.assertIn("empty local shard on rank 1", msg)
        self.assertFalse(left)
        for r in range(WORLD):
            kind, msg, left = refused[r]["replicated"]
            self.assertEqual(kind, "Unimplemented")
            self.assertIn("param w (global shape (4, 3)) has placement Replicate()", msg)
            self.assertFalse(left)

    def test_save_over_a_checkpoint_and_load_it(self):
        # DCP asks the Stateful for state_dict() on load too: that writes nothing; a save over an
        # existing checkpoint replaces its optstate state (as DCP replaces its own files). The second
        # save asks for state.safetensors, and the default load takes that checkpoint as well.
        model = make_model()
        opt = ot.AdamW(groups(model), store=self.path("s"), lr=LR, host_cache_bytes=0, **OPT_KW)
        ck = self.path("ck")
        train_step(model, opt, 0, slice(None))
        dcp.save({"model": model.state_dict(), "optim": OptstateState(opt, ck)}, checkpoint_id=ck)
        self.assertEqual(safetensors_of(os.path.join(ck, "optstate", "rank-00000")), (False, False))
        train_step(model, opt, 1, slice(None))
        dcp.save({"model": model.state_dict(), "optim": OptstateState(opt, ck, safetensors=True)}, checkpoint_id=ck)
        self.assertEqual(safetensors_of(os.path.join(ck, "optstate", "rank-00000")), (True, None))
        at_two = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_step(model, opt, 2, slice(None))
        dcp.load({"model": model.state_dict(), "optim": OptstateState(opt, ck)}, checkpoint_id=ck)
        self.assertEqual(opt.step_count(0), 2)
        for n, p in model.named_parameters():
            self.assertTrue(torch.equal(p.detach(), at_two[n]), n)
        self.assertEqual(sorted(os.listdir(os.path.join(ck, "optstate"))), ["rank-00000"])
        opt.close()


if __name__ == "__main__":
    unittest.main()
