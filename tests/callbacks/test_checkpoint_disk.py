"""A full disk, a file-size limit, a read-only or mistyped directory: the error names the directory and its free
space, no staged directory keeps the space, and a directory that cannot be written fails before training."""

import contextlib
import json
import subprocess
import sys

import pytest
from cadence.callbacks.checkpoint import Checkpoint
from fixtures import make_learner
from helpers import REPO, SCRIPTS, cadence_env


def write_limited(directory, what, *flags):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "write_limit.py"), "--dir", str(directory), "--what", what,
                           *flags], capture_output=True, text=True, timeout=120, env=cadence_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    return lines["ERROR"], int(lines["STEP"]), json.loads(lines["HIDDEN"])


TARGET = {"checkpoint": "the checkpoint {}/step-00000004", "save": "the saved model {}/m"}


# 32 KiB: the weights (~90 KB, safetensors) fail; 128 KiB: they fit and the optimizer state (torch.save) fails
@pytest.mark.parametrize("what, fsize", [("checkpoint", 128 * 1024), ("save", 32 * 1024)])
def test_a_write_past_a_file_size_limit_names_the_directory_and_leaves_nothing(tmp_path, what, fsize):
    out = tmp_path / "out"
    error, step, hidden = write_limited(out, what, "--fsize", str(fsize))
    assert error.startswith(f"OSError: ") and f"could not write {TARGET[what].format(out)}: " in error, error
    assert "GiB free there)" in error or "MiB free there)" in error, error
    assert "inline_container" not in error and "serializing" not in error, error
    assert hidden == [] and step == 4                          # no .step-00000004.tmp/ nor .m.tmp/ holds the space


@contextlib.contextmanager
def tmpfs(path, options):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("what", ["checkpoint"])
def test_a_full_disk_names_the_directory_and_its_free_space(tmp_path, what):
    with tmpfs(tmp_path / "small", "size=64k") as small:
        error, step, hidden = write_limited(small / "out", what)
        left = sorted(p.name for p in small.rglob("*") if p.name.startswith("."))
    assert error.startswith("OSError: [Errno 28] ") and f"{TARGET[what].format(small / 'out')}: No space left" in error
    assert "KiB free there)" in error or " B free there)" in error, error
    assert hidden == left == [] and step == 4


def test_a_read_only_directory_fails_before_training(dls, tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        learn = make_learner(dls, tmp_path, [Checkpoint(ro / "ckpt")])
        with pytest.raises(OSError, match=rf"checkpoint directory {ro}/ckpt is not writable: Read-only file system"):
            learn.fit(1)
        assert learn.step == 0 and learn.recorder.losses == []
        learn.model_dir = ro / "models"
        with pytest.raises(OSError, match=rf"model directory {ro}/models is not writable: Read-only file system"):
            learn.save("m")


def test_a_file_where_the_checkpoint_directory_goes_fails_before_training(dls, tmp_path):
    (tmp_path / "taken").write_text("a file")
    for where in ("taken", "taken/ckpt"):
        learn = make_learner(dls, tmp_path, [Checkpoint(where)])
        with pytest.raises(NotADirectoryError, match=rf"checkpoint directory {tmp_path}/{where} cannot be created: "
                                                     rf"{tmp_path}/taken is a file, not a directory"):
            learn.fit(1)
        assert learn.step == 0 and learn.recorder.losses == []
    learn.model_dir = "taken"
    with pytest.raises(NotADirectoryError, match=rf"model directory {tmp_path}/taken cannot be created"):
        learn.save("m")
