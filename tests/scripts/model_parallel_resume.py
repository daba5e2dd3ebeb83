"""Launched by tests/distributed/test_model_parallel.py: the tiny tied LM of model_parallel.py trained with
shuffling, AdamW and a Checkpoint every 2 steps under `model_parallel` (tp_size=TP), resume="auto".

  model_parallel_resume.py --tp TP --ckpt DIR --out FILE [--kill-at STEP] [--epochs N]
`WEIGHTS <step> <checksum>` lines: the full weights when the fit starts and after each epoch.
--kill-at: SIGKILL every rank right after optimizer step STEP (after that step's checkpoint).
The final weights (the plain module after the context) go to FILE (torch.save) from rank 0; `STEPS <n>` is printed.
On one process (no launcher) the same script trains the plain model and resumes any checkpoint of it.
"""

import argparse
import os
import signal

import torch
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, Order
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import rank
from model_parallel import BS, N_TRAIN, data, lm_loss, make_model, parallelize


class PrintWeights(Callback):
    """`WEIGHTS <step> <checksum>` (rank 0) when the fit starts (after a resume) and after every epoch."""
    order = Order.CHECKPOINT + 5

    def before_fit(self):
        self._print()

    def after_epoch(self):
        self._print()

    def _print(self):
        state = self.learn.strategy.model_state_dict(self.learn.model)  # every rank: a collective when sharded
        if rank() == 0:
            total = sum(float(v.double().abs().sum()) for v in state.values())
            print(f"WEIGHTS {self.learn.step} {total!r}", flush=True)


class KillAt(Callback):
    order = Order.CHECKPOINT + 10  # after the checkpoint of this step was written

    def __init__(self, step):
        self.at = step

    def after_batch(self):
        if self.training and self.learn.step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    x, y = data(N_TRAIN, 1)
    xv, yv = data(8, 2)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=True),
                      DataLoader(TensorDataset(xv, yv), batch_size=BS), device="cpu")
    cbs = [Checkpoint(args.ckpt, every_n_steps=2, keep_last=2), PrintWeights()] + ([KillAt(args.kill_at)] if args.kill_at else [])
    learn = Learner(dls, make_model(), loss_func=lm_loss, opt_func=torch.optim.AdamW, lr=1e-2, cbs=cbs)
    with learn.distrib_ctx(strategy="model_parallel", tp_size=args.tp, parallelize=parallelize):
        learn.fit(args.epochs, resume="auto")
    model = learn.model
    assert model.head.weight is model.embed.weight, "the tie must hold after the context"
    if rank() == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
        print(f"STEPS {learn.step}", flush=True)


if __name__ == "__main__":
    main()
