"""A state.json cannot be turned against the user: pruning deletes only this run's `step-*` directories inside
its own checkpoint directory, and every value that steers the run is checked before anything is loaded."""

import re

import pytest
import torch
from cadence.callbacks.checkpoint import Checkpoint, complete_checkpoints
from fixtures import edit_state, make_learner


def names(root):
    return [d.name for d in complete_checkpoints(root)]


def precious(path):
    path.mkdir(parents=True)
    (path / "thesis.txt").write_text("years of work")
    return path


def test_a_history_naming_paths_outside_the_directory_is_refused_and_deletes_nothing(dls, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    make_learner(dls, tmp_path / "run", [Checkpoint(keep_last=2)]).fit(1)
    elsewhere, absolute = precious(tmp_path / "run" / "elsewhere"), precious(tmp_path / "absolute")
    edit_state(root / "step-00000004",
               lambda s: s["callbacks"]["checkpoint"].update(history=["../elsewhere", str(absolute), "step-00000004"]))
    learn = make_learner(dls, tmp_path / "run", [Checkpoint(keep_last=2)])
    with pytest.raises(ValueError, match=r"step-00000004/state.json: callbacks.checkpoint.history\[0\] is "
                                         r"'../elsewhere': expected a checkpoint name"):
        learn.fit(4, resume="latest")
    assert (elsewhere / "thesis.txt").is_file() and (absolute / "thesis.txt").is_file()
    assert learn.step == 0 and names(root) == ["step-00000004"]


def test_a_symlink_named_like_a_checkpoint_is_never_followed_by_pruning(dls, tmp_path):
    root = tmp_path / "checkpoints"
    make_learner(dls, tmp_path, [Checkpoint(keep_last=2)]).fit(1)
    target = precious(tmp_path / "target")
    (root / "step-00000001").symlink_to(target, target_is_directory=True)
    edit_state(root / "step-00000004",
               lambda s: s["callbacks"]["checkpoint"].update(history=["step-00000001", "step-00000004"]))
    make_learner(dls, tmp_path, [Checkpoint(keep_last=2)]).fit(3, resume="latest")
    assert (target / "thesis.txt").is_file()


def test_resuming_from_another_directory_never_prunes_this_directorys_checkpoints(dls, tmp_path):
    make_learner(dls, tmp_path, [Checkpoint(dir="a")]).fit(3)              # a/: steps 4, 8, 12
    make_learner(dls, tmp_path, [Checkpoint(dir="b")]).fit(3)              # b/: steps 4, 8, 12 of an earlier run
    assert names(tmp_path / "b") == ["step-00000004", "step-00000008", "step-00000012"]
    learn = make_learner(dls, tmp_path, [Checkpoint(dir="b", keep_last=2)])
    with pytest.warns(UserWarning, match="holds checkpoints this run did not write"):
        learn.fit(5, resume=tmp_path / "a" / "step-00000012")              # writes b/step-00000016 and step-00000020
    assert names(tmp_path / "b") == ["step-00000004", "step-00000008", "step-00000012", "step-00000016",
                                     "step-00000020"]
    assert names(tmp_path / "a") == ["step-00000004", "step-00000008", "step-00000012"]


@pytest.fixture
def checkpoint(dls, tmp_path):
    make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2)]).fit(1)     # step-00000002: mid-epoch
    return tmp_path / "checkpoints" / "step-00000002"


def set_field(path, value):
    def change(state):
        *parents, last = path.split(".")
        node = state
        for key in parents:
            node = node[key]
        node[last] = value
    return change


@pytest.mark.parametrize("field, value", [
    ("epoch", 1e9), ("epoch", 10**9), ("epoch", -3), ("epoch", "0"), ("step", -5), ("train_iter", -1),
    ("world_size", 0), ("epoch_complete", "no"), ("sampler.batches_done", -3), ("sampler.epoch", -1),
    ("sampler.seed", "x"), ("sampler.world_size", 0), ("sampler.batch_size", 0), ("callbacks", []),
    ("callbacks.checkpoint.history", "step-00000002"), ("callbacks.recorder", None),
])
def test_a_bad_value_in_state_json_is_refused_naming_the_file_and_field_before_loading(dls, tmp_path, checkpoint,
                                                                                        field, value):
    edit_state(checkpoint, set_field(field, value))
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(f"step-00000002/state.json: {field} is {value!r}")):
        learn.fit(2, resume="step-00000002")
    assert learn.step == 0 and learn.recorder.losses == []
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())


def test_a_state_saved_by_hand_before_any_fit_loads(dls, tmp_path):
    learn = make_learner(dls, tmp_path)
    learn.save_state(tmp_path / "before")                     # n_epoch 0, epoch 0: nothing trained yet
    other = make_learner(dls, tmp_path)
    other.load_state(tmp_path / "before")
    assert other.step == 0 and all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), other.model.parameters()))


def test_a_checkpoint_beyond_the_fits_length_is_refused_not_silently_skipped(dls, tmp_path):
    make_learner(dls, tmp_path, [Checkpoint()]).fit(3)
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    with pytest.raises(ValueError, match=r"step-00000012/state.json: the checkpoint is at epoch 3 of 3, beyond this "
                                         r"fit's n_epoch=1: fit\(3\) continues it"):
        learn.fit(1, resume="auto")                           # trained nothing and exited 0 before
    assert learn.step == 0
