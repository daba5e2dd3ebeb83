"""A small transformer-like model for the big-model tests: blocks with a residual connection (never split);
this process's memory figures from /proc."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.norm(self.fc(x)).relu()


class Net(nn.Module):
    def __init__(self, d: int = 64, n_blocks: int = 6, n_in: int = 16, n_out: int = 4):
        super().__init__()
        self.inp = nn.Linear(n_in, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n_blocks)])
        self.head = nn.Linear(d, n_out)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.head(self.blocks(self.inp(x))) * self.scale


def block_bytes(d: int) -> int:
    """fc (d*d + d) and norm (2d) float32 numbers, counted by hand."""
    return (d * d + d + 2 * d) * 4


def net_bytes(d: int, n_blocks: int, n_in: int = 16, n_out: int = 4) -> int:
    return ((n_in * d + d) + (d * n_out + n_out) + 1) * 4 + n_blocks * block_bytes(d)


def memory_kib() -> dict[str, int]:
    """This process's VmRSS, VmHWM (peak), RssAnon (private) and RssFile (mapped files), in KiB."""
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in open("/proc/self/status")) if k in fields}
