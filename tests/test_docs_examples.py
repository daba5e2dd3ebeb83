"""The how-to pages' code: each docs/examples/ script (whose sections the pages include, see test_docs_pages.py) runs
the way its page says, and does what the page promises. Each runs in its own temporary directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cadence_env, run_launch

EXAMPLES = REPO / "docs" / "examples"


def run_python(name: str, cwd: Path, as_cell: bool = False) -> str:
    """`python docs/examples/<name>` in cwd (as_cell: its code run in a `__main__` without a file, as a notebook cell
    is); its stdout, or AssertionError with both streams."""
    path = EXAMPLES / name
    cmd = [sys.executable, "-c", "import sys; p = sys.argv[1]; exec(compile(open(p).read(), p, 'exec'))", str(path)] \
        if as_cell else [sys.executable, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=cadence_env(MPLBACKEND="Agg"))
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


def launch(name: str, cwd: Path, nproc: int = 2) -> str:
    """`cadence launch --cpu --num_processes nproc docs/examples/<name>` in cwd; rank 0's and the others' stdout."""
    return run_launch(EXAMPLES / name, nproc=nproc, cwd=cwd, timeout=300).stdout


def floats(pattern: str, text: str) -> list[float]:
    return [float(v) for v in re.search(pattern, text).group(1).split(",")]


def test_every_example_is_run_here_or_in_the_xla_lane():
    tested = set(re.findall(r'"(\w+\.py)"', Path(__file__).read_text()))
    tested |= set(re.findall(r'"(\w+\.py)"', (REPO / "tests" / "xla" / "test_xla_docs_example.py").read_text()))
    assert {p.name for p in EXAMPLES.glob("*.py")} <= tested


def test_index_quickstart_learns(tmp_path):
    out = run_python("index.py", tmp_path)
    assert float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1)) >= 0.9, out   # chance is 0.5


def test_training_page(tmp_path):
    out = run_python("training.py", tmp_path)
    assert re.search(r"get_preds: \(256, 3\) accuracy (0\.9[5-9]|1\.0)", out), out
    assert (tmp_path / "models" / "stage1" / "model.safetensors").is_file()
    assert (tmp_path / "models" / "stage1" / "optimizer.pt").is_file()
    stopped = int(re.search(r"StopAtLoss: stopped in epoch (\d+) of 10", out).group(1))
    assert stopped < 9, out                                               # CancelFitException ended the fit early
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert len(kept) == 3 and (tmp_path / "checkpoints" / "latest").read_text().strip() == kept[-1]   # keep_last=3
    assert list(tmp_path.rglob("*.csv")), "the csv tracker wrote nothing"
    assert "load_learner: predictions equal the trained model's: True" in out
    assert (tmp_path / "export.pkl" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_notebook_launcher_runs_a_cell_on_two_processes(tmp_path):
    out = run_python("notebooks.py", tmp_path, as_cell=True)
    assert "rank 0 of 2 trained" in out and "rank 1 of 2 trained" in out, out
    assert float(re.search(r"result on the notebook's side: valid loss [0-9.]+, accuracy ([0-9.]+)", out).group(1)) > 0.7


def test_checkpoints_kept_and_resumed(tmp_path):
    first = run_python("checkpoints.py", tmp_path)
    assert "epoch 9 |" in first and "trained to step 80" in first, first
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert kept == ["step-00000064", "step-00000072", "step-00000080"]   # every epoch (8 steps), keep_last=3
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and (tmp_path / "ckpt" / "state.json").is_file()
    second = run_python("checkpoints.py", tmp_path)                      # resume="auto": the fit is already done
    assert not re.search(r"^epoch \d+ \|", second, re.M) and "trained to step 80" in second, second   # no epoch ran
    assert "Checkpoint: resumed from checkpoints/step-00000080 (epoch 9, step 80)" in second, second


def test_big_model_dispatched_over_cpu_and_disk(tmp_path):
    out = run_python("big_models.py", tmp_path)
    placed = re.search(r"hf_device_map: (\{.*\})", out).group(1)
    assert "'embed': 'cpu'" in placed and "'head': 'disk'" in placed, placed
    assert "output equals the trained model's: True" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_on_two_processes(tmp_path):
    out = launch("ddp.py", tmp_path)
    # every rank: the whole validation set, in order
    assert out.count("processes 2: get_preds 256 items, targets in order True") == 2, out
    assert float(re.search(r"accuracy ([0-9.]+)", out.splitlines()[-1]).group(1)) >= 0.85, out
    assert (tmp_path / "data.pt").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_on_two_processes(tmp_path):
    out = launch("fsdp.py", tmp_path)
    losses = floats(r"rank 0 of 2: valid loss per epoch \[(.*?)\]", out)
    assert losses[-1] < 0.8 * losses[0], out
    assert out.count("plain module after the context True, export loads into it True") == 2, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_on_two_processes(tmp_path):
    pytest.importorskip("deepspeed", reason="make setup-deepspeed")
    out = launch("deepspeed_zero.py", tmp_path)
    zero3 = floats(r"ZeRO-3 with CPU offload \[(.*?)\]", out)
    config = floats(r"ds_config.json \[(.*?)\]", out)
    assert zero3[-1] < zero3[0] and config[-1] < config[0] < zero3[0], out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_huggingface_fsdp_save_model_reloads(tmp_path):
    out = launch("huggingface.py", tmp_path)
    before, after = floats(r"valid loss: ([0-9.]+,[0-9.]+) after", out.replace(" before, ", ","))
    assert before != after, out                                                 # it trained
    assert "from_pretrained('tuned') gives the trained model's logits: True" in out, out
    assert (tmp_path / "tuned" / "config.json").is_file() and (tmp_path / "tuned" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_on_two_processes(tmp_path):
    out = launch("model_parallel.py", tmp_path)
    for r in range(2):
        mlp = floats(rf"rank {r}: MLP valid loss per epoch \[(.*?)\]", out)
        llama = floats(rf"rank {r}: .*Llama train loss per epoch \[(.*?)\]", out)
        assert mlp[-1] < 0.5 * mlp[0] and llama[-1] < llama[0], out
    assert out.count("whole after the context True") == 2, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pipeline_on_two_processes(tmp_path):
    out = launch("pipeline.py", tmp_path)
    named = floats(r"rank 0: train loss per epoch, cut at '5' \[(.*?)\]", out)
    by_split = floats(r"cut by split \[(.*?)\]", out)
    assert named[-1] < 0.5 * named[0] and by_split[-1] < by_split[0], out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_loop_on_two_processes(tmp_path):
    out = launch("accelerate_loop.py", tmp_path)
    assert "processes 2: learning rate at the end 0.0" in out, out   # the schedule ends with the training
    assert "eval samples gathered: 10 of 10" in out, out                # each sample once
    assert (tmp_path / "checkpoints" / "checkpoint_0" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_parallelism_on_four_processes(tmp_path):
    out = launch("accelerate_parallelism.py", tmp_path, nproc=4)   # tp 2 x dp_shard 2, as the page launches it
    first, last = floats(r"loss ([0-9.]+,[0-9.]+),", out.replace(" -> ", ","))
    assert last < 0.7 * first, out
    assert "eval samples gathered 100," in out, out                # each sample once
    assert (tmp_path / "export" / "model.safetensors").is_file()
