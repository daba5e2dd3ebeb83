"""learn.save("m") twice, with different weights and optimizer state; optionally SIGKILLed inside the second save.

  save_twice.py --path DIR [--kill-at-op KIND:N]
Before each save, the weights and the optimizer's step count are also written as DIR/first.st and
DIR/second.st (safetensors, the step count as the tensor "adam_step"), for the test to compare.
"""

import argparse
import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fs_kill import kill_at_filesystem_op  # noqa: E402

from cadence import DataLoaders, Learner  # noqa: E402
from cadence.trainer import saving  # noqa: E402


def snapshot(learn, file):
    state = {k: v.contiguous() for k, v in learn.model.state_dict().items()}
    state["adam_step"] = torch.tensor(float(learn.opt.state_dict()["state"][0]["step"]))
    save_file(state, file)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--path", required=True)
    p.add_argument("--kill-at-op")
    args = p.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=16), device="cpu")
    learn = Learner(dls, nn.Linear(4, 2), loss_func=nn.CrossEntropyLoss(), path=args.path)
    with learn.no_bar():
        learn.fit(1)
        snapshot(learn, os.path.join(args.path, "first.st"))
        learn.save("m")
        learn.fit(1)
    snapshot(learn, os.path.join(args.path, "second.st"))
    if args.kill_at_op:
        kill_at_filesystem_op(args.kill_at_op, saving, "save")
    saving.save(learn, "m")
    print("SAVED TWICE")


if __name__ == "__main__":
    main()
