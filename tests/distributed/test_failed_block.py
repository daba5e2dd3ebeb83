"""A `distrib_ctx` block that fails on one process of several leaves without gathering the weights: the gather is a
collective, and the other processes may be in another one (a rank that refused its own damaged checkpoint file
while the others load theirs sat there, silent, until the collective timeout). The run stops at once with that
rank's error."""

import time

import pytest

from tests.helpers import run_launch


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_a_block_failing_on_one_process_stops_the_run_with_its_error_instead_of_hanging(strategy):
    start = time.monotonic()
    proc = run_launch("fails_on_one_rank.py", strategy, check=False, timeout=150)   # it hung past 90 s before
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: rank 0 refused its checkpoint file" in proc.stderr
    assert "cadence launch: rank 0 failed" in proc.stderr
    assert time.monotonic() - start < 120


def test_a_failure_on_one_process_keeps_the_gathered_model(tmp_path):
    """On one process nothing waits for anyone: a failed block still hands back the whole trained module."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from cadence import DataLoaders, Learner

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    learn = Learner(DataLoaders.from_dsets(TensorDataset(x, x[:, :1]), TensorDataset(x, x[:, :1]), bs=8),
                    nn.Linear(4, 1), loss_func=nn.MSELoss(), path=tmp_path)
    with pytest.raises(KeyboardInterrupt), learn.no_bar(), learn.distrib_ctx(strategy="fsdp"):
        learn.fit(1)
        raise KeyboardInterrupt
    assert type(learn.model) is nn.Linear and not any(hasattr(p, "placements") for p in learn.model.parameters())


def test_a_lock_whose_file_cannot_be_removed_is_still_released(tmp_path, monkeypatch):
    """A checkpoint directory that became read-only mid-run: the save fails, and releasing the lock cannot remove
    its file. The lock is released all the same (a later fit in the same process, a notebook's, was refused as
    'in use by another job', its own pid) and the release raises nothing that would hide the save's error."""
    from pathlib import Path

    from cadence.callbacks.checkpoint.lock import LOCK_FILE, DirectoryLock

    lock = DirectoryLock(tmp_path)
    lock.acquire()
    unlink = Path.unlink

    def read_only(path, *args, **kwargs):
        if path.name == LOCK_FILE:
            raise PermissionError(1, "Operation not permitted", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", read_only)
    lock.release()
    assert (tmp_path / LOCK_FILE).exists()
    monkeypatch.setattr(Path, "unlink", unlink)
    with DirectoryLock(tmp_path):  # taken again, the file left behind taken over
        pass
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_truncated_deepspeed_file_is_refused_naming_it(tmp_path):
    """torch's reader says only "failed finding central directory": the refusal names the file."""
    import torch

    from cadence.distributed.safe_load import load_deepspeed_file

    path = tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"fp32_flat_groups": [torch.zeros(1000)]}}, path)
    path.write_bytes(path.read_bytes()[:900])
    assert load_deepspeed_file(path, "cpu", mmap=True) is None   # not a zip to map: its callers read it plainly
    with pytest.raises(ValueError, match=rf"{path} is damaged \(.*\): it was cut short"):
        load_deepspeed_file(path, "cpu")
