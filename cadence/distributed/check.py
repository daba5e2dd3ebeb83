"""The short distributed check `cadence test` launches: rendezvous, an all-reduce, three DDP steps.

Rank 0 prints one line per check that passed; a check that fails prints what was expected on
the rank that saw it and raises, so `cadence launch` reports its traceback and exits non-zero.

    cadence launch --num_processes 2 --cpu -m cadence.distributed.check
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from cadence.distributed import env


class CheckFailed(RuntimeError):
    """A check ran but its result was wrong."""


def check_rendezvous() -> str:
    """Join the process group (gloo on CPU, nccl on CUDA) with the launcher's timeout.

    >>> check_rendezvous()          # in a launched process     # doctest: +SKIP
    '2 process(es) joined over gloo in 0.1s'
    """
    device = env.default_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    start = time.perf_counter()
    dist.init_process_group(backend=backend, timeout=env.timeout())
    return f"{dist.get_world_size()} process(es) joined over {backend} in {time.perf_counter() - start:.1f}s"


def check_all_reduce() -> str:
    """Sum rank + 1 over all ranks and compare with n(n+1)/2.

    >>> check_all_reduce()          # after check_rendezvous()  # doctest: +SKIP
    'sum over 2 rank(s) is 3 as expected'
    """
    n = dist.get_world_size()
    total = torch.tensor([dist.get_rank() + 1.0], device=env.default_device())
    dist.all_reduce(total)
    if total.item() != n * (n + 1) / 2:
        raise CheckFailed(f"all_reduce of rank+1 gave {total.item()}, expected {n * (n + 1) / 2}")
    return f"sum over {n} rank(s) is {total.item():g} as expected"


def check_ddp_steps(steps: int = 3) -> str:
    """Train a tiny model under DistributedDataParallel on different data per rank; weights must agree.

    >>> check_ddp_steps()           # after check_rendezvous()  # doctest: +SKIP
    '3 steps, weights identical on every rank, last loss 1.9830'
    """
    device = env.default_device()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=data).to(device), torch.randn(8, 2, generator=data).to(device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    gap = max((c - flat).abs().max().item() for c in copies)
    if gap > 1e-6:
        raise CheckFailed(f"weights differ across ranks by {gap:.2e} after {steps} DDP steps: gradients were not averaged")
    return f"{steps} steps, weights identical on every rank, last loss {loss.item():.4f}"


CHECKS: tuple[tuple[str, Callable[[], str]], ...] = (
    ("rendezvous", check_rendezvous), ("all-reduce", check_all_reduce), ("DDP steps", check_ddp_steps))


def main() -> None:
    """Run every check in order; rank 0 prints what passed, the failing rank prints what failed.

        cadence launch --cpu --num_processes 2 -m cadence.distributed.check
    """
    try:
        for name, check in CHECKS:
            try:
                detail = check()
            except Exception as e:
                print(f"FAILED {name} (rank {env.rank()}): {e}", flush=True)
                raise
            if env.is_main_process():
                print(f"passed {name}: {detail}", flush=True)
    finally:
        env.teardown_distrib()


if __name__ == "__main__":
    main()
