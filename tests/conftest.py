import os

import pytest
import torch

torch.set_num_threads(1)

# scripts the tests launch (some are ports of Accelerate's test_*.py scripts): never collected as tests
collect_ignore = ["scripts"]


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Keep every test's config, Jupyter and W&B files out of the user's home."""
    home = tmp_path_factory.mktemp("home")
    for var in ("IPYTHONDIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
                "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.delenv("CADENCE_CONFIG_FILE", raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # the last three would make output a terminal
        monkeypatch.delenv(var, raising=False)
    from cadence.accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # each test starts as a new process: the first Accelerator fixes the precision
    yield
    AcceleratorState._reset_state()


from fixtures import dls, dsets, model  # noqa: E402,F401  shared fixtures
