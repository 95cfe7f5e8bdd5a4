"""python/bench/muon_gpt2.py as a smoke test on the CPU (--tiny, 3 steps): the streamed
optstate.torch.Muon and the unstreamed torch.optim.Muon + torch.optim.AdamW train the same model on the
same batches: identical losses before any update, close ones after (torch's Newton-Schulz runs in bf16,
ours in fp32: a few 1e-3 of the loss after 2 updates), and the report carries both final losses."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "bench", "muon_gpt2.py")


class MuonGpt2BenchTest(unittest.TestCase):
    def test_tiny_run_compares_like_with_like(self):
        try:
            import transformers  # noqa: F401
        except ImportError:
            self.skipTest("transformers is not installed")
        if not hasattr(torch.optim, "Muon"):
            self.skipTest("torch.optim.Muon needs torch >= 2.9")
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "muon.json")
            subprocess.run([sys.executable, _BENCH, "--tiny", "--steps", "3", "--device", "cpu", "--lr", "1e-2",
                            "--dir", d, "--json", out], check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                result = json.load(f)
        rows = result["rows"]
        self.assertEqual(len(rows), 3)
        self.assertGreater(result["muon_params"], 0)
        self.assertLess(result["muon_params"], result["params"])
        self.assertEqual(rows[0]["loss_reference"], rows[0]["loss_optstate"])  # same model, same batch
        for r in rows[1:]:
            self.assertAlmostEqual(r["loss_optstate"], r["loss_reference"], delta=1e-2 * r["loss_reference"])
        self.assertLess(rows[-1]["loss_reference"], rows[0]["loss_reference"])  # both stepped: it learns
        self.assertLess(rows[-1]["loss_optstate"], rows[0]["loss_optstate"])
        self.assertGreaterEqual(result["rel_diff"], 0.0)


if __name__ == "__main__":
    unittest.main()
