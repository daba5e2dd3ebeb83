"""The Learner under 2-D parallelism (2 tp x 2 FSDP2 dp groups) on 4 gloo CPU processes launched by our CLI: what
each process sees, exact metrics, one writer per file, and the callbacks that must keep working
(tests/scripts/model_parallel_2d.py, against a hand-written one-process loop)."""

import pytest

from helpers import run_launch

CHECKS = ("files:batches_per_group", "files:metrics_exact", "files:one_writer_each", "files:trackers_read_back",
          "files:export_equals_reference", "accum:early_stopping_agreed", "accum:weights_equal_reference",
          "bf16:trains_like_fp32")


@pytest.mark.slow
def test_2x2_learner_batches_metrics_files_gradaccum_gradclip_bf16_tracker_and_early_stopping(tmp_path):
    out = run_launch("model_parallel_2d.py", tmp_path, nproc=4, timeout=400).stdout
    for check in CHECKS:
        assert out.count(f"CHECK {check} ok") == 1, out
    lines = out.splitlines()
    # three fits of 2 epochs: each progress line printed once, not once per tp rank or per process
    assert sum(line.startswith("epoch 0 |") for line in lines) == 3, out
    assert sum(line.startswith("epoch 1 |") for line in lines) == 3, out
    assert sum(line.startswith("EarlyStopping: no improvement") for line in lines) == 1, out
    # per-rank files (its DCP shard and RNG state) by that rank, every other file by rank 0 alone
    wrote = [line.split(maxsplit=2)[1:] for line in lines if line.startswith("WROTE ")]
    assert {r for r, _ in wrote} == {"0", "1", "2", "3"}
    assert all(r == "0" for r, path in wrote if "rank" not in path and ".distcp" not in path), wrote
