"""`cadence launch` end to end: 2 CPU processes over gloo, settings from flags and config, failures."""

import json
import os
import time

import pytest
import yaml

from tests.helpers import SCRIPTS, run_launch

ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def launched(config_file, *flags) -> dict:
    """Run tests/scripts/launch_env.py with `config_file`; return what rank 0 saw."""
    proc = run_launch("launch_env.py", flags=("--config_file", str(config_file), *flags))
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture
def default_config(tmp_path):
    from cadence.cli import main

    path = tmp_path / "cadence.yaml"
    assert main(["config", "default", "--config_file", str(path), "--num_processes", "2", "--use_cpu",
                 "--mixed_precision", "bf16", "--gradient_accumulation_steps", "4", "--timeout", "77"]) == 0
    return path


@pytest.mark.slow
def test_cadence_and_accelerate_configs_launch_the_same_run(tmp_path, default_config):
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text(ACCELERATE_YAML + "gradient_accumulation_steps: 4\ntimeout: 77\n")
    ours, theirs = launched(default_config), launched(accelerate)
    assert ours == theirs
    assert ours["ranks"] == [["0", "0"], ["1", "1"]] and ours["sum"] == 1.0
    env = ours["env"]
    assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
    assert (env["CADENCE_MIXED_PRECISION"], env["CADENCE_GRADIENT_ACCUMULATION_STEPS"], env["CADENCE_TIMEOUT"]) == ("bf16", "4", "77.0")
    assert (env["CADENCE_USE_CPU"], env["CADENCE_STRATEGY"]) == ("1", "ddp")


@pytest.mark.slow
def test_flags_override_the_config(default_config):
    env = launched(default_config, "--mixed_precision", "fp16", "--timeout", "33", "--num_cpu_threads_per_process", "1")["env"]
    assert env["CADENCE_MIXED_PRECISION"] == "fp16" and env["CADENCE_TIMEOUT"] == "33.0"
    assert env["CADENCE_GRADIENT_ACCUMULATION_STEPS"] == "4"          # not overridden: from the config
    assert env["OMP_NUM_THREADS"] == "1"


def test_misspelled_key_fails_before_launching(tmp_path, capsys):
    from cadence.cli import main

    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({"num_procesess": 2, "use_cpu": True}))
    assert main(["launch", "--config_file", str(path), str(SCRIPTS / "launch_env.py")]) == 2
    out, err = capsys.readouterr()
    assert "RESULT" not in out
    assert "'num_procesess'" in err and "did you mean 'num_processes'" in err and str(path) in err


@pytest.mark.slow
def test_a_failing_rank_ends_the_run_with_its_traceback_once():
    proc = run_launch("launch_raise.py", check=False, timeout=120)
    elapsed = time.time() - float(proc.stdout.split("RAISING AT ")[1].split()[0])
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 30, f"the run took {elapsed:.0f}s to end after rank 1 raised"
    assert output.count("ValueError: launch_raise failed on purpose at step 2") == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "cadence launch: rank 1 failed" in proc.stderr and 'launch_raise.py", line ' in proc.stderr and ', in step' in proc.stderr


def parsed(*argv: str):
    import argparse

    from cadence.distributed.launch import add_launch_args, resolve_config

    parser = argparse.ArgumentParser()
    add_launch_args(parser)
    args = parser.parse_args(argv)
    return resolve_config(args), args


def test_multi_machine_arguments_reach_torchrun():
    from cadence.distributed.launch import torchrun_args

    config, args = parsed("--num_machines", "2", "--num_processes", "8", "--machine_rank", "1", "--main_process_ip",
                          "10.0.0.1", "--rdzv_backend", "c10d", "--max_restarts", "2", "train.py", "--lr", "1")
    agent = torchrun_args(config, args)
    assert (agent.nnodes, agent.nproc_per_node, agent.node_rank) == ("2", "4", 1)
    assert (agent.master_port, agent.rdzv_endpoint, agent.max_restarts) == (29500, "10.0.0.1:29500", 2)
    assert agent.training_script_args[-3:] == ["train.py", "--lr", "1"]


def test_launch_env_threads_strategy_and_bad_combinations(monkeypatch):
    from cadence.distributed.launch import launch_env, torchrun_args

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = launch_env(parsed("--cpu", "--num_processes", "2", "--debug", "x.py")[0])
    assert env["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2)) and env["CADENCE_DEBUG"] == "1"
    assert launch_env(parsed("x.py")[0])["CADENCE_STRATEGY"] is None
    with pytest.raises(ValueError, match="main_process_ip"):
        torchrun_args(*parsed("--num_machines", "2", "--num_processes", "2", "x.py"))
    with pytest.raises(ValueError, match="--no_python and --module"):
        torchrun_args(*parsed("--no_python", "-m", "x"))


def test_the_rank_that_raised_is_reported_before_a_rank_the_agent_stopped(tmp_path, capsys):
    # torch's record of a rank killed by the agent has whole-second time, which can sort before the real error's
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from cadence.distributed.launch import report_failure

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "ValueError: fp16 is not supported", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\nValueError: fp16 is not supported\n",
        "timestamp": str(int(time.time())), "time_ns": time.time_ns() + 10**8, "peer_failure": False}}}))
    stopped = ProcessFailure(local_rank=1, pid=2, exitcode=-15, error_file=str(tmp_path / "none.json"))
    raised = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert report_failure({1: stopped, 0: raised}) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "cadence launch: rank 0 failed:" and "ValueError: fp16 is not supported" in lines
    assert lines[-1] == "cadence launch: rank 1 also stopped: killed by SIGTERM"


# what a script's own parser takes: torch's parser abbreviates (--max -> --max-restarts), argparse drops a first `--`
SCRIPT_ARGS = [["--max", "3"], ["--n", "2"], ["--log", "x.log"], ["--node", "1"], ["--m", "5"], ["--no"], ["--max=3"],
               ["-m", "pkg"], ["--nproc_per_node", "4"], ["--num_processes", "3"], ["--", "--lr", "1"], ["--"], []]


@pytest.mark.parametrize("script_args", SCRIPT_ARGS, ids=lambda a: " ".join(a) or "none")
def test_everything_after_the_script_reaches_it_untouched(script_args, monkeypatch):
    from cadence import cli
    from cadence.distributed import launch as launch_mod

    seen = {}

    def run(args):           # stands in for launch(): what torchrun would get, without starting processes
        agent = launch_mod.torchrun_args(launch_mod.resolve_config(args), args)
        seen.update(training_script=args.training_script, worker=agent.training_script_args)
        return 0

    monkeypatch.setattr(launch_mod, "launch", run)
    assert cli.main(["launch", "--cpu", "--num_processes", "2", "train.py", *script_args]) == 0
    assert seen["training_script"] == "train.py"
    assert seen["worker"][-len(script_args) - 1:] == ["train.py", *script_args]


@pytest.mark.slow
def test_script_arguments_arrive_exactly_through_a_launch(tmp_path):
    script_args = [a for spelling in SCRIPT_ARGS[:-3] for a in spelling] + ["--", "--lr", "1"]
    proc = run_launch("print_argv.py", *script_args, timeout=120)
    seen = [json.loads(l.split(" ", 2)[2]) for l in proc.stdout.splitlines() if l.startswith("ARGV ")]
    assert len(seen) == 2 and all(argv == script_args for argv in seen), proc.stdout
