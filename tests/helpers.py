"""Shared test helpers: run scripts on N processes through our own launcher, with a timeout; a checkpointable
counter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parent.parent


def cadence_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: one torch thread each, repo importable, no GPU."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", CUDA_VISIBLE_DEVICES="")
    env.update(extra)
    return env


def run_launch(script: str | Path, *script_args: str, nproc: int = 2, flags: tuple[str, ...] = (),
               timeout: float = 180, env: dict[str, str] | None = None, check: bool = True,
               cwd: str | Path = REPO) -> subprocess.CompletedProcess:
    """Run `cadence launch --num_processes nproc [flags] script [args]` and return the finished process.

    `script` is a path or a name under tests/scripts/; it runs in `cwd` (the repository by default). Raises AssertionError with both streams
    when `check` and the run failed; subprocess.TimeoutExpired when it ran past `timeout`.
    """
    path = Path(script) if Path(script).exists() else SCRIPTS / script
    cmd = [sys.executable, "-m", "cadence.cli", "launch", "--cpu", "--num_processes", str(nproc), *flags,
           str(path), *map(str, script_args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or cadence_env(), cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


class Counter:
    """An object with a state (`register_for_checkpointing`'s kind): `n`, counted by the test."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]
