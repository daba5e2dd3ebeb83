"""Checkpoint cost per save early and late in a long run: does saving slow down as the run grows?

A tiny MLP trains for 20,000 optimizer steps (20 epochs of 1,000 batches of 1 sample, no
validation) with Checkpoint(every_n_steps=250, every_epoch=False, keep_last=2). Each save is
timed; the table compares the medians of the saves around step 1,000 (steps 500-2,000: the first
save, which warms up, is left out) and of the last 2,000 steps.

    .venv/bin/python bench/checkpoint_cost.py            # ~1 min on one core
    .venv/bin/python bench/checkpoint_cost.py --steps 5000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.callbacks.checkpoint import Checkpoint

STEPS_PER_EPOCH, EVERY = 1000, 250


class TimedCheckpoint(Checkpoint):
    """Checkpoint that records (step, seconds, state.json bytes) for every save."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saves: list[tuple[int, float, int]] = []

    def _save(self, epoch_complete: bool) -> None:
        start = time.perf_counter()
        super()._save(epoch_complete)
        took = time.perf_counter() - start
        self.saves.append((self.learn.step, took, (self.root / self.history[-1] / "state.json").stat().st_size))


def run(steps: int, workdir: Path) -> tuple[TimedCheckpoint, float]:
    torch.manual_seed(0)
    x, y = torch.randn(STEPS_PER_EPOCH, 8), torch.randint(0, 3, (STEPS_PER_EPOCH,))
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=1), None, device="cpu")
    ckpt = TimedCheckpoint(workdir / "ckpt", every_n_steps=EVERY, every_epoch=False, keep_last=2)
    learn = Learner(dls, nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)), loss_func=nn.CrossEntropyLoss(),
                    cbs=[ckpt], path=workdir)
    learn.remove_cb(learn.progress)
    start = time.perf_counter()
    learn.fit(steps // STEPS_PER_EPOCH)
    return ckpt, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="run length (a multiple of 1000, >= 2000)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as tmp:
        ckpt, seconds = run(args.steps, Path(tmp))
    early = [s for s in ckpt.saves[1:] if s[0] <= 2000]
    late = [s for s in ckpt.saves if s[0] > args.steps - 2000]
    print(f"{args.steps} steps in {seconds:.1f} s ({args.steps / seconds:.0f} steps/s), {len(ckpt.saves)} saves")
    print("\n| saves | steps | median ms per save | state.json bytes |\n|---|---|---|---|")
    for label, rows in (("early", early), ("late", late)):
        print(f"| {label} ({len(rows)}) | {rows[0][0]}-{rows[-1][0]} | {statistics.median(r[1] for r in rows) * 1e3:.1f} "
              f"| {rows[-1][2]} |")
    ratio = statistics.median(r[1] for r in late) / statistics.median(r[1] for r in early)
    print(f"\nlate / early: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
