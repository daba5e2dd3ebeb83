"""Accelerate's own test scripts, ported with the import swapped to cadence, on 1 and 2 processes via `cadence launch`.

The ports live in tests/scripts/accelerate_ports/; each says where cadence deliberately differs
(contiguous shards) and asserts cadence's behaviour.
"""

import pytest

from helpers import run_launch

PORTS = ["port_test_script", "port_test_ops", "port_test_metrics", "port_test_sync", "port_test_checkpointing"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 1])
def test_accelerate_test_scripts_pass(tmp_path, nproc):
    proc = run_launch("accelerate_ports.py", str(tmp_path), *PORTS, nproc=nproc, timeout=400)
    assert [line for line in proc.stdout.splitlines() if line.endswith(" OK")] == [f"{p} OK" for p in PORTS]


@pytest.mark.slow
def test_checkpointing_port_resumes_exactly_under_fsdp(tmp_path):
    """save_state writes FSDP's sharded format; load_state on 2 processes gives the uninterrupted run's weights and Adam state."""
    proc = run_launch("accelerate_ports.py", str(tmp_path), "port_test_checkpointing", nproc=2, flags=("--use_fsdp",),
                      timeout=300)
    assert proc.stdout.count("port_test_checkpointing OK") == 1, proc.stdout
    assert (tmp_path / "port_test_checkpointing" / "run0" / "checkpoints" / "checkpoint_1" / "sharded").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("flags, mode", [((), "apart"), (("--use_fsdp",), "together"),  # each engine, each order
                                         (("--use_fsdp",), "optimizer-first"),
                                         pytest.param((), "together", marks=pytest.mark.long),
                                         pytest.param(("--use_fsdp",), "apart", marks=pytest.mark.long),
                                         pytest.param((), "optimizer-first", marks=pytest.mark.long)],
                         ids=["ddp-apart", "fsdp-together", "fsdp-optimizer-first", "ddp-together", "fsdp-apart",
                              "ddp-optimizer-first"])
def test_optimizer_built_over_the_plain_model_steps_the_wrapped_parameters_and_is_saved(tmp_path, flags, mode):
    """prepare(optimizer, model), prepare_model then prepare_optimizer, or prepare(optimizer) then prepare(model):
    the optimizer trains the wrapped model as one process would, and save_state/load_state bring its momentum back
    (the resumed steps match)."""
    proc = run_launch("accelerator_prepare_order.py", mode, str(tmp_path / "ckpt"), nproc=2, flags=flags, timeout=300)
    assert proc.stdout.count("ORDER OK") == 1, proc.stdout + proc.stderr
