"""Launched on 2 processes by tests/callbacks/test_early_stop_ddp.py; argument: a directory for saved models.

Every rank prints what it stopped at, as `RANK <r> <what> <value>` lines, for the test to compare:
- EarlyStopping on a real, worsening valid_loss (huge lr): the epoch it stopped after and the recorded values;
- SaveModel: rank 0 saved, every rank loaded the best epoch's weights (`best_loaded True`);
- TerminateOnNaN with an infinite input on rank 1 only: the step and batch each rank stopped at.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, Learner, Order
from cadence.callbacks.early_stop import EarlyStopping, SaveModel, TerminateOnNaN
from cadence.distributed.env import rank
from toy import classification

NAN_AT = 5  # training batch (over the fit) that gets an infinite input on rank 1: epoch 1, batch 1, step 6


class InfInputOnRank1(Callback):
    def before_batch(self):
        if self.learn.training and self.learn.train_iter == NAN_AT and rank() == 1:
            x = self.learn.xb[0].clone()
            x[0, 0] = float("inf")
            self.learn.xb = (x, *self.learn.xb[1:])


class CaptureWeights(Callback):
    order = Order.RECORD + 1

    def __init__(self):
        self.weights = []

    def after_epoch(self):
        self.weights.append({k: v.clone() for k, v in self.learn.model.module.state_dict().items()})


def report(what, value):
    # one write per line: both ranks share stdout, and print's separate newline write could interleave
    sys.stdout.write(f"RANK {rank()} {what} {value}\n")
    sys.stdout.flush()


def main(path):
    x, y = classification(96, features=8)
    dls = DataLoaders(DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8),
                      DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8), device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1, path=path)
    with learn.distrib_ctx():
        learn.fit(2)
        capture, saver = CaptureWeights(), SaveModel(fname="best")
        learn.fit(20, lr=5.0, cbs=[capture, EarlyStopping(patience=2), saver])   # gets worse: stops early
        report("early_stop_epoch", learn.epoch)
        report("values", [(r["epoch"], r["train_loss"], r["valid_loss"]) for r in learn.recorder.values])
        best = capture.weights[saver.best_epoch]
        report("best_loaded", all(torch.equal(v, best[k]) for k, v in learn.model.module.state_dict().items()))

        learn.fit(3, lr=0.1, cbs=[InfInputOnRank1(), TerminateOnNaN()])
        report("nan_step", learn.step)
        report("nan_batch", (learn.epoch, learn.iter))
        report("validated", len(learn.recorder.values))


if __name__ == "__main__":
    main(sys.argv[1])
