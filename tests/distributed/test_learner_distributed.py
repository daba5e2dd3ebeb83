"""The Learner under distrib_ctx on 2 processes (gloo), launched through `cadence launch`."""

import pytest

from helpers import run_launch

pytestmark = pytest.mark.slow


def test_learner_ddp_on_two_processes():
    out = run_launch("learner_ddp.py").stdout
    for check in ("ddp_equals_double_batch", "metrics_equal_single_process", "get_preds_dataset_order",
                  "single_process_after_ctx"):
        assert f"CHECK {check} ok" in out, out
    assert out.count("epoch 0 |") == 2  # two fits printed by rank 0 only (the last fit runs on both ranks alone)
