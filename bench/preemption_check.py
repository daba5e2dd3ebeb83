"""Per-step cost of the preemption agreement on 2 gloo processes: `AgreedFlag.check` against a blocking all-reduce.

Each step is some compute and a gradient-sized all-reduce (what keeps DDP ranks in lockstep); only
the time spent in the check is measured. Run from the repo root:

    .venv/bin/python -m cadence.cli launch --cpu --num_processes 2 bench/preemption_check.py
"""

import statistics
import time

import torch
import torch.distributed as dist

from cadence.distributed.env import rank, setup_distrib
from cadence.distributed.flag import AgreedFlag

STEPS, REPEATS = 400, 3


def median_check_us(kind: str, x: torch.Tensor, grads: torch.Tensor) -> float:
    flag, local, spent = AgreedFlag(), torch.zeros(1, dtype=torch.int64), []
    dist.barrier()
    for _ in range(STEPS):
        for _ in range(20):
            x @ x                                   # the step's compute
        dist.all_reduce(grads)                      # DDP's gradient all-reduce
        start = time.perf_counter()
        if kind == "agreed flag":
            flag.check(0)
        elif kind == "blocking all-reduce":
            dist.all_reduce(local)
        spent.append(time.perf_counter() - start)
    flag.finish()
    dist.barrier()
    return statistics.median(spent) * 1e6


def main() -> None:
    setup_distrib()
    x, grads = torch.randn(128, 128), torch.randn(10_000)
    for _ in range(REPEATS):
        result = {kind: median_check_us(kind, x, grads) for kind in ("nothing", "agreed flag", "blocking all-reduce")}
        if rank() == 0:
            print("median µs per step in the check:", {k: round(v, 1) for k, v in result.items()}, flush=True)


if __name__ == "__main__":
    main()
