"""A value any rank may raise at any time, which every rank then reads at the same point of the program.

Used for preemption: the rank that got SIGTERM raises it, and all ranks checkpoint at the same
step. A blocking all-reduce at every step would cost a round trip per step; instead each check
starts a non-blocking all-reduce (max) and reads the one the previous check started, which has
finished by then in the common case. Every rank must call `check` at the same points; they all
see a raised value at the same check, one check after the first rank raised it.

>>> flag = AgreedFlag()
>>> for step in steps:
...     if flag.check(got_signal):      # 0 until some rank raised a value one check ago
...         break
>>> flag.finish()                       # no collective left pending
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import env


class AgreedFlag:
    """The maximum over ranks of a small int, agreed one `check` late, without a blocking collective per check."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def check(self, value: int) -> int:
        """Offer this rank's `value`; returns the maximum over ranks offered at the previous check (0 at the first)."""
        if not env.is_initialized():
            return value
        agreed = self.finish()
        local = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._pending = (dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True), local)
        return agreed

    def finish(self) -> int:
        """Wait for the collective still in flight (every rank must call it); returns its maximum, 0 if none."""
        if self._pending is None:
            return 0
        work, value = self._pending
        self._pending = None
        work.wait()
        return int(value.item())

    def abandon(self) -> None:
        """Forget the collective in flight without waiting (another rank failed: it may never complete)."""
        self._pending = None
