"""optstate.checkpoint.save / load: a checkpoint directory written by the
library, byte for byte the mount's view of the snapshot, restored into a fresh
store so that training continues bit for bit; damaged or foreign checkpoints
are refused with nothing committed."""
import hashlib
import json
import os
import shutil
import subprocess
import unittest

import torch

from common import HANG_LIMIT_S, OPT_KW, TempDirTest, binary, mounted, optstate, wait_for
import optstate.checkpoint as ckpt
import optstate.torch as ot
from torch_adamw_test import make_model, two_groups


def tree(root):
    """{relative path: sha256} of every file under root, and the set of directories."""
    files, dirs = {}, set()
    for d, subdirs, names in os.walk(root):
        for s in subdirs:
            dirs.add(os.path.relpath(os.path.join(d, s), root))
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                files[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return files, dirs


class CheckpointTest(TempDirTest):
    def setUp(self):
        super().setUp()
        gen = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen)

    def steps(self, model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            ((model(self.x) - self.y) ** 2).mean().backward()
            opt.step()

    def trained(self, name, steps=3, model=None):
        model = model or make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path(name), lr=1e-2, **OPT_KW)
        self.steps(model, opt, steps)
        return model, opt

    def test_save_load_continues_bit_for_bit(self):
        model, opt = self.trained("a", steps=5)
        gen = ckpt.save(opt, self.path("ck"))
        self.assertEqual(gen, opt.generation)
        self.assertEqual(opt.store.snapshots(), [])  # nothing left behind in the store
        at_save = [p.detach().clone() for p in model.parameters()]
        self.steps(model, opt, 5)

        # A fresh process: another init, another store, other hyperparameters; the checkpoint wins.
        fresh = make_model(1)
        groups = two_groups(fresh)
        for g in groups:
            g["lr"], g["weight_decay"] = 0.5, 0.0
        opt2 = ot.AdamW(groups, store=self.path("b"), lr=0.5, **OPT_KW)
        before = opt2.generation
        new_gen = ckpt.load(opt2, self.path("ck"))
        self.assertGreater(new_gen, before)
        self.assertEqual(opt2.generation, new_gen)
        for a, b in zip(at_save, fresh.parameters()):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual((opt2.step_count(0), opt2.step_count(1)), (5, 5))
        self.assertEqual([(g["lr"], g["weight_decay"]) for g in opt2.param_groups],
                         [(g["lr"], g["weight_decay"]) for g in opt.param_groups])
        self.steps(fresh, opt2, 5)
        for a, b in zip(model.parameters(), fresh.parameters()):
            self.assertTrue(torch.equal(a, b))
            for field in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(opt.read_state(a, field), opt2.read_state(b, field)), field)
        # A named save keeps its snapshot; a Store (no torch needed) saves and loads too.
        ckpt.save(opt, self.path("named"), name="keep")
        self.assertEqual([n for n, _ in opt.store.snapshots()], ["keep"])
        opt.close()
        opt2.close()
        with optstate.Store(self.path("a")) as store:
            with self.assertRaises(optstate.AlreadyExists):
                ckpt.save(store, self.path("named"))
            ckpt.save(store, self.path("plain"))
            self.assertEqual(tree(self.path("named"))[0], tree(self.path("plain"))[0])
            mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20)
            with self.assertRaises(optstate.FailedPrecondition):
                ckpt.load(store, self.path("ck"))  # a manager is open on it
            mm.close()
            gen = ckpt.load(store, self.path("ck"))
            self.assertEqual(store.latest_generation()[0], gen)

    def test_save_without_safetensors_continues_bit_for_bit(self):
        model, opt = self.trained("a", steps=5)
        gen = ckpt.save(opt, self.path("lean"), safetensors=False)
        ckpt.save(opt, self.path("full"))  # the same generation, the default layout
        self.assertEqual(opt.generation, gen)
        at_save = [p.detach().clone() for p in model.parameters()]
        self.steps(model, opt, 5)  # the uninterrupted run

        lean, _ = tree(self.path("lean"))
        full, _ = tree(self.path("full"))
        self.assertNotIn("state.safetensors", lean)
        self.assertIn("state.safetensors", full)
        # The same field files; the manifest says the checkpoint has no state.safetensors.
        self.assertEqual({k: v for k, v in lean.items() if k != "manifest.json"},
                         {k: v for k, v in full.items() if k not in ("manifest.json", "state.safetensors")})
        with open(self.path("lean/manifest.json")) as f:
            self.assertIs(json.load(f)["state_safetensors"], False)
        with open(self.path("full/manifest.json")) as f:
            self.assertNotIn("state_safetensors", json.load(f))

        fresh = make_model(1)
        opt2 = ot.AdamW(two_groups(fresh), store=self.path("b"), lr=0.5, **OPT_KW)
        ckpt.load(opt2, self.path("lean"))
        for a, b in zip(at_save, fresh.parameters()):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual((opt2.step_count(0), opt2.step_count(1)), (5, 5))
        self.steps(fresh, opt2, 5)
        for a, b in zip(model.parameters(), fresh.parameters()):
            self.assertTrue(torch.equal(a, b))
            for field in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(opt.read_state(a, field), opt2.read_state(b, field)), field)
        opt2.close()
        # A Store saves one too, of a snapshot (the C ABI's args struct carries both).
        opt.store.snapshot("s")
        opt.store.export_checkpoint(self.path("snap_lean"), snapshot="s", safetensors=False)
        snap, _ = tree(self.path("snap_lean"))
        self.assertNotIn("state.safetensors", snap)
        with open(self.path("snap_lean/manifest.json")) as f:
            self.assertEqual(json.load(f)["generation"], opt.store.snapshots()[0][1])
        opt.close()

    def chunks_of(self, ckpt_dir):
        with open(os.path.join(ckpt_dir, "manifest.json")) as f:
            return sum(len(fld["chunks"]) for t in json.load(f)["tensors"] for fld in t["fields"])

    def resumes_bit_for_bit(self, src, at_save, counts, model, opt, steps):
        """A fresh optimizer loaded from src holds the params at_save and, stepped `steps` times, the same
        params and moments as model/opt stepped as many times from there."""
        fresh = make_model(1)
        opt2 = ot.AdamW(two_groups(fresh), store=self.path("fresh-%d" % len(os.listdir(self.dir))), lr=0.5, **OPT_KW)
        ckpt.load(opt2, src)
        for a, b in zip(at_save, fresh.parameters()):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual((opt2.step_count(0), opt2.step_count(1)), counts)
        self.steps(fresh, opt2, steps)
        for a, b in zip(model.parameters(), fresh.parameters()):
            self.assertTrue(torch.equal(a, b))
            for field in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(opt.read_state(a, field), opt2.read_state(b, field)), field)
        opt2.close()

    def test_save_writes_what_the_host_cache_tier_holds_from_ram(self):
        # A tier that holds the whole state: every chunk from RAM, the files of an export from the store.
        kw = dict(OPT_KW, host_cache_bytes=16 << 20)
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("a"), lr=1e-2, **kw)
        self.steps(model, opt, 3)
        gen = ckpt.save(opt, self.path("ram"), safetensors=False)
        self.assertEqual(opt.store.export_checkpoint(self.path("disk"), safetensors=False), gen)
        self.assertEqual(tree(self.path("ram")), tree(self.path("disk")))
        done = opt.last_checkpoint_export
        n = self.chunks_of(self.path("ram"))
        self.assertEqual((done["generation"], done["ram_chunks"], done["disk_chunks"], done["ram_mismatch_chunks"]),
                         (gen, n, 0, 0))
        self.assertEqual(done["disk_bytes"], 0)
        self.assertGreater(done["ram_bytes"], 0)
        at_save = [p.detach().clone() for p in model.parameters()]
        self.steps(model, opt, 2)
        self.resumes_bit_for_bit(self.path("ram"), at_save, (3, 3), model, opt, 2)
        opt.close()

        # A tier that holds part of the state: the rest from the disk, the same files.
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("b"), lr=1e-2, **dict(OPT_KW, host_cache_bytes=40 << 10))
        self.steps(model, opt, 3)
        gen = ckpt.save(opt, self.path("part"))  # with state.safetensors
        opt.store.export_checkpoint(self.path("part_disk"))
        self.assertEqual(tree(self.path("part")), tree(self.path("part_disk")))
        done = opt.last_checkpoint_export
        self.assertGreater(done["ram_chunks"], 0)
        self.assertGreater(done["disk_chunks"], 0)
        self.assertEqual(done["ram_chunks"] + done["disk_chunks"], self.chunks_of(self.path("part")))
        opt.close()

    def test_save_into_of_an_older_generation_than_the_tier_holds(self):
        # durable_every_steps 3: the state_dict's generation is step 3's; steps 4-5 are held only in the
        # tier (newer bytes of every chunk). The checkpoint is step 3's, from the disk, and resumes bit for bit.
        kw = dict(OPT_KW, host_cache_bytes=16 << 20, durable_every_steps=3)
        model = make_model(0)
        opt = ot.AdamW(two_groups(model), store=self.path("a"), lr=1e-2, **kw)
        self.steps(model, opt, 3)
        sd = opt.state_dict()
        at_sd = [p.detach().clone() for p in model.parameters()]
        self.steps(model, opt, 2)
        self.assertEqual(opt._live().uncommitted_steps, 2)
        dest = ckpt.save_into(opt, self.path("root"), state_dict=sd, safetensors=False)
        opt.store.export_checkpoint(self.path("disk"), snapshot=sd["optstate"]["snapshot"], safetensors=False)
        self.assertEqual(tree(dest), tree(self.path("disk")))
        done = opt.last_checkpoint_export
        n = self.chunks_of(dest)
        self.assertEqual(done["generation"], sd["optstate"]["generation"])
        self.assertEqual((done["ram_chunks"], done["ram_mismatch_chunks"], done["disk_chunks"]), (0, n, n))
        self.resumes_bit_for_bit(dest, at_sd, (3, 3), model, opt, 2)  # opt went on from step 3 two steps
        opt.close()

    def test_save_equals_the_mounts_snapshot_and_optstate_restore_takes_it(self):
        model, opt = self.trained("s")
        ckpt.save(opt, self.path("saved"), name="snap")
        files, dirs = tree(self.path("saved"))
        self.assertIn("manifest.json", files)
        self.assertIn("state.safetensors", files)
        self.assertEqual(sum(1 for f in files if f.startswith("tensors/")), 3 * len(list(model.parameters())))
        # The field files hold the committed state (an independent read path: optstate_store_read_field).
        with open(self.path("saved/manifest.json")) as f:
            manifest = json.load(f)
        self.assertEqual(manifest["generation"], opt.generation)
        for p in model.parameters():
            name = opt.param_name(p)
            entry = [t for t in manifest["tensors"] if t["name"] == name][0]
            for field in entry["fields"]:
                got = torch.from_file(self.path("saved/" + field["file"]), size=p.numel(), dtype=torch.float32)
                self.assertTrue(torch.equal(got.view(p.shape), opt.read_state(p, field["name"])), name)
        opt.close()

        restore_bin = binary("OPTSTATE_RESTORE_BIN", "tools", "optstate-restore")
        if restore_bin is not None:
            subprocess.run([restore_bin, self.path("saved"), self.path("restored"), "--create", "r", "-q"], check=True,
                           stdout=subprocess.DEVNULL)
            with optstate.Store(self.path("restored"), create=False) as r, optstate.Store(self.path("s")) as s:
                self.assertEqual(r.latest_generation()[1], s.latest_generation()[1])
                for t in manifest["tensors"]:
                    for field in ("main", "exp_avg", "exp_avg_sq"):
                        self.assertTrue((r.read(t["name"], field) == s.read(t["name"], field)).all())

        mount_bin = binary("OPTSTATE_MOUNT_BIN", "mount", "optstate-mount")
        if (mount_bin is None or not os.access("/dev/fuse", os.R_OK | os.W_OK)
                or shutil.which("fusermount3") is None):
            self.skipTest("optstate-mount, /dev/fuse or fusermount3 missing: compared with the store only")
        mnt = self.path("mnt")
        os.mkdir(mnt)
        root = self.path("root")
        os.mkdir(root)
        os.rename(self.path("s"), os.path.join(root, "s"))
        log = self.path("mount.log")
        daemon = subprocess.Popen([mount_bin, root, mnt, "-f", "--log", log], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.STDOUT)
        try:
            # The mount table itself, or the daemon's exit.
            if not wait_for(lambda: mounted(mnt) or daemon.poll() is not None) or not mounted(mnt):
                with open(log) as f:
                    self.fail("optstate-mount did not come up:\n" + f.read()[-3000:])
            m_files, m_dirs = tree(os.path.join(mnt, "s", "snapshots", "snap"))
        finally:
            if mounted(mnt):
                subprocess.run(["fusermount3", "-u", mnt], check=False)
            daemon.wait(timeout=HANG_LIMIT_S)
        self.assertEqual(files, m_files)
        self.assertEqual(dirs, m_dirs)

    def test_damaged_or_foreign_checkpoints_commit_nothing(self):
        model, opt = self.trained("a")
        ckpt.save(opt, self.path("ck"))
        with open(self.path("ck/manifest.json")) as f:
            manifest = json.load(f)
        field = manifest["tensors"][0]["fields"][1]
        model2, opt2 = self.trained("b", steps=2, model=make_model(2))
        gen, params = opt2.generation, [p.detach().clone() for p in model2.parameters()]

        def unchanged():
            self.assertEqual((opt2.generation, opt2.store.latest_generation()[0], opt2.step_count()), (gen, gen, 2))
            self.assertTrue(all(torch.equal(a, b) for a, b in zip(params, model2.parameters())))

        damaged = self.path("damaged")
        shutil.copytree(self.path("ck"), damaged)
        with open(os.path.join(damaged, field["file"]), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x40]))
        with self.assertRaises(optstate.FailedPrecondition):
            ckpt.load(opt2, damaged)  # another store's checkpoint into a trained store
        unchanged()
        with self.assertRaises(optstate.Corruption) as cm:
            ckpt.load(opt2, damaged, force=True)
        self.assertIn(field["file"], str(cm.exception))
        self.assertIn("chunk 0", str(cm.exception))
        self.assertEqual(opt2.store.snapshots(), [])  # the head kept for the load is released again
        unchanged()

        # Another layout: a model whose first layer is wider.
        other = torch.nn.Sequential(torch.nn.Linear(16, 65), torch.nn.Tanh(), torch.nn.Linear(65, 64),
                                    torch.nn.Tanh(), torch.nn.Linear(64, 4))
        with ot.AdamW(two_groups(other), store=self.path("c"), **OPT_KW) as o:
            ckpt.save(o, self.path("other"))
        with self.assertRaises(optstate.InvalidArgument) as cm:
            ckpt.load(opt2, self.path("other"))
        self.assertIn("numel", str(cm.exception))
        self.assertIn(opt2.param_name(model2[0].weight), str(cm.exception))
        unchanged()
        with self.assertRaises(optstate.NotFound):
            ckpt.load(opt2, self.path("no_such_dir"))
        # The optimizer still trains after the refusals.
        self.steps(model2, opt2, 1)
        self.assertEqual(opt2.step_count(), 3)

    def test_save_refuses_a_non_empty_destination(self):
        model, opt = self.trained("a", steps=1)
        os.mkdir(self.path("full"))
        with open(self.path("full/x"), "w") as f:
            f.write("x")
        with self.assertRaises(optstate.AlreadyExists) as cm:
            ckpt.save(opt, self.path("full"))
        self.assertIn(self.path("full"), str(cm.exception))
        self.assertEqual(sorted(os.listdir(self.dir)), ["a", "full"])  # no partial directory left
        os.mkdir(self.path("empty"))
        ckpt.save(opt, self.path("empty"))  # an empty directory is taken
        self.assertIn("manifest.json", os.listdir(self.path("empty")))
        # Missing parents are made (the documented layout /ckpt/step-N/rankR).
        gen = ckpt.save(opt, self.path("ckpt/step-1/rank0"))
        self.assertEqual(gen, opt.generation)
        self.assertIn("manifest.json", os.listdir(self.path("ckpt/step-1/rank0")))

    def test_failed_named_save_releases_its_snapshot(self):
        model, opt = self.trained("a", steps=1)
        os.mkdir(self.path("full"))
        with open(self.path("full/x"), "w") as f:
            f.write("x")
        with self.assertRaises(optstate.AlreadyExists):
            ckpt.save(opt, self.path("full"), name="keep")
        self.assertEqual(opt.store.snapshots(), [])
        gen = ckpt.save(opt, self.path("retry"), name="keep")  # the retry is not refused
        self.assertEqual(opt.store.snapshots(), [("keep", gen)])

    def test_load_of_another_stores_checkpoint_needs_force_and_keeps_the_head(self):
        model, opt = self.trained("a", steps=3)
        ckpt.save(opt, self.path("ck"))
        other_model, other = self.trained("other", steps=4, model=make_model(1))
        before = [p.detach().clone() for p in other_model.parameters()]
        head = other.generation
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            ckpt.load(other, self.path("ck"))
        self.assertIn("force", str(cm.exception))
        self.assertIn(opt.store.uuid, str(cm.exception))
        self.assertEqual(other.generation, head)
        self.assertEqual(other.store.snapshots(), [])
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(before, other_model.parameters())))
        ckpt.load(other, self.path("ck"), force=True)
        self.assertEqual(other.step_count(0), 3)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters())))
        kept = other.store.last_restore_snapshot
        self.assertTrue(kept.startswith("pre-restore-%d-" % head), kept)
        self.assertEqual(other.store.snapshots(), [(kept, head)])
        opt.close()
        other.close()


if __name__ == "__main__":
    unittest.main()
