"""matplotlib, imported only when a plot is asked for (it is an optional dependency)."""

from __future__ import annotations

import importlib.util
from typing import Any


def has_matplotlib() -> bool:
    """Whether matplotlib can be imported here."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a module hidden by sys.modules[name] = None, or a broken install
        return False


def pyplot() -> Any:
    """`matplotlib.pyplot`, or ModuleNotFoundError with the command that installs it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ModuleNotFoundError("plotting needs matplotlib, which is not installed: pip install matplotlib "
                                  "(or pip install \"cadence[examples]\")") from e
    return plt
