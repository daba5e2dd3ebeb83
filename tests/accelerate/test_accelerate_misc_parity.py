"""Accelerate 1.15 parity: `save_state(safe_serialization=False)` in Accelerate's layout, read back by
cadence and by the real Accelerate; `get_logger`'s `[RANK n]` prefix and `warning_once`; the TensorBoard tracker
skipping what it cannot log; `accelerator.state`'s attributes and `AcceleratorState`."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from cadence import Accelerator


def _prepared(seed=0):
    acc = Accelerator(cpu=True)
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    return acc, *acc.prepare(model, opt, sched)


def _train_step(acc, model, opt, sched):
    acc.backward(model(torch.ones(4, 3)).sum())
    opt.step()
    sched.step()
    opt.zero_grad()


_ACCELERATE_LOAD = """
    import sys, torch
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt, sched = acc.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1))
    acc.load_state(sys.argv[1])
    print(model.weight.tolist(), opt.state_dict()["state"][0]["step"].item(), sched.state_dict()["last_epoch"], acc.step)
"""


def test_save_state_without_safetensors_writes_accelerates_files_that_both_load(tmp_path):
    acc, model, opt, sched = _prepared()
    _train_step(acc, model, opt, sched)
    acc.step = 7
    acc.save_state(tmp_path / "ckpt", safe_serialization=False)
    # Accelerate 1.15 writes these for one model, optimizer and scheduler
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["optimizer.bin", "pytorch_model.bin", "random_states_0.pkl",
                                                    "scheduler.bin"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())        # the staged folder was committed
    weights = torch.load(tmp_path / "ckpt" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(weights["weight"], model.weight)
    saved = model.weight.detach().clone()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CADENCE_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_ACCELERATE_LOAD), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"{saved.tolist()} 1.0 1 7"
    fresh, model2, opt2, sched2 = _prepared(seed=1)
    fresh.load_state(tmp_path / "ckpt")
    assert torch.equal(model2.weight, saved) and fresh.step == 7
    assert sched2.state_dict()["last_epoch"] == 1 and opt2.state_dict()["state"][0]["step"].item() == 1


def test_save_state_without_safetensors_never_unpickles_code_when_loading(tmp_path):
    acc, model, opt, sched = _prepared()
    acc.save_state(tmp_path / "ckpt", safe_serialization=False)
    torch.save({"weight": model.weight.detach(), "bias": nn.Linear}, tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="does not unpickle"):
        acc.load_state(tmp_path / "ckpt")


def test_get_logger_prefixes_the_rank_and_warns_once_as_accelerate(caplog):
    from accelerate.logging import get_logger as theirs_get_logger
    from accelerate.state import PartialState as TheirState

    from cadence.logging import get_logger

    TheirState()
    messages = {}
    for name, factory in (("cadence", get_logger), ("accelerate", theirs_get_logger)):
        logger = factory(f"misc.{name}", log_level="INFO")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=f"misc.{name}"):
            logger.info("main only %d", 0)
            logger.warning_once("once")
            logger.warning_once("once")
            logger.warning_once("other")
        messages[name] = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages["cadence"] == messages["accelerate"] == [
        ("INFO", "[RANK 0] main only 0"), ("WARNING", "[RANK 0] once"), ("WARNING", "[RANK 0] other")]


def test_tensorboard_logs_what_it_can_and_warns_once_per_key_it_cannot(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    acc.init_trackers("proj")
    with pytest.warns(UserWarning, match="'vec' is not logged") as caught:
        acc.log({"loss": 0.5, "acc": torch.tensor([0.25]), "vec": torch.ones(3)}, step=1)
        acc.log({"vec": torch.ones(3), "group": {"a": 1.0, "bad": [1, 2]}}, step=2)
    assert sorted(str(w.message).split("'")[1] for w in caught) == ["group/bad", "vec"]
    acc.end_training()
    run = next(p.parent for p in tmp_path.rglob("events.out*") if "group" not in str(p.parent))
    events = EventAccumulator(str(run))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["acc", "loss"]       # as Accelerate's run (t6.py): vec skipped


def test_accelerator_state_has_accelerates_attributes():
    from accelerate import Accelerator as Theirs

    from cadence.accelerate.state import AcceleratorState

    ours, theirs = Accelerator(cpu=True).state, Theirs(cpu=True).state
    assert isinstance(ours, AcceleratorState)
    for name in ("is_fsdp2", "parallelism_config", "torch_tp_plugin"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_accelerator_skip_first_batches_of_a_plain_loader_as_accelerate():
    import accelerate

    outs = []
    for make in (Accelerator, accelerate.Accelerator):
        acc = make(cpu=True)
        dl = torch.utils.data.DataLoader(list(range(10)), batch_size=3)
        outs.append(([b.tolist() for b in acc.skip_first_batches(dl, 2)],
                     [b.tolist() for b in acc.skip_first_batches(dl, 5)]))
    assert outs[0] == outs[1] == ([[6, 7, 8], [9]], [])
