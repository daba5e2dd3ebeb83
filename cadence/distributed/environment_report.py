"""What `cadence env` prints: the versions, CPUs and accelerators here, and the launcher's config file.

>>> print(environment_report())                         # doctest: +SKIP
cadence 0.1.0
Python 3.11.9 (Linux-6.1-x86_64)
...
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import default_config_path

__all__ = ["environment_report"]

OPTIONAL_EXTRAS = ("deepspeed", "torch_xla", "tensorboard", "wandb")


def environment_report(path: str | os.PathLike | None = None) -> str:
    """What `cadence env` prints: versions, CPUs, accelerators, and the config file (`path`, else the default
    one) with its contents."""
    import platform
    from importlib import metadata

    import torch

    from ..version import __version__

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    lines = [f"cadence {__version__}", f"Python {platform.python_version()} ({platform.platform()})",
             f"torch {torch.__version__}", f"numpy {version('numpy')}",
             *(f"{name} {version(name)}" for name in OPTIONAL_EXTRAS),
             f"CPUs: {os.cpu_count()}", f"Accelerators: {_accelerators(torch)}", f"XLA runtime: {_xla_runtime()}"]
    file = Path(path).expanduser() if path is not None else default_config_path()
    if file.is_file():
        lines += [f"Config: {file}", *("  " + line for line in file.read_text().splitlines())]
    else:
        lines.append(f"Config: {file} (not found; `cadence config` writes it, defaults apply)")
    return "\n".join(lines)


def _xla_runtime() -> str:
    """torch_xla's device type and device count (starting its runtime: seconds), when torch_xla is installed."""
    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        return "none (torch_xla not installed)"
    try:
        import torch_xla.runtime as xr

        return f"{xr.device_type()}, {xr.global_runtime_device_count()} device(s)"
    except Exception as e:  # a torch_xla built for another torch fails to import: say so, do not crash the report
        return f"torch_xla does not load ({type(e).__name__}: {e})"[:300]


def _accelerators(torch) -> str:
    found = [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return ", ".join(found) or "none (CPU only)"
