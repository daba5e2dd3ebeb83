"""`accelerate.logging` under cadence: `get_logger(name)` logs on the main process unless told otherwise.

As Accelerate's, every message starts with the rank of the process that logs it (`[RANK 0] ...`).

>>> from cadence.logging import get_logger
>>> logger = get_logger(__name__, log_level="INFO")
>>> logger.info("once per run")                            # INFO:__main__:[RANK 0] once per run
>>> logger.info("on every process", main_process_only=False)
>>> logger.warning_once("deprecated option")               # the same arguments warn once per logger
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from .distributed import env
from .distributed.ops import MultiProcessAdapter as _RankFilteredAdapter

__all__ = ["get_logger", "MultiProcessAdapter"]


class MultiProcessAdapter(_RankFilteredAdapter):
    """Accelerate's `MultiProcessAdapter`: logs on the main process (`main_process_only=False`: on every process,
    `in_order=True`: one after the other), each message prefixed with `[RANK <process index>] `.

    >>> get_logger("train").warning("late", main_process_only=False)   # WARNING:train:[RANK 1] late (on rank 1)
    """

    def process(self, msg: Any, kwargs: Any) -> tuple[str, Any]:
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {env.rank()}] {msg}", kwargs

    @functools.lru_cache(None)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, emitted once per logger for the same arguments (they must be hashable), as Accelerate's.

        >>> for _ in range(3): logger.warning_once("slow path")    # logged once
        """
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: int | str | None = None) -> MultiProcessAdapter:
    """A logger whose calls log once (main process); `main_process_only=False` logs on every process.

    `log_level` (default `$ACCELERATE_LOG_LEVEL`, Accelerate's variable) sets the level.

    >>> get_logger(__name__, log_level="info").info("ready")
    """
    level = log_level if log_level is not None else os.environ.get("ACCELERATE_LOG_LEVEL")
    if isinstance(level, str):
        level = level.upper()
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level)
    return MultiProcessAdapter(logger, {})
