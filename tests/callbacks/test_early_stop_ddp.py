"""EarlyStopping, SaveModel and TerminateOnNaN under DDP: every rank stops at the same step (2 processes, gloo)."""

import re

import pytest

from helpers import run_launch

pytestmark = pytest.mark.slow


def test_every_rank_stops_at_the_same_step(tmp_path):
    proc = run_launch("stop_ddp.py", str(tmp_path), nproc=2, timeout=150)   # exits 0, no hang
    out = proc.stdout
    reports = {}
    for r, what, value in re.findall(r"^RANK (\d) (\w+) (.*)$", out, flags=re.M):
        reports.setdefault(what, {})[int(r)] = value
    for what in ("early_stop_epoch", "values", "best_loaded", "nan_step", "nan_batch", "validated"):
        assert set(reports[what]) == {0, 1}, (what, out)
        assert reports[what][0] == reports[what][1], (what, out)   # identical on both ranks
    assert int(reports["early_stop_epoch"][0]) < 19, out               # stopped early
    assert reports["best_loaded"][0] == "True", out
    assert reports["nan_step"][0] == "6" and reports["nan_batch"][0] == "(1, 1)", out
    assert reports["validated"][0] == "1", out                          # epoch 1's validation never ran
    # messages come from the main process only, once each; the NaN was seen by one rank of two
    assert out.count("EarlyStopping: no improvement in valid_loss for 2 epoch(s)") == 1, out
    assert out.count("TerminateOnNaN: loss is not finite on 1 of 2 process(es) at step 6 (epoch 1, batch 1)") == 1, out
    assert (tmp_path / "models" / "best" / "model.safetensors").exists()
