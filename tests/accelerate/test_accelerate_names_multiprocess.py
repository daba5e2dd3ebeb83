"""Accelerate's names that need several processes, one launch on 2 processes (tests/scripts/accelerate_names_ddp.py
checks each against Accelerate's documented behaviour and prints "ok <check>")."""

import pytest

from helpers import run_launch

CHECKS = ["distributed_type and comm hooks", "gather_for_metrics of a repeated loss",
          "gather_for_metrics over a stream without length", "LocalSGD with accumulation 1",
          "LocalSGD with accumulation 2", "trigger_sync_in_backward", "sync_each_batch", "synchronize_rng_states",
          "rng_types", "FSDP model.no_sync", "destroy_process_group"]


@pytest.mark.slow
def test_comm_hooks_repeated_loss_and_stream_gathers_local_sgd_trigger_sync_sync_each_batch_rng_sync_and_fsdp_no_sync():
    proc = run_launch("accelerate_names_ddp.py", timeout=300)
    assert [line.removeprefix("ok ") for line in proc.stdout.splitlines() if line.startswith("ok ")] == CHECKS
