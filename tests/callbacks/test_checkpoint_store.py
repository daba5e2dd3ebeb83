"""Checkpoints are never lost: fresh names for a re-saved step, pruning by the run's own history, `latest`
never deleted, two runs in one directory, resume="auto" (one process, fast)."""

import json
import warnings

import pytest
import torch
from cadence.callbacks.checkpoint import Checkpoint, CheckpointStore, complete_checkpoints
from fixtures import make_learner


def names(root):
    return [d.name for d in complete_checkpoints(root)]


def state_of(root, name):
    return json.loads((root / name / "state.json").read_text())


def test_a_step_saved_twice_keeps_both_under_fresh_names(dls, tmp_path):
    # 4 batches per epoch: every_n_steps=4 saves step 4 mid-epoch, then the epoch's end saves step 4 again
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=4)])
    learn.fit(1)
    root = tmp_path / "checkpoints"
    assert names(root) == ["step-00000004", "step-00000004-1"]
    assert state_of(root, "step-00000004")["epoch_complete"] is False
    assert state_of(root, "step-00000004-1")["epoch_complete"] is True
    assert (root / "latest").read_text() == "step-00000004-1"
    again = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=4)])
    with pytest.warns(UserWarning, match="holds checkpoints this run did not write"):
        again.fit(1)                                          # a fresh run in the same directory: nothing replaced
    assert names(root) == ["step-00000004", "step-00000004-1", "step-00000004-2", "step-00000004-3"]
    assert state_of(root, "step-00000004")["epoch_complete"] is False   # the first run's, as it was


def test_keep_last_prunes_only_this_runs_history(dls, tmp_path):
    root = tmp_path / "checkpoints"
    first = make_learner(dls, tmp_path, [Checkpoint(keep_last=1)])
    first.fit(3)                                              # steps 4, 8, 12: keeps step 12
    assert names(root) == ["step-00000012"]
    second = make_learner(dls, tmp_path, [Checkpoint(keep_last=1)])
    with pytest.warns(UserWarning, match=r"holds checkpoints this run did not write \(step-00000012\); this run starts"):
        second.fit(2)                                          # a fresh run next to the first one's checkpoint
    assert names(root) == ["step-00000008", "step-00000012"]  # the first run's step 12 survives keep_last=1
    assert (root / "latest").read_text() == "step-00000008"
    assert state_of(root, "step-00000008")["callbacks"]["checkpoint"]["history"] == ["step-00000008"]


def test_resuming_an_older_checkpoint_never_deletes_the_newer_ones(dls, tmp_path):
    root = tmp_path / "checkpoints"
    make_learner(dls, tmp_path, [Checkpoint(keep_last=2)]).fit(3)  # keeps steps 8 and 12
    assert names(root) == ["step-00000008", "step-00000012"]
    again = make_learner(dls, tmp_path, [Checkpoint(keep_last=2)])
    with pytest.warns(UserWarning, match=r"\(step-00000012\); they are not in the history of step-00000008"):
        again.fit(4, resume="step-00000008")                  # epochs 2 and 3 again: steps 12 and 16
    assert names(root) == ["step-00000012", "step-00000012-1", "step-00000016"]
    assert (root / "latest").read_text() == "step-00000016"
    # step-00000008 was this run's, so keep_last pruned it; the other run's step 12 was never touched
    assert state_of(root, "step-00000016")["callbacks"]["checkpoint"]["history"] == ["step-00000012-1", "step-00000016"]


def test_latest_and_best_are_never_pruned(dls, tmp_path):
    root = tmp_path / "checkpoints"
    ckpt = Checkpoint(keep_last=1, monitor="valid_loss")
    learn = make_learner(dls, tmp_path, [ckpt])
    learn.fit(3)
    store = CheckpointStore(root)
    assert store.pointed("latest") in names(root) and store.pointed("best") in names(root)
    assert set(names(root)) == {store.pointed("latest"), store.pointed("best")}


def test_resume_auto_starts_fresh_then_continues(dls, tmp_path):
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # a first run in an empty directory: nothing to say
        learn.fit(1, resume="auto")
    assert learn.step == 4 and names(tmp_path / "checkpoints") == ["step-00000004"]
    again = make_learner(dls, tmp_path, [Checkpoint()])
    again.fit(2, resume="auto")                               # continues after epoch 0: one more epoch
    assert again.step == 8 and len(again.recorder.values) == 2
    assert names(tmp_path / "checkpoints") == ["step-00000004", "step-00000008"]


def test_resume_latest_on_a_first_run_points_to_auto(dls, tmp_path):
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    with pytest.raises(FileNotFoundError, match=r"holds no complete checkpoint.*fit\(resume=\"auto\"\)"):
        learn.fit(1, resume="latest")
    assert learn.step == 0


def test_save_state_replaces_a_directory_as_one_unit(dls, tmp_path):
    learn = make_learner(dls, tmp_path)
    learn.fit(1)
    learn.save_state(tmp_path / "manual")
    learn.fit(1)
    learn.save_state(tmp_path / "manual")                     # the same directory again: replaced whole
    assert json.loads((tmp_path / "manual" / "state.json").read_text())["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_resume_from_the_last_batch_of_an_epoch_validates_that_epoch_then_goes_on(dls, tmp_path):
    reference = make_learner(dls, tmp_path / "ref", [Checkpoint()])
    reference.fit(2)
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=4)])
    learn.fit(1)                                              # step-00000004: every batch of epoch 0 done, not validated
    resumed = make_learner(dls, tmp_path, [Checkpoint()])
    with pytest.warns(UserWarning, match=r"did not write \(step-00000004-1\)"):   # the epoch-end save after it
        resumed.fit(2, resume="step-00000004")
    assert [v["epoch"] for v in resumed.recorder.values] == [0, 1] and resumed.step == 8
    assert resumed.recorder.values[0]["valid_loss"] == reference.recorder.values[0]["valid_loss"]
    assert all(torch.equal(a, b) for a, b in zip(reference.model.parameters(), resumed.model.parameters()))


def test_a_resume_says_what_it_loaded_and_a_latest_naming_no_checkpoint_is_warned(dls, tmp_path, capsys):
    import shutil

    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2, every_epoch=False)])
    learn.fit(1)                                              # steps 2 and 4 (4 batches of 16)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-00000004"
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2, every_epoch=False)])
    capsys.readouterr()
    learn.fit(2, resume="auto")
    assert f"Checkpoint: resumed from {root / 'step-00000004'} (epoch 0, step 4)" in capsys.readouterr().out
    shutil.rmtree(root / "step-00000006")                     # `latest` (step 8 now) and the one before it gone
    shutil.rmtree(root / "step-00000008")
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2, every_epoch=False)])
    with pytest.warns(UserWarning, match=r"latest names 'step-00000008', which is not a complete checkpoint here; "
                                         r"the newest complete one, step-00000004, is used"):
        learn.fit(2, resume="auto")
    assert "Checkpoint: resumed from" in capsys.readouterr().out


def test_a_latest_naming_no_checkpoint_in_an_empty_directory_is_warned_and_the_run_starts_afresh(dls, tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step-00000004")
    learn = make_learner(dls, tmp_path, [Checkpoint()])
    with pytest.warns(UserWarning, match="names 'step-00000004', which is not a complete checkpoint here; there is "
                                         "no other: the run starts afresh"):
        learn.fit(1, resume="auto")
    assert learn.step == 4 and (root / "latest").read_text() == "step-00000004"   # trained from the start
