"""`accelerate.logging` under cadence: `get_logger(name)` logs on the main process unless told otherwise.

>>> from cadence.logging import get_logger
>>> logger = get_logger(__name__, log_level="INFO")
>>> logger.info("once per run")
>>> logger.info("on every process", main_process_only=False)
"""

from __future__ import annotations

import os

from .distributed.ops import MultiProcessAdapter
from .distributed.ops import get_logger as _get_logger

__all__ = ["get_logger", "MultiProcessAdapter"]


def get_logger(name: str, log_level: int | str | None = None) -> MultiProcessAdapter:
    """A logger whose calls log once (main process); `main_process_only=False` logs on every process.

    `log_level` (default `$ACCELERATE_LOG_LEVEL`, Accelerate's variable) sets the level.
    """
    level = log_level if log_level is not None else os.environ.get("ACCELERATE_LOG_LEVEL")
    if isinstance(level, str):
        level = level.upper()
    return _get_logger(name, level)
