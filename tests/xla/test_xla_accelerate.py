"""Accelerate's nlp_example (imports swapped to cadence, otherwise unchanged) on XLA's CPU device: the Accelerator
picks strategy "xla" from $CADENCE_STRATEGY (what a launcher sets), trains to the accuracy floor and counts every
evaluation sample once. The stand-ins for the hub, datasets and evaluate are tests/accelerate/examples'."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "accelerate" / "examples"))
from matrix import EXAMPLES, Run, prepare  # noqa: E402
from xla_env import REPO  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # each runs torch_xla subprocesses (compiles: minutes when loaded)


def test_accelerate_nlp_example_runs_unchanged_on_xla(xla_python, tmp_path):
    scripts, standins_env = prepare(tmp_path / "work")
    example = next(e for e in EXAMPLES if e.script == "nlp_example")
    site = HERE.parent / "accelerate" / "examples" / "standins" / example.site
    env = {**os.environ, **standins_env, "PJRT_DEVICE": "CPU", "CADENCE_STRATEGY": "xla", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([str(xla_python), str(scripts / "nlp_example.py")], capture_output=True, text=True,
                          timeout=800, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "device='xla:0'" in proc.stdout  # the script's own prints of its batches: they were on the XLA device
    problems = [p for check in example.checks for p in check(Run(proc.stdout, proc.stderr, tmp_path))]
    assert not problems, problems
