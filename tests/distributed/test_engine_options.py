"""Options meant for another engine are refused, naming them (before: `cadence launch --tpu --use_deepspeed` trained
with XLA and ignored DeepSpeed; `distrib_ctx(strategy="xla", zero_stage=2)` said only "unexpected keyword argument")."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from cadence import DataLoaders, Learner
from cadence.cli import build_parser
from cadence.distributed.launch_flags import resolve_config
from cadence.distributed.registry import get_strategy

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags, said", [
    (["--tpu", "--use_deepspeed"], r"--tpu \(XLA\) and --use_deepspeed \(DeepSpeed\) each choose the engine"),
    (["--tpu", "--zero_stage", "2"], r"--tpu \(XLA\) and --zero_stage \(DeepSpeed\)"),
    (["--tpu", "--use_fsdp"], r"--tpu \(XLA\) and --use_fsdp \(FSDP\).*strategy='xla', spmd=True, fsdp=True"),
    (["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--use_deepspeed"],
     r"--use_fsdp --fsdp_sharding_strategy \(FSDP\) and --use_deepspeed \(DeepSpeed\).*keep one engine's flags$"),
])
def test_flags_of_two_engines_are_refused_naming_both(flags, said):
    args = build_parser().parse_args(["launch", *flags, "--num_processes", "1", "train.py"])
    with pytest.raises(ValueError, match=said):
        resolve_config(args)


@pytest.mark.parametrize("flags, engine", [(["--tpu"], "XLA"), (["--use_deepspeed", "--zero_stage", "2"], "DEEPSPEED"),
                                           (["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD"], "FSDP")])
def test_one_engines_flags_still_choose_it(flags, engine):
    args = build_parser().parse_args(["launch", *flags, "--num_processes", "1", "train.py"])
    assert resolve_config(args).distributed_type == engine


def test_launch_tpu_with_use_deepspeed_exits_before_any_worker_starts(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = subprocess.run([sys.executable, "-m", "cadence.cli", "launch", "--tpu", "--use_deepspeed", "--num_processes",
                           "1", str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 2, proc.stderr
    assert "--tpu (XLA) and --use_deepspeed (DeepSpeed)" in proc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("name, options, said", [
    ("xla", {"zero_stage": 2}, r"strategy 'xla' \(XLA\) does not take zero_stage: it takes device, spmd, fsdp, "
                               r"mesh_shape, axis_names; zero_stage is an option of strategy 'deepspeed'; DeepSpeed "
                               r"options do not apply to strategy 'xla'"),
    ("dp", {"tp_size": 2, "nonsense": 1}, r"strategy 'dp' \(DataParallel\) does not take tp_size, nonsense: it takes "
                                          r"device, device_ids; tp_size is an option of strategy 'model_parallel'"),
])
def test_an_option_a_strategy_does_not_take_is_named_with_what_it_takes_and_who_does(name, options, said):
    with pytest.raises(TypeError, match=said):
        get_strategy(name, **options)


def test_distrib_ctx_xla_with_zero_stage_says_deepspeed_options_do_not_apply():
    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    learn = Learner(DataLoaders.from_dsets(ds, ds, bs=4), torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss())
    with pytest.raises(TypeError, match="DeepSpeed options do not apply to strategy 'xla'"):
        with learn.distrib_ctx(strategy="xla", zero_stage=2):
            learn.fit(1)
