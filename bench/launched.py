"""Run a bench script on N CPU processes with `cadence launch`, and the bits each launched bench shares.

>>> print(relaunch(2, __file__, ["--rounds", "5"]))      # from a bench's main(): rank 0's output
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def relaunch(nproc: int, script: str, args: list[str], timeout: float = 1800) -> str:
    """Run `script --worker args` on `nproc` CPU processes (one torch thread each); return rank 0's stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "cadence.cli", "launch", "--cpu", "--num_processes", str(nproc), str(script),
           "--worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def is_worker() -> bool:
    """True inside the launched processes (the script was started with --worker)."""
    return "--worker" in sys.argv
