"""fastai's distributed example (`nbs/examples/distrib.py`) with cadence, on scikit-learn's digits.

The same script runs on any number of processes; each one trains on its shard of the data and
DDP averages the gradients. Run it from the repository root, in one of three ways:

    cadence launch --cpu --num_processes 2 examples/distrib.py      # cadence's launcher
    cadence launch --cpu --num_processes 2 --use_fsdp examples/distrib.py   # the same, sharded (FSDP2)
    torchrun --nproc_per_node 2 examples/distrib.py                 # PyTorch's launcher
    python examples/distrib.py                                      # one process, no launcher

Options: `--epochs`, `--bs` (per process), `--lr`, `--seed`, `--data_dir` (where the data is
cached; default `$XDG_CACHE_HOME/cadence/data`, i.e. `~/.cache/cadence/data`).

The recipe, as in fastai:

    path = rank0_first(get_digits, data_dir)      # rank 0 "downloads" the data, the others then read it
    learn = Learner(dls, model, loss_func=..., metrics=accuracy)
    with learn.distrib_ctx():                     # DDP over however many processes were launched
        learn.fit_one_cycle(epochs, lr)

The model and the training settings come from `train_digits.py` next to this file.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_digits.py, however the script was started

from train_digits import get_model  # noqa: E402

from cadence import DataLoaders, Learner, accuracy, main_print, rank0_first, world_size  # noqa: E402


def default_data_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cadence" / "data"


def get_digits(data_dir: Path) -> Path:
    """Cache the digits as `data_dir/digits.npz` if it is not there yet (our stand-in for a download); return its path.

    The file is written under a temporary name and renamed, so a reader never sees half of it.
    """
    path = Path(data_dir) / "digits.npz"
    if not path.exists():
        from sklearn.datasets import load_digits

        digits = load_digits()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, images=digits.images.astype(np.float32), target=digits.target.astype(np.int64))
        os.replace(tmp, path)
    return path


def get_dls(path: Path, bs: int = 64, valid_pct: float = 0.2, seed: int = 42) -> DataLoaders:
    """Train and valid loaders from the cached file; the same split as `train_digits.get_dls`."""
    with np.load(path) as data:
        x = torch.from_numpy(data["images"]).unsqueeze(1) / 16.0  # (n, 1, 8, 8), pixel values 0..16 -> [0, 1]
        y = torch.from_numpy(data["target"])
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_valid = int(len(x) * valid_pct)
    valid, train = idx[:n_valid], idx[n_valid:]
    return DataLoaders.from_dsets(TensorDataset(x[train], y[train]), TensorDataset(x[valid], y[valid]), bs=bs)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="number of epochs (default: 8)")
    parser.add_argument("--bs", type=int, default=64, help="batch size per process (default: 64)")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle schedule (default: 1e-2)")
    parser.add_argument("--seed", type=int, default=42, help="random seed for the split, the weights and the batch order")
    parser.add_argument("--data_dir", type=Path, default=None, help="where to cache the data (default: ~/.cache/cadence/data)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    path = rank0_first(get_digits, args.data_dir or default_data_dir())  # rank 0 caches the data, then the others read it
    learn = Learner(get_dls(path, args.bs, seed=args.seed), get_model(), loss_func=nn.CrossEntropyLoss(),
                    metrics=accuracy)
    with learn.distrib_ctx():
        learn.fit_one_cycle(args.epochs, lr_max=args.lr)
        acc = learn.validate()["accuracy"]  # over the whole validation set, every sample counted once
        n_procs = world_size()
    main_print(f"trained on {n_procs} process{'es' if n_procs > 1 else ''}")
    main_print(f"validation accuracy: {acc:.4f}")
    return acc


if __name__ == "__main__":
    main()
