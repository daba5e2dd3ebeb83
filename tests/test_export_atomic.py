"""`save_model` over an existing export: the old export or the new one, whole, never shards of two saves.

A save runs in a subprocess (tests/scripts/export_save.py) that runs out of room at shard 3 of 4
(a file-size limit, as a full disk) or is SIGKILLed just before a chosen filesystem call; the
export left behind is then loaded with `load_checkpoint_and_dispatch` and compared with each save's
weights. Loading refuses an export whose shards do not belong to its index.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from cadence import DataLoaders, Learner
from cadence.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
from cadence.serialization import recover_dir
from helpers import REPO, SCRIPTS, cadence_env

sys.path.insert(0, str(SCRIPTS))
from export_save import model  # noqa: E402  (the script's model, so both sides build the same one)


def save(directory, seed, *flags):
    return subprocess.run([sys.executable, str(SCRIPTS / "export_save.py"), str(directory), "--seed", str(seed), *flags],
                          capture_output=True, text=True, timeout=120, env=cadence_env(), cwd=REPO)


def save_here(directory, seed):
    Learner(DataLoaders([]), model(seed), loss_func=nn.MSELoss()).save_model(directory, max_shard_size="20KB")


def loaded(directory) -> dict[str, torch.Tensor]:
    with init_empty_weights():
        empty = model(0)
    return load_checkpoint_and_dispatch(empty, directory, device_map={"": "cpu"}).state_dict()


def which_save(directory) -> int:
    """The seed whose weights the export holds, every tensor of them (a mix matches neither)."""
    state = loaded(directory)
    seeds = [s for s in (1, 2) if all(torch.equal(state[k], v) for k, v in model(s).state_dict().items())]
    assert len(seeds) == 1, f"{directory} holds neither save whole"
    return seeds[0]


@pytest.fixture
def export(tmp_path):
    directory = tmp_path / "export"
    save_here(directory, 1)
    (directory / "config.json").write_text("{}")                                   # the user's file, kept
    assert len(list(directory.glob("model-0000?-of-00004.safetensors"))) == 4
    return directory


def test_a_save_that_runs_out_of_room_at_shard_3_leaves_the_previous_export_whole(export):
    proc = save(export, 2, "--fsize-limit", str(64 * 1024))                         # shard 3 is 160 KiB
    assert proc.returncode == 3, proc.stderr
    assert f"could not write the export {export}: File too large" in proc.stdout
    assert "The previous export there, if any, is untouched" in proc.stdout
    assert which_save(export) == 1
    assert sorted(p.name for p in export.parent.iterdir()) == ["export"]            # the staged files are gone
    assert (export / "config.json").read_text() == "{}"
    save_here(export, 2)
    assert which_save(export) == 2                                                  # room again: the new one
    assert (export / "config.json").read_text() == "{}"


# a slice of the moments (bench/faults.py's kill_in_export row kills at 50 random ones)
@pytest.mark.parametrize("op, left", [("replace:2", 1),     # shard 2 of the new save written, not renamed
                                      ("rename:2", None),   # the old export moved aside, the new one not yet in
                                      ("unlink:2", 2)])     # the new export in, the old one being deleted
def test_a_kill_anywhere_in_a_save_leaves_one_whole_export(export, op, left):
    proc = save(export, 2, "--kill-at-op", op)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    if left is None:
        with pytest.raises(FileNotFoundError, match="interrupted while it swapped the new export in"):
            loaded(export)
        recover_dir(export)                                                          # as the next save does first
        left = 2
    assert which_save(export) == left
    save_here(export, 1)
    assert which_save(export) == 1
    assert sorted(p.name for p in export.parent.iterdir()) == ["export"]
    assert (export / "config.json").read_text() == "{}"


def test_loading_refuses_shards_that_do_not_belong_to_their_index(tmp_path):
    for seed in (1, 2):
        save_here(tmp_path / f"s{seed}", seed)
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "s1", mixed)
    shutil.copy(tmp_path / "s2" / "model-00003-of-00004.safetensors", mixed)       # same names, another save
    with pytest.raises(ValueError, match=r"model-00003-of-00004.safetensors does not match its index: it was written "
                                         r"by another save"):
        loaded(mixed)
    index = json.loads((tmp_path / "s1" / "model.safetensors.index.json").read_text())
    index["weight_map"]["0.weight"] = "model-00002-of-00004.safetensors"            # an index naming the wrong shard
    (tmp_path / "s1" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-00002-of-00004.safetensors does not match its index: it lacks "
                                         r"\['0.weight'\]"):
        loaded(tmp_path / "s1")


def test_the_working_directory_or_a_file_is_refused_before_any_work(tmp_path, monkeypatch):
    learn = Learner(DataLoaders([]), model(1), loss_func=nn.MSELoss())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        learn.save_model(tmp_path / "file")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="holds the working directory"):
        learn.save_model(".")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
