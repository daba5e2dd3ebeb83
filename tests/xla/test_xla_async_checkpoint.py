"""Checkpoint(async_save=True) under strategy="xla" (XLA's CPU device, in the XLA environment: see conftest.py).

XLA tensors have no host memory a writer's thread could read: the save point copies the state to the CPU
(after a sync) and the writer's thread writes those copies. It used to fail at the first save (the late copy
asked the parameters' storage for a data pointer)."""

import json
import subprocess

import pytest
import torch

from xla_env import run_xla

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def train(xla_python, directory, *args) -> subprocess.CompletedProcess:
    directory.mkdir(exist_ok=True)
    return run_xla(xla_python, "xla_async_checkpoint.py", "--dir", str(directory), *args)


def ran(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_async_checkpoints_equal_sync_ones_and_resume_exactly(xla_python, tmp_path):
    """A checkpoint at every step of 10 (AdamW, dropout drawing from XLA's generator): the async run writes every
    file the sync run writes, byte for byte, but for the recorder's wall-clock epoch time in state.json; a run
    killed (SIGKILL) at step 7 with async saves, resumed with resume="auto", ends with the uninterrupted weights."""
    sync, async_, broken = tmp_path / "sync", tmp_path / "async", tmp_path / "broken"
    ran(train(xla_python, sync))
    ran(train(xla_python, async_, "--async"))
    names = sorted(p.name for p in (sync / "checkpoints").glob("step-*"))
    assert len(names) == 10 and names == sorted(p.name for p in (async_ / "checkpoints").glob("step-*"))
    for name in names:
        a, b = sync / "checkpoints" / name, async_ / "checkpoints" / name
        files = sorted(p.name for p in a.iterdir())
        assert files == sorted(p.name for p in b.iterdir())
        assert {"model.safetensors", "optimizer.pt", "rng-rank0.pt"} <= set(files)
        for f in files:
            if f == "state.json":
                sa, sb = (json.loads((d / f).read_text()) for d in (a, b))
                for s in (sa, sb):
                    for row in s["callbacks"]["recorder"]["values"]:
                        row.pop("time")
                assert sa == sb, name
            else:
                assert (a / f).read_bytes() == (b / f).read_bytes(), (name, f)
    whole = torch.load(sync / "final.pt")
    assert all(torch.equal(whole[k], v) for k, v in torch.load(async_ / "final.pt").items())

    killed = train(xla_python, broken, "--async", "--kill-at", "7")
    assert killed.returncode == -9, killed.stderr[-3000:]
    ran(train(xla_python, broken, "--async"))
    resumed = json.loads((broken / "report.json").read_text())
    assert resumed["steps"] == 10 and 0 < resumed["first_step"] <= 7, resumed  # it continued, not from scratch
    final = torch.load(broken / "final.pt")
    assert final.keys() == whole.keys() and all(torch.equal(final[k], whole[k]) for k in whole)
