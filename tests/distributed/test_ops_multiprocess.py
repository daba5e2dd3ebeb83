"""ops, DistributedDL and DDP on 2 gloo processes, launched through `cadence launch`."""

import pytest

from tests.helpers import run_launch

pytestmark = pytest.mark.slow


def test_collectives_on_two_processes(tmp_path):
    """gather / pad / broadcast / reduce, gather_for_metrics over DistributedDL shards, run order, logger."""
    proc = run_launch("ops_collectives.py", str(tmp_path))
    assert "OPS OK" in proc.stdout
    assert proc.stdout.count("MAIN_PRINT_MARKER") == 1


def test_ddp_matches_one_process_with_double_batch():
    """2 x batch B == 1 x batch 2B with SGD; no_sync accumulates locally; teardown only of its own group."""
    proc = run_launch("ddp_train.py")
    assert "DDP OK" in proc.stdout
