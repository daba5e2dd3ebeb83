"""Pipeline parallelism (and PP x FSDP2) through the Learner, on gloo CPU processes launched by our CLI."""

import pytest
import torch
from torch import nn

from helpers import run_launch

CHECKS = ("eval_leaves_pending_gradients", "losses_and_norms", "weights_equal_reference", "valid_and_get_preds")


def assert_checks(out: str, variants: tuple[str, ...]) -> None:
    for variant in variants:
        for check in CHECKS:
            assert f"CHECK {variant}:{check} ok" in out, out


@pytest.mark.slow
def test_gpipe_1f1b_interleaved_and_v_shaped_schedules_on_two_processes_equal_one_process_and_save_load(tmp_path):
    # 1F1B/3: 3 micro-batches of a batch of 8 (the last padded); +split: a user's split function naming the layers
    # its own way (two stages per rank); ZBVZeroBubble: the last stage on rank 0; +bf16: learn.to_bf16()
    variants = ("GPipe/4", "1F1B/3", "Interleaved1F1B/4+split", "ZBVZeroBubble/4", "1F1B/4+bf16")
    out = run_launch("pipeline.py", "0.2", *variants, f"save_load={tmp_path}", nproc=2, timeout=400).stdout
    assert_checks(out, variants)
    assert "CHECK grad_accum:refused ok" in out, out
    # learn.save / learn.load with the optimizer inside the block: the files hold a one-process loop's weights and
    # momentum and load in one process; loading them (or the loop's own files) in the pipeline trains on like the loop
    assert "CHECK save_load:equals_one_process ok" in out, out


@pytest.mark.slow
def test_pipeline_inside_fsdp2_also_in_bf16_and_with_tp_inside_stages_on_4_processes_equals_one_process_with_the_global_batch(tmp_path):
    variants = ("1F1B/4", "Interleaved1F1B/4", "1F1B/4+tp", "1F1B/4+bf16")   # pp x dp x tp: 2x2x1, 2x2x1, 2x1x2, 2x2x1
    out = run_launch("pipeline.py", "0.2", *variants, f"save_load+split={tmp_path}", nproc=4, timeout=400).stdout
    assert_checks(out, variants)
    assert "CHECK save_load+split:equals_one_process ok" in out, out       # stages named their own way, FSDP2 over dp


@pytest.mark.slow
@pytest.mark.long
def test_pipeline_with_hsdp_stages_on_8_processes_equals_one_process_with_the_global_batch():
    """pp 2 x (dp_replicate 2 x dp_shard 2): each stage sharded within a group, replicated across the two."""
    variants = ("1F1B/4+hsdp",)
    assert_checks(run_launch("pipeline.py", "0.05", *variants, nproc=8, timeout=600).stdout, variants)


@pytest.mark.slow
def test_the_last_stages_output_reaches_every_rank_in_one_broadcast_once_its_layout_is_known_and_when_it_changes():
    assert "OUTPUTS OK" in run_launch("pipeline_outputs.py", nproc=2, timeout=120).stdout


def _sequential(tie_across: bool) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[4 if tie_across else 2].weight = model[0].weight
    return model


def _pipeline(**options):
    from cadence.distributed.registry import get_strategy

    return get_strategy("model_parallel", device="cpu", pp_size=2, **options)


def test_weights_tied_across_stages_are_refused_and_a_tie_inside_a_stage_is_kept():
    with pytest.raises(ValueError, match=r"'0.weight' of stage 0 is tied to '4.weight' of stage 1.*untie"):
        _pipeline(pp_split_points=["3"])._cut(_sequential(tie_across=True))
    stages = _pipeline(pp_split_points=["3"])._cut(_sequential(tie_across=False))
    assert stages[0][2].weight is stages[0][0].weight


def test_sizes_schedules_and_split_points_that_do_not_fit_are_refused_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"pp_size=2 x tp_size=1 = 2 does not divide the 3 processes.*\[1, 3\]"):
        _pipeline(pp_split_points=["3"])._mesh_shape_for(3)
    with pytest.raises(ValueError, match=r"pp_size=2 x dp_shard_size=3 x tp_size=1 = 6, not the 4 processes"):
        _pipeline(pp_split_points=["3"], dp_shard_size=3)._mesh_shape_for(4)
    with pytest.raises(ValueError, match=r"'1F1B' runs one per rank, but 3 stages on pp_size=2"):
        _pipeline(pp_schedule="1F1B", pp_split_points=["2", "3"])
    with pytest.raises(ValueError, match=r"'Interleaved1F1B' runs several per rank, but 2 stages"):
        _pipeline(pp_schedule="Interleaved1F1B", pp_split_points=["3"])
    with pytest.raises(ValueError, match=r"pp_schedule='Zigzag'"):
        _pipeline(pp_schedule="Zigzag", pp_split_points=["3"])
    with pytest.raises(ValueError, match=r"pp_split_points \['7'\] are not children of the model"):
        _pipeline(pp_split_points=["7"])._cut(_sequential(tie_across=False))
    with pytest.raises(ValueError, match=r"tp_size=2 with pp_size=2: pass parallelize=fn\(stage_module, tp_mesh\)"):
        _pipeline(pp_split_points=["3"], tp_size=2).setup(_sequential(tie_across=False), torch.optim.SGD)
    with pytest.raises(ValueError, match="needs where to cut the model"):
        _pipeline()._cut(_sequential(tie_across=False))


def test_fp16_under_a_pipeline_is_refused_with_bf16_named():
    from torch.utils.data import DataLoader, TensorDataset

    from cadence import DataLoaders, Learner

    dls = DataLoaders(DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=4), device="cpu")
    learn = Learner(dls, _sequential(tie_across=False), loss_func=nn.functional.mse_loss).to_fp16()
    with pytest.raises(ValueError, match=r"fp16 under pipeline parallelism.*use bf16"):
        with learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_split_points=["3"]):
            pass


def test_pipeline_on_one_process_trains_the_plain_model_like_a_plain_loop():
    from torch.utils.data import DataLoader, TensorDataset

    from cadence import DataLoaders, Learner

    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=8), device="cpu")
    learn = Learner(dls, _sequential(tie_across=False), loss_func=nn.functional.mse_loss, opt_func=torch.optim.SGD, lr=0.1)
    ref = _sequential(tie_across=False)
    ref.load_state_dict(learn.model.state_dict())
    with learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_split_points=["3"]):
        learn.fit(1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xb, yb in ((x[:8], y[:8]), (x[8:], y[8:])):
        nn.functional.mse_loss(ref(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), learn.model.parameters()):
        torch.testing.assert_close(a, b)


def _weights_lines(out: str) -> dict[int, float]:
    return {int(step): float(total) for step, total in
            (line.split()[1:] for line in out.splitlines() if line.startswith("WEIGHTS "))}


@pytest.mark.slow
@pytest.mark.long
def test_a_2x2_pipeline_killed_mid_training_resumes_bitwise_on_2x2_exactly_on_1x2_and_loads_in_one_process(tmp_path):
    """pp=2 x dp=2, cut by a `split` function naming the layers its own way: the checkpoint is keyed by the model's
    names, so it resumes without a pipeline (pp=1 x dp=2, the same global batches) and in one process."""
    import shutil
    import subprocess
    import sys

    from helpers import SCRIPTS, cadence_env

    def launch(nproc, ckpt, out, *extra, check=True):
        return run_launch("pipeline_resume.py", "--ckpt", tmp_path / ckpt, "--out", tmp_path / out, *extra,
                          nproc=nproc, timeout=300, check=check)

    launch(4, "ref", "ref.pt")
    killed = launch(4, "run", "run.pt", "--kill-at", "5", check=False)
    assert killed.returncode != 0 and (tmp_path / "run" / "latest").exists(), killed.stderr[-2000:]
    saved = _weights_lines(killed.stdout)[4]          # the weights of the step-4 checkpoint, as the pipeline saw them
    shutil.copytree(tmp_path / "run", tmp_path / "on1x2")
    shutil.copytree(tmp_path / "run", tmp_path / "on1")

    resumed = launch(4, "run", "run.pt")               # the same command continues the run
    ref, run = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert ref.keys() == run.keys() and all(torch.equal(ref[k], run[k]) for k in ref), "the resume is not bitwise"
    assert "STEPS 6" in resumed.stdout

    on_1x2 = launch(2, "on1x2", "on1x2.pt", "--pp", "1")                       # no pipeline, FSDP2 over dp=2
    assert _weights_lines(on_1x2.stdout)[4] == saved and "STEPS 6" in on_1x2.stdout, on_1x2.stdout
    final = torch.load(tmp_path / "on1x2.pt")
    for k in ref:                                                               # and trains on like the pipeline
        torch.testing.assert_close(final[k], ref[k], rtol=1e-5, atol=1e-6)

    one = subprocess.run([sys.executable, str(SCRIPTS / "pipeline_resume.py"), "--ckpt", str(tmp_path / "on1"),
                          "--out", str(tmp_path / "on1.pt")], capture_output=True, text=True, timeout=300,
                         env=cadence_env(PYTHONPATH=str(SCRIPTS)))
    assert one.returncode == 0, one.stderr[-3000:]
    assert _weights_lines(one.stdout)[4] == saved, (saved, one.stdout)        # loaded exactly


@pytest.mark.slow
def test_cadences_pp_flags_make_a_plain_distrib_ctx_a_pipeline_inside_fsdp():
    out = run_launch("pipeline_launch.py", nproc=4, timeout=300,
                     flags=("--parallelism_config_pp_size", "2", "--parallelism_config_pp_schedule", "GPipe",
                            "--parallelism_config_pp_microbatches", "2")).stdout
    assert "STRATEGY model_parallel pp 2 ScheduleGPipe 2 dp 2" in out and "TRAINED 2" in out, out


@pytest.mark.parametrize("flags, said", [
    (("--parallelism_config_pp_size", "3"), "pp_size=3 x tp_size=1 = 3 does not divide the 4 processes: pp x dp x tp"),
    (("--parallelism_config_pp_size", "2", "--parallelism_config_tp_size", "4"), "pp_size=2 x tp_size=4 = 8 does not"),
    (("--parallelism_config_pp_size", "2", "--parallelism_config_dp_shard_size", "4"),
     "pp_size=2 x dp_shard_size=4 x tp_size=1 = 8"),
    (("--parallelism_config_pp_size", "2", "--parallelism_config_pp_schedule", "Zigzag"), "pp_schedule='Zigzag'"),
])
def test_pp_sizes_that_do_not_fit_are_refused_before_any_worker_starts(flags, said, capsys):
    from cadence.cli import main

    assert main(["launch", "--cpu", "--num_processes", "4", "--use_parallelism_config", *flags, "train.py"]) == 2
    assert said in capsys.readouterr().err


def test_a_config_files_parallelism_block_carries_the_pp_keys_to_the_workers(tmp_path):
    from cadence.distributed.config import load_config
    from cadence.distributed.launch import launch_env

    path = tmp_path / "config.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 4\nuse_cpu: true\nparallelism_config:\n"
                    "  parallelism_config_pp_size: 2\n  parallelism_config_pp_schedule: 1F1B\n"
                    "  parallelism_config_pp_microbatches: 4\n")
    config = load_config(path)
    config.check_engine_options()
    env = launch_env(config)
    assert env["CADENCE_STRATEGY"] == "model_parallel"
    assert '"parallelism_config_pp_size": 2' in env["CADENCE_PARALLELISM_CONFIG"]
    path.write_text(path.read_text().replace("pp_size: 2", "pp_size: 3"))
    with pytest.raises(ValueError, match="pp_size=3 x tp_size=1 = 3 does not divide the 4 processes"):
        load_config(path).check_engine_options()


def test_an_optimizer_state_that_does_not_fit_the_whole_model_is_refused_naming_what_to_do():
    from cadence.distributed.pipeline_state import merged_optimizer_state
    from cadence.distributed.strategy import named_by_position

    model = _sequential(tie_across=False)
    saved = torch.optim.SGD(model[0].parameters(), lr=0.1).state_dict()   # 2 parameters; the model has 5 (a tie)
    with pytest.raises(ValueError, match=r"groups of \[2\] parameters, this model's optimizer \[5\].*with_opt=False"):
        named_by_position(saved, torch.optim.SGD(model.parameters(), lr=0.1), model)
    parts = [{"state": {}, "param_groups": [{"params": ["0.weight"]}]},
             {"state": {}, "param_groups": [{"params": ["4.weight"]}, {"params": ["4.bias"]}]}]
    with pytest.raises(ValueError, match=r"ranks have \[1, 2\] optimizer parameter groups.*with_opt=False"):
        merged_optimizer_state(parts, model)


def test_zero_or_non_integer_micro_batches_are_refused_naming_the_value():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"pp_microbatches={bad!r}: a whole number >= 1"):
            _pipeline(pp_split_points=["3"], pp_microbatches=bad)


PADDING_SCRIPT = '''
import warnings
import torch
from torch import nn
from torch.utils.data import TensorDataset
from cadence import DataLoaders, Learner

torch.manual_seed(0)
ds = TensorDataset(torch.randn(16, 4), torch.randn(16, 4))
learn = Learner(DataLoaders.from_dsets(ds, ds, bs=4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                loss_func=nn.MSELoss())
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    with learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_split_points=["1"], pp_microbatches=8):
        learn.fit(1)
print("WARNED", [str(w.message) for w in seen if "pp_microbatches" in str(w.message)], flush=True)
'''


@pytest.mark.slow
def test_more_micro_batches_than_rows_is_warned_once_with_the_padding_counted(tmp_path):
    script = tmp_path / "padding.py"
    script.write_text(PADDING_SCRIPT)
    out = run_launch(script, nproc=2, timeout=180).stdout
    warned = [line for line in out.splitlines() if line.startswith("WARNED")]
    assert len(warned) == 2 and all(line.count("pp_microbatches=8 with a batch of 4 rows: 4 of the 8 micro-batches "
                                               "are padding") == 1 for line in warned), out
