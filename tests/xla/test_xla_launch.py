"""`cadence launch` in the XLA environment (torch 2.9, whose torchrun lacks options newer torch has): `--tpu` and
`distributed_type: XLA` make a script whose `distrib_ctx()` names no strategy train on the XLA device;
`--main_training_function main` calls the script's main() as Accelerate's TPU launcher does. One process on XLA's
CPU device: several cannot run collectives there (see test_xla_refused.py's torchrun guard test)."""

import json
import os
import subprocess

import pytest

from xla_env import REPO, SCRIPTS, run_xla

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # torch_xla subprocesses (compiles: minutes when loaded)


def launch(xla_python, tmp_path, *flags, script_args=()) -> dict:
    out = tmp_path / "out.json"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
           "CADENCE_CONFIG_FILE": str(tmp_path / "no-config.yaml")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CADENCE_STRATEGY"):
        env.pop(var, None)
    proc = subprocess.run([str(xla_python), "-m", "cadence.cli", "launch", "--num_processes", "1", *flags,
                           str(SCRIPTS / "xla_launched.py"), "--out", str(out), *script_args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_launch_tpu_trains_on_xla_and_calls_the_main_training_function(xla_python, tmp_path):
    r = launch(xla_python, tmp_path, "--tpu", "--main_training_function", "main")
    assert (r["strategy"], r["device"], r["entered"]) == ("XLA", "xla:0", "main_training_function"), r
    assert r["diff"] < 1e-5, r  # 2 epochs of SGD: the same weights as the plain-CPU Learner


@pytest.mark.parametrize("function", ["main", pytest.param(None, marks=pytest.mark.long)])
def test_distributed_type_xla_in_the_config_selects_the_xla_strategy(xla_python, tmp_path, function):
    """An `accelerate config` TPU file: its `main_training_function: main` is called, as Accelerate's TPU launcher
    does; without the key the script runs as __main__."""
    config = tmp_path / "tpu.yaml"
    key = f"main_training_function: {function}\n" if function else ""
    config.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: TPU\n{key}"
                      "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 1\ntpu_env: []\ntpu_use_cluster: false\n")
    r = launch(xla_python, tmp_path, "--config_file", str(config))
    assert (r["strategy"], r["device"], r["entered"]) == ("XLA", "xla:0", "main_training_function" if function
                                                          else "__main__"), r
    assert r["diff"] < 1e-5, r


def test_notebook_launcher_with_one_process_trains_on_xla_in_this_process(xla_python, tmp_path):
    """notebook_launcher(fn, num_processes=1) with PJRT_DEVICE set: fn runs in the calling process, its
    distrib_ctx() picks the xla strategy. (Several processes go through xmp.spawn: TPUs only, untested here.)"""
    out = tmp_path / "out.json"
    proc = run_xla(xla_python, "xla_launched.py", "--notebook", "--out", str(out))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(out.read_text())
    assert (r["strategy"], r["device"], r["entered"]) == ("XLA", "xla:0", "notebook_launcher"), r
    assert r["diff"] < 1e-5, r
