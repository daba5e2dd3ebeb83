"""`cadence launch` end to end: 2 CPU processes over gloo, settings from flags and config, failures."""

import json
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
    start = time.monotonic()
    proc = run_launch("launch_raise.py", check=False, timeout=60)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 30, f"took {elapsed:.0f}s"
    assert output.count("ValueError: launch_raise failed on purpose at step 2") == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "cadence launch: rank 1 failed" in proc.stderr and 'launch_raise.py", line 14, in step' in proc.stderr
