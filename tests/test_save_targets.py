"""Where saves land and what they leave: a target that is a symbolic link to a directory (written where it points,
the link kept), `learn.export()` killed between its two renames (the previous or the new export loads under its
name, the next export cleans up), temporaries of killed writers (removed by the next save, a live writer's kept),
and a safetensors header whose tied-name list (`cadence_aliases`) is crafted or damaged (refused, naming the file).
"""

import errno
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from cadence import load_learner
from cadence.serialization import atomic_path, load_weights, save_torch, save_weights, writing
from fixtures import make_learner
from helpers import REPO, SCRIPTS, cadence_env


def shifted(learn, by):
    """Move every weight by `by`: a second save must hold these, not the first save's."""
    with torch.no_grad():
        for p in learn.model.parameters():
            p += by
    return {k: v.clone() for k, v in learn.model.state_dict().items()}


def hidden(*folders):
    return sorted(p.name for folder in folders for p in folder.iterdir() if p.name.startswith("."))


def same(state, expected):
    return sorted(state) == sorted(expected) and all(torch.equal(state[k], v) for k, v in expected.items())


@pytest.mark.parametrize("how", ["save", "save_model", "export"])
def test_a_linked_directory_is_written_where_it_points_and_the_link_stays(dls, tmp_path, how):
    disk = tmp_path / "bigdisk" / "m"
    disk.mkdir(parents=True)
    (disk / "tokenizer.json").write_text("{}")                      # the user's file, which save_model keeps
    learn = make_learner(dls, tmp_path / "project")
    link = {"save": learn.path / learn.model_dir / "m", "save_model": learn.path / "hf",
            "export": learn.path / "export.pkl"}[how]
    link.parent.mkdir(parents=True)
    link.symlink_to(disk, target_is_directory=True)
    write = {"save": lambda: learn.save("m"), "save_model": lambda: learn.save_model(link), "export": learn.export}[how]
    for by in (0.0, 1.0):
        expected = shifted(learn, by)
        write()
        assert link.is_symlink() and link.resolve() == disk
        assert same(load_weights(disk / "model.safetensors"), expected)
        assert hidden(link.parent, disk.parent) == []
    fresh = make_learner(dls, tmp_path / "project")
    if how == "save":
        fresh.load("m")
        assert same(fresh.model.state_dict(), expected)
    elif how == "export":
        assert same(load_learner(link, model=fresh.model).model.state_dict(), expected)
    else:
        assert (disk / "tokenizer.json").read_text() == "{}"


def test_a_link_to_a_directory_not_made_yet_gets_it_there(dls, tmp_path):
    learn = make_learner(dls, tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m").symlink_to(tmp_path / "bigdisk" / "m")
    expected = shifted(learn, 0.0)
    learn.save("m")
    assert (tmp_path / "models" / "m").is_symlink()
    assert same(load_weights(tmp_path / "bigdisk" / "m" / "model.safetensors"), expected)


# the child exports its model (seed 2), SIGKILLed just before the chosen filesystem call inside Learner.export
EXPORT_CHILD = """
import sys, torch
from torch import nn
from cadence import DataLoaders, Learner
from fs_kill import kill_at_filesystem_op
torch.manual_seed(2)
learn = Learner(DataLoaders([]), nn.Linear(4, 3), loss_func=nn.MSELoss(), path=sys.argv[1])
kill_at_filesystem_op(sys.argv[2], Learner, "export")
learn.export()
"""


def exported(seed, path):
    from cadence import DataLoaders, Learner
    torch.manual_seed(seed)
    learn = Learner(DataLoaders([]), torch.nn.Linear(4, 3), loss_func=torch.nn.MSELoss(), path=path)
    learn.export()
    return learn.model.state_dict()


@pytest.mark.parametrize("op, left", [("rename:1", 1),    # the new export staged, the old one still in place
                                      ("rename:2", 2),    # the old export moved aside, the new one not yet in
                                      ("unlink:1", 2)])   # the new export in, the old one being deleted
@pytest.mark.parametrize("then", ["load_learner", "export"])
def test_an_export_killed_at_any_point_leaves_one_under_its_name(tmp_path, op, left, then):
    first = exported(1, tmp_path)
    proc = subprocess.run([sys.executable, "-c", EXPORT_CHILD, str(tmp_path), op], capture_output=True, text=True,
                          timeout=120, env=cadence_env(PYTHONPATH=f"{REPO}{os.pathsep}{SCRIPTS}"), cwd=REPO)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    torch.manual_seed(2)
    second = torch.nn.Linear(4, 3).state_dict()
    if then == "load_learner":                                   # reading finishes an interrupted swap
        model = load_learner(tmp_path / "export.pkl", model=torch.nn.Linear(4, 3)).model
        assert same(model.state_dict(), {1: first, 2: second}[left])
        if op == "rename:2":
            assert hidden(tmp_path) == []
    third = exported(3, tmp_path)                                # the next export cleans what the kill left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.pkl"]
    assert same(load_learner(tmp_path / "export.pkl", model=torch.nn.Linear(4, 3)).model.state_dict(), third)


# the child is SIGKILLed while it writes `weights.pt`, its temporary half written
KILLED_WRITER = """
import os, signal, sys
from cadence.serialization import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_bytes(bytes(100_000))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writers_temporary_goes_with_the_next_save_and_a_live_writers_stays(tmp_path):
    target = tmp_path / "weights.pt"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(target)], capture_output=True, text=True,
                          timeout=120, env=cadence_env(), cwd=REPO)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [dead] = hidden(tmp_path)
    assert dead.startswith(".weights.pt.tmp")
    with atomic_path(target) as tmp:                             # this process's name for its temporary
        ours = tmp.name
        tmp.write_bytes(b"")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        others = [ours.replace(f"tmp{os.getpid()}@", f"tmp{live.pid}@"),      # a writer still at work
                  dead.rsplit("@", 1)[0] + "@another-host",                 # whose pid cannot be checked
                  dead.replace(".weights.pt.", ".other.pt.")]                 # another target's
        for name in others:
            (tmp_path / name).write_bytes(b"partial")
        save_torch({"w": torch.ones(3)}, target)
        assert hidden(tmp_path) == sorted(others)
        assert torch.equal(torch.load(target)["w"], torch.ones(3))
    finally:
        live.kill()
        live.wait()


def test_a_linked_file_is_written_where_it_points(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "weights.pt").symlink_to(tmp_path / "disk" / "weights.pt")
    save_torch({"w": torch.ones(2)}, tmp_path / "weights.pt")
    assert (tmp_path / "weights.pt").is_symlink() and (tmp_path / "disk" / "weights.pt").is_file()


@pytest.mark.parametrize("aliases, why", [
    ("[1, 2]", "is not a JSON object of names"),
    ("5", "is not a JSON object of names"),
    ("{not json", "is not a JSON object of names"),
    ('{"b2": "nope"}', "maps 'b2' to 'nope', which the file does not hold"),
    ('{"b2": 3}', "maps 'b2' to 3, which the file does not hold"),
    ('{"b": "a"}', "maps 'b', a tensor the file holds, onto 'a'"),   # same shape: would load a's values as b
])
def test_a_crafted_aliases_header_is_refused_naming_the_file(tmp_path, aliases, why):
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(2, 2), "b": torch.ones(2, 2)}, str(f), metadata={"cadence_aliases": aliases})
    with pytest.raises(ValueError, match=re.escape(f"{f}: the cadence_aliases entry of its header {why}")):
        load_weights(f)


def test_tied_names_load_as_the_one_tensor(tmp_path):
    w = torch.randn(2, 2)
    save_weights({"embed": w, "head": w}, tmp_path / "m.safetensors")
    state = load_weights(tmp_path / "m.safetensors")
    assert torch.equal(state["head"], w) and state["head"] is state["embed"]


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "free there); free some space or choose another directory"),
                                          (errno.EACCES, "Permission denied; choose a writable directory")])
def test_free_space_is_advised_only_when_space_ran_out(tmp_path, code, advice):
    with pytest.raises(OSError) as error, writing(tmp_path / "m", "saved model"):
        raise OSError(code, os.strerror(code))
    assert str(error.value).startswith(f"[Errno {code}] could not write the saved model {tmp_path / 'm'}: ")
    assert str(error.value).endswith(advice) and ("free there" in str(error.value)) == (code == errno.ENOSPC)


def test_retiring_a_symlinked_directory_is_refused_and_what_it_points_to_stays(tmp_path):
    from cadence.serialization import retire_dir

    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "precious.txt").write_text("keep")
    (tmp_path / "step-1").symlink_to(tmp_path / "archive", target_is_directory=True)
    with pytest.raises(ValueError, match="step-1 is a symbolic link .* never what a link points to"):
        retire_dir(tmp_path / "step-1")
    assert (tmp_path / "archive" / "precious.txt").read_text() == "keep" and (tmp_path / "step-1").is_symlink()
