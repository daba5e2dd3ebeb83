"""Accelerate's `ParallelismConfig` through cadence's Accelerator: TP and TP x FSDP2 on gloo CPU processes launched
by our CLI, against a hand-written one-process loop (tests/scripts/accelerate_parallelism.py)."""

import pytest

from helpers import run_launch

CHECKS = ("mesh", "batches", "losses_and_norms", "metrics", "state_dict", "save_model", "save_load_state",
          "presliced_without_tp_refused")


def assert_checks(out: str, four_processes: bool = False) -> None:
    for check in CHECKS + (("presliced_refused",) if four_processes else ()):
        assert f"CHECK {check} ok" in out, out
        assert out.count(f"CHECK {check} ok") == 1, "printed by more than the main process"


@pytest.mark.slow
@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_tensor_parallel_accelerator_on_two_processes_equals_one_process(tmp_path, precision):
    assert_checks(run_launch("accelerate_parallelism.py", tmp_path, *precision, nproc=2, timeout=300).stdout)


@pytest.mark.slow
def test_launcher_sizes_give_an_accelerator_script_naming_none_tp_inside_fsdp2_with_accumulation_on_four_processes(
        tmp_path):
    out = run_launch("accelerate_parallelism.py", tmp_path, "--launched", nproc=4, timeout=300,
                     flags=("--use_parallelism_config", "--parallelism_config_tp_size", "2",
                            "--gradient_accumulation_steps", "2")).stdout
    assert_checks(out, four_processes=True)


@pytest.mark.slow
def test_hsdp_under_tp_with_a_model_sliced_before_prepare_on_four_processes_equals_one_process(tmp_path):
    """Accelerate's way: the model comes sliced on `accelerator.torch_device_mesh["tp"]` (from_pretrained(tp_plan=
    "auto")), and dp_replicate_size=2 replicates it across the two tp groups."""
    out = run_launch("accelerate_parallelism.py", tmp_path, "--replicas", "--presliced", nproc=4, timeout=300).stdout
    assert_checks(out, four_processes=True)


@pytest.mark.parametrize("sizes", [dict(tp_size=2), dict(tp_size=2, dp_shard_size=2), dict(dp_shard_size=4),
                                   dict(tp_size=2, dp_replicate_size=2, dp_shard_size=2)])
def test_dimension_names_are_accelerates(sizes):
    """(Accelerate refuses tp with dp_replicate and no dp_shard, which cadence runs: the 4-process test above.)"""
    from accelerate.parallelism_config import ParallelismConfig as Theirs

    from cadence.parallelism_config import ParallelismConfig

    ours, theirs = ParallelismConfig(**sizes), Theirs(**sizes)
    for name in ("dp_dim_names", "non_dp_dim_names", "dp_shard_cp_dim_names", "dp_cp_dim_names", "fsdp_dim_names",
                 "active_mesh_dims", "total_size", "data_parallel_size", "non_data_parallel_size"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_sizes_whose_product_is_not_the_process_count_are_refused_with_the_arithmetic():
    from cadence.utils import ParallelismConfig

    with pytest.raises(ValueError, match=r"dp_shard_size=4 x tp_size=2 x cp_size=1 = 8, not the 4 processes"):
        ParallelismConfig(tp_size=2, dp_shard_size=4).check_processes(4)


@pytest.mark.parametrize("sizes, said", [
    ({"tp_size": 0}, "tp_size=0: give a whole number >= 1"),
    ({"tp_size": 2, "cp_size": 2}, "cp_size=2: context parallelism is not available"),
    ({"sp_size": 2}, "sp_size=2: Accelerate's sequence parallelism"),
])
def test_sizes_cadence_cannot_run_are_refused_when_the_config_is_built(sizes, said):
    from cadence.utils import ParallelismConfig

    with pytest.raises(ValueError, match=said):
        ParallelismConfig(**sizes)


def test_a_config_naming_no_sizes_takes_the_launchers(monkeypatch):
    from cadence import ParallelismConfig

    monkeypatch.setenv("CADENCE_PARALLELISM_CONFIG", '{"parallelism_config_tp_size": 2}')
    config = ParallelismConfig()
    assert (config.tp_size, config.dp_shard_size, config.tp_enabled) == (2, 1, True)


def test_a_launched_pipeline_size_is_refused_to_a_hand_written_accelerator_loop(monkeypatch):
    from cadence import Accelerator

    monkeypatch.setenv("CADENCE_PARALLELISM_CONFIG", '{"parallelism_config_pp_size": 2}')
    with pytest.raises(ValueError, match=r"pp_size=2 \(the launcher's parallelism_config\).*train with the Learner"):
        Accelerator()


def test_one_process_runs_the_plain_model_whatever_the_sizes():
    import torch

    from cadence import Accelerator, ParallelismConfig

    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2))
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    assert accelerator.torch_device_mesh is None and accelerator.tensor_parallel_rank == 0
    assert isinstance(accelerator.unwrap_model(model).weight, torch.nn.Parameter)
    assert accelerator.gather_for_metrics(torch.ones(3)).shape == (3,)
