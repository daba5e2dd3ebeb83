"""Launched by tests/distributed/test_mesh_checkpoint.py: one epoch of a tiny model under `model_parallel` with AdamW
and a Checkpoint every 2 steps, stopped after a step and resumed on the same mesh or another one.

  mesh_resume.py --ckpt DIR --out FILE [--model lm|seq] [--tp T] [--replicate R] [--pp P --split A,B] [--stop-at STEP]

`lm`: model_parallel.py's tied language model (`--tp` slices it, `--replicate` dp groups replicate: HSDP); `seq`:
pipeline.py's nn.Sequential (`--pp` cuts it before the children named by `--split`, one stage per rank, 1F1B; `--tp`
slices inside the stages). The fit is `fit(1, resume="auto")` with its checkpoints in DIR; `--stop-at`: it stops
after that optimizer step (its checkpoint written). Rank 0 writes the whole model's weights when the fit starts (after
a resume: the weights loaded) to FILE.start and the trained ones (after the context) to FILE.
Run without the launcher, it trains the plain model. `learner()` is imported by the test.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import CancelFitException, Callback, DataLoaders, Learner, Order
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import rank

import model_parallel
import pipeline

N_TRAIN, BS = 32, 4


class Report(Callback):
    """The weights when the fit starts to `start` (rank 0), and the fit stopped after step `stop_at` (once its
    checkpoint is written)."""
    order = Order.CHECKPOINT + 10

    def __init__(self, start, stop_at=None):
        self.start, self.stop_at = start, stop_at

    def before_fit(self):
        state = self.learn.strategy.model_state_dict(self.learn.model)  # every rank: a collective when sharded
        if rank() == 0 and self.start is not None:
            torch.save(state, self.start)

    def after_batch(self):
        if self.training and self.learn.step == self.stop_at:
            raise CancelFitException()


def learner(model, ckpt, start=None, stop_at=None):
    if model == "lm":
        (x, y), net, loss = model_parallel.data(N_TRAIN, 1), model_parallel.make_model(), model_parallel.lm_loss
    else:
        (x, y), net, loss = pipeline.data(N_TRAIN, 1), pipeline.make_model(), nn.functional.cross_entropy
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=True),
                      DataLoader(TensorDataset(x[:8], y[:8]), batch_size=BS), device="cpu")
    learn = Learner(dls, net, loss_func=loss, opt_func=torch.optim.AdamW, lr=1e-2,
                    cbs=[Checkpoint(ckpt, every_n_steps=2), Report(start, stop_at)])
    learn.remove_cb(learn.progress)
    return learn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=("lm", "seq"), default="lm")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--replicate", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--split", default="4")
    p.add_argument("--stop-at", type=int)
    args = p.parse_args()
    learn = learner(args.model, args.ckpt, f"{args.out}.start", args.stop_at)
    mesh = dict(tp_size=args.tp, dp_replicate_size=args.replicate)
    if args.pp > 1:
        mesh.update(pp_size=args.pp, pp_schedule="1F1B", pp_split_points=args.split.split(","),
                    parallelize=pipeline.parallelize if args.tp > 1 else None)
    elif args.model == "lm":
        mesh["parallelize"] = model_parallel.parallelize
    with learn.distrib_ctx(strategy="model_parallel", **mesh):
        learn.fit(1, resume="auto")
    if rank() == 0:
        torch.save({k: v.detach().clone() for k, v in learn.model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
