"""Checkpoint(async_save=...) under strategy="xla" on torch_xla's CPU device, run by tests/xla/test_xla_async_checkpoint.py.

  python xla_async_checkpoint.py --dir D [--async] [--kill-at N]

trains xla_learner.py's AdamW model (dropout: XLA's generator is checkpointed too) for 2 epochs with a checkpoint
at every step under D/checkpoints, resume="auto"; `--kill-at`: SIGKILL at that step. Python's and numpy's
generators are seeded, so the RNG files of two runs are alike. Writes D/final.pt (the weights) and D/report.json
(the step reached, the first step of this fit).
"""

import argparse
import json
import os
import random

from xla_learner import Die, FirstStep, learner, weights  # first: it makes the XLA device

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cadence.callbacks.checkpoint import Checkpoint  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--kill-at", type=int, default=0)
    a = p.parse_args()
    random.seed(0)
    np.random.seed(0)
    learn = learner("adamw", dropout=0.3, shuffle=True)
    learn.path = a.dir
    first = FirstStep()
    cbs = [Checkpoint(every_n_steps=1, every_epoch=False, async_save=a.async_save), first]
    with learn.distrib_ctx(strategy="xla"):
        learn.fit(2, cbs=cbs + ([Die(a.kill_at)] if a.kill_at else []), resume="auto")
        w = weights(learn)
    torch.save(w, os.path.join(a.dir, "final.pt"))
    with open(os.path.join(a.dir, "report.json"), "w") as f:
        json.dump({"steps": learn.step, "first_step": first.first}, f)
