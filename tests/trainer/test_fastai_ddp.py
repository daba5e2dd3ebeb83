"""get_preds and MixUp on 2 and 3 processes through `cadence launch` (tests/scripts/fastai_ddp.py says what each check is)."""

import pytest

from helpers import run_launch

CHECKS = ["get_preds_train_all_items_in_order", "get_preds_train_values", "get_preds_valid_all_items_in_order",
          "mixup_same_mixed_inputs", "mixup_same_weights", "mixup_inputs_were_mixed"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_get_preds_in_dataset_order_and_mixup_equal_to_one_process(nproc):
    out = run_launch("fastai_ddp.py", nproc=nproc, timeout=400).stdout
    assert [line.split()[1] for line in out.splitlines() if line.startswith("CHECK ")] == CHECKS
