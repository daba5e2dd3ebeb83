"""notebook_launcher / debug_launcher: spawn + cloudpickle workers, rank 0's result back, errors re-raised."""

import os
import time

import pytest

from cadence.distributed.notebook import WorkerError, debug_launcher, notebook_launcher

# Defined as a notebook cell would define them: in a `__main__` namespace, not importable by workers.
CELL = '''
import os

def all_reduce_ranks(offset):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(total)
    seen = dict(rank=dist.get_rank(), total=total.item(), threads=torch.get_num_threads(),
                env={k: os.environ[k] for k in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "CADENCE_MIXED_PRECISION", "CADENCE_USE_CPU")})
    dist.destroy_process_group()
    return seen

def fail_on_rank_1():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise KeyError("cell failed on rank 1")
    dist.all_reduce(torch.ones(1))              # rank 0 waits here for a peer that is gone
'''


@pytest.fixture(scope="module")
def cell():
    namespace = {"__name__": "__main__"}
    exec(CELL, namespace)
    return namespace


@pytest.mark.slow
def test_notebook_function_runs_on_two_ranks_and_rank0_result_comes_back(cell):
    out = notebook_launcher(cell["all_reduce_ranks"], args=(10.0,), num_processes=2, mixed_precision="bf16")
    assert out["rank"] == 0 and out["total"] == 21.0
    assert out["env"] == {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                          "CADENCE_MIXED_PRECISION": "bf16", "CADENCE_USE_CPU": "0"}
    assert out["threads"] == max(1, os.cpu_count() // 2)


@pytest.mark.slow
def test_worker_exception_is_reraised_with_its_traceback_and_no_hang(cell):
    start = time.monotonic()
    with pytest.raises(KeyError, match="cell failed on rank 1") as info:
        debug_launcher(cell["fail_on_rank_1"], num_processes=2)
    assert time.monotonic() - start < 30
    cause = info.value.__cause__
    assert isinstance(cause, WorkerError)
    assert "rank 1 raised" in str(cause) and "in fail_on_rank_1" in str(cause) and "Traceback" in str(cause)


def test_bad_arguments_fail_before_spawning():
    with pytest.raises(TypeError, match="callable"):
        debug_launcher("not a function")
    with pytest.raises(ValueError, match="num_processes"):
        debug_launcher(print, num_processes=0)
    with pytest.raises(ValueError, match="mixed_precision"):
        notebook_launcher(print, num_processes=1, mixed_precision="fp8")
