"""Running tests/scripts in the XLA environment (see conftest.py): where it is, and the command that runs a script."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"
# the Makefile's default XLA_VENV (keep the two in step): keyed by the pinned versions
DEFAULT_VENV = Path.home() / ".cache" / "cadence" / "xla-torch2.9.0-xla2.9.0"


def run_xla(python: Path, *args: str, devices: int | None = None, torchrun: int | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run tests/scripts/<args[0]> (or `-m module ...`) with the XLA environment's python on XLA's CPU device (PJRT_DEVICE=CPU).

    `devices`: SPMD over that many virtual CPU devices; `torchrun`: that many processes under torchrun.
    """
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    if devices:
        env.update(CADENCE_XLA_SPMD="1", CPU_NUM_DEVICES=str(devices))
    cmd = [str(python), *args] if args[0] == "-m" else [str(python), str(SCRIPTS / args[0]), *args[1:]]
    if torchrun:
        cmd = [str(python), "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun),
               "--master_port", str(_free_port()), *cmd[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
