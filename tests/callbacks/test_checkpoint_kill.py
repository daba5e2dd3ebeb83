"""SIGKILL inside a checkpoint save or a learn.save, at chosen filesystem calls: nothing the user had is lost,
the next start cleans up, and the run still ends bitwise equal to an uninterrupted one (real kills, one process).

tests/scripts/fs_kill.py counts the filesystem calls made inside the save and kills before the N-th
of a kind; tests/scripts/resume.py (keep_last=1, a checkpoint every 4 optimizer steps and every
epoch end, 6 steps per epoch on one process) and tests/scripts/save_twice.py run the saves.
"""

import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cadence import DataLoaders, Learner
from cadence.callbacks.checkpoint import complete_checkpoints, read_state
from helpers import REPO, SCRIPTS, cadence_env

pytestmark = pytest.mark.slow


def run(script, *args):
    return subprocess.run([sys.executable, str(SCRIPTS / script), *map(str, args)], capture_output=True, text=True,
                          timeout=240, env=cadence_env(), cwd=REPO)


def hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    proc = run("resume.py", "--ckpt", out / "ckpt", "--out", out / "ref.st", "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    return load_file(str(out / "ref.st"))


# the second save (step 6, the end of epoch 0) is killed: before its rename into place, between that
# rename and `latest` moving to it, and while the first checkpoint (step 4) is being deleted by keep_last=1
@pytest.mark.parametrize("kill_at, latest_after_kill, leftover", [
    ("rename:2", "step-00000004", ".step-00000006.tmp"),
    pytest.param("replace:12", "step-00000004", ".latest.tmp", marks=pytest.mark.long),  # 6 per save: 4 files,
    # state.json, latest
    ("unlink:2", "step-00000006", ".step-00000004.deleted"),
])
def test_kill_during_a_checkpoint_loses_nothing_and_resumes_exactly(tmp_path, reference, kill_at, latest_after_kill,
                                                                    leftover):
    root = tmp_path / "ckpt"
    args = ("--ckpt", root, "--out", tmp_path / "run.st", "--keep-last", "1")
    killed = run("resume.py", *args, "--kill-at-op", kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (root / "latest").read_text() == latest_after_kill
    assert read_state(root / latest_after_kill)["step"] == int(latest_after_kill[-2:])   # latest is complete
    assert any(name.startswith(leftover) for name in hidden(root)), hidden(root)

    done = run("resume.py", *args)        # the same command continues the run
    assert done.returncode == 0 and "STEPS 18" in done.stdout, done.stderr
    assert hidden(root) == []             # the killed save's leftovers are gone
    final = load_file(str(tmp_path / "run.st"))
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)
    latest = (root / "latest").read_text()
    assert latest in [d.name for d in complete_checkpoints(root)] and read_state(root / latest)["step"] == 18


def load_m(path):
    learn = Learner(DataLoaders(torch.utils.data.DataLoader([]), device="cpu"), nn.Linear(4, 2),
                    loss_func=nn.CrossEntropyLoss(), path=path)
    learn.load("m")
    return learn


# the second learn.save("m") is killed: with the new pair staged, between its two renames, while the old pair is
# deleted (unlink 1 removes the probe file of the check that the directory is writable)
@pytest.mark.parametrize("kill_at, expected", [("rename:1", "first.st"), ("rename:2", "second.st"),
                                               ("unlink:2", "second.st")])
def test_learn_save_killed_leaves_one_whole_pair(tmp_path, kill_at, expected):
    killed = run("save_twice.py", "--path", tmp_path, "--kill-at-op", kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    learn = load_m(tmp_path)
    want = load_file(str(tmp_path / expected))
    assert torch.equal(learn.model.weight, want["weight"]) and torch.equal(learn.model.bias, want["bias"])
    assert learn.opt.state_dict()["state"][0]["step"] == want["adam_step"].item()  # the optimizer of the same save
    assert hidden(tmp_path / "models") == []     # the load finished or dropped the killed save's directories
