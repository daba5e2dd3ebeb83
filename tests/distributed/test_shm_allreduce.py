"""SharedMemoryAllReduce, DDP's default gradient averaging on one machine's CPU, against gloo's all-reduce."""

import glob
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import run_launch


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.long)])
def test_the_shared_memory_average_equals_gloos_on_every_rank_and_leaves_no_file(tmp_path, nproc):
    # a region left by a rank SIGKILLed while setting up (its name ends with that dead pid): the next job removes it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(f"/dev/shm/cadence-ddp-{uuid.uuid4().hex}-1-{dead.pid}")
    stale.write_bytes(b"x" * 4096)
    before = set(glob.glob("/dev/shm/cadence-ddp-*")) - {str(stale)}
    proc = run_launch("shm_allreduce.py", str(tmp_path), "compare", nproc=nproc, timeout=240)
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["available"]                              # one machine, CPU, x86: DDP uses it by default
    # a /dev/shm too small for the regions (Docker's 64 MB and 8 ranks): gloo instead, said once, no SIGBUS later
    assert not result["available_with_chunks_of_all_free_space"]
    assert proc.stderr.count("not through shared memory: /dev/shm has") == 1, proc.stderr
    assert "--shm-size" in proc.stderr
    assert len(result["cases"]) == 18
    for case in result["cases"]:
        assert case["same_on_every_rank"], case             # the replicas stay identical
        if nproc == 2:
            assert case["bitwise_gloo"], case               # a/2 + b/2 in either order
        else:                                                # gloo's ring adds in another order
            assert case["max_abs_diff"] <= {"torch.float32": 1e-6, "torch.bfloat16": 2e-2,
                                            "torch.float64": 1e-14}[case["dtype"]], case
    assert set(glob.glob("/dev/shm/cadence-ddp-*")) == before   # the names are removed once mapped
    assert not stale.exists()


@pytest.mark.slow
def test_a_rank_that_never_joins_times_out_with_the_group_timeout(tmp_path):
    run_launch("shm_allreduce.py", str(tmp_path), "late", flags=("--timeout", "3"), timeout=120)
    message, waited = (tmp_path / "error.txt").read_text().rsplit("\n", 1)
    assert "timed out after 3 s waiting for rank 1" in message   # "timed out": how the launcher tells a timeout
    assert 3 <= float(waited) < 6


@pytest.mark.slow
def test_a_rank_that_exits_is_noticed_within_seconds(tmp_path):
    run_launch("shm_allreduce.py", str(tmp_path), "gone", flags=("--timeout", "60"), timeout=120)
    message, waited = (tmp_path / "error.txt").read_text().rsplit("\n", 1)
    assert "rank 1 (pid" in message and "exited during the gradient all-reduce" in message
    assert float(waited) < 5


@pytest.mark.slow
def test_a_region_that_cannot_be_allocated_leaves_gloo_on_every_rank_and_no_file(tmp_path):
    before = set(glob.glob("/dev/shm/cadence-ddp-*"))
    run_launch("shm_allreduce.py", str(tmp_path), "noroom", timeout=120)
    outcomes = json.loads((tmp_path / "noroom.json").read_text())
    assert len(outcomes) == 2, outcomes
    for outcome in outcomes:                                                # both ranks gave up, alike
        assert "gloo's all-reduce" in outcome and "could not be reserved in /dev/shm" in outcome, outcomes
    assert "File too large" in outcomes[1], outcomes                       # rank 1 says why
    assert set(glob.glob("/dev/shm/cadence-ddp-*")) == before              # rank 0's reserved region removed too
