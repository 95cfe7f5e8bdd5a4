"""python/bench/miles_loop.py's MilesStreaming (miles' streaming's step
re-implemented for the training-loop benchmark) does the real work: on the CPU,
after two steps its bucket files hold what torch.optim.AdamW computes, at the
miles' streaming's layout, and the bf16 params carry the updated mains."""
import importlib.util
import os
import tempfile
import unittest

import numpy as np
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "python", "bench", "miles_loop.py")
_spec = importlib.util.spec_from_file_location("miles_loop", _PATH)
ml = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ml)


class MilesLoopTest(unittest.TestCase):
    def test_two_steps_match_torch_adamw_at_miles_layout(self):
        sizes = [1000, 70001, 3, 30000]
        old = (ml.BUCKET_NUMEL_LIMIT, ml.STAGING_BYTES)
        ml.BUCKET_NUMEL_LIMIT, ml.STAGING_BYTES = 71000, 64 << 10  # buckets {0, 1}, {2, 3}; chunked transfers
        self.addCleanup(lambda: setattr(ml, "BUCKET_NUMEL_LIMIT", old[0]) or setattr(ml, "STAGING_BYTES", old[1]))
        g = torch.Generator().manual_seed(3)
        params = [(torch.rand(n, generator=g) * 0.2 - 0.1).to(torch.bfloat16) for n in sizes]
        hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
        ref = [p.float().clone().requires_grad_(True) for p in params]
        ropt = torch.optim.AdamW(ref, **hyper)
        with tempfile.TemporaryDirectory() as d:
            port = ml.MilesStreaming(params, os.path.join(d, "port"), **hyper)
            self.assertEqual(len(port.files), 2)
            for _ in range(2):
                grads = [torch.rand(n, generator=g) * 0.02 - 0.01 for n in sizes]
                port.step(grads)
                for r, gr in zip(ref, grads):
                    r.grad = gr.clone()
                ropt.step()
            members = [[0, 1], [2, 3]]
            for b, idx in enumerate(members):
                raw = np.fromfile(os.path.join(d, "port", "bucket%05d.bin" % b), dtype=np.uint8)
                at = 0
                for seg in ("main", "exp_avg", "exp_avg_sq"):
                    for i in idx:
                        n = sizes[i]
                        got = raw[at:at + 4 * n].view(np.float32)
                        want = ref[i].detach() if seg == "main" else ropt.state[ref[i]][seg]
                        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-9,
                                                   err_msg="%s of param %d" % (seg, i))
                        at += (4 * n + 4095) // 4096 * 4096
                self.assertEqual(at, raw.size, "bucket %d: posix_fallocate'd to the layout's size" % b)
            for p, r in zip(params, ref):
                self.assertTrue(torch.equal(p, r.detach().to(torch.bfloat16)))
            port.close()


if __name__ == "__main__":
    unittest.main()
