"""Train a small CNN on scikit-learn's handwritten digits (8x8 images, 10 classes) with cadence.

The data ships with scikit-learn, so nothing is downloaded. On one CPU core this reaches
about 99% validation accuracy in a few seconds of training.

    python examples/train_digits.py                     # defaults: 8 epochs, bs 64, lr 1e-2
    python examples/train_digits.py --epochs 4 --lr 3e-3

`get_dls` and `get_model` are importable, so other examples can reuse them:

    from train_digits import get_dls, get_model
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner, accuracy


def get_dsets(valid_pct: float = 0.2, seed: int = 42) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (image, label) datasets: images of shape (1, 8, 8) scaled to [0, 1], a random split."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_valid = int(len(x) * valid_pct)
    valid, train = idx[:n_valid], idx[n_valid:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[valid], y[valid])


def get_dls(bs: int = 64, valid_pct: float = 0.2, seed: int = 42) -> DataLoaders:
    """Train (shuffled) and valid loaders over the digits."""
    train_ds, valid_ds = get_dsets(valid_pct, seed)
    return DataLoaders.from_dsets(train_ds, valid_ds, bs=bs)


def conv_block(n_in: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(n_in, n_out, 3, padding=1), nn.BatchNorm2d(n_out), nn.ReLU())


def get_model(n_classes: int = 10) -> nn.Module:
    """A small CNN: 8x8 -> 4x4 -> 2x2 feature maps, then a linear classifier."""
    return nn.Sequential(
        conv_block(1, 32), nn.MaxPool2d(2),   # 32 x 4 x 4
        conv_block(32, 64), nn.MaxPool2d(2),  # 64 x 2 x 2
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 2 * 2, n_classes),
    )


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="number of epochs (default: 8)")
    parser.add_argument("--bs", type=int, default=64, help="batch size (default: 64)")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle schedule (default: 1e-2)")
    parser.add_argument("--seed", type=int, default=42, help="random seed for the split, the weights and the batch order")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: 1; a model this small gains nothing from more)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    learn = Learner(get_dls(args.bs, seed=args.seed), get_model(), loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
    learn.fit_one_cycle(args.epochs, lr_max=args.lr)
    acc = learn.validate()["accuracy"]
    print(f"validation accuracy: {acc:.4f}")
    return acc


if __name__ == "__main__":
    main()
