"""`accelerate.utils.write_basic_config` under cadence: `cadence config default` from Python.

>>> write_basic_config(mixed_precision="bf16")      # then `cadence launch train.py` reads it
PosixPath('/home/me/.cache/cadence/default_config.yaml')
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..distributed import config as cfg_mod

__all__ = ["write_basic_config"]


def write_basic_config(mixed_precision: str = "no", save_location: str | os.PathLike | None = None) -> Path | bool:
    """Write a config for this machine: every GPU one process (DDP over several), else one CPU process.

    `save_location` defaults to cadence's config file (`$CADENCE_CONFIG_FILE`, else
    `~/.cache/cadence/default_config.yaml`). As Accelerate's, an existing file is left alone: the
    answer is then False, else the path written.

    >>> write_basic_config(save_location=tmp_path / "config.yaml").name
    'config.yaml'
    """
    path = Path(save_location).expanduser() if save_location is not None else cfg_mod.default_config_path()
    if path.exists():
        print(f"Configuration already exists at {path}, will not override. Run `cadence config` or pass another "
              f"save_location.")
        return False
    gpus = torch.cuda.device_count()
    config = cfg_mod.Config(mixed_precision=str(mixed_precision).lower(), use_cpu=gpus == 0,
                            num_processes=max(gpus, 1), distributed_type="MULTI_GPU" if gpus > 1 else "NO")
    return cfg_mod.save(config, path)
