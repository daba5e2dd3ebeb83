"""strategy="xla" in an environment without torch_xla (the main one): refused before any work, saying how to install."""

import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from cadence.distributed.launch_xla import installed_torchrun_options
from cadence.distributed.registry import get_strategy
from cadence.trainer.data import DataLoaders
from cadence.trainer.learner import Learner


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_xla_without_torch_xla_says_how_to_install():
    ds = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    learn = Learner(DataLoaders(DataLoader(ds, batch_size=4)), torch.nn.Linear(2, 1), loss_func=torch.nn.MSELoss())
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ImportError, match=r'strategy "xla" needs torch_xla.*pip install "cadence\[xla\]".*make setup-xla'):
        with learn.distrib_ctx(strategy="xla"):
            learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())  # nothing trained
    assert learn.strategy.name == "single"
    with pytest.raises(ImportError, match="torch_xla"):
        get_strategy("xla")


def test_cadence_env_reports_no_xla_runtime_here():
    from cadence.distributed.environment_report import environment_report

    assert "XLA runtime: none (torch_xla not installed)" in environment_report()


def test_launch_tpu_selects_the_xla_strategy_and_passes_torchrun_only_options_it_has(monkeypatch):
    import argparse

    from cadence.cli import build_parser
    from cadence.distributed import launch as launch_mod

    sub = build_parser()._subparsers._group_actions[0].choices["launch"]
    args = sub.parse_args(["--tpu", "--num_processes", "1", "--main_training_function", "main", "train.py", "--lr", "1"])
    monkeypatch.setenv("CADENCE_CONFIG_FILE", "/nonexistent/config.yaml")
    config = launch_mod.resolve_config(args)
    assert config.distributed_type == "XLA" and launch_mod.launch_env(config)["CADENCE_STRATEGY"] == "xla"
    agent = launch_mod.torchrun_args(config, args)  # the worker imports train.py and calls main()
    assert agent.training_script_args[-5:] == ["cadence.distributed.xla_main", "train.py", "main", "--lr", "1"]
    assert agent.signals_to_handle  # this torch (2.13) has the option: passed
    # an option the installed torchrun lacks (torch 2.9's has no --signals_to_handle) is left out, not passed:
    # a parser that knows only --nnodes stands in for an older torch's
    from torch.distributed import run as torchrun
    older = argparse.ArgumentParser()
    older.add_argument("--nnodes")
    monkeypatch.setattr(torchrun, "get_args_parser", lambda: older)
    assert installed_torchrun_options(["--nnodes", "1", "--signals_to_handle", "SIGTERM"]) == ["--nnodes", "1"]


def test_a_main_training_function_the_script_lacks_is_refused_before_launching(tmp_path, capsys):
    from cadence.cli import main

    script = tmp_path / "train.py"
    script.write_text("def train():\n    pass\n")
    assert main(["launch", "--tpu", "--main_training_function", "main", str(script)]) == 2
    assert f"--main_training_function main: {script} defines no function 'main'" in capsys.readouterr().err
