"""Several trainer processes (torch.distributed, gloo on CPU, DDP), one
store per rank: snapshot, `cp -r` of each rank's snapshot from a real
optstate-mount of the store root, optstate-restore into fresh stores, resume:
the resumed ranks continue bit for bit like the uninterrupted run.

The ranks are this file run as a script (subprocesses, init_method file://).
Data and learning rates are functions of (step, rank), so both runs see the
same inputs. Needs /dev/fuse, fusermount3 and the optstate-mount and
optstate-restore binaries ($OPTSTATE_MOUNT_BIN, $OPTSTATE_RESTORE_BIN, else
the source tree's build/default); skipped, saying which is missing, without
them."""
import os
import shutil
import subprocess
import sys
import unittest

import torch

from common import HANG_LIMIT_S, OPT_KW, TempDirTest, binary, mounted, wait_for

WORLD = 2
SNAPSHOT_STEP = 3
STEPS = 6
SNAPSHOT = "ckpt"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 4))


def train_step(ddp, opt, k, rank):
    """Step k (1-based) of one rank: its batch depends on (k, rank), its learning rates on k."""
    gen = torch.Generator().manual_seed(100 * k + rank)
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)
    lr = 1e-2 / (1.0 + 0.5 * k)
    opt.param_groups[0]["lr"] = lr
    opt.param_groups[1]["lr"] = 3 * lr
    opt.zero_grad()
    ((ddp(x) - y) ** 2).mean().backward()  # DDP averages the gradients of the ranks
    opt.step()


def worker(rank, init_file, store_template, phase, out):
    import torch.distributed as dist
    import optstate.torch as ot

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=WORLD)
    # A resumed rank starts from another initialisation: the restored store's mains must win.
    model = build_model(0 if phase == "train" else 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    named = list(model.named_parameters())
    opt = ot.AdamW([{"params": [(n, p) for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                    {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                   store=store_template, **OPT_KW)  # "{rank}" in the path: one store per rank
    first = 1 if phase == "train" else opt.step_count(0) + 1
    resumed_at = opt.step_count(0)
    for k in range(first, STEPS + 1):
        train_step(ddp, opt, k, rank)
        if phase == "train" and k == SNAPSHOT_STEP:
            opt.snapshot(SNAPSHOT)
    result = {"resumed_at": resumed_at, "step_counts": [opt.step_count(0), opt.step_count(1)],
              "store": opt.store.path}
    for name, p in named:
        result[name] = p.detach().clone()
        for field in ("main", "exp_avg", "exp_avg_sq"):
            result[name + "/" + field] = opt.read_state(p, field)
    opt.close()
    torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


class DdpMountTest(TempDirTest):
    def setUp(self):
        super().setUp()
        if not os.access("/dev/fuse", os.R_OK | os.W_OK):
            self.skipTest("/dev/fuse is not available: the test copies snapshots from a real optstate-mount")
        if shutil.which("fusermount3") is None:
            self.skipTest("fusermount3 is not installed (fuse3): needed to unmount optstate-mount")
        self.mount_bin = binary("OPTSTATE_MOUNT_BIN", "mount", "optstate-mount")
        self.restore_bin = binary("OPTSTATE_RESTORE_BIN", "tools", "optstate-restore")
        if self.mount_bin is None or self.restore_bin is None:
            self.skipTest("optstate-mount or optstate-restore is not built (set OPTSTATE_MOUNT_BIN and "
                          "OPTSTATE_RESTORE_BIN, or build build/default)")
        self.daemon = None
        self.mnt = self.path("mnt")

    def tearDown(self):
        if self.daemon is not None:
            if mounted(self.mnt):
                subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)
            if self.daemon.poll() is None:
                self.daemon.kill()
            self.daemon.wait()
        super().tearDown()

    def run_ranks(self, phase, store_template):
        init_file = self.path("init-" + phase)
        procs, outs, logs = [], [], []
        for rank in range(WORLD):
            outs.append(self.path("%s-rank%d.pt" % (phase, rank)))
            logs.append(self.path("%s-rank%d.log" % (phase, rank)))
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "worker", str(rank), init_file, store_template,
                     phase, outs[-1]], stdout=log, stderr=subprocess.STDOUT, cwd=os.path.dirname(__file__),
                    env=dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))))
        codes = [p.wait(timeout=240) for p in procs]
        for rank, code in enumerate(codes):
            if code != 0:
                with open(logs[rank]) as f:
                    self.fail("%s rank %d exited with %d:\n%s" % (phase, rank, code, f.read()[-4000:]))
        return [torch.load(o) for o in outs]

    def mount(self, root):
        os.mkdir(self.mnt)
        log = self.path("optstate-mount.log")
        self.daemon = subprocess.Popen([self.mount_bin, root, self.mnt, "-f", "--log", log],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        # The mount table itself, or the daemon's exit.
        if not wait_for(lambda: mounted(self.mnt) or self.daemon.poll() is not None) or not mounted(self.mnt):
            with open(log) as f:
                self.fail("optstate-mount %s %s did not come up (exit %s):\n%s"
                          % (root, self.mnt, self.daemon.poll(), f.read()[-3000:]))

    def unmount(self):
        subprocess.run(["fusermount3", "-u", self.mnt], check=True)
        self.assertEqual(self.daemon.wait(timeout=HANG_LIMIT_S), 0)
        self.daemon = None
        self.assertFalse(mounted(self.mnt))

    def test_ddp_snapshot_cp_from_mount_restore_resume(self):
        stores = self.path("stores")
        os.mkdir(stores)
        uninterrupted = self.run_ranks("train", os.path.join(stores, "rank{rank}"))
        for rank, r in enumerate(uninterrupted):
            self.assertEqual(r["store"], os.path.join(stores, "rank%d" % rank))
            self.assertEqual(r["step_counts"], [STEPS, STEPS])
        # DDP keeps the ranks' models equal, so every rank's store holds the same state.
        for key, value in uninterrupted[0].items():
            if isinstance(value, torch.Tensor):
                self.assertTrue(torch.equal(value, uninterrupted[1][key]), key)

        self.mount(stores)
        ckpt = self.path("ckpt")
        os.mkdir(ckpt)
        for rank in range(WORLD):
            src = os.path.join(self.mnt, "rank%d" % rank, "snapshots", SNAPSHOT)
            subprocess.run(["cp", "-r", src, os.path.join(ckpt, "rank%d" % rank)], check=True)
        self.unmount()

        restored = self.path("restored")
        os.mkdir(restored)
        for rank in range(WORLD):
            src = os.path.join(ckpt, "rank%d" % rank)
            self.assertTrue(os.path.isfile(os.path.join(src, "manifest.json")), os.listdir(src))
            done = subprocess.run([self.restore_bin, src, os.path.join(restored, "rank%d" % rank),
                                   "--create", "rank%d" % rank], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, universal_newlines=True)
            self.assertEqual(done.returncode, 0, done.stdout)

        resumed = self.run_ranks("resume", os.path.join(restored, "rank{rank}"))
        for rank in range(WORLD):
            got, want = resumed[rank], uninterrupted[rank]
            self.assertEqual(got["store"], os.path.join(restored, "rank%d" % rank))
            self.assertEqual(got["resumed_at"], SNAPSHOT_STEP)
            self.assertEqual(got["step_counts"], [STEPS, STEPS])
            for key, value in want.items():
                if isinstance(value, torch.Tensor):
                    self.assertTrue(torch.equal(got[key], value), "rank %d: %s differs" % (rank, key))


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "worker":
        sys.path.insert(0, os.path.join(_REPO, "python"))
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
    else:
        unittest.main()
