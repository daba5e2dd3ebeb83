"""A damaged checkpoint or saved model fails with a message naming the file, before anything is loaded."""

import json
import traceback

import pytest
import torch
from cadence.callbacks.checkpoint import Checkpoint
from fixtures import make_learner


class NotATensor:
    pass


@pytest.fixture
def checkpoint(dls, tmp_path):
    make_learner(dls, tmp_path, [Checkpoint()]).fit(1)
    return tmp_path / "checkpoints" / "step-00000004"


def truncate(file):
    file.write_bytes(file.read_bytes()[:len(file.read_bytes()) // 2])


def corrupt_json(file):
    file.write_text(file.read_text()[:-20])


def drop_callbacks(file):
    state = json.loads(file.read_text())
    del state["callbacks"]
    file.write_text(json.dumps(state))


def other_objects(file):
    torch.save({"state": NotATensor()}, file)


@pytest.mark.parametrize("name, damage, error, said", [
    ("model.safetensors", truncate, ValueError, r"model.safetensors is not a readable safetensors file \(truncated"),
    ("state.json", corrupt_json, ValueError, r"state.json is corrupt \("),
    ("state.json", drop_callbacks, ValueError, r"state.json lacks \['callbacks'\]: it is not a complete cadence"),
    ("optimizer.pt", lambda f: f.unlink(), FileNotFoundError, r"step-00000004 has no optimizer.pt: the checkpoint is"),
    ("optimizer.pt", truncate, ValueError, r"optimizer.pt is truncated or corrupt: it is corrupt or not a cadence"),
    ("optimizer.pt", other_objects, ValueError, r"optimizer.pt holds objects other than tensors: it is corrupt or not"),
    ("rng-rank0.pt", other_objects, ValueError, r"rng-rank0.pt holds objects other than tensors"),
])
def test_damaged_checkpoint_names_the_file_and_loads_nothing(dls, tmp_path, checkpoint, name, damage, error, said):
    damage(checkpoint / name)
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(error, match=said) as info:
        learn.fit(2, resume="latest")
    assert str(checkpoint) in str(info.value)
    shown = "".join(traceback.format_exception(info.value))
    assert "weights_only=False" not in shown and "weights_only" not in str(info.value)  # never suggest unpickling
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items()) and learn.step == 0


def test_learn_load_of_a_truncated_file_names_it(dls, tmp_path):
    learn = make_learner(dls, tmp_path)
    saved = learn.save("m")
    truncate(saved / "model.safetensors")
    with pytest.raises(ValueError, match=r"m/model.safetensors is not a readable safetensors file"):
        make_learner(dls, tmp_path).load("m")


def test_learn_load_reads_the_old_file_pair(dls, tmp_path):
    from safetensors.torch import save_file

    learn = make_learner(dls, tmp_path)
    learn.fit(1)
    models = tmp_path / "models"
    models.mkdir()
    save_file({k: v.contiguous() for k, v in learn.model.state_dict().items()}, str(models / "old.safetensors"))
    torch.save(learn.opt.state_dict(), models / "old.opt.pt")    # the layout cadence 0.1 wrote
    fresh = make_learner(dls, tmp_path).load("old")
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), fresh.model.parameters()))
    assert fresh.opt.state_dict()["state"][0]["step"] == learn.opt.state_dict()["state"][0]["step"]
    with pytest.raises(FileNotFoundError, match=r"nothing saved at .*models/nope; saved in .*: \['old.safetensors'\]"):
        fresh.load("nope")
