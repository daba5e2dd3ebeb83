"""Checkpoint directory format, pruning, best tracking, loading checks, save_model shards (one process)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cadence import CancelFitException, Callback
from cadence.callbacks.checkpoint import Checkpoint, complete_checkpoints
from fixtures import make_learner


def test_directory_format(dls, tmp_path):
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=3)])
    learn.fit(2)
    root = tmp_path / "checkpoints"
    names = [d.name for d in complete_checkpoints(root)]
    assert names == ["step-00000003", "step-00000004", "step-00000006", "step-00000008"]  # every 3 steps + epoch ends
    assert (root / "latest").read_text() == "step-00000008"
    ckpt = root / "step-00000008"
    files = ["callbacks.tensors", "model.safetensors", "optimizer.pt", "rng-rank0.pt"]
    assert sorted(p.name for p in ckpt.iterdir()) == [*files, "state.json"]
    weights = load_file(str(ckpt / "model.safetensors"))
    for k, v in learn.model.state_dict().items():
        assert torch.equal(weights[k], v)
    state = json.loads((ckpt / "state.json").read_text())
    assert (state["epoch"], state["step"], state["epoch_complete"], state["world_size"]) == (1, 8, True, 1)
    assert "recorder" in state["callbacks"] and state["sampler"]["batches_done"] == 4
    assert state["files"] == files                      # a checkpoint is complete only when all of them are there
    assert load_file(str(ckpt / "callbacks.tensors"))["recorder.losses"].tolist() == learn.recorder.losses
    mid = json.loads((root / "step-00000003" / "state.json").read_text())
    assert (mid["epoch"], mid["sampler"]["batches_done"], mid["epoch_complete"]) == (0, 3, False)
    torch.load(ckpt / "optimizer.pt", weights_only=True)
    torch.load(ckpt / "rng-rank0.pt", weights_only=True)
    assert not list(root.glob(".*"))  # no temporary directories left


def test_keep_last_and_monitor_keep_the_best(dls, tmp_path):
    class ScriptedAccuracy(Callback):
        order = 55  # after the Recorder: overwrite the epoch's accuracy with a known sequence

        def after_epoch(self):
            self.learn.recorder.values[-1]["accuracy"] = [0.5, 0.9, 0.6, 0.7, 0.8][self.epoch]

    ckpt = Checkpoint(keep_last=2, monitor="accuracy", mode="max")
    learn = make_learner(dls, tmp_path, [ScriptedAccuracy(), ckpt])
    learn.fit(5)
    root = tmp_path / "checkpoints"
    assert [d.name for d in complete_checkpoints(root)] == ["step-00000008", "step-00000016", "step-00000020"]
    assert (root / "best").read_text() == "step-00000008" and ckpt.best == 0.9


def test_lr_find_saves_nothing_and_the_resumed_fit_after_it_starts_fresh(dls, tmp_path):
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2)])
    learn.lr_find(num_it=8, show_plot=False)                 # a sweep to throw away: no checkpoint of it
    assert not (tmp_path / "checkpoints").exists()
    learn.fit(1, lr=1e-2, resume="auto")                      # nothing to resume: epoch 0, from step 0
    plain = make_learner(dls, tmp_path / "plain")
    plain.fit(1, lr=1e-2)
    assert learn.step == 4 and [d.name for d in complete_checkpoints(tmp_path / "checkpoints")] == [
        "step-00000002", "step-00000004", "step-00000004-1"]     # the epoch's end saves step 4 again
    assert all(torch.equal(a, b) for a, b in zip(learn.model.parameters(), plain.model.parameters()))


def test_epoch_stopped_early_is_still_saved(dls, tmp_path):
    class StopAfterFirstEpoch(Callback):
        order = 70

        def after_epoch(self):
            raise CancelFitException()

    learn = make_learner(dls, tmp_path, [StopAfterFirstEpoch(), Checkpoint()])
    learn.fit(3)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000004"


def test_resume_needs_the_checkpoint_callback(dls, tmp_path):
    learn = make_learner(dls, tmp_path)
    with pytest.raises(ValueError, match="Checkpoint"):
        learn.fit(1, resume="latest")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        learn.fit(1, cbs=Checkpoint(), resume="latest")


def test_resume_from_another_architecture_fails_before_loading(dls, tmp_path):
    make_learner(dls, tmp_path, [Checkpoint()]).fit(1)
    other = make_learner(dls, tmp_path, [Checkpoint()], model=nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3)))
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"shape mismatches: 0.weight: \(16, 8\) in .*, \(4, 8\) in model"):
        other.fit(1, cbs=None, resume="latest")
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())


def test_save_state_load_state_round_trip(dls, tmp_path):
    learn = make_learner(dls, tmp_path)
    learn.fit(1)
    learn.save_state(tmp_path / "manual")
    other = make_learner(dls, tmp_path)
    other.load_state(tmp_path / "manual")
    for a, b in zip(learn.model.parameters(), other.model.parameters()):
        assert torch.equal(a, b)
    assert other.step == learn.step == 4
    assert other.recorder.values == learn.recorder.values


def test_save_model_shards_in_hugging_face_layout(dls, tmp_path):
    learn = make_learner(dls, tmp_path)
    out = learn.save_model(tmp_path / "export", max_shard_size=400)  # bytes: forces several shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for f in files:
        loaded.update(load_file(str(out / f)))
    assert loaded.keys() == learn.model.state_dict().keys()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in loaded.values())
    single = learn.save_model(tmp_path / "one")
    assert sorted(p.name for p in single.iterdir()) == ["model.safetensors"]
    with pytest.raises(ValueError, match="max_shard_size"):
        learn.save_model(tmp_path / "bad", max_shard_size="lots")


def test_bad_arguments():
    with pytest.raises(ValueError, match="every_n_steps"):
        Checkpoint(every_n_steps=0)
    with pytest.raises(ValueError, match="mode"):
        Checkpoint(mode="best")


def test_grad_scaler_state_round_trips_before_the_first_fit(dls, tmp_path):
    from cadence import MixedPrecision

    learn = make_learner(dls, tmp_path, [MixedPrecision("fp16", init_scale=1024.0)])
    learn.fit(1)
    learn.save_state(tmp_path / "amp")
    fresh = make_learner(dls, tmp_path, [MixedPrecision("fp16")])  # default scale 65536, no fit yet
    fresh.load_state(tmp_path / "amp")
    assert fresh.mixed_precision.state_dict() == learn.mixed_precision.state_dict()
    assert fresh.mixed_precision.plugin.scaler.get_scale() == learn.mixed_precision.plugin.scaler.get_scale()


def test_state_json_does_not_grow_with_the_steps_and_resume_restores_the_history_exactly(dsets, tmp_path):
    from cadence import DataLoaders
    from torch.utils.data import DataLoader

    train, valid = dsets
    dls = DataLoaders(DataLoader(train, batch_size=2, shuffle=True), DataLoader(valid, batch_size=16), device="cpu")
    reference = make_learner(dls, tmp_path / "ref", [Checkpoint()])  # the same (seeded, resumable) shuffling
    reference.fit(2)                                          # 32 steps per epoch
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=8)])
    learn.fit(2)
    root = tmp_path / "checkpoints"
    size = {n: (root / f"step-{n:08d}" / "state.json").stat().st_size for n in (16, 24, 48, 56)}
    # 8 steps later: one more name in the checkpoint history (~18 bytes), not 16 more numbers (~330 bytes)
    assert size[24] - size[16] < 30 and size[56] - size[48] < 30, size
    resumed = make_learner(dls, tmp_path, [Checkpoint()])
    with pytest.warns(UserWarning, match="did not write"):   # steps 48 to 64 of the first run are left alone
        resumed.fit(2, resume="step-00000040")                # mid-epoch 1
    assert resumed.recorder.losses == reference.recorder.losses and len(reference.recorder.losses) == 64
    assert resumed.recorder.lrs == reference.recorder.lrs
    drop_time = [{k: v for k, v in row.items() if k != "time"} for row in reference.recorder.values]
    assert [{k: v for k, v in row.items() if k != "time"} for row in resumed.recorder.values] == drop_time


def test_rng_file_restores_the_same_draws_and_an_earlier_layout_still_loads(tmp_path):
    """python's state travels as one int64 tensor (625 numbers a resume unpickles 3x faster than a tuple of them);
    a file from before, holding the tuple, restores too."""
    import random

    import numpy as np

    from cadence.callbacks.checkpoint import rng_state, set_rng_state
    from cadence.serialization import load_torch, save_torch

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_torch(rng_state(), tmp_path / "rng.pt")
    earlier = {**load_torch(tmp_path / "rng.pt"), "python": random.getstate()}
    save_torch(earlier, tmp_path / "earlier.pt")
    draws = [random.random(), np.random.rand(), torch.rand(1).item()]
    for file in ("rng.pt", "earlier.pt"):
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        set_rng_state(load_torch(tmp_path / file))
        assert [random.random(), np.random.rand(), torch.rand(1).item()] == draws, file
