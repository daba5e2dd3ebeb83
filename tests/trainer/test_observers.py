"""Observers never change a run: adding a Checkpoint (or a tracker) to a one-process fit trains on the same
batches with the same random numbers, bitwise; and resuming from its checkpoints still ends equal."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.callbacks.checkpoint import Checkpoint
from cadence.callbacks.tracking import Tracker


def learner(tmp_path, *cbs, generator=False):
    """Shuffled batches of 8 (the last one short), dropout, AdamW: everything random that a loader can change."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(1)
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(5) if generator else None)
    dls = DataLoaders(train, DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8), device="cpu")
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), path=tmp_path, cbs=list(cbs))
    learn.remove_cb(learn.progress)
    return learn


def weights(learn):
    return {k: v.clone() for k, v in learn.model.state_dict().items()}


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("generator", [False, True], ids=["global RNG", "loader generator"])
def test_checkpoint_and_tracker_do_not_change_the_run_and_resume_stays_exact(tmp_path, generator):
    plain = learner(tmp_path / "plain", generator=generator)
    plain.fit_one_cycle(3, 1e-2)
    after_plain = torch.rand(4)                       # the global RNG stream went on the same way too

    observed = learner(tmp_path / "obs", Checkpoint(every_n_steps=5), Tracker("csv", dir=tmp_path / "runs"),
                       generator=generator)
    observed.fit_one_cycle(3, 1e-2)
    assert torch.equal(torch.rand(4), after_plain)
    assert_bitwise_equal(weights(observed), weights(plain))
    assert observed.recorder.raw_losses == plain.recorder.raw_losses

    # resume from the mid-epoch checkpoint at step 5 (epoch 0 has 8 batches), then from the one of step 15
    for name in ("step-00000005", "step-00000015"):
        resumed = learner(tmp_path / name, Checkpoint(every_n_steps=5), generator=generator)
        torch.manual_seed(123)                                         # a new process: other random states
        resumed.fit_one_cycle(3, 1e-2, resume=tmp_path / "obs" / "checkpoints" / name)
        assert resumed.step == plain.step == 24
        assert_bitwise_equal(weights(resumed), weights(plain))
        assert resumed.recorder.values[-1]["train_loss"] == pytest.approx(plain.recorder.values[-1]["train_loss"],
                                                                          rel=1e-12)
