"""Tensor parallelism and TP x FSDP2 (2-D) through the Learner, on gloo CPU processes launched by our CLI."""

import pytest

from helpers import run_launch

CHECKS = ("tied_while_sliced", "batches_per_group", "losses_and_norms", "weights_equal_reference", "valid_and_get_preds")


def assert_checks(out: str, variants: tuple[str, ...]) -> None:
    for variant in variants:
        for check in CHECKS:
            assert f"CHECK {variant}:{check} ok" in out, out


@pytest.mark.slow
def test_tp_sp_loss_parallel_and_bf16_on_two_processes_equal_one_process_with_clipping_and_tied_embeddings():
    variants = ("tp", "sp", "loss_parallel", "bf16")
    assert_checks(run_launch("model_parallel.py", "0.5", *variants, nproc=2, timeout=300).stdout, variants)


@pytest.mark.slow
def test_tp_and_tp_sp_inside_fsdp_on_a_2x2_mesh_and_hsdp_equal_one_process_with_the_global_batch():
    variants = ("tp", "sp", "hsdp")     # hsdp: tp 1, FSDP2 over (dp_replicate 2, dp_shard 2)
    assert_checks(run_launch("model_parallel.py", "0.5", *variants, nproc=4, timeout=300).stdout, variants)


@pytest.mark.slow
@pytest.mark.long
def test_hsdp_with_tp_inside_on_a_2x2x2_mesh_equals_one_process_with_the_global_batch():
    """8 processes: tp 2 inside FSDP2 over (dp_replicate 2, dp_shard 2), with clipping and tied embeddings."""
    assert_checks(run_launch("model_parallel.py", "0.5", "hsdp_tp", nproc=8, timeout=600).stdout, ("hsdp_tp",))


@pytest.mark.slow
def test_a_hugging_face_llama_with_tied_embeddings_is_sliced_by_its_own_plan_trains_like_one_process_and_exports(
        tmp_path):
    out = run_launch("model_parallel_hf.py", tmp_path / "export", nproc=2, timeout=300).stdout
    for check in ("losses", "weights", "export_loads_with_from_pretrained"):
        assert f"CHECK {check} ok" in out, out


def test_a_tp_size_that_does_not_divide_the_processes_is_refused_with_the_divisors():
    from cadence.distributed.model_parallel import ModelParallel

    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the 4 processes.*\[1, 2, 4\]"):
        ModelParallel(device="cpu", tp_size=3)._mesh_shape_for(4)
    with pytest.raises(ValueError, match="needs tp_size"):
        ModelParallel(device="cpu")


def _weights_lines(out: str) -> dict[int, float]:
    return {int(step): float(total) for step, total in
            (line.split()[1:] for line in out.splitlines() if line.startswith("WEIGHTS "))}


def _launch_resume(tmp_path, nproc, ckpt, out, *extra, check=True):
    return run_launch("model_parallel_resume.py", "--ckpt", tmp_path / ckpt, "--out", tmp_path / out, *extra,
                      nproc=nproc, timeout=300, check=check)


@pytest.mark.slow
def test_a_2x2_run_killed_mid_training_resumes_bitwise_and_its_checkpoint_loads_on_1x2_and_in_one_process(tmp_path):
    import shutil
    import subprocess
    import sys

    import torch

    from helpers import SCRIPTS, cadence_env

    _launch_resume(tmp_path, 4, "ref", "ref.pt")
    killed = _launch_resume(tmp_path, 4, "run", "run.pt", "--kill-at", "5", check=False)
    assert killed.returncode != 0 and (tmp_path / "run" / "latest").exists(), killed.stderr[-2000:]
    saved = _weights_lines(killed.stdout)[4]          # the weights of the step-4 checkpoint, as the 2x2 run saw them
    shutil.copytree(tmp_path / "run", tmp_path / "on1x2")
    shutil.copytree(tmp_path / "run", tmp_path / "on1")

    resumed = _launch_resume(tmp_path, 4, "run", "run.pt")          # the same command continues the run
    ref, run = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert ref.keys() == run.keys() and all(torch.equal(ref[k], run[k]) for k in ref), "2x2 resume is not bitwise"
    assert "STEPS 12" in resumed.stdout

    on_1x2 = _weights_lines(_launch_resume(tmp_path, 2, "on1x2", "on1x2.pt").stdout)
    one = subprocess.run([sys.executable, str(SCRIPTS / "model_parallel_resume.py"), "--ckpt", str(tmp_path / "on1"),
                          "--out", str(tmp_path / "on1.pt")], capture_output=True, text=True, timeout=300,
                         env=cadence_env(PYTHONPATH=str(SCRIPTS)))
    assert one.returncode == 0, one.stderr[-3000:]
    in_one = _weights_lines(one.stdout)
    assert on_1x2[4] == saved and in_one[4] == saved, (saved, on_1x2, in_one)   # loaded exactly
    assert on_1x2.keys() == in_one.keys() == {4, 12, 20}                       # dp=1: 8 steps per epoch
    for step in (12, 20):
        assert abs(on_1x2[step] - in_one[step]) <= 1e-6 * abs(in_one[step])      # TP and one process train alike


def test_context_parallelism_is_refused_with_what_to_use_instead():
    from cadence.distributed.model_parallel import ModelParallel

    with pytest.raises(ValueError, match=r"cp_size=2: context parallelism is not available.*SequenceParallel"):
        ModelParallel(device="cpu", tp_size=2, cp_size=2)


@pytest.mark.slow
def test_accelerates_parallelism_flags_make_a_plain_distrib_ctx_model_parallel():
    out = run_launch("model_parallel_launch.py", nproc=4, timeout=300,
                     flags=("--use_parallelism_config", "--parallelism_config_tp_size", "2")).stdout
    assert "STRATEGY model_parallel tp 2 dp 2" in out and "TRAINED 4" in out, out


@pytest.mark.parametrize("flags, said", [
    (("--parallelism_config_tp_size", "3"), "tp_size=3 does not divide the 4 processes"),
    (("--parallelism_config_tp_size", "2", "--parallelism_config_dp_shard_size", "4"), "dp_shard_size=4 x tp_size=2 = 8"),
    (("--parallelism_config_tp_size", "2", "--parallelism_config_dp_replicate_size", "3"),
     "dp_replicate_size=3 does not divide the 2 data-parallel processes (4 / tp_size=2): pick one of [1, 2]"),
    (("--parallelism_config_tp_size", "2", "--parallelism_config_cp_size", "2"), "cp_size=2"),
])
def test_parallelism_sizes_that_do_not_fit_are_refused_before_any_worker_starts(flags, said, capsys):
    from cadence.cli import main

    assert main(["launch", "--cpu", "--num_processes", "4", "--use_parallelism_config", *flags, "train.py"]) == 2
    assert said in capsys.readouterr().err


def test_an_accelerate_config_files_parallelism_block_selects_model_parallel_with_its_sizes(tmp_path):
    from cadence.distributed.config import load_config
    from cadence.distributed.launch import launch_env

    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 4\nuse_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
                    "parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n  parallelism_config_dp_shard_size: 2\n"
                    "  parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 1\n  parallelism_config_cp_backend: torch\n")
    config = load_config(path)
    config.check_engine_options()
    env = launch_env(config)
    assert env["CADENCE_STRATEGY"] == "model_parallel" and '"parallelism_config_tp_size": 2' in env["CADENCE_PARALLELISM_CONFIG"]


@pytest.mark.slow
@pytest.mark.long
def test_an_iterable_without_length_is_agreed_over_dp_and_validates_exactly_on_a_2x2_mesh():
    out = run_launch("model_parallel_stream.py", nproc=4, timeout=300, flags=("--timeout", "60")).stdout
    assert "CHECK steps_agreed_over_dp ok" in out and "CHECK valid_loss_exact ok" in out, out


@pytest.mark.slow
def test_a_rank_hung_in_a_mesh_subgroup_collective_times_out_with_the_runs_timeout():
    import time

    start = time.monotonic()
    proc = run_launch("mesh_timeout.py", nproc=2, timeout=120, flags=("--timeout", "5"), check=False)
    assert proc.returncode != 0 and time.monotonic() - start < 60, proc.stderr[-2000:]
    assert "rank 1 stopped responding" in proc.stderr, proc.stderr[-2000:]


HEADS_SCRIPT = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM
from cadence import DataLoaders, Learner

model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=48, intermediate_size=64, num_attention_heads=3,
                                     num_key_value_heads=3, vocab_size=64, max_position_embeddings=32))
ids = torch.randint(0, 64, (8, 8))
dl = DataLoader([{"input_ids": i, "labels": i} for i in ids], batch_size=4)
learn = Learner(DataLoaders(dl, dl), model, loss_func=None)
try:
    with learn.distrib_ctx(strategy="model_parallel", tp_size=2):
        learn.fit(1)
except ValueError as e:
    print("REFUSED", e, flush=True)
'''


@pytest.mark.slow
def test_attention_heads_that_tp_size_does_not_divide_are_refused_before_training(tmp_path):
    script = tmp_path / "heads.py"
    script.write_text(HEADS_SCRIPT)
    out = run_launch(script, nproc=2, timeout=180).stdout
    assert out.count("REFUSED tp_size=2 does not divide the model's num_attention_heads=3") == 2, out
    assert "pick tp_size among [1, 3]" in out and "train_loss" not in out


EXPORT_IN_BLOCK = '''
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM
from cadence import DataLoaders, Learner

ids = torch.randint(0, 128, (16, 8), generator=torch.Generator().manual_seed(1))
items = [{"input_ids": r, "labels": r} for r in ids]
model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=4, vocab_size=128, max_position_embeddings=64))
learn = Learner(DataLoaders(DataLoader(items, batch_size=8), DataLoader(items, batch_size=8)), model, loss_func=None)
try:
    with learn.distrib_ctx(strategy="model_parallel", tp_size=2):
        learn.fit(1)
        learn.export("in_block")
except Exception as e:
    print("RAISED", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
'''


@pytest.mark.slow
def test_an_export_that_fails_on_the_main_process_fails_on_every_process_instead_of_hanging(tmp_path):
    """A tensor-parallel model's slicing hooks cannot be pickled: export inside the block fails on rank 0; rank 1
    raises too (it waited in a barrier while rank 0 went on into the block's exit, a collective, and the run hung)."""
    script = tmp_path / "export_in_block.py"
    script.write_text(EXPORT_IN_BLOCK)
    out = run_launch(script, nproc=2, timeout=180, cwd=tmp_path).stdout
    raised = sorted(line for line in out.splitlines() if line.startswith("RAISED"))
    assert len(raised) == 2, out
    assert raised[0].startswith("RAISED RuntimeError export failed on the main process (TypeError: export could not "
                                "pickle the model"), raised
    assert raised[1].startswith("RAISED TypeError export could not pickle the model"), raised
    assert not (tmp_path / "in_block").exists()
