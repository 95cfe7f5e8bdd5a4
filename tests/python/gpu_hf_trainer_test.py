"""Hugging Face Trainer flows with a GPT-2 124M (from a config, random init) in
bf16 on CUDA with optstate.torch.AdamW and optstate.integrations.transformers:
20 steps saving every 5; resume from checkpoint-10 while the store is at step
20; resume a copy of checkpoint-10 on a fresh store path. Prints a table (flow,
steps, max |diff| vs the uninterrupted run). A second uninterrupted run measures
the GPU's own run-to-run noise (deterministic algorithms are requested, so it is
0 where the kernels allow): each resumed run must differ from the first by no
more than that. Skipped without CUDA or transformers."""
import os
import shutil
import unittest

import torch

from common import TempDirTest, optstate  # noqa: F401  (common puts the package on the path)

try:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError:
    transformers = None
if transformers is not None:
    import optstate.integrations.transformers
import optstate.torch as ot

LR = 3e-4
STEPS = 20
SEQ = 128


class Data(torch.utils.data.Dataset):
    def __init__(self, vocab):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (8 * STEPS, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@unittest.skipIf(transformers is None or not torch.cuda.is_available(), "needs CUDA and transformers")
class GpuHfTrainerTest(TempDirTest):
    def setUp(self):
        super().setUp()
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # 124M

    def run_trainer(self, store, out, resume=None, **kw):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(self.cfg).to("cuda", torch.bfloat16)
        opt = ot.AdamW(model.named_parameters(), store=store, lr=LR, weight_decay=0.0, budget=1 << 30)
        args = TrainingArguments(output_dir=out, max_steps=STEPS, save_steps=5, save_strategy="steps",
                                 per_device_train_batch_size=8, learning_rate=LR, weight_decay=0.0,
                                 logging_steps=100, report_to=[], seed=0, dataloader_num_workers=0,
                                 disable_tqdm=True, **kw)
        t = Trainer(model=model, args=args, train_dataset=Data(self.cfg.vocab_size), optimizers=(opt, None))
        optstate.integrations.transformers.install(t)
        t.train(resume_from_checkpoint=resume)
        steps = opt.step_count(0)
        w = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        opt.close()
        return w, steps

    def test_flows(self):
        def diff(a, b):
            return max((a[k] - b[k]).abs().max().item() for k in a)

        ref, steps = self.run_trainer(self.path("ref"), self.path("ref_out"))
        again, _ = self.run_trainer(self.path("ref2"), self.path("ref2_out"))
        floor = diff(again, ref)
        rows = [("uninterrupted, again (noise floor)", steps, floor)]
        shutil.rmtree(self.path("ref2"))
        shutil.rmtree(self.path("ref2_out"))

        w, _ = self.run_trainer(self.path("s"), self.path("out"))
        rows.append(("20 steps, saving every 5", STEPS, diff(w, ref)))
        w, steps = self.run_trainer(self.path("s"), self.path("out_b"), resume=self.path("out/checkpoint-10"))
        rows.append(("resume checkpoint-10, store at step 20", steps, diff(w, ref)))
        shutil.copytree(self.path("out/checkpoint-10"), self.path("copied"))
        shutil.rmtree(self.path("out_b"))
        w, steps = self.run_trainer(self.path("fresh"), self.path("out_c"), resume=self.path("copied"))
        rows.append(("resume a copy of checkpoint-10, fresh store", steps, diff(w, ref)))

        print("\n%-46s %6s %14s" % ("flow (GPT-2 124M, bf16, %s)" % torch.cuda.get_device_name(), "steps",
                                     "max |diff|"))
        for name, n, d in rows:
            print("%-46s %6d %14.3g" % (name, n, d))
        for name, n, d in rows[1:]:
            self.assertEqual(n, STEPS, name)
            self.assertLessEqual(d, floor, name)


if __name__ == "__main__":
    unittest.main()
