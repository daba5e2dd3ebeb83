"""What the live progress bar costs a long fit: cadence with the rich bar drawn against plain lines.

    .venv/bin/python bench/live_bar.py              # 6 interleaved fits of 4000 tiny steps each way: ~1 min
    .venv/bin/python bench/live_bar.py --smoke      # the script runs (tests/test_bench.py)

overhead.py's "cadence, live bar" row times fits of 0.15-0.3 s, where the bar's start and stop
weigh; here each fit runs ~2 s, so what is left is the redraws (rich renders on its own thread,
holding the GIL). Prints the median CPU time of each, their ratio and the redraws per second.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import torch
import torch.nn.functional as F

from overhead import LR, make_batches, make_model, quiet


def main(n_batches: int = 4000, repeats: int = 6) -> None:
    from rich.console import Console

    import cadence.callbacks.live_bar as live_bar
    from cadence import DataLoaders, Learner, ProgressCallback

    torch.set_num_threads(1)
    redraws = [0]
    polled = live_bar._PolledProgress.get_renderables

    def counted(self):
        redraws[0] += 1
        yield from polled(self)

    live_bar._PolledProgress.get_renderables = counted
    data = make_batches("tiny", n_batches)
    learners = {}
    for live in (True, False):
        learn = Learner(DataLoaders(data, None, device="cpu"), make_model("tiny"), loss_func=F.cross_entropy,
                        opt_func=torch.optim.SGD, lr=LR)
        learners[live] = learn.remove_cb(ProgressCallback).add_cb(
            ProgressCallback(Console(file=io.StringIO(), force_terminal=live)))
    cpu, wall = {True: [], False: []}, {True: [], False: []}
    with quiet():  # the plain learner's epoch lines
        for r in range(repeats):
            for live in (True, False) if r % 2 else (False, True):
                c0, w0 = time.process_time(), time.perf_counter()
                learners[live].fit(1)
                cpu[live].append(time.process_time() - c0)
                wall[live].append(time.perf_counter() - w0)
    med = {live: statistics.median(cpu[live]) for live in cpu}
    print(f"{repeats} fits of {n_batches} tiny steps each way, CPU time medians")
    print(f"plain lines  {med[False]:.3f} s")
    print(f"live bar     {med[True]:.3f} s   ratio {med[True] / med[False]:.3f}   "
          f"{redraws[0] / sum(wall[True]):.1f} redraws/s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="two short fits each way: checks the script runs")
    args = p.parse_args()
    main(*((50, 2) if args.smoke else ()))
