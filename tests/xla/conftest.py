"""The XLA lane: tests that run scripts in the XLA environment (torch_xla needs torch 2.9 exactly; the main
environment is on torch 2.13). `make setup-xla` builds that environment once, outside the clone, at
$CADENCE_XLA_VENV (the Makefile's XLA_VENV). Missing, the tests fail saying so; CADENCE_XLA=off skips them."""

import os
from pathlib import Path

import pytest
from xla_env import DEFAULT_VENV


@pytest.fixture(scope="session")
def xla_python() -> Path:
    """The XLA environment's python; fails (or skips with CADENCE_XLA=off) when it is not built."""
    if os.environ.get("CADENCE_XLA", "").lower() == "off":
        pytest.skip("CADENCE_XLA=off: the XLA lane is turned off")
    venv = Path(os.environ.get("CADENCE_XLA_VENV") or DEFAULT_VENV)
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists() or not python.exists():
        pytest.fail(f"the XLA environment is missing at {venv}: run `make setup-xla` (builds it once: torch and "
                    f"torch_xla 2.9.0, a ~4 GB download), or set CADENCE_XLA=off to turn the XLA tests off")
    return python
