"""The `cadence` command: --version, env, config (non-terminal, default, update, asking), test."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import cadence
from cadence.cli import main
from cadence.distributed.config import Config, default_config_path, load_config
from tests.helpers import REPO, SCRIPTS, cadence_env

CADENCE = Path(sys.executable).with_name("cadence")


def run_cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run the installed `cadence` script (stdin not a terminal) and return the finished process."""
    return subprocess.run([str(CADENCE), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          stdin=subprocess.DEVNULL, env=cadence_env(**env))


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"cadence {cadence.__version__}"


def test_config_from_a_non_terminal_with_flags(tmp_path):
    path = tmp_path / "cfg.yaml"
    proc = run_cli("config", "--num_processes", "2", "--use_cpu", "--mixed_precision", "bf16", CADENCE_CONFIG_FILE=str(path))
    assert proc.returncode == 0, proc.stderr
    assert str(path) in proc.stdout
    assert load_config(path) == Config(num_processes=2, use_cpu=True, mixed_precision="bf16", distributed_type="MULTI_CPU")


def test_env_shows_versions_and_the_config(capsys):
    assert main(["config", "default", "--mixed_precision", "fp16"]) == 0
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    import torch

    for expected in (f"cadence {cadence.__version__}", f"torch {torch.__version__}", "numpy ", "Python ", "deepspeed ",
                     "torch_xla not installed", "CPUs: ", "Accelerators: ", "mixed_precision: fp16"):
        assert expected in out
    assert f"Config: {default_config_path()}" in out


def test_config_update_rewrites_an_accelerate_file(tmp_path, capsys):
    path = tmp_path / "acc.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\ndowncast_bf16: 'no'\n"
                    "main_training_function: main\nmixed_precision: 'no'\nnum_processes: 2\nuse_cpu: true\nfp16: false\n")
    assert main(["config", "update", "--config_file", str(path)]) == 0
    raw = yaml.safe_load(path.read_text())
    assert "main_training_function" not in raw and "fp16" not in raw and raw["timeout"] == 600.0
    assert load_config(path) == Config(num_processes=2, use_cpu=True, distributed_type="MULTI_CPU")


def test_config_asks_in_a_terminal(tmp_path, monkeypatch, capsys):
    answers = iter(["no", "1", "4", "", "8", ""])
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    path = tmp_path / "asked.yaml"
    assert main(["config", "--config_file", str(path), "--mixed_precision", "bf16"]) == 0
    cfg = load_config(path)
    assert (cfg.num_processes, cfg.gradient_accumulation_steps, cfg.mixed_precision) == (4, 8, "bf16")


def test_bad_flag_value_names_the_problem(capsys):
    assert main(["config", "default", "--num_processes", "0"]) == 2
    assert "num_processes must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "65536"])
def test_a_port_out_of_range_is_refused_before_the_port_check(port, capsys):
    # the port-in-use check used to run first and end in a raw OverflowError
    assert main(["launch", "--cpu", "--main_process_port", port, str(SCRIPTS / "print_argv.py")]) == 2
    err = capsys.readouterr().err
    assert f"main_process_port must be <= 65535, got {port}" in err and "Overflow" not in err


@pytest.mark.slow
def test_cadence_test_passes_on_two_cpu_processes():
    proc = run_cli("test", "--cpu", "--num_processes", "2", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in ("passed rendezvous", "passed all-reduce", "passed DDP steps", "all checks passed"):
        assert check in proc.stdout
