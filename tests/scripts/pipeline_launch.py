"""Launched by tests/distributed/test_pipeline.py with `--parallelism_config_pp_size 2 --parallelism_config_pp_schedule
GPipe --parallelism_config_pp_microbatches 2`: a script whose `distrib_ctx` names no strategy and no sizes (only where
to cut the model) trains a pipeline. Rank 0 prints `STRATEGY <name> pp <pp_size> <schedule> <microbatches> dp <dp_size>`
and `TRAINED <steps>`.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.distributed.env import rank
from pipeline import BS, N_TRAIN, SPLITS, data, make_model


def main():
    x, y = data(N_TRAIN, 1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), device="cpu")
    learn = Learner(dls, make_model(), loss_func=nn.functional.cross_entropy, opt_func=torch.optim.SGD, lr=0.1)
    with learn.distrib_ctx(pp_split_points=SPLITS[2]):
        s = learn.strategy
        if rank() == 0:
            print(f"STRATEGY {s.name} pp {s.pp_size} {s.schedule_class.__name__} {s.microbatches} dp {s.dp_size}", flush=True)
        learn.fit(1)
    if rank() == 0:
        print(f"TRAINED {learn.step}", flush=True)


if __name__ == "__main__":
    main()
