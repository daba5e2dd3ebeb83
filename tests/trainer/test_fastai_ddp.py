"""get_preds, a 1-item validation set, lr_find, the Recorder and MixUp on 2 and 3 processes through `cadence launch` (tests/scripts/fastai_ddp.py says what each check is)."""

import pytest

from helpers import run_launch

CHECKS = ["get_preds_train_all_items_in_order", "get_preds_train_values", "get_preds_valid_all_items_in_order",
          "tta_lerps_augmented_and_plain_in_order", "one_valid_item_counted_once_on_every_process",
          "one_valid_item_get_preds", "one_valid_item_model_computed_loss", "model_computed_loss_padded_batch_ddp",
          "model_computed_loss_padded_batch_fsdp",
          "get_preds_concat_dim_drops_padding_along_the_batch", "reset_opt_counts_afresh_under_ddp",
          "lr_find_one_sweep_on_every_process",
          "recorder_losses_are_this_process_smoothed", "recorder_train_loss_is_the_mean_over_processes",
          "recorder_train_accuracy_over_all_processes", "batch_sampler_as_sampler_every_batch_once",
          "mixup_same_mixed_inputs", "mixup_same_weights", "mixup_inputs_were_mixed"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.long)])
def test_get_preds_recorder_and_mixup_on_n_processes(nproc):
    out = run_launch("fastai_ddp.py", nproc=nproc, timeout=400).stdout
    assert [line.split()[1] for line in out.splitlines() if line.startswith("CHECK ")] == CHECKS
