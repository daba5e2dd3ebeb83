"""Loaders beyond batch_size + shuffle on 2 processes; launched by tests/distributed/test_loaders_ddp.py.

  loaders_ddp.py {weighted,bucket} OUT: three fits of 3 epochs with a WeightedRandomSampler or a
      bucketing batch sampler: uninterrupted ("ref"), stopped after the mid-epoch checkpoint of step 7
      ("stop"), and resumed from it ("resume"). Each rank writes OUT/<kind>-rank<r>.json with every
      training batch's [run, epoch, iter, ids]; rank 0 saves the final weights of ref and resume.
  loaders_ddp.py stream OUT: an IterableDataset without __len__ (17 train items, 9 valid): fit 2 epochs,
      validate, get_preds. Rank 0 adds the validation loss computed directly over the 9 items.
"""

import json
import random
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, WeightedRandomSampler

from cadence import Callback, DataLoaders, Learner, Order
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed import DistributedDL, setup_distrib, teardown_distrib
from cadence.distributed.env import rank
from cadence.distributed.ops import gather_for_metrics
from cadence.trainer.events import CancelFitException


def sample(i):
    return torch.tensor([float(i), float(i % 5)]), torch.tensor([float(i % 3)])


class Ids(Dataset):
    def __init__(self, n=60):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return sample(i)


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return (sample(i) for i in range(self.n))


class Bucketing(Sampler):
    """Batches of 6 ids with similar `i % 17`, in a random order drawn with Python's `random`."""

    def __init__(self, n=60):
        self.n = n

    def __iter__(self):
        idxs = list(range(self.n))
        random.shuffle(idxs)
        idxs.sort(key=lambda i: i % 17)
        batches = [idxs[i:i + 6] for i in range(0, self.n, 6)]
        random.shuffle(batches)
        return iter(batches)

    def __len__(self):
        return -(-self.n // 6)


class Record(Callback):
    def __init__(self, run, rows):
        self.tag, self.rows = run, rows

    def before_batch(self):
        if self.learn.training:
            self.rows.append([self.tag, self.learn.epoch, self.learn.iter, self.learn.xb[0][:, 0].long().tolist()])


class StopAfter(Callback):
    order = Order.CHECKPOINT + 10  # after the checkpoint of that step was written

    def __init__(self, step):
        self.step = step

    def after_batch(self):
        if self.learn.training and self.learn.step == self.step:
            raise CancelFitException()


def loader(kind):
    if kind == "weighted":
        weights = torch.tensor([0.0] * 10 + [1.0] * 50)        # ids 0..9 are never drawn
        return DataLoader(Ids(), batch_size=6, sampler=WeightedRandomSampler(weights, 50))
    return DataLoader(Ids(), batch_sampler=Bucketing())


def fit(kind, out, run, rows, cbs=(), resume=None):
    torch.manual_seed(0)
    learn = Learner(DataLoaders(loader(kind), device="cpu"), nn.Linear(2, 1), loss_func=nn.MSELoss(), lr=1e-3,
                    cbs=[Record(run, rows), Checkpoint(out / f"ckpt-{kind}", every_n_steps=7, every_epoch=False),
                         *cbs])
    with learn.distrib_ctx():
        learn.fit(3, resume=resume)
    if rank() == 0 and run != "stop":
        torch.save(learn.model.state_dict(), out / f"{kind}-{run}.pt")


def gathered_ids(kind):
    """gather_for_metrics over every batch of a 27-item valid loader (5 batch-sampler batches: rank 1's 3rd is padding)."""
    dl = (DataLoader(Ids(27), batch_sampler=Bucketing(27)) if kind == "bucket" else
          DataLoader(Ids(27), batch_size=6, sampler=WeightedRandomSampler(torch.ones(27), 27, replacement=False)))
    ddl = DistributedDL(dl)
    return torch.cat([gather_for_metrics(xb[:, 0].long(), ddl) for xb, _ in ddl]).tolist()


def samplers(kind, out):
    rows = []
    fit(kind, out, "ref", rows)
    fit(kind, out, "stop", rows, cbs=[StopAfter(7)])
    fit(kind, out, "resume", rows, resume="step-00000007")
    setup_distrib()
    try:
        valid_ids = gathered_ids(kind)
    finally:
        teardown_distrib()
    (out / f"{kind}-rank{rank()}.json").write_text(json.dumps({"rows": rows, "valid_ids": valid_ids}))


def stream(out):
    rows = []
    torch.manual_seed(0)
    dls = DataLoaders(DataLoader(Stream(17), batch_size=4), DataLoader(Stream(9), batch_size=4), device="cpu")
    learn = Learner(dls, nn.Linear(2, 1), loss_func=nn.MSELoss(), lr=1e-3, cbs=[Record("fit", rows)])
    with learn.distrib_ctx():
        learn.fit(2)
        valid_loss = learn.validate()["valid_loss"]
        inputs, preds, targs = learn.get_preds(with_input=True)
        model = learn.strategy.unwrap(learn.model)
    result = {"rows": rows, "valid_loss": valid_loss, "pred_ids": inputs[:, 0].long().tolist(),
              "n_preds": len(preds), "recorded_valid": [v["valid_loss"] for v in learn.recorder.values]}
    if rank() == 0:
        xs, ys = zip(*(sample(i) for i in range(9)))
        with torch.no_grad():
            result["direct_valid_loss"] = float(nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys)))
    (out / f"stream-rank{rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    stream(out) if kind == "stream" else samplers(kind, out)
