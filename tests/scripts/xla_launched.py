"""A script that names no strategy, run by `cadence launch --tpu` (or plainly, with --notebook) (tests/xla/test_xla_launch.py) in the XLA environment.

It trains a Learner inside `learn.distrib_ctx()` and the same Learner on the plain CPU, and writes to `--out`:
the strategy the launcher's config chose, the device the model trained on, how the script was entered
(`__main__`, its `main()` called by --main_training_function, or `notebook_launcher` with --notebook) and the max |weight difference| to the CPU run.
"""

import argparse
import json

import torch_xla  # the XLA device must exist before the first backward of the process (autograd sizes its queues)

torch_xla.device()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cadence.trainer.data import DataLoaders  # noqa: E402
from cadence.trainer.learner import Learner  # noqa: E402


def learner() -> Learner:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=g)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()
    dls = DataLoaders(DataLoader(TensorDataset(x[:32], y[:32]), batch_size=8),
                      DataLoader(TensorDataset(x[32:], y[32:]), batch_size=8))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return Learner(dls, model, loss_func=F.cross_entropy, lr=0.1, opt_func=torch.optim.SGD, cbs=[])


def train(entered: str) -> dict:
    learn = learner()
    with learn.distrib_ctx():                    # no strategy named: the launcher's config picks it
        strategy = type(learn.strategy).__name__
        device = str(next(learn.model.parameters()).device)
        learn.fit(2)
    reference = learner()
    reference.fit(2)
    diff = max((a.detach().cpu() - b.detach()).abs().max().item()
               for a, b in zip(learn.model.parameters(), reference.model.parameters()))
    return {"strategy": strategy, "device": device, "entered": entered, "diff": diff}


def main(entered: str = "main_training_function") -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--notebook", action="store_true", help="train through notebook_launcher(num_processes=1)")
    args = parser.parse_args()
    if args.notebook:
        from cadence.distributed.notebook import notebook_launcher

        result = notebook_launcher(train, ("notebook_launcher",), num_processes=1)
    else:
        result = train(entered)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main("__main__")
