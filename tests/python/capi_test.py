"""The C ABI through the optstate package's handles (no torch): a streamed
AdamW against a float64 numpy loop, snapshots, stats, errors with codes."""
import ctypes
import os
import subprocess
import sys
import textwrap
import unittest

import numpy as np

from common import STORE_KW, TempDirTest, optstate, safetensors_of


def adamw_reference(p, m, v, g, step, lr, b1, b2, eps, wd):
    """torch.optim.AdamW's update in float64."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - b2 ** step) + eps
    return p - (lr / (1 - b1 ** step)) * m / denom, m, v


class CapiTest(TempDirTest):
    def open(self, name="s"):
        store = optstate.Store(self.path(name), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
        return store, mm, optstate.StreamedAdam(store, mm)

    def twin_runs(self, names, w0):
        """{name: (store, adam, pid, w)}: an optimizer per name (AdamW, lr 1e-2, wd 0.01) on a store of
        its own with one param "w" registered from a copy w of w0."""
        runs = {}
        for name in names:
            store, mm, adam = self.open(name)
            adam.set_group(0, 1e-2, 0.9, 0.999, 1e-8, 0.01)
            w = w0.copy()
            pid, _ = adam.register_param("w", len(w), 0, w.ctypes.data, optstate.F32)
            runs[name] = (store, adam, pid, w)
        return runs

    def test_bf16_moments_step_read_back_and_reopen(self):
        store = optstate.Store(self.path("b"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
        with self.assertRaises(optstate.InvalidArgument):
            optstate.StreamedAdam(store, mm, moment_dtype="q4")
        adam = optstate.StreamedAdam(store, mm, moment_dtype="bf16")
        rng = np.random.default_rng(2)
        n = 1_100_000  # over two bf16 slices (2 MiB chunks: 1048576 bf16 moments a slice)
        w = rng.standard_normal(n).astype(np.float32)
        adam.set_group(0, 1e-2, 0.9, 0.999, 1e-8, 0.1)
        pid, _ = adam.register_param("w", n, 0, w.ctypes.data, optstate.F32)
        p64, m64, v64 = w.astype(np.float64), np.zeros(n), np.zeros(n)
        for step in range(1, 21):
            g = rng.standard_normal(n).astype(np.float32)
            adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32])
            p64, m64, v64 = adamw_reference(p64, m64, v64, g.astype(np.float64), step, 1e-2, 0.9, 0.999, 1e-8, 0.1)
        adam.make_durable()
        m, v = store.read("w", "exp_avg"), store.read("w", "exp_avg_sq")
        # Stored as bf16: read back decoded, the low 16 bits of every fp32 value are zero.
        self.assertFalse((m.view(np.uint32) & 0xFFFF).any())
        self.assertFalse((v.view(np.uint32) & 0xFFFF).any())
        # 20 steps against float64 moments: each store rounds to 2^-8 relative; carried on with
        # weight beta, exp_avg_sq stays within 20 x 2^-8 and exp_avg within 10 x 2^-8 of its scale.
        np.testing.assert_allclose(v, v64, rtol=20 * 2 ** -8, atol=0)
        np.testing.assert_allclose(m, m64, rtol=0, atol=10 * 2 ** -8 * np.abs(m64).max())
        np.testing.assert_allclose(w, p64, rtol=0, atol=20 * 1e-2 * 2 ** -6)
        np.testing.assert_array_equal(store.read("w", "main"), w)
        adam.close()
        mm.close()
        store.close()
        store = optstate.Store(self.path("b"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20)
        with self.assertRaises(optstate.InvalidArgument) as cm:
            optstate.StreamedAdam(store, mm)  # f32 moments on a store that holds bf16
        for word in ("'w'", "exp_avg", "bf16", "f32", self.path("b")):
            self.assertIn(word, str(cm.exception))
        np.testing.assert_array_equal(store.read("w", "exp_avg"), m)  # nothing changed

    def test_q8_moments_step_read_back_and_reopen(self):
        store = optstate.Store(self.path("q"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
        adam = optstate.StreamedAdam(store, mm, moment_dtype="q8")
        rng = np.random.default_rng(3)
        n = 2_100_000 + 77  # over two q8 slices (2 MiB chunks: 2097152 elements a slice), not a multiple of 256
        blocks = (n + 255) // 256
        w = rng.standard_normal(n).astype(np.float32)
        adam.set_group(0, 1e-2, 0.9, 0.999, 1e-8, 0.1)
        pid, _ = adam.register_param("w", n, 0, w.ctypes.data, optstate.F32)
        m64, v64 = np.zeros(n), np.zeros(n)
        steps = 20
        for step in range(1, steps + 1):
            g = rng.standard_normal(n).astype(np.float32)
            adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32])
            m64 = 0.9 * m64 + 0.1 * g.astype(np.float64)
            v64 = 0.999 * v64 + 0.001 * g.astype(np.float64) ** 2
        adam.make_durable()
        m, v = store.read("w", "exp_avg"), store.read("w", "exp_avg_sq")
        ma = store.read("w", "exp_avg.absmax", 0, blocks)
        va = store.read("w", "exp_avg_sq.absmax", 0, blocks)
        # Decoded as map[code] x absmax: each block's largest |value| is its absmax, or for a negative
        # exp_avg the signed map's most negative value (-0.993) times it.
        pad = blocks * 256 - n
        for x, a in ((m, ma), (v, va)):
            xb = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(blocks, 256)
            top = np.abs(xb).max(axis=1)
            self.assertTrue((top <= a).all() and (top >= 0.99 * a).all())
        np.testing.assert_array_equal(np.abs(v.reshape(-1)).max(), va.max())  # unsigned map: 1.0 is a code
        # Moments depend only on the grads: each store is within half the map's gap x absmax
        # (<= 0.0071 x absmax) of the exact update; carried on with weight beta, the error stays
        # below 0.0071 x absmax / (1 - beta) (plus fp32 rounding).
        am = np.repeat(ma, 256)[:n]
        av = np.repeat(va, 256)[:n]
        self.assertTrue((np.abs(m - m64) <= 0.0071 * am / 0.1 + 1e-6).all())
        self.assertTrue((np.abs(v - v64) <= 0.0071 * av * steps + 1e-6).all())
        np.testing.assert_array_equal(store.read("w", "main"), w)
        adam.close()
        mm.close()
        store.close()
        store = optstate.Store(self.path("q"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20)
        with self.assertRaises(optstate.InvalidArgument) as cm:
            optstate.StreamedAdam(store, mm, moment_dtype="bf16")  # a store that holds q8
        for word in ("'w'", "exp_avg", "q8s", "bf16", self.path("q")):
            self.assertIn(word, str(cm.exception))
        # The moment dtype it suggests is one StreamedAdam takes (q8), and it works.
        self.assertIn("open it with moment dtype q8,", str(cm.exception))
        self.assertNotIn("moment dtype q8s", str(cm.exception))
        optstate.StreamedAdam(store, mm, moment_dtype="q8").close()
        np.testing.assert_array_equal(store.read("w", "exp_avg"), m)  # nothing changed

    def test_param_without_grad_keeps_its_own_step_count(self):
        # Params "a" and "b" of one group; "b" has no grad in steps 1-3. Its first update (step 4) is
        # bias-corrected with its own count 1, as torch's AdamW counts; the count survives a reopen.
        store, mm, adam = self.open()
        rng = np.random.default_rng(5)
        n = 1000
        w = {k: rng.standard_normal(n).astype(np.float32) for k in "ab"}
        adam.set_group(0, 1e-2, 0.9, 0.999, 1e-8, 0.1)
        ids = {k: adam.register_param(k, n, 0, w[k].ctypes.data, optstate.F32)[0] for k in "ab"}
        ref = {k: (w[k].astype(np.float64), np.zeros(n), np.zeros(n)) for k in "ab"}
        count = {"a": 0, "b": 0}
        for step in range(1, 7):
            names = "a" if step <= 3 else "ab"
            grads = {k: rng.standard_normal(n).astype(np.float32) for k in names}
            adam.step([ids[k] for k in names], [grads[k].ctypes.data for k in names], [optstate.F32] * len(names),
                      [w[k].ctypes.data for k in names], [optstate.F32] * len(names))
            for k in names:
                count[k] += 1
                ref[k] = adamw_reference(*ref[k], grads[k].astype(np.float64), count[k], 1e-2, 0.9, 0.999, 1e-8, 0.1)
            self.assertEqual({k: adam.param_step_count(k) for k in "ab"}, count)
        self.assertEqual(adam.step_count(0), 6)  # the group stepped in every step
        for k in "ab":
            # fp32 against float64, 6 steps (|p| < 5, ulp 4.8e-7); bias-corrected with the group's count
            # instead, "b"'s first update would be off by ~lr.
            np.testing.assert_allclose(w[k], ref[k][0], rtol=0, atol=1e-5, err_msg=k)
        with self.assertRaises(optstate.NotFound) as cm:
            adam.param_step_count("c")
        self.assertIn(self.path("s"), str(cm.exception))
        adam.close()
        mm.close()
        store.close()
        store, mm, adam = self.open()
        self.assertEqual({k: adam.param_step_count(k) for k in "ab"}, {"a": 6, "b": 3})
        adam.close()
        mm.close()
        store.close()

    def test_version(self):
        self.assertRegex(optstate.library_version(), r"^\d+\.\d+\.\d+$")
        self.assertGreaterEqual(optstate._lib_handle.optstate_abi_version(), optstate._lib.ABI_VERSION)

    def test_steps_match_float64_reference_and_read_back(self):
        store, mm, adam = self.open()
        rng = np.random.default_rng(1)
        # Two params; one spans two chunks (2 MiB = 524288 fp32), so reads cross a chunk edge.
        sizes = {"a": 600_000, "b": 1000}
        w = {k: rng.standard_normal(n).astype(np.float32) for k, n in sizes.items()}
        ids = {}
        for gid, (k, n) in enumerate(sizes.items()):
            adam.set_group(gid, 1e-2, 0.9, 0.999, 1e-8, 0.1 * gid)
            ids[k], existed = adam.register_param(k, n, gid, w[k].ctypes.data, optstate.F32)
            self.assertFalse(existed)
        ref = {k: (w[k].astype(np.float64), np.zeros(n), np.zeros(n)) for k, n in sizes.items()}
        for step in range(1, 6):
            grads = {k: rng.standard_normal(n).astype(np.float32) for k, n in sizes.items()}
            adam.step([ids[k] for k in sizes], [grads[k].ctypes.data for k in sizes], [optstate.F32] * 2,
                      [w[k].ctypes.data for k in sizes], [optstate.F32] * 2)
            for gid, k in enumerate(sizes):
                ref[k] = adamw_reference(*ref[k], grads[k].astype(np.float64), step, 1e-2, 0.9, 0.999, 1e-8,
                                         0.1 * gid)
        self.assertEqual(adam.step_count(0), 5)
        adam.make_durable()  # the last step's commit may still run in the background (commit_lag_steps 1)
        self.assertEqual(store.latest_generation(), (adam.last_generation, 5))
        for k in sizes:
            p64, m64, v64 = ref[k]
            # fp32 arithmetic against float64: a few ulps a step, 5 steps (|p| < 6, ulp 4.8e-7).
            np.testing.assert_allclose(w[k], p64, rtol=0, atol=2e-5)
            np.testing.assert_array_equal(store.read(k, "main"), w[k])  # the param copy is the main, fp32
            np.testing.assert_allclose(store.read(k, "exp_avg"), m64, rtol=1e-5, atol=1e-7)
            # 1 - beta2 is formed in double and rounded once, as torch does.
            np.testing.assert_allclose(store.read(k, "exp_avg_sq"), v64, rtol=1e-5, atol=1e-9)
        # A range across the chunk edge reads the same as the whole field's slice.
        np.testing.assert_array_equal(store.read("a", "main", 524_000, 1000), w["a"][524_000:525_000])

    def test_per_step_grad_scale_divides_the_grads(self):
        """A step given grad_scale s on grads g*s equals a step on g (powers of two: exact); 0 keeps the
        optimizer's scale; a negative or non-finite scale is refused and commits nothing."""
        rng = np.random.default_rng(3)
        n = 5000
        runs = self.twin_runs(("scaled", "plain"), rng.standard_normal(n).astype(np.float32))
        current = 1.0
        for s in [1024.0, 0.0, 0.125, 65536.0, 1.0]:
            current = s if s > 0 else current  # 0 keeps the scale the last step set
            g = rng.standard_normal(n).astype(np.float32)
            for name, (store, adam, pid, w) in runs.items():
                if name == "scaled":
                    gs = (g * current).astype(np.float32)
                    adam.step([pid], [gs.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32],
                              grad_scale=s)
                else:
                    adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32])
        a, b = runs["scaled"], runs["plain"]
        for _, adam, _, _ in runs.values():
            adam.make_durable()  # the last step's commit may still run in the background (commit_lag_steps 1)
        for field in ("main", "exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(a[0].read("w", field), b[0].read("w", field), err_msg=field)
        store, adam, pid, w = a
        gen = store.latest_generation()
        g = np.ones(n, dtype=np.float32)
        for bad in (-2.0, float("inf"), float("nan")):
            with self.assertRaises(optstate.InvalidArgument) as cm:
                adam.step([pid], [g.ctypes.data], [optstate.F32], grad_scale=bad)
            self.assertIn("grad_scale", str(cm.exception))
        self.assertEqual(store.latest_generation(), gen)

    def test_step2_checks_numels_and_reads_the_scale_through_a_pointer(self):
        """A grad whose numel is not the registered one fails in the library (naming the param and both
        sizes) before anything runs; a scale given by pointer applies to that step only."""
        store, mm, adam = self.open()
        adam.set_group(0, 1e-2, 0.9, 0.999, 1e-8, 0.0)
        w = np.ones(1000, dtype=np.float32)
        pid, _ = adam.register_param("w", 1000, 0, w.ctypes.data, optstate.F32)
        adam.make_durable()
        gen = store.latest_generation()
        g = np.ones(1000, dtype=np.float32)
        with self.assertRaises(optstate.InvalidArgument) as cm:
            adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32], numels=[999])
        self.assertIn("'w'", str(cm.exception))
        self.assertIn("999", str(cm.exception))
        self.assertIn("1000", str(cm.exception))
        with self.assertRaises(optstate.InvalidArgument):
            adam.step([pid], [g.ctypes.data], [optstate.F32], numels=[0])
        self.assertEqual(store.latest_generation(), gen)
        np.testing.assert_array_equal(w, np.ones(1000, dtype=np.float32))
        # A pointer scale of 8 on grads 8*g: the same as the plain step on g, and the next step is unscaled.
        other_store, _, other = self.open("t")
        other.set_group(0, 1e-2, 0.9, 0.999, 1e-8, 0.0)
        w2 = np.ones(1000, dtype=np.float32)
        pid2, _ = other.register_param("w", 1000, 0, w2.ctypes.data, optstate.F32)
        scale = np.full(1, 8.0, dtype=np.float32)
        g8 = g * 8
        adam.step([pid], [g8.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32], numels=[1000],
                  grad_scale_ptr=scale.ctypes.data)
        other.step([pid2], [g.ctypes.data], [optstate.F32], [w2.ctypes.data], [optstate.F32])
        adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32], numels=[1000])
        other.step([pid2], [g.ctypes.data], [optstate.F32], [w2.ctypes.data], [optstate.F32])
        np.testing.assert_array_equal(w, w2)
        for bad in (0.0, -1.0, float("inf")):
            scale[0] = bad
            with self.assertRaises(optstate.InvalidArgument):
                adam.step([pid], [g.ctypes.data], [optstate.F32], grad_scale_ptr=scale.ctypes.data)
        self.assertEqual(adam.step_count(0), 2)

    def test_step_and_step2_are_wrappers_of_step_with(self):
        """optstate_adam_step (a float scale that becomes the standing one) and optstate_adam_step2 (numels
        and a per-step scale pointer), called directly, step bit for bit as optstate_adam_step_with given
        the same inputs; a struct_size short of the struct is refused and commits nothing."""
        from optstate._lib import StepArgs, call, lib
        rng = np.random.default_rng(5)
        n = 3000
        runs = self.twin_runs(("old", "new"), rng.standard_normal(n).astype(np.float32))
        u32, vp, i32 = ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int
        scale = np.full(1, 4.0, dtype=np.float32)
        for k in range(3):
            g = (rng.standard_normal(n) * 8).astype(np.float32)
            for name, (store, adam, pid, w) in runs.items():
                ids, grads, gdt = (u32 * 1)(pid), (vp * 1)(g.ctypes.data), (i32 * 1)(optstate.F32)
                params, pdt = (vp * 1)(w.ctypes.data), (i32 * 1)(optstate.F32)
                if name == "old" and k == 0:
                    call(lib.optstate_adam_step, adam._h, 1, ids, grads, gdt, params, pdt, None, ctypes.c_float(2.0))
                elif name == "old":
                    call(lib.optstate_adam_step2, adam._h, 1, ids, grads, gdt, (ctypes.c_uint64 * 1)(n), params, pdt,
                         None, scale.ctypes.data if k == 1 else None)
                else:
                    if k == 0:
                        adam.set_grad_scale(2.0)
                    adam.step_with(StepArgs(n=1, ids=ids, grads=grads, grad_dtypes=gdt, params=params,
                                            param_dtypes=pdt, numels=(ctypes.c_uint64 * 1)(n) if k else None,
                                            grad_scale=scale.ctypes.data if k == 1 else None))
        for _, adam, _, _ in runs.values():
            adam.make_durable()
        (a, _, _, wa), (b, adam, pid, wb) = runs["old"], runs["new"]
        np.testing.assert_array_equal(wa, wb)
        for field in ("main", "exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(a.read("w", field), b.read("w", field), err_msg=field)
        gen = b.latest_generation()
        short = StepArgs(n=1, ids=(u32 * 1)(pid), grads=(vp * 1)(wb.ctypes.data), grad_dtypes=(i32 * 1)(0))
        short.struct_size = ctypes.sizeof(StepArgs) - 8
        with self.assertRaises(optstate.InvalidArgument) as cm:
            adam.step_with(short)
        self.assertIn("struct_size", str(cm.exception))
        self.assertEqual(b.latest_generation(), gen)

    def test_a_gc_cycle_finalises_the_handles_in_any_order(self):
        """A store, its manager and its optimizer that end up in one garbage cycle are finalised in the
        collector's order (the store's first: weak references are cleared before finalisers run); the
        process survives, the optimizer commits what it held and the store's lock is released."""
        script = textwrap.dedent("""
            import gc, sys
            import numpy as np
            import optstate
            gc.disable()
            store = optstate.Store(sys.argv[1], chunk_size_bytes=2 << 20)
            mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
            adam = optstate.StreamedAdam(store, mm, durable_every_steps=4)
            adam.set_group(0, 1e-2, 0.9, 0.999, 1e-8, 0.0)
            w = np.ones(1000, dtype=np.float32)
            pid, _ = adam.register_param("w", 1000, 0, w.ctypes.data, optstate.F32)
            adam.make_durable()
            g = np.full(1000, 0.5, dtype=np.float32)
            adam.step([pid], [g.ctypes.data], [optstate.F32], [w.ctypes.data], [optstate.F32])
            store.cycle = [store, mm, adam]
            del store, mm, adam
            gc.collect()
            reopened = optstate.Store(sys.argv[1])
            np.testing.assert_array_equal(reopened.read("w", "main"), w)
            print("ok", reopened.latest_generation()[1])
        """)
        r = subprocess.run([sys.executable, "-c", script, self.path("gc")], capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.split(), ["ok", "1"])

    def test_the_library_logs_warnings_only_unless_asked(self):
        """Imported from Python, liboptstate logs no [info] lines (here: a restore's) unless
        OPTSTATE_LOG_LEVEL or optstate.set_log_level raises the level; an unknown level is refused."""
        script = textwrap.dedent("""
            import os, sys
            import numpy as np
            import optstate
            if sys.argv[2] == "call":
                optstate.set_log_level("info")
            d = sys.argv[1]
            store = optstate.Store(os.path.join(d, "s"), chunk_size_bytes=2 << 20)
            mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
            adam = optstate.StreamedAdam(store, mm)
            w = np.ones(100, dtype=np.float32)
            pid, _ = adam.register_param("w", 100, 0, w.ctypes.data, optstate.F32)
            adam.step([pid], [w.ctypes.data], [optstate.F32])
            adam.close()
            mm.close()
            store.export_checkpoint(os.path.join(d, "ckpt"))
            store.restore_checkpoint(os.path.join(d, "ckpt"))
            store.close()
            try:
                optstate.set_log_level("loud")
            except optstate.InvalidArgument as e:
                print("refused:", e)
        """)
        for how in ("default", "env", "call"):
            d = self.path(how)
            os.makedirs(d)
            env = dict(os.environ)
            env.pop("OPTSTATE_LOG_LEVEL", None)
            if how == "env":
                env["OPTSTATE_LOG_LEVEL"] = "info"
            r = subprocess.run([sys.executable, "-c", script, d, how], capture_output=True, text=True, env=env,
                               timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("refused:", r.stdout)
            self.assertIn("loud", r.stdout)
            if how == "default":
                self.assertNotIn("[info]", r.stderr)
            else:
                self.assertIn("[info]", r.stderr, how)
                self.assertIn("restored", r.stderr, how)

    def test_retire_param(self):
        """A param the store holds that this run does not register blocks steps until retired; retired,
        its state stays unchanged in later generations."""
        store, mm, adam = self.open()
        a, b = np.ones(100, dtype=np.float32), np.full(50, 2.0, dtype=np.float32)
        ida, _ = adam.register_param("a", 100, 0, a.ctypes.data, optstate.F32)
        idb, _ = adam.register_param("b", 50, 0, b.ctypes.data, optstate.F32)
        adam.step([ida, idb], [a.ctypes.data, b.ctypes.data], [optstate.F32] * 2)
        adam.make_durable()  # the step's commit may still run in the background (commit_lag_steps 1)
        b_state = {f: store.read("b", f) for f in ("main", "exp_avg", "exp_avg_sq")}
        store.close()
        store, mm, adam = self.open()  # resume with a model that lost "b"
        ida, existed = adam.register_param("a", 100, 0, a.ctypes.data, optstate.F32)
        self.assertTrue(existed)
        gen = store.latest_generation()
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            adam.step([ida], [a.ctypes.data], [optstate.F32])
        self.assertIn("b", str(cm.exception))
        self.assertEqual(store.latest_generation(), gen)
        with self.assertRaises(optstate.NotFound) as cm:
            adam.retire_param("no_such_param")
        self.assertIn(store.path, str(cm.exception))
        with self.assertRaises(optstate.FailedPrecondition):
            adam.retire_param("a")  # registered in this run
        adam.retire_param("b")
        adam.step([ida], [a.ctypes.data], [optstate.F32])
        adam.step([ida], [a.ctypes.data], [optstate.F32])
        adam.make_durable()
        self.assertEqual(store.latest_generation()[0], gen[0] + 2)
        for f, v in b_state.items():
            np.testing.assert_array_equal(store.read("b", f), v, err_msg=f)

    def test_register_params_in_one_call(self):
        """register_params checks every registration before it makes any (a bad one changes nothing),
        then registers all of them as one-by-one registrations would: the same stored mains and shapes,
        existed set for params the store holds, and a step over them equals one over params registered
        one by one."""
        store, mm, adam = self.open()
        ws = [np.arange(k + 1, dtype=np.float32) * (k + 1) for k in range(40)]
        names = ["t%d" % k for k in range(40)]
        bad = names[:-1] + [names[0]]  # a name given twice: nothing may be registered
        with self.assertRaises(optstate.InvalidArgument) as cm:
            adam.register_params(bad, [w.size for w in ws], [0] * 40, [w.ctypes.data for w in ws], [optstate.F32] * 40)
        self.assertIn("t0", str(cm.exception))
        with self.assertRaises(optstate.InvalidArgument):  # a shape that does not match numel: likewise
            adam.register_params(names, [w.size for w in ws], [0] * 40, [w.ctypes.data for w in ws],
                                 [optstate.F32] * 40, [(w.size,) for w in ws[:-1]] + [(99,)])
        got = adam.register_params(names, [w.size for w in ws], [0] * 40, [w.ctypes.data for w in ws],
                                   [optstate.F32] * 40, [(w.size,) for w in ws])
        self.assertEqual([e for _, e in got], [False] * 40)
        self.assertEqual(len({i for i, _ in got}), 40)
        adam.make_durable()
        for name, w in zip(names, ws):
            np.testing.assert_array_equal(store.read(name, "main"), w, err_msg=name)
        gs = [np.full(w.size, 0.5, dtype=np.float32) for w in ws]
        adam.step([i for i, _ in got], [g.ctypes.data for g in gs], [optstate.F32] * 40)
        adam.make_durable()
        batched = [store.read(n, "main") for n in names]
        store.close()
        # The same params registered one by one, in a store of their own.
        store2, mm2, adam2 = self.open("one_by_one")
        ids = [adam2.register_param(n, w.size, 0, w.ctypes.data, optstate.F32, (w.size,))[0]
               for n, w in zip(names, ws)]
        adam2.step(ids, [g.ctypes.data for g in gs], [optstate.F32] * 40)
        adam2.make_durable()
        for n, b in zip(names, batched):
            np.testing.assert_array_equal(store2.read(n, "main"), b, err_msg=n)
        store2.close()
        store, mm, adam = self.open()  # resume: every param exists
        got = adam.register_params(names, [w.size for w in ws], [0] * 40, [w.ctypes.data for w in ws],
                                   [optstate.F32] * 40)
        self.assertEqual([e for _, e in got], [True] * 40)

    def test_several_rules_in_one_optimizer(self):
        """Muon for a matrix and AdamW for a vector in one optimizer (optstate_adam_options_add_rule,
        optstate_adam_register_params_with): the store keeps each param's own fields, one step of each
        equals a float64 numpy computation (torch.optim.Muon's math; AdamW's), a group's hyperparameters
        are the union of the rules' names, and what does not fit a rule is refused naming the param."""
        store = optstate.Store(self.path("r"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
        with self.assertRaisesRegex(optstate.InvalidArgument, "adam2"):
            optstate.StreamedAdam(store, mm, rules=["muon", "adam2"])
        adam = optstate.StreamedAdam(store, mm, rules=["muon", ("adamw", "f32")])
        self.assertEqual(adam.fields(), ("main", "momentum_buffer", "exp_avg", "exp_avg_sq"))
        hyper = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": 1.0, "ns_steps": 5.0,
                 "ns_eps": 1e-7, "adjust_lr_fn": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
        adam.set_group_hyper(0, hyper)
        got = adam.get_group_hyper(0)
        for k, v in hyper.items():
            self.assertEqual(got[k], v, k)
        rng = np.random.default_rng(4)
        w, b = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
        with self.assertRaisesRegex(optstate.InvalidArgument, "bias.*2-D"):  # a vector under Muon
            adam.register_params(["bias"], [5], [0], [b.ctypes.data], [optstate.F32], [(5,)], rules=[0])
        with self.assertRaisesRegex(optstate.InvalidArgument, "bias.*rule index 2"):
            adam.register_params(["bias"], [5], [0], [b.ctypes.data], [optstate.F32], [(5,)], rules=[2])
        (wid, _), (bid, _) = adam.register_params(["w", "bias"], [24, 5], [0, 0], [w.ctypes.data, b.ctypes.data],
                                                  [optstate.F32] * 2, [(6, 4), (5,)], rules=[0, 1])
        gw, gb = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
        adam.step([wid, bid], [gw.ctypes.data, gb.ctypes.data], [optstate.F32] * 2)
        adam.make_durable()
        # Muon in float64: buf = 0.1 g; u = 0.1 g + 0.9 buf; Newton-Schulz on u^T (4 x 6).
        buf = 0.1 * gw.astype(np.float64)
        x = (0.1 * gw + 0.9 * buf).T
        x = x / max(np.linalg.norm(x), 1e-7)
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        want_w = w * (1 - 0.02 * 0.1) - 0.02 * 0.2 * np.sqrt(6) * x.T
        np.testing.assert_allclose(store.read("w", "main").reshape(6, 4), want_w, rtol=0, atol=1e-6)
        np.testing.assert_allclose(store.read("w", "momentum_buffer").reshape(6, 4), buf, rtol=0, atol=1e-7)
        want_b, m, v = adamw_reference(b.astype(np.float64), 0, 0, gb.astype(np.float64), 1, 0.02, 0.9, 0.95,
                                       1e-8, 0.1)
        np.testing.assert_allclose(store.read("bias", "main"), want_b, rtol=0, atol=1e-6)
        np.testing.assert_allclose(store.read("bias", "exp_avg"), m, rtol=0, atol=1e-7)
        store.close()
        # Reopened with the rules' indices swapped: each stored param keeps the rule whose fields it has,
        # so registering it under the other is refused naming it.
        store = optstate.Store(self.path("r"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, read_ahead_chunks=2)
        adam = optstate.StreamedAdam(store, mm, rules=["adamw", "muon"])
        with self.assertRaisesRegex(optstate.InvalidArgument, "w"):
            adam.register_params(["w"], [24], [0], [w.ctypes.data], [optstate.F32], [(6, 4)], rules=[0])
        got = adam.register_params(["w", "bias"], [24, 5], [0, 0], None, None, [(6, 4), (5,)], rules=[1, 0])
        self.assertEqual([e for _, e in got], [True, True])
        store.close()

    def test_snapshots_stats_and_sleep(self):
        store, mm, adam = self.open()
        w = np.ones(100, dtype=np.float32)
        pid, _ = adam.register_param("w", 100, 0, w.ctypes.data, optstate.F32, (10, 10))
        g = np.full(100, 0.5, dtype=np.float32)
        adam.step([pid], [g.ctypes.data], [optstate.F32])
        adam.make_durable()  # a snapshot of the step: its commit may still run in the background
        gen = store.snapshot("one")
        self.assertEqual(store.snapshots(), [("one", gen)])
        with self.assertRaises(optstate.AlreadyExists):
            store.snapshot("one")
        adam.step([pid], [g.ctypes.data], [optstate.F32])
        adam.make_durable()
        self.assertGreater(store.latest_generation()[0], gen)
        store.release_snapshot("one")
        self.assertEqual(store.snapshots(), [])
        with self.assertRaises(optstate.NotFound) as cm:
            store.release_snapshot("one")
        self.assertIn("one", str(cm.exception))
        st = mm.stats()
        self.assertLessEqual(st["peak_resident_bytes"], st["budget_bytes"])
        self.assertGreater(st["nvme_write_bytes"], 0)
        mm.release_all()
        self.assertEqual(mm.stats()["resident_bytes"], 0)
        adam.step([pid], [g.ctypes.data], [optstate.F32])  # wakes by itself
        self.assertEqual(adam.step_count(0), 3)
        self.assertGreater(store.stats()["live_bytes"], 0)

    def test_export_and_snapshot_wait_for_the_last_steps_commit(self):
        """With commit_lag_steps 1 the step's commit is still running when step() returns: an export or a
        snapshot of "the newest state" right after it is of that step, never of the one before."""
        from optstate._lib import call, lib
        import ctypes
        import json
        store, mm, adam = self.open()
        n = 3_000_000  # a few chunks per field: the commit takes a moment
        w = np.ones(n, dtype=np.float32)
        pid, _ = adam.register_param("w", n, 0, w.ctypes.data, optstate.F32)
        g = np.full(n, 0.5, dtype=np.float32)
        for step in range(1, 4):
            adam.step([pid], [g.ctypes.data], [optstate.F32])
            gen = ctypes.c_uint64()
            dest = self.path("ck%d" % step)
            call(lib.optstate_checkpoint_export, store._live(), None, dest.encode(), ctypes.byref(gen))
            with open(dest + "/manifest.json") as f:
                self.assertEqual(json.load(f)["step"], step)
            self.assertEqual(gen.value, store.latest_generation()[0])
        adam.step([pid], [g.ctypes.data], [optstate.F32])
        gen = store.snapshot("four")
        self.assertEqual(store.latest_generation(), (gen, 4))

    def test_export_with_args(self):
        """optstate_checkpoint_export_with: NULL args write the default layout (with state.safetensors),
        OPTSTATE_EXPORT_NO_SAFETENSORS leaves it out; unknown flags and a struct_size short of the
        struct are refused and write nothing."""
        from optstate._lib import EXPORT_NO_SAFETENSORS, ExportArgs, call, lib
        import ctypes
        store, mm, adam = self.open()
        w = np.ones(1000, dtype=np.float32)
        pid, _ = adam.register_param("w", 1000, 0, w.ctypes.data, optstate.F32)
        adam.step([pid], [np.full(1000, 0.5, dtype=np.float32).ctypes.data], [optstate.F32])
        gen = ctypes.c_uint64()
        call(lib.optstate_checkpoint_export_with, store._live(), self.path("default").encode(), None,
             ctypes.byref(gen))
        self.assertEqual(gen.value, store.latest_generation()[0])
        self.assertTrue(os.path.exists(self.path("default/state.safetensors")))
        args = ExportArgs(flags=EXPORT_NO_SAFETENSORS)
        call(lib.optstate_checkpoint_export_with, store._live(), self.path("lean").encode(), ctypes.byref(args),
             None)
        self.assertFalse(os.path.exists(self.path("lean/state.safetensors")))
        self.assertEqual(sorted(os.listdir(self.path("lean"))), ["manifest.json", "tensors"])
        with self.assertRaises(optstate.InvalidArgument) as cm:
            call(lib.optstate_checkpoint_export_with, store._live(), self.path("bad").encode(),
                 ctypes.byref(ExportArgs(flags=2)), None)
        self.assertIn("flags", str(cm.exception))
        short = ExportArgs(flags=EXPORT_NO_SAFETENSORS)
        short.struct_size = ExportArgs.flags.offset  # short of the fields of ABI version 5
        with self.assertRaises(optstate.InvalidArgument) as cm:
            call(lib.optstate_checkpoint_export_with, store._live(), self.path("bad").encode(), ctypes.byref(short),
                 None)
        self.assertIn("struct_size", str(cm.exception))
        self.assertFalse(os.path.exists(self.path("bad")))

    def test_reshard_with_args(self):
        """optstate_checkpoint_reshard_with: NULL args reshard as optstate_checkpoint_reshard (each rank
        with state.safetensors), OPTSTATE_RESHARD_NO_SAFETENSORS leaves it out (the manifest says so);
        unknown flags and a struct_size short of the struct are refused naming the call, nothing written."""
        from optstate._lib import RESHARD_NO_SAFETENSORS, ReshardArgs, call, lib
        import ctypes
        import json
        store, mm, adam = self.open()
        w = np.ones(1000, dtype=np.float32)
        pid, _ = adam.register_param("w", 1000, 0, w.ctypes.data, optstate.F32)
        adam.step([pid], [np.full(1000, 0.5, dtype=np.float32).ctypes.data], [optstate.F32])
        store.export_checkpoint(self.path("src"), safetensors=False)
        layout = json.dumps(optstate.checkpoint.reshard_layout([self.path("src")], ranks=2)).encode()
        srcs = (ctypes.c_char_p * 1)(self.path("src").encode())
        ranks = ctypes.c_uint32()

        def reshard(dest, args):
            call(lib.optstate_checkpoint_reshard_with, srcs, 1, layout, self.path(dest).encode(), args,
                 ctypes.byref(ranks))

        reshard("default", None)
        self.assertEqual(ranks.value, 2)
        for r in range(2):
            self.assertEqual(safetensors_of(self.path("default/rank-%05d" % r)), (True, None))
        reshard("lean", ctypes.byref(ReshardArgs(flags=RESHARD_NO_SAFETENSORS)))
        for r in range(2):
            d = self.path("lean/rank-%05d" % r)
            self.assertEqual(safetensors_of(d), (False, False))
            self.assertEqual(sorted(os.listdir(d)), ["manifest.json", "tensors"])
        with self.assertRaises(optstate.InvalidArgument) as cm:
            reshard("bad", ctypes.byref(ReshardArgs(flags=2)))
        self.assertIn("optstate_checkpoint_reshard_with: unknown flags", str(cm.exception))
        short = ReshardArgs(flags=RESHARD_NO_SAFETENSORS)
        short.struct_size = ctypes.sizeof(ReshardArgs) - 8
        with self.assertRaises(optstate.InvalidArgument) as cm:
            reshard("bad", ctypes.byref(short))
        self.assertIn("struct_size", str(cm.exception))
        self.assertFalse(os.path.exists(self.path("bad")))

    def test_export2_with_an_optimizer(self):
        """optstate_checkpoint_export2: with args->optimizer the chunks its host cache tier holds come from
        RAM (counted in the result), the files are the store's; an optimizer of another store is refused;
        a caller of ABI version 5 (struct_size without the optimizer) exports from the disk; the result
        is written only as far as its struct_size."""
        from optstate._lib import EXPORT_NO_SAFETENSORS, ExportArgs, ExportResult, call, lib
        import ctypes
        import hashlib

        def files(root):
            out = {}
            for d, _, names in os.walk(root):
                for n in names:
                    with open(os.path.join(d, n), "rb") as f:
                        out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
            return out

        store = optstate.Store(self.path("s"), **STORE_KW)
        mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20, host_cache_bytes=32 << 20)
        adam = optstate.StreamedAdam(store, mm)
        w = np.ones(1000, dtype=np.float32)
        pid, _ = adam.register_param("w", 1000, 0, w.ctypes.data, optstate.F32)
        adam.step([pid], [np.full(1000, 0.5, dtype=np.float32).ctypes.data], [optstate.F32])
        res = ExportResult()
        args = ExportArgs(flags=EXPORT_NO_SAFETENSORS, optimizer=adam._live())
        call(lib.optstate_checkpoint_export2, store._live(), self.path("ram").encode(), ctypes.byref(args),
             ctypes.byref(res))
        store.export_checkpoint(self.path("disk"), safetensors=False)
        self.assertEqual(files(self.path("ram")), files(self.path("disk")))
        self.assertEqual((res.generation, res.ram_chunks, res.disk_chunks, res.ram_mismatch_chunks),
                         (store.latest_generation()[0], 3, 0, 0))  # main, exp_avg, exp_avg_sq
        self.assertEqual(res.ram_bytes, 3 * 4000)
        # The same through the package: the counts of optstate.StreamedAdam.export_checkpoint.
        done = adam.export_checkpoint(self.path("pkg"), safetensors=False)
        self.assertEqual((done["ram_chunks"], done["disk_chunks"]), (3, 0))
        self.assertEqual(files(self.path("pkg")), files(self.path("disk")))

        other_store, _, other = self.open("other")
        bad = ExportArgs(optimizer=other._live())
        with self.assertRaises(optstate.InvalidArgument) as cm:
            call(lib.optstate_checkpoint_export2, store._live(), self.path("bad").encode(), ctypes.byref(bad), None)
        self.assertIn(other_store.path, str(cm.exception))
        self.assertFalse(os.path.exists(self.path("bad")))
        # A version-5 struct: the optimizer field lies past struct_size and is not read.
        v5 = ExportArgs(flags=EXPORT_NO_SAFETENSORS, optimizer=other._live())
        v5.struct_size = ExportArgs.optimizer.offset
        part = ExportResult()
        part.struct_size = ExportResult.ram_chunks.offset
        part.ram_chunks = 77
        call(lib.optstate_checkpoint_export2, store._live(), self.path("v5").encode(), ctypes.byref(v5),
             ctypes.byref(part))
        self.assertEqual(files(self.path("v5")), files(self.path("disk")))
        self.assertEqual(part.generation, store.latest_generation()[0])
        self.assertEqual(part.ram_chunks, 77)  # past its struct_size: left alone

    def test_restore_refuses_while_an_optimizer_is_open(self):
        """optstate_checkpoint_restore (called directly, past the package's own check) refuses while a
        manager or optimizer is open on the store: they would step on with stale step counts."""
        from optstate._lib import call, lib
        import ctypes
        store, mm, adam = self.open()
        w = np.ones(1000, dtype=np.float32)
        pid, _ = adam.register_param("w", 1000, 0, w.ctypes.data, optstate.F32)
        g = np.full(1000, 0.5, dtype=np.float32)
        adam.step([pid], [g.ctypes.data], [optstate.F32])
        adam.make_durable()
        store.export_checkpoint(self.path("ck"))
        adam.step([pid], [g.ctypes.data], [optstate.F32])
        adam.make_durable()
        before = store.latest_generation()
        gen = ctypes.c_uint64()
        for fn in ("optstate_checkpoint_restore", "optstate_checkpoint_restore2"):
            args = (store._live(), self.path("ck").encode())
            args += ((0, ctypes.byref(gen), None) if fn.endswith("2") else (ctypes.byref(gen),))
            with self.assertRaises(optstate.FailedPrecondition) as cm:
                call(getattr(lib, fn), *args)
            self.assertIn(self.path("s"), str(cm.exception))
            self.assertIn("optimizer", str(cm.exception))
            self.assertEqual(store.latest_generation(), before)
        adam.close()
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            call(lib.optstate_checkpoint_restore, store._live(), self.path("ck").encode(), ctypes.byref(gen))
        self.assertIn("memory manager", str(cm.exception))
        mm.close()
        call(lib.optstate_checkpoint_restore, store._live(), self.path("ck").encode(), ctypes.byref(gen))
        self.assertEqual(store.latest_generation(), (gen.value, 1))

    def test_errors_carry_code_and_message(self):
        store, mm, adam = self.open()
        with self.assertRaises(optstate.Busy) as cm:
            optstate.Store(self.path("s"))
        self.assertIn(self.path("s"), str(cm.exception))
        with self.assertRaises(optstate.NotFound) as cm:
            store.read("nope", "main")
        self.assertIn("nope", str(cm.exception))
        w = np.ones(10, dtype=np.float32)
        pid, _ = adam.register_param("w", 10, 0, w.ctypes.data, optstate.F32)
        with self.assertRaises(optstate.InvalidArgument) as cm:
            adam.register_param("w", 11, 0, w.ctypes.data, optstate.F32)
        self.assertIn("w", str(cm.exception))
        self.assertIn(self.path("s"), str(cm.exception))
        with self.assertRaises(optstate.InvalidArgument) as cm:
            adam.step([pid], [w.ctypes.data], [7])
        self.assertIn("gradient dtype", str(cm.exception))
        with self.assertRaises(optstate.NotFound):
            adam.step([pid + 5], [w.ctypes.data], [optstate.F32])
        self.assertEqual(adam.step_count(0), 0)  # bad input stepped nothing
        adam.step([pid], [w.ctypes.data], [optstate.F32])
        adam.make_durable()
        with self.assertRaises(optstate.InvalidArgument) as cm:
            store.read("w", "main", 5, 6)
        self.assertIn("outside its 10 elements", str(cm.exception))
        with self.assertRaises(optstate.InvalidArgument):
            optstate.MemoryManager(store, backend="tpu")
        store.close()
        with self.assertRaises(optstate.FailedPrecondition) as cm:
            adam.step([pid], [w.ctypes.data], [optstate.F32])
        self.assertIn("closed", str(cm.exception))
        with self.assertRaises(optstate.Error) as cm:
            optstate.Store(self.path("missing/parent/s"), create=True)
        self.assertIn("missing/parent", str(cm.exception))

    def test_set_group_error_shows_the_values_given(self):
        store, mm, adam = self.open()
        with self.assertRaises(optstate.InvalidArgument) as cm:
            adam.set_group(0, 1e-3, 1.5, 0.999, 1e-12, 0.0)
        msg = str(cm.exception)
        # The shortest repr of each double, not "%f" (which printed eps 0.000000).
        self.assertIn("lr 0.001,", msg)
        self.assertIn("betas 1.5/0.999,", msg)
        self.assertIn("eps 1e-12,", msg)
        self.assertIn("weight_decay 0)", msg)

    def test_adam_shaped_group_calls_refuse_other_rules(self):
        """optstate_adam_get_group/set_group on a Lion or SGD optimizer: FailedPrecondition naming the
        rule, the store and the by-name call (they used to return AdamW's defaults for names the rule
        does not have); the outputs stay untouched, the group stays as set, and AdamW still answers."""
        from optstate._lib import lib
        for rule, name, hyper in (("lion", "Lion", {"lr": 3e-4, "beta1": 0.8, "beta2": 0.97}),
                                  ("sgd", "SGD", {"lr": 0.05, "momentum": 0.7}),
                                  ("sgd_plain", "SGD", {"lr": 0.05})):
            with self.subTest(rule=rule):
                store = optstate.Store(self.path(rule), **STORE_KW)
                mm = optstate.MemoryManager(store, backend="host", device_budget_bytes=64 << 20)
                adam = optstate.StreamedAdam(store, mm, rule=rule)
                adam.set_group_hyper(0, hyper)
                for call, instead in ((lambda: adam.get_group(0), "optstate_adam_get_group_hyper"),
                                      (lambda: adam.set_group(0, 1e-3, 0.9, 0.999, 1e-8, 0.0),
                                       "optstate_adam_set_group_hyper")):
                    with self.assertRaises(optstate.FailedPrecondition) as cm:
                        call()
                    msg = str(cm.exception)
                    self.assertIn(name + " rule", msg)
                    self.assertIn(store.path, msg)
                    self.assertIn(instead, msg)
                # Through the C ABI: the code, and no output written.
                vals = [ctypes.c_double(-7.0) for _ in range(5)]
                flag = ctypes.c_int(-7)
                err = ctypes.c_void_p()
                code = lib.optstate_adam_get_group(adam._live(), 0, *[ctypes.byref(v) for v in vals],
                                                   ctypes.byref(flag), ctypes.byref(err))
                self.assertEqual(code, 4)  # OPTSTATE_FAILED_PRECONDITION
                self.assertIn(b"optstate_adam_get_group_hyper", ctypes.string_at(err.value))
                lib.optstate_free(err)
                self.assertEqual([v.value for v in vals] + [flag.value], [-7.0] * 6)
                got = adam.get_group_hyper(0)
                for k, v in hyper.items():
                    self.assertEqual(got[k], v)
                adam.close()
                mm.close()
                store.close()
        store, mm, adam = self.open("adamw")
        adam.set_group(0, 2e-3, 0.8, 0.99, 1e-7, 0.05, adamw=False)
        self.assertEqual(adam.get_group(0), dict(lr=2e-3, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.05,
                                                 adamw=False))


if __name__ == "__main__":
    unittest.main()
