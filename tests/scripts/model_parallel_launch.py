"""Launched by tests/distributed/test_model_parallel.py with `--use_parallelism_config --parallelism_config_tp_size 2`:
a script whose `distrib_ctx` names no strategy and no sizes (only how to slice the model) trains model parallel.
Rank 0 prints `STRATEGY <name> tp <tp_size> dp <dp_size>` and `TRAINED <steps>`.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.distributed.env import rank
from model_parallel import BS, N_TRAIN, data, lm_loss, make_model, parallelize


def main():
    x, y = data(N_TRAIN, 1)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), DataLoader(TensorDataset(x, y), batch_size=BS),
                      device="cpu")
    learn = Learner(dls, make_model(), loss_func=lm_loss, opt_func=torch.optim.SGD, lr=0.1)
    with learn.distrib_ctx(parallelize=parallelize):
        strategy = learn.strategy
        if rank() == 0:
            print(f"STRATEGY {strategy.name} tp {strategy.tp_size} dp {strategy.dp_size}", flush=True)
        learn.fit(1)
    if rank() == 0:
        print(f"TRAINED {learn.step}", flush=True)


if __name__ == "__main__":
    main()
