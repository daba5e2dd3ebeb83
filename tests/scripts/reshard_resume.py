"""Record the sample ids every rank trains on; checkpoint mid-epoch; resume on any number of processes.

Launched by tests/distributed/test_data_reshard.py:
  reshard_resume.py --ckpt DIR --out DIR [--resume NAME]
100 samples whose input is their id, batch 12 per process, shuffled, 2 epochs; Checkpoint every
7 optimizer steps (mid-epoch 1 on 2 processes). Each rank writes OUT/ids-rank<r>.json: one
[epoch, iter, [ids]] row per training batch it ran.
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from cadence import Callback, DataLoaders, Learner
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import rank


class Ids(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i % 3)])


class RecordIds(Callback):
    def __init__(self, out):
        self.out, self.rows = Path(out), []

    def before_batch(self):
        if self.learn.training:
            self.rows.append([self.learn.epoch, self.learn.iter, self.learn.xb[0][:, 0].long().tolist()])

    def after_fit(self):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"ids-rank{rank()}.json").write_text(json.dumps(self.rows))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume")
    args = p.parse_args()
    torch.manual_seed(0)
    dls = DataLoaders(DataLoader(Ids(), batch_size=12, shuffle=True), device="cpu")
    learn = Learner(dls, nn.Linear(1, 1), loss_func=nn.MSELoss(), lr=1e-4,
                    cbs=[RecordIds(args.out), Checkpoint(args.ckpt, every_n_steps=7)])
    with learn.distrib_ctx():
        learn.fit(2, resume=args.resume)


if __name__ == "__main__":
    main()
