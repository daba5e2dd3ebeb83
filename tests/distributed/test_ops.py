"""cadence.distributed.ops and DDP in one process (no process group): plain single-process code."""

import logging
from collections import namedtuple

import pytest
import torch
from torch import nn

from cadence.distributed import ops
from cadence.distributed.ddp import DDP
from cadence.distributed.data import DistributedDL

Pair = namedtuple("Pair", "a b")


def test_collectives_are_identity_in_one_process():
    t = torch.arange(4.)
    data = {"x": t, "y": (t, [t])}
    ops.wait_for_everyone()
    assert ops.gather(t) is t and ops.gather(data) is data
    assert ops.reduce(t, "sum") is t and ops.reduce(t, "mean") is t
    assert ops.pad_across_processes(t, dim=0, pad_index=-1, pad_first=True) is t
    assert ops.broadcast({"seed": 3}) == {"seed": 3} and ops.broadcast(t) is t
    assert ops.gather_object("a") == ["a"]


def test_bad_input_messages():
    with pytest.raises(ValueError, match="one of"):
        ops.reduce(torch.ones(1), op="median")
    with pytest.raises(TypeError, match="gather_object"):
        ops.gather({"x": torch.ones(1), "name": "a"})


def test_map_tensors_keeps_container_types():
    out = ops.map_tensors(lambda t: t + 1, Pair(torch.zeros(1), [torch.ones(1), "s", {"k": torch.zeros(2)}]))
    assert isinstance(out, Pair) and out.a.tolist() == [1.] and out.b[1] == "s" and out.b[2]["k"].tolist() == [1., 1.]


def test_main_process_helpers_run_once(capsys):
    calls = []
    with ops.main_process_first():
        calls.append("main")
    with ops.local_main_process_first():
        calls.append("local")
    assert ops.rank0_first(lambda x, y=0: x + y, 1, y=2) == 3
    assert ops.on_main_process(lambda: "ran")() == "ran"
    assert ops.on_local_main_process(lambda: "ran")() == "ran"
    ops.main_print("hello", end="!")
    assert calls == ["main", "local"] and capsys.readouterr().out == "hello!"


def test_decorators_skip_other_ranks(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ops.on_main_process(lambda: "ran")() is None
    assert ops.on_local_main_process(lambda: "ran")() is None
    ops.main_print("hidden")
    assert capsys.readouterr().out == ""


def test_get_logger_logs_once_unless_asked(monkeypatch, caplog):
    logger = ops.get_logger("cadence.test", level="INFO")
    with caplog.at_level(logging.INFO, logger="cadence.test"):
        logger.info("on main")
        monkeypatch.setenv("RANK", "1")
        logger.info("hidden on rank 1")
        logger.warning("every rank %d", 1, main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["on main", "every rank 1"]


def test_sync_bn_conversion_keeps_parameter_objects():
    """DDP.wrap converts after the optimizer exists: that relies on torch keeping the same Parameters."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    before = [id(t) for t in (*model.parameters(), *model.buffers())]
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[1], nn.SyncBatchNorm)
    assert [id(t) for t in (*converted.parameters(), *converted.buffers())] == before


def test_ddp_in_one_process():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    strategy = DDP(device="cpu", sync_bn=True)
    strategy.setup_environment()
    with pytest.warns(UserWarning, match="SyncBatchNorm needs a GPU"):
        wrapped, opt = strategy.setup(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    assert not strategy.created_group
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    assert type(wrapped[1]) is nn.BatchNorm1d and strategy.unwrap(wrapped) is wrapped
    assert strategy.model_state_dict(wrapped).keys() == model.state_dict().keys()
    strategy.set_gradient_sync(wrapped, False)  # no DDP wrapper in one process: nothing to switch, no error
    wrapped(torch.randn(5, 3)).sum().backward()
    assert isinstance(strategy.shard(torch.utils.data.DataLoader(range(4))), DistributedDL)
    assert (strategy.is_main, strategy.dp_rank, strategy.dp_size) == (True, 0, 1)
    strategy.teardown()
