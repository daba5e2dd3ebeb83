"""Accelerator on one process: accumulation, schedulers, precision, checkpoints, trackers, helpers, bad input."""

import copy
import csv
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cadence import (Accelerator, DummyOptim, DummyScheduler, GradScalerKwargs, PartialState, ProjectConfiguration,
                     find_executable_batch_size, set_seed)
from cadence.callbacks.tracking import Tracker
from cadence.callbacks.tracking import tracker as tracking_tracker
from cadence.callbacks.tracking.csv import CSVTracker
from helpers import Counter
from scripts.regression import RegressionDataset, RegressionModel


def _setup(acc, length=80, bs=16, sched=False, shuffle=False):
    set_seed(42)
    model = RegressionModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(RegressionDataset(length=length, seed=0), batch_size=bs, shuffle=shuffle)
    objs = [model, opt, dl] + ([torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)] if sched else [])
    return acc.prepare(*objs)


def test_accumulate_steps_once_per_window_and_on_the_last_batch():
    acc = Accelerator(gradient_accumulation_steps=2)
    model, opt, dl, sched = _setup(acc, sched=True)             # 5 batches: windows [0,1] [2,3] [4]
    ref = copy.deepcopy(acc.unwrap_model(model))
    syncs, lrs = [], []
    for batch in dl:
        with acc.accumulate(model):
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            acc.backward(loss)
            opt.step(); sched.step(); opt.zero_grad()
        # a plain loop: each micro-batch's loss / 2, summed, stepped at the window's end
        (F.mse_loss(ref(batch["x"]), batch["y"]) / 2).backward()
        syncs.append(acc.sync_gradients)
        lrs.append(sched.get_last_lr()[0])
        if acc.sync_gradients:
            with torch.no_grad():
                for p in ref.parameters():
                    p -= 0.1 * 0.5 ** (sum(syncs) - 1) * p.grad   # the lr of the k-th step
                    p.grad = None
    assert syncs == [False, True, False, True, True]
    assert lrs == [0.1, 0.05, 0.05, 0.025, 0.0125]               # the scheduler moved once per optimizer step
    for p, q in zip(acc.unwrap_model(model).parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_a_stream_without_length_iterates_and_ends_its_last_accumulation_window(tmp_path):
    class Stream(torch.utils.data.IterableDataset):   # a streaming dataset: no __len__
        def __iter__(self):
            return iter(torch.arange(11.0))

    acc = Accelerator(gradient_accumulation_steps=2)
    model = acc.prepare(torch.nn.Linear(1, 1))
    dl = acc.prepare(DataLoader(Stream(), batch_size=2))     # 6 batches: windows [0,1] [2,3] [4,5]; then 5 batches
    seen, ends, syncs = [], [], []
    for batch in dl:
        with acc.accumulate(model):
            acc.backward(model(batch[:, None]).sum())
        seen += acc.gather_for_metrics(batch).tolist()
        ends.append(acc.gradient_state.end_of_dataloader)
        syncs.append(acc.sync_gradients)
    assert seen == list(range(11))
    assert ends == [False] * 5 + [True] and syncs == [False, True] * 3
    assert not acc.gradient_state.end_of_dataloader and acc.gradient_state.active_dataloader is None
    assert [len(b) for b in dl] == [2] * 5 + [1]              # a second epoch of the same stream
    for i, _ in enumerate(dl):
        if i == 2:
            acc.save_state(tmp_path / "state")                 # mid-stream, after batches 0-2
    acc.load_state(tmp_path / "state")
    assert [b.tolist() for b in dl] == [[6.0, 7.0], [8.0, 9.0], [10.0]]   # the rest of that pass
    for i, _ in enumerate(dl):
        if i == 5:
            acc.save_state(tmp_path / "last")                  # at the last batch: the epoch not over yet
    acc.load_state(tmp_path / "last")
    assert [b.tolist() for b in dl] == []                      # what a sized loader gives: the pass had ended


def test_a_loop_that_skips_the_batches_load_state_already_skipped_is_warned(tmp_path):
    import warnings

    def run(skip_done_batches):
        acc = Accelerator()
        model = torch.nn.Linear(1, 1)
        model, opt, dl = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                     DataLoader(torch.arange(10.0)[:, None], batch_size=1))
        for step, batch in enumerate(dl):
            acc.backward(model(batch).sum())
            if step == 3:
                acc.save_state(tmp_path / "state")
                break
        acc.load_state(tmp_path / "state")              # the loader continues at batch 4
        trained = []
        for step, batch in enumerate(dl):
            if skip_done_batches and step < 4:           # Accelerate scripts' own skip (older diffusers scripts)
                continue
            acc.backward(model(batch).sum())
            trained.append(int(batch))
        return trained

    with pytest.warns(UserWarning, match=r"continued at batch 4.*4 more of its batches.*skips them twice"):
        assert run(skip_done_batches=True) == [8, 9]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run(skip_done_batches=False) == [4, 5, 6, 7, 8, 9]    # what the script means: the rest, once


def test_batches_as_dicts_reach_the_device_and_a_model_computing_its_own_loss():
    class OwnLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x, labels):
            out = self.lin(x)
            return {"logits": out, "loss": F.mse_loss(out, labels)}

    x = torch.randn(32, 3)
    ds = [{"x": a, "labels": a.sum(0, keepdim=True)} for a in x]
    acc = Accelerator()
    model = OwnLoss()
    model, opt, dl = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ds, batch_size=8))
    first = last = None
    for _ in range(20):
        for batch in dl:
            loss = model(**batch)["loss"]
            acc.backward(loss); opt.step(); opt.zero_grad()
            first = loss.item() if first is None else first
            last = loss.item()
    assert last < first / 10


def test_bf16_forward_runs_in_autocast_and_returns_fp32():
    acc = Accelerator(mixed_precision="bf16")
    seen = []
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))     # inside the model's forward
    model = acc.prepare(net)
    out = model(torch.randn(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(torch.randn(2, 4)).dtype == torch.float32 and seen[-1] == torch.float32


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10)])
    model, opt, dl, sched = _setup(acc, sched=True)
    before = [p.detach().clone() for p in model.parameters()]
    batch = next(iter(dl))
    acc.backward(model(batch["x"]).sum() * float("inf"))
    opt.step(); sched.step(); opt.zero_grad()
    assert acc.optimizer_step_was_skipped and sched.get_last_lr() == [0.1]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    acc.backward(F.mse_loss(model(batch["x"]), batch["y"]))
    opt.step(); sched.step()
    assert not acc.optimizer_step_was_skipped and sched.get_last_lr() == [0.05]


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_backward_passes_its_keyword_arguments_to_the_loss_backward(precision):
    acc = Accelerator(mixed_precision=precision, kwargs_handlers=[GradScalerKwargs(init_scale=1.0)])
    model = acc.prepare(torch.nn.Linear(2, 1))
    loss = model(torch.ones(1, 2)).sum()
    acc.backward(loss, retain_graph=True)                 # the graph survives for a second backward
    acc.backward(loss, inputs=[model.bias])               # gradients for the given inputs only
    assert model.weight.grad.tolist() == [[1.0, 1.0]] and model.bias.grad.tolist() == [2.0]

def test_clip_grad_norm_returns_the_norm_before_clipping():
    acc = Accelerator()
    model, opt, dl = _setup(acc)
    batch = next(iter(dl))
    acc.backward(100 * F.mse_loss(model(batch["x"]), batch["y"]))
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = acc.clip_grad_norm_(model.parameters(), 1.0)
    assert norm == pytest.approx(expected.item(), rel=1e-5) and norm > 1
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped == pytest.approx(1.0, rel=1e-4)
    acc.clip_grad_value_(model.parameters(), 0.1)
    assert max(p.grad.abs().max() for p in model.parameters()) <= 0.1


def _train(acc, model, opt, dl, epochs, sched=None):
    rands = []
    for _ in range(epochs):
        for batch in dl:
            acc.backward(F.mse_loss(model(batch["x"]), batch["y"]))
            opt.step(); opt.zero_grad()
        rands.append(random.random())
        if sched is not None:
            sched.step()
    return rands


def test_save_state_load_state_resume_exactly(tmp_path):
    """Accelerate's test_state_checkpointing: resuming gives the weights, optimizer and RNG of the uninterrupted run."""
    config = lambda it=0: ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True, iteration=it)  # noqa: E731
    acc = Accelerator(project_config=config())
    model, opt, dl, sched = _setup(acc, sched=True, shuffle=True)
    acc.save_state()
    truth = _train(acc, model, opt, dl, 3, sched)
    a1, opt1 = [p.item() for p in model.parameters()], copy.deepcopy(opt.state_dict())

    acc = Accelerator(project_config=config(1))
    model, opt, dl, sched = _setup(acc, sched=True, shuffle=True)
    torch.manual_seed(1234)           # a different seed: what load_state restores must not depend on it
    acc.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    rands = _train(acc, model, opt, dl, 2, sched)
    acc.save_state()
    acc.load_state()                  # the newest: checkpoint_1
    rands += _train(acc, model, opt, dl, 1, sched)
    assert [p.item() for p in model.parameters()] == a1 and opt.state_dict() == opt1 and rands == truth


def test_resume_mid_epoch_continues_with_the_same_batches(tmp_path):
    acc = Accelerator()
    *_, dl = _setup(acc, shuffle=True)
    it = iter(dl)
    seen = [next(it)["x"] for _ in range(2)]
    acc.save_state(tmp_path / "mid")
    rest = [b["x"] for b in it]
    acc2 = Accelerator()
    *_, dl2 = _setup(acc2, shuffle=True)
    acc2.load_state(tmp_path / "mid")
    again = [b["x"] for b in dl2]
    assert len(seen) + len(rest) == len(dl) and len(again) == len(rest)
    assert all(torch.equal(a, b) for a, b in zip(again, rest))


def test_total_limit_keeps_the_newest(tmp_path):
    acc = Accelerator(project_dir=tmp_path, project_config=ProjectConfiguration(automatic_checkpoint_naming=True,
                                                                                total_limit=2))
    acc.prepare(RegressionModel())
    for _ in range(11):
        acc.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_10", "checkpoint_9"]


def test_register_for_checkpointing(tmp_path):
    acc = Accelerator()
    with pytest.raises(ValueError, match="Item at index 0.*Item at index 1") as e:
        acc.register_for_checkpointing(torch.ones(1), torch.ones(1), Counter())
    assert "index 2" not in str(e.value)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    counter.n = 7
    acc.save_state(tmp_path / "c")
    counter.n = 0
    acc.load_state(tmp_path / "c")
    assert counter.n == 7


def test_checkpoint_from_other_objects_is_refused_before_loading(tmp_path):
    acc = Accelerator()
    model, opt, dl = _setup(acc)
    acc.save_state(tmp_path / "c")
    other = Accelerator()
    other.prepare(RegressionModel(), torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="holds 1 model"):
        other.load_state(tmp_path / "c")


def test_bad_input_is_refused_with_what_to_change(tmp_path):
    for steps in (-1, 0, 1.5):
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            Accelerator(gradient_accumulation_steps=steps)
    with pytest.raises(TypeError, match="kwargs_handlers"):
        Accelerator(kwargs_handlers=[{"find_unused_parameters": True}])
    with pytest.raises(ValueError, match="precision"):
        Accelerator(mixed_precision="fp8")
    acc = Accelerator()
    with pytest.raises(ValueError, match="output_dir"):
        acc.save_state()
    model = RegressionModel()
    with pytest.raises(ValueError, match="DeepSpeed"):
        acc.prepare(model, DummyOptim(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="total_limit"):
        ProjectConfiguration(total_limit=0)


def test_dummy_optim_fills_the_auto_values_of_the_optimizer_a_deepspeed_config_names():
    pytest.importorskip("deepspeed")
    from cadence.utils import DeepSpeedPlugin

    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "eps": 1e-6}}}
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero_stage=0))
    try:
        net = torch.nn.Linear(3, 1)
        model, _ = acc.prepare(net, DummyOptim(net.parameters(), lr=0.02, weight_decay=0.1))
        group = model.optimizer.param_groups[0]               # the engine's optimizer, built from the config
        assert (group["lr"], group["weight_decay"], group["eps"]) == (0.02, 0.1, 1e-6)
    finally:
        acc.strategy.teardown()   # the one-process group DeepSpeed needs must not outlive the test


def test_dummy_scheduler_fills_the_auto_values_of_the_schedule_a_deepspeed_config_names():
    pytest.importorskip("deepspeed")
    from cadence.utils import DeepSpeedPlugin

    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": "auto",
                                                                "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                                "warmup_type": "linear"}}}
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero_stage=0))
    try:
        net = torch.nn.Linear(3, 1)
        opt = DummyOptim(net.parameters(), lr=0.1)
        model, opt, sched = acc.prepare(net, opt, DummyScheduler(opt, total_num_steps=8, warmup_num_steps=4))
        lrs = []
        for _ in range(8):
            acc.backward(model(torch.ones(2, 3)).sum())
            opt.step(); sched.step(); opt.zero_grad()          # sched.step(): the engine stepped it already
            lrs.append(sched.get_last_lr()[0])
        # DeepSpeed's WarmupDecayLR at iterations 0..7: 0.1 * t / 4 over the warm-up, then 0.1 * (8 - t) / 4
        assert lrs == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1, 0.075, 0.05, 0.025], abs=1e-6), lrs
    finally:
        acc.strategy.teardown()


@pytest.mark.parametrize("config, what", [({"zero_optimization": {"stage": 0}}, "optimizer"),
                                          ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "scheduler")])
def test_a_dummy_without_its_section_in_the_deepspeed_config_is_refused_naming_it(config, what):
    pytest.importorskip("deepspeed")
    from cadence.utils import DeepSpeedPlugin

    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero_stage=0))
    try:
        net = torch.nn.Linear(3, 1)
        opt = DummyOptim(net.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=rf"Dummy\w+ stands for the {what} a DeepSpeed config names"):
            acc.prepare(net, opt, DummyScheduler(opt, total_num_steps=4))   # Accelerate refuses both alike
    finally:
        acc.strategy.teardown()


def test_clip_grad_value_over_part_of_a_model_leaves_the_rest():
    acc = Accelerator()
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    acc.backward(model(torch.randn(8, 4) * 10).pow(2).sum())
    first = net[0].weight.grad.clone()
    acc.clip_grad_value_(net[1].parameters(), 1e-3)
    assert torch.equal(net[0].weight.grad, first) and first.abs().max() > 1e-3
    assert net[1].weight.grad.abs().max() <= 1e-3


def test_find_executable_batch_size_reduces_on_a_real_allocation_failure():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def allocate(batch_size):
        tried.append(batch_size)
        return torch.empty(2**60 if batch_size > 8 else batch_size, dtype=torch.uint8).numel()

    assert allocate() == 8   # Accelerate 1.15's reduction: times 0.9, rounded down
    assert tried == [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8]


def test_helpers_on_one_process(capsys):
    acc = Accelerator()
    assert (acc.process_index, acc.num_processes, acc.is_main_process, acc.device.type) == (0, 1, True, "cpu")
    with acc.split_between_processes({"a": [1, 2, 3], "t": torch.arange(3)}) as part:
        assert part["a"] == [1, 2, 3] and part["t"].tolist() == [0, 1, 2]
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False
    assert acc.reduce(torch.tensor([1.0, 2.0]), "sum", scale=2.0).tolist() == [1.0, 2.0]   # Accelerate: scale is XLA's
    acc.print("hello")
    assert capsys.readouterr().out == "hello\n"
    assert PartialState().num_processes == 1
    model, opt = acc.prepare(RegressionModel(), torch.optim.SGD(RegressionModel().parameters(), lr=1))
    assert acc.free_memory(model, opt) == [None, None] and acc._models == []


def test_trackers_log_to_csv(tmp_path):
    acc = Accelerator(log_with=CSVTracker(run_name="r", dir=tmp_path))
    acc.init_trackers("proj", config={"lr": 0.1})
    acc.log({"loss": torch.tensor(0.5)})
    acc.log({"loss": 0.25}, step=5)
    assert acc.get_tracker("csv").name == "csv"
    acc.end_training()
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    assert [(r["step"], float(r["loss"])) for r in rows] == [("0", 0.5), ("5", 0.25)]


def test_tensorboard_logs_text_and_dicts_as_accelerates_and_the_trackers_iterate(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    acc.init_trackers("proj")
    acc.log({"phase": "warmup", "loss": {"train": 1.0, "eval": 2.0}, "lr": 0.1}, step=3)
    assert [t.name for t in acc.trackers] == ["tensorboard"] and len(acc.trackers) == 1
    acc.end_training()
    runs = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}   # add_scalars: one run per dict key too
    tags = {}
    for run in runs:
        tb = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
        tb.Reload()
        tags[run.relative_to(tmp_path).as_posix()] = tb.Tags()
        for tag in tb.Tags()["scalars"]:
            tags[f"{run.name}:{tag}"] = [(e.step, e.value) for e in tb.Scalars(tag)]
    assert [(3, pytest.approx(0.1))] in tags.values() and [(3, 2.0)] in tags.values() and [(3, 1.0)] in tags.values()
    assert any("phase/text_summary" in t.get("tensors", []) for t in tags.values() if isinstance(t, dict)), tags


def test_scheduler_built_over_the_prepared_optimizer_skips_with_it():
    acc = Accelerator(mixed_precision="fp16")
    model, opt, dl = _setup(acc)
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    acc.backward(model(next(iter(dl))["x"]).sum() * float("inf"))
    opt.step(); sched.step()
    assert acc.optimizer_step_was_skipped and sched.get_last_lr() == [0.1]


def test_log_with_all_opens_every_installed_tracker_and_an_unknown_name_is_refused(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # wandb is installed with the dev extras: stand in for a machine without it by renaming its package
    monkeypatch.setitem(tracking_tracker._TRACKER_PACKAGES, "wandb", "wandb_is_not_installed_here")
    acc = Accelerator(log_with="all", project_dir=tmp_path)
    acc.init_trackers("proj", config={"lr": 0.1})
    acc.log({"loss": 0.5}, step=1)
    acc.log({"loss": 0.25}, step=2)
    assert sorted(t.name for t in acc.trackers.trackers) == ["csv", "tensorboard"]
    assert [t.name for t in Tracker("all", dir=tmp_path).trackers] == ["tensorboard", "csv"]  # the Learner's callback too
    acc.end_training()
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    tb = EventAccumulator(str(events))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    assert [(r["step"], float(r["loss"])) for r in rows] == [("1", 0.5), ("2", 0.25)]
    with pytest.raises(ValueError, match=r"unknown tracker 'tensorbord'.*\['csv', 'tensorboard', 'wandb'\]"):
        Accelerator(log_with=["tensorbord"])
