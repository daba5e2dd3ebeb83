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
    assert "downcast_bf16" not in raw and "fp16" not in raw and raw["timeout"] == 600.0
    assert raw["main_training_function"] == "main"         # kept: XLA launches call it, as Accelerate's TPU launcher
    assert load_config(path) == Config(num_processes=2, use_cpu=True, distributed_type="MULTI_CPU",
                                       main_training_function="main")


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


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_timeout_that_is_not_a_finite_number_is_refused_before_launching(value, tmp_path, capsys):
    """`--timeout inf` / a config's `timeout: .nan` used to start the workers, which then failed converting it."""
    assert main(["launch", "--cpu", "--num_processes", "2", "--timeout", value, str(SCRIPTS / "print_argv.py")]) == 2
    assert f"timeout must be a finite number, got {value}" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text(f"num_processes: 2\ntimeout: .{value}\n")
    assert main(["launch", "--cpu", "--config_file", str(config), str(SCRIPTS / "print_argv.py")]) == 2
    assert f"timeout must be a finite number, got {value}" in capsys.readouterr().err


@pytest.mark.slow
def test_cadence_test_passes_on_two_cpu_processes():
    proc = run_cli("test", "--cpu", "--num_processes", "2", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in ("passed rendezvous", "passed all-reduce", "passed DDP steps", "all checks passed"):
        assert check in proc.stdout


def unknown_flag_error(flag: str, capsys) -> str:
    """Run `cadence launch <flag> 1 train.py`; return the one-line error (the launch must stop before starting)."""
    with pytest.raises(SystemExit) as info:
        main(["launch", "--cpu", flag, "1", str(SCRIPTS / "print_argv.py")])
    assert info.value.code == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("flag, meant", [
    ("--num_gpus", "did you mean --num_processes?"), ("--num_nodes", "did you mean --num_machines?"),
    ("--hostfile", "run the same command on each machine with --num_machines"), ("--include", "did you mean --gpu_ids?"),
    ("--exclude", "did you mean --gpu_ids?"), ("--master_addr", "did you mean --main_process_ip?"),
    ("--master_port", "did you mean --main_process_port?"), ("--autotuning", "does not run DeepSpeed's autotuner"),
    ("--nproc_per_node", "did you mean --num_processes?"), ("--num-gpus", "did you mean --num_processes?"),
])
def test_deepspeed_and_torchrun_habits_get_the_flag_they_mean(flag, meant, capsys):
    # difflib alone answered --num_gpus with --multi_gpu and --hostfile with --config_file
    err = unknown_flag_error(flag, capsys)
    assert f"unknown flag {flag}: " in err and meant in err, err
    assert "--multi_gpu" not in err and "--config_file" not in err


ACCELERATE_FLAGS_WITH_VALUES = {"--config_file", "--mixed_precision", "--num_processes", "--num_machines",
                                "--num_cpu_threads_per_process", "--dynamo_backend", "--dynamo_mode", "--gpu_ids",
                                "--machine_rank", "--main_process_ip", "--main_process_port", "--log_dir", "--tee",
                                "--role", "--rdzv_backend", "--rdzv_conf", "--max_restarts", "--monitor_interval",
                                "--main_training_function", "--gradient_accumulation_steps", "--zero_stage"}


def test_every_accelerate_launch_flag_is_taken_or_refused_with_a_reason():
    # Accelerate's own parser lists its flags (accelerate is installed for comparison, never imported by cadence)
    launch = pytest.importorskip("accelerate.commands.launch")
    from cadence.cli import build_parser
    from cadence.distributed.other_launchers import advice

    theirs = {o for a in launch.launch_command_parser()._actions for o in a.option_strings if o.startswith("--")}
    sub = build_parser()._subparsers._group_actions[0].choices["launch"]
    ours = set(sub._option_string_actions)
    neither = sorted(f for f in theirs if f not in ours and advice(f) is None)
    assert not neither, f"accelerate launch flags cadence launch neither takes nor explains: {neither}"
    assert len(theirs) > 150 and "--use_megatron_lm" not in ours


@pytest.mark.parametrize("flag", ["--use_megatron_lm", "--megatron_lm_tp_degree"])
def test_megatron_points_to_the_model_parallel_strategy(flag, capsys):
    err = unknown_flag_error(flag, capsys)
    assert "not supported" in err and 'strategy="model_parallel"' in err, err


@pytest.mark.parametrize("flag, said", [("--parallelism_config_sp_size", "SequenceParallel"),
                                        ("--parallelism_config_cp_backend", "context parallelism")])
def test_parallelism_flags_cadence_cannot_honour_say_why(flag, said, capsys):
    err = unknown_flag_error(flag, capsys)
    assert "not supported" in err and said in err, err


def test_accelerate_launch_habits_are_honoured(monkeypatch, capsys):
    from cadence.distributed import launch as launch_mod

    seen = {}

    def run(args):           # stands in for launch(): the config, the workers' variables and torchrun's arguments
        config = launch_mod.resolve_config(args)
        seen.update(env=launch_mod.launch_env(config), agent=launch_mod.torchrun_args(config, args), config=config)
        return 0

    monkeypatch.setattr(launch_mod, "launch", run)
    assert main(["launch", "--use_cpu", "--num-processes", "2", "--num_cpu_threads_per_process", "3", "--same-network",
                 "-q", "--debug", "--mixed_precision", "bf16", "--dynamo_backend", "no", "--log_dir", "/tmp/logs",
                 "--tee", "3", "--role", "trainer", "--main_training_function", "train", "-m", "pkg.train", "--x"]) == 0
    env, agent, config = seen["env"], seen["agent"], seen["config"]
    assert config.use_cpu and config.debug and config.mixed_precision == "bf16" and env["OMP_NUM_THREADS"] == "3"
    assert (agent.log_dir, agent.tee, agent.role) == ("/tmp/logs", "3", "trainer")
    assert agent.training_script_args[-3:] == ["-m", "pkg.train", "--x"]
    assert "--main_training_function train is for Accelerate's TPU launcher" in capsys.readouterr().err
    assert main(["launch", "--num_processes", "2", "--gpu_ids", "1,3", "x.py"]) == 0
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "1,3"


@pytest.mark.parametrize("flags, words", [
    (["--num_processes", "2", "--gpu_ids", "0"], ["gpu_ids 0 lists 1 GPU(s) for 2 processes"]),
    (["--gpu_ids", "cuda:0"], ["gpu_ids must be all or comma-separated GPU ids"]),
    (["--use_fsdp", "--fsdp_version", "1"], ["--fsdp_version 1", "FSDP2"]),
])
def test_accelerate_flags_cadence_cannot_honour_are_refused_before_launching(flags, words, capsys):
    assert main(["launch", *flags, str(SCRIPTS / "print_argv.py")]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_accelerate_config_default_and_env_spellings_work(tmp_path, capsys):
    # `accelerate config default --mixed_precision bf16` and `accelerate env --config-file F`, with cadence's name
    path = tmp_path / "default.yaml"
    assert main(["config", "default", "--config-file", str(path), "--mixed-precision", "bf16"]) == 0
    assert load_config(path).mixed_precision == "bf16"
    assert main(["env", "--config-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"Config: {path}" in out and "mixed_precision: bf16" in out
