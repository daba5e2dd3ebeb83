"""Toy data the launched test scripts share (a script's folder is on sys.path under `cadence launch`).

>>> x, y = classification(8, features=6); tuple(x.shape), tuple(y.shape)
((8, 6), (8,))
>>> two_rank_batch(1, bs=2, half=4).tolist()   # rank 0's batch 1, then rank 1's
[2, 3, 6, 7]
"""

import torch


def classification(n: int, features: int, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random inputs labelled by the argmax of a fixed random linear map: the same tensors for the same seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return x, (x @ torch.randn(features, classes, generator=g)).argmax(1)


def two_rank_batch(k: int, bs: int, half: int) -> torch.Tensor:
    """Indices of the one-process batch equal to batch k of rank 0 (items [0, half)) and of rank 1 ([half, 2 half))."""
    return torch.cat([torch.arange(k * bs, (k + 1) * bs), torch.arange(half + k * bs, half + (k + 1) * bs)])


def two_rank_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, bs: int):
    """One epoch in one process, cross-entropy, equal to 2 ranks of batch `bs` each splitting `x` in halves."""
    half = len(x) // 2
    for k in range(half // bs):
        idx = two_rank_batch(k, bs, half)
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()
