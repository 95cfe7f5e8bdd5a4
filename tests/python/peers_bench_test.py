"""python/bench/peers.py compares like with like: on the CPU (--device cpu), the
same GPT-2, the same batches and hyperparameters give torch.optim.AdamW, miles'
streaming (its port) and optstate.torch.AdamW (f32 moments, with and without
the RAM tier, durable every step or every 3) the same loss at every step (the
fp32 update of each agrees to rounding), and optstate's checkpoint holds the
state once (its field files, no state.safetensors)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "bench", "peers.py")


class PeersBenchTest(unittest.TestCase):
    def test_every_method_trains_the_same_model_on_the_same_batches(self):
        try:
            import transformers  # noqa: F401
        except ImportError:
            self.skipTest("transformers is not installed")
        methods = ["torch-fused", "miles", "ours-f32", "ours-f32-disk", "ours-f32-dur3"]
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "peers.json")
            subprocess.run([sys.executable, _BENCH, "--device", "cpu", "--size", "tiny", "--vocab", "256",
                            "--seq", "32", "--batch", "2", "--steps", "6", "--round", "2", "--lr", "1e-2",
                            "--methods", ",".join(methods), "--dir", os.path.join(d, "work"), "--json", out],
                           check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                result = json.load(f)
        rows = {r["method"]: r for r in result["rows"]}
        self.assertEqual(sorted(rows), sorted(methods))
        self.assertEqual(result["skipped"], {})
        ref = rows["torch-fused"]["losses"]
        self.assertEqual(len(ref), 6)
        self.assertLess(ref[-1], ref[0])  # it learns: a method that did not step would be caught below
        for name in methods[1:]:
            losses = rows[name]["losses"]
            for step, (a, b) in enumerate(zip(losses, ref)):
                self.assertAlmostEqual(a, b, delta=2e-3 * abs(b), msg="%s step %d" % (name, step))
        for name in ("ours-f32", "ours-f32-disk"):
            self.assertGreater(rows[name]["disk_written_per_step"], 0, name)  # durable every step
        # Ours saves its field files only: the f32 state (12 bytes a param) once, not twice, and says so.
        state_bytes = 12 * result["params"]
        for name in ("ours-f32", "ours-f32-disk", "ours-f32-dur3"):
            self.assertGreaterEqual(rows[name]["checkpoint_bytes"], state_bytes, name)
            self.assertLess(rows[name]["checkpoint_bytes"], 1.5 * state_bytes, name)
            self.assertIn("field files only", rows[name]["checkpoint_note"], name)
        self.assertEqual(rows["torch-fused"]["checkpoint_note"], "")


if __name__ == "__main__":
    unittest.main()
