"""What `save_state(total_limit=...)` and `save` never lose: a failed save keeps every earlier checkpoint, pruning
leaves the user's own `checkpoint_<n>` folders and symlinks alone, a killed `save` leaves no temporary for good.

The folder names after each save are compared with the real Accelerate 1.15's (one process on the CPU).
"""

import ast
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from cadence import Accelerator, ProjectConfiguration
from helpers import Counter, cadence_env

_LAUNCHED = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in cadence_env().items() if k not in _LAUNCHED}


def _run(code: str, *args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=_plain_env(), timeout=240,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"the child failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.splitlines()


def _listing(project) -> list[str]:
    return sorted(os.listdir(project / "checkpoints"))   # hidden staging or tombstones would show here too


def _accelerator(project, total_limit, iteration=0):
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit,
                                  iteration=iteration)
    acc = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return acc, *acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


class _Fails(Counter):
    """A registered object whose state_dict raises once `failing` is set: the save fails mid-way."""
    failing = False

    def state_dict(self):
        if self.failing:
            raise RuntimeError("state_dict failed")
        return super().state_dict()


# ---------------------------------------------------------------------------- a failed save
def test_a_save_that_fails_midway_keeps_the_earlier_checkpoint_loadable(tmp_path):
    acc, model, _ = _accelerator(tmp_path, total_limit=1)
    counter = _Fails()
    acc.register_for_checkpointing(counter)
    counter.n = 7
    acc.save_state()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    counter.n, counter.failing = 9, True
    with pytest.raises(RuntimeError, match="state_dict failed"):
        acc.save_state()
    assert _listing(tmp_path) == ["checkpoint_0"]            # not pruned, no staged folder left
    counter.failing = False
    acc.load_state()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items()) and counter.n == 7
    acc.save_state()                                          # the failed save took no number
    assert _listing(tmp_path) == ["checkpoint_1"]


def test_a_save_past_the_file_size_limit_keeps_the_earlier_checkpoint(tmp_path):
    """A real failed write (RLIMIT_FSIZE: as on a full disk) in a child process, total_limit=1."""
    lines = _run("""
        import os, resource, signal, sys
        import torch
        from torch import nn
        from cadence import Accelerator, ProjectConfiguration
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=1))
        torch.manual_seed(0)
        model = acc.prepare(nn.Linear(256, 256))
        acc.save_state()
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            acc.save_state()
            print("saved")
        except OSError as e:
            print("failed", "File too large" in str(e))
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(sorted(os.listdir(os.path.join(sys.argv[1], "checkpoints"))))
        acc.load_state()
        print("restored", torch.equal(model.weight, saved))
    """, str(tmp_path))
    assert lines[-3:] == ["failed True", "['checkpoint_0']", "restored True"]


# ---------------------------------------------------------------------------- total_limit
_ACCELERATE_NAMES = """
    import os, sys
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=int(sys.argv[2])))
    acc.prepare(torch.nn.Linear(3, 2))
    for _ in range(4):
        acc.save_state()
        print(sorted(os.listdir(os.path.join(sys.argv[1], "checkpoints"))))
"""


@pytest.mark.parametrize("total_limit", [1, 2])
def test_total_limit_keeps_exactly_the_newest_with_accelerates_names(tmp_path, total_limit):
    acc, model, _ = _accelerator(tmp_path / "cadence", total_limit)
    listings = []
    for i in range(4):
        with torch.no_grad():
            model.bias.fill_(i)
        acc.save_state()
        listings.append(_listing(tmp_path / "cadence"))
    expected = [sorted(f"checkpoint_{n}" for n in range(max(i + 1 - total_limit, 0), i + 1)) for i in range(4)]
    assert listings == expected
    reference = _run(_ACCELERATE_NAMES, str(tmp_path / "accelerate"), str(total_limit))
    assert [ast.literal_eval(line) for line in reference if line.startswith("[")] == expected
    acc.load_state()
    assert torch.equal(model.bias, torch.full((2,), 3.0))


def test_an_async_save_prunes_once_it_is_in_place(tmp_path):
    acc, *_ = _accelerator(tmp_path, total_limit=1)
    acc.save_state()
    acc.save_state(async_save=True)
    assert "checkpoint_0" in _listing(tmp_path)               # still there while checkpoint_1 is being written
    acc.finish_saving()
    assert _listing(tmp_path) == ["checkpoint_1"]


def test_a_tombstone_that_a_killed_removal_left_goes_at_the_next_save(tmp_path):
    (tmp_path / "checkpoints" / ".checkpoint_0.deleted").mkdir(parents=True)
    acc, *_ = _accelerator(tmp_path, total_limit=1, iteration=1)
    acc.save_state()
    assert _listing(tmp_path) == ["checkpoint_1"]


# ---------------------------------------------------------------------------- what the user had
def _foreign(tmp_path):
    """The user's `checkpoint_0` folder, a `checkpoint_1` symlink to another, a `checkpoint_2` with a stranger's
    state.json."""
    checkpoints, precious = tmp_path / "checkpoints", tmp_path / "precious"
    (checkpoints / "checkpoint_0").mkdir(parents=True)
    (checkpoints / "checkpoint_0" / "notes.txt").write_text("mine")
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    (checkpoints / "checkpoint_1").symlink_to(precious, target_is_directory=True)
    (checkpoints / "checkpoint_2").mkdir()
    (checkpoints / "checkpoint_2" / "state.json").write_text('{"epoch": 3}')
    return checkpoints, precious


def _untouched(checkpoints, precious) -> bool:
    return ((checkpoints / "checkpoint_0" / "notes.txt").read_text() == "mine"
            and (checkpoints / "checkpoint_1").is_symlink() and (checkpoints / "checkpoint_1").resolve() == precious
            and (precious / "thesis.txt").read_text() == "years of work"
            and (checkpoints / "checkpoint_2" / "state.json").read_text() == '{"epoch": 3}')


@pytest.mark.parametrize("total_limit", [1, 2])
def test_the_users_own_folders_and_symlinks_are_left_alone_and_saves_succeed(tmp_path, total_limit):
    checkpoints, precious = _foreign(tmp_path)
    acc, model, _ = _accelerator(tmp_path, total_limit, iteration=3)
    for _ in range(3):
        acc.save_state()
    ours = [f"checkpoint_{n}" for n in range(3, 6)][-total_limit:]
    assert _listing(tmp_path) == sorted(["checkpoint_0", "checkpoint_1", "checkpoint_2", *ours])
    assert _untouched(checkpoints, precious)
    acc.load_state()                                          # the newest is ours
    assert acc.step == 0 and (checkpoints / "checkpoint_5" / "state.json").is_file()


def test_a_number_taken_by_a_symlink_or_folder_is_refused_before_any_work(tmp_path):
    checkpoints, precious = _foreign(tmp_path)
    for iteration in (0, 1, 2):
        acc, *_ = _accelerator(tmp_path, total_limit=1, iteration=iteration)
        with pytest.raises(ValueError, match=rf"checkpoint_{iteration} already exists.*the highest under .* is 2"):
            acc.save_state()
    assert _listing(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"] and _untouched(checkpoints, precious)


# ---------------------------------------------------------------------------- Accelerator.save killed mid-write
_KILLED_WRITER = """
    import sys, time
    from cadence.serialization import atomic_path
    with atomic_path(sys.argv[1]) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"x" * 1_000_000)
            f.flush()
            print("writing", flush=True)
            time.sleep(600)
"""


def test_a_killed_save_leaves_no_temporary_after_the_next_save(tmp_path):
    target = tmp_path / "weights.pt"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(target)], env=_plain_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    stale, = tmp_path.glob(f".weights.pt.tmp{child.pid}*")      # atomic_path's name for it, pid first
    assert stale.stat().st_size == 1_000_000 and not target.exists()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        writing = tmp_path / stale.name.replace(str(child.pid), str(live.pid))  # a save still being written: kept
        writing.write_bytes(b"y")
        other = tmp_path / stale.name.replace("weights", "other")             # another file's temporary: kept
        other.write_bytes(b"z")
        Accelerator(cpu=True).save({"w": torch.ones(3)}, target)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["weights.pt", writing.name, other.name])
        assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
    finally:
        live.kill()
        live.wait()
    Accelerator(cpu=True).save({"w": torch.zeros(3)}, target.with_suffix(".safetensors"), safe_serialization=True)
    Accelerator(cpu=True).save({"w": torch.zeros(3)}, str(target))                   # that writer is gone now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["weights.pt", "weights.safetensors", other.name])
