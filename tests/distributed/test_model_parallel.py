"""Tensor parallelism and TP x FSDP2 (2-D) through the Learner, on gloo CPU processes launched by our CLI."""

import pytest

from helpers import run_launch

CHECKS = ("tied_while_sliced", "batches_per_group", "losses_and_norms", "weights_equal_reference", "valid_and_get_preds")


def assert_checks(out: str) -> None:
    for check in CHECKS:
        assert f"CHECK {check} ok" in out, out


@pytest.mark.slow
def test_tensor_parallel_on_two_processes_equals_one_process_with_clipping_and_tied_embeddings():
    assert_checks(run_launch("model_parallel.py", "2", "0.5", nproc=2, timeout=240).stdout)


@pytest.mark.slow
def test_tensor_parallel_inside_fsdp_on_a_2x2_mesh_equals_one_process_with_the_global_batch():
    assert_checks(run_launch("model_parallel.py", "2", "0.5", nproc=4, timeout=300).stdout)


def test_a_tp_size_that_does_not_divide_the_processes_is_refused_with_the_divisors():
    from cadence.distributed.model_parallel import ModelParallel

    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the 4 processes.*\[1, 2, 4\]"):
        ModelParallel(device="cpu", tp_size=3)._mesh_shape_for(4)
    with pytest.raises(ValueError, match="needs tp_size"):
        ModelParallel(device="cpu")
