"""A saved optimizer state read from the mapped file straight into the tensors a trained optimizer holds
(`cadence/distributed/load_in_place.py`): the base engines' `load_state` (one device, DDP), real optimizers, real
files."""

from collections import defaultdict, namedtuple

import pytest
import torch
from torch import nn

from cadence import Checkpoint
from cadence.distributed import load_in_place
from cadence.distributed.load_in_place import copied_out, in_place_targets, load_mapped, load_optimizer_in_place
from cadence.serialization import load_torch

Pair = namedtuple("Pair", "a b")  # a saved namedtuple (pickled by reference: at module level)


def trained_adam(*shapes):
    params = [nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def test_a_trained_optimizer_loads_a_saved_state_into_its_own_tensors_with_the_files_values(tmp_path):
    """Every moment and step is copied into the tensor the optimizer already holds (none of the file's memory is kept
    mapped: the file zeroed afterwards changes nothing), and the optimizer then steps as one given the state by
    torch's own `load_state_dict` does."""
    torch.manual_seed(0)
    params, opt = trained_adam((4, 3), (5,), (2, 2))
    saved = {k: v for k, v in opt.state_dict().items()}
    path = tmp_path / "optimizer.pt"
    torch.save(saved, path)
    expected = torch.load(path)
    for p in params:  # more training: the live state moves away from the file's
        p.grad = torch.randn_like(p)
    opt.step()
    live = {id(t) for s in opt.state.values() for t in s.values()}
    load_optimizer_in_place(opt, load_mapped(str(path)), str(path))
    assert {id(t) for s in opt.state.values() for t in s.values()} == live and len(live) == 9
    path.write_bytes(bytes(path.stat().st_size))
    for i, p in enumerate(params):
        assert all(torch.equal(opt.state[p][k], v) for k, v in expected["state"][i].items()), i
    twin_params = [nn.Parameter(p.detach().clone()) for p in params]
    twin = torch.optim.AdamW([{"params": twin_params[:1]}, {"params": twin_params[1:], "lr": 0.1}])
    twin.load_state_dict(expected)
    for a, b in zip(params, twin_params):
        a.grad = b.grad = torch.ones_like(a)
    opt.step(), twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))


def live_targets(saved, opt):
    return [target for _, _, target in in_place_targets(saved, opt.state, [g["params"] for g in opt.param_groups])]


def test_what_cannot_stand_in_for_the_loaded_tensor_is_copied_out_and_loaded_as_torch_does(tmp_path):
    """Groups of other sizes: nothing is written into the optimizer (torch's `load_state_dict` refuses them). A step
    tensor shared by two parameters' states, a state of another dtype or shape, a parameter of another dtype (torch
    would convert the loaded state), a step that torch would move to the parameter's device as float32 (a fused or
    capturable saved group) or keep as loaded (neither): copied out of the mapping, the live tensor untouched."""
    torch.manual_seed(0)
    params, opt = trained_adam((3,), (3,))
    state = opt.state_dict()
    other_groups = {**state, "param_groups": [{**state["param_groups"][0], "params": [0, 1]},
                                              {**state["param_groups"][1], "params": []}]}
    before = {id(t): t.clone() for s in opt.state.values() for t in s.values()}
    assert live_targets(other_groups, opt) == []
    assert all(torch.equal(t, before[id(t)]) for s in opt.state.values() for t in s.values())

    shared = torch.tensor(7.0)
    for s in opt.state.values():
        s["step"] = shared
    opt.state[params[1]]["exp_avg"] = torch.zeros(3, dtype=torch.float64)
    saved = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(4)},
                       1: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}},
             "param_groups": state["param_groups"]}
    into = live_targets(saved, opt)
    assert [id(t) for t in into] == [id(opt.state[params[0]]["exp_avg"]), id(opt.state[params[1]]["exp_avg_sq"])]
    assert shared == 7.0

    half = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    half_opt = torch.optim.AdamW([half])
    half_opt.state[half] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3)}  # live in fp32, the parameter fp16
    saved = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(3)}},
             "param_groups": half_opt.state_dict()["param_groups"]}
    assert live_targets(saved, half_opt) == [half_opt.state[half]["step"]]  # a CPU step, kept as loaded
    saved["param_groups"][0]["capturable"] = True  # torch makes it float32 on the parameter's device: that one
    assert live_targets(saved, half_opt) == [half_opt.state[half]["step"]]
    half_opt.state[half]["step"] = torch.tensor(0.0, dtype=torch.float64)
    saved["state"][0]["step"] = torch.tensor(1.0, dtype=torch.float64)
    assert live_targets(saved, half_opt) == []  # capturable: torch would make the loaded float64 step float32
    del saved["param_groups"][0]["capturable"]
    assert live_targets(saved, half_opt) == [half_opt.state[half]["step"]]  # kept as loaded: float64 on the CPU


def test_nothing_is_written_into_the_optimizer_before_the_whole_file_is_read(tmp_path, monkeypatch):
    """A state tensor that cannot be copied out of the mapping as a view (a sparse one) is cloned, and the load
    succeeds; a copy-out that fails leaves the optimizer as it was, every tensor of it untouched."""
    torch.manual_seed(0)
    params, opt = trained_adam((4,), (2,))
    state = opt.state_dict()
    state["state"][1]["sparse"] = torch.eye(3).to_sparse()
    path = tmp_path / "optimizer.pt"
    torch.save(state, path)
    before = {id(t): t.clone() for s in opt.state.values() for t in s.values()}
    for s in opt.state.values():
        s["exp_avg"].add_(1.0)

    def failing(*args, **kwargs):
        raise OSError("the disk went away")
    monkeypatch.setattr(load_in_place, "copied_out", failing)
    with pytest.raises(OSError, match="went away"):
        load_optimizer_in_place(opt, load_mapped(str(path)), str(path))
    assert all(not torch.equal(s["exp_avg"], before[id(s["exp_avg"])]) for s in opt.state.values())  # not written
    monkeypatch.undo()
    load_optimizer_in_place(opt, load_mapped(str(path)), str(path))
    assert torch.equal(opt.state[params[1]]["sparse"].to_dense(), torch.eye(3))
    assert all(torch.equal(t, before[id(t)]) for s in opt.state.values() for k, t in s.items() if k != "sparse")


def test_copied_out_keeps_views_and_containers_and_leaves_nothing_mapped(tmp_path):
    """Every tensor not kept is copied out of the file's pages (views of one storage still one copy); a defaultdict,
    a namedtuple and a plain tuple come back as what they were."""
    base = torch.arange(10.0)
    state = {"d": defaultdict(list, {"x": [base, base[2:5]]}), "p": Pair(torch.ones(2), 3), "t": (torch.zeros(1),)}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    kept = torch.full((2,), 5.0)
    loaded = torch.load(str(path), mmap=True, weights_only=False)   # a namedtuple: a full unpickling
    loaded["p"] = loaded["p"]._replace(a=kept)
    out = copied_out(loaded, keep=[kept])
    path.write_bytes(bytes(path.stat().st_size))
    assert type(out["d"]) is defaultdict and type(out["p"]) is Pair and type(out["t"]) is tuple
    assert out["p"].a is kept and out["p"].b == 3 and torch.equal(out["t"][0], torch.zeros(1))
    x, part = out["d"]["x"]
    assert torch.equal(x, base) and torch.equal(part, base[2:5])
    assert part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_a_mapped_read_of_a_legacy_file_reads_it_and_a_truncated_one_is_named(tmp_path):
    """torch's legacy format cannot be mapped: read as it is. A truncated file: a ValueError naming it."""
    path = tmp_path / "optimizer.pt"
    torch.save({"state": {0: {"exp_avg": torch.ones(3)}}}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_torch(path, mmap=True)["state"][0]["exp_avg"], torch.ones(3))
    torch.save({"state": {0: {"exp_avg": torch.ones(300)}}}, path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="optimizer.pt is truncated or corrupt"):
        load_torch(path, mmap=True)


def test_learn_load_state_after_more_training_reads_into_the_optimizers_tensors_and_trains_on_as_from_the_file(dls, tmp_path):
    """`learn.load_state` of a checkpoint after more training on one device: the optimizer keeps its tensors, which
    now hold the checkpoint's values, and training on gives the weights a fresh Learner loading that checkpoint
    gets."""
    from fixtures import make_learner

    ckpt = tmp_path / "ckpt" / "step-00000002"
    learn = make_learner(dls, tmp_path)
    learn.fit(1, cbs=[Checkpoint("ckpt", every_n_steps=2)])
    before = {id(t) for s in learn.opt.state.values() for t in s.values()}
    learn.load_state(ckpt)
    assert {id(t) for s in learn.opt.state.values() for t in s.values()} == before and len(before) == 12
    saved = torch.load(ckpt / "optimizer.pt")["state"]
    params = [p for g in learn.opt.param_groups for p in g["params"]]
    assert all(torch.equal(learn.opt.state[params[i]][k], v) for i, s in saved.items() for k, v in s.items())
    learn.fit(1)
    fresh = make_learner(dls, tmp_path / "fresh")
    fresh.load_state(ckpt)
    fresh.fit(1)
    assert all(torch.equal(a, b) for a, b in zip(learn.model.state_dict().values(), fresh.model.state_dict().values()))


def test_each_mapped_tensor_is_read_from_its_own_bytes_in_the_file(tmp_path):
    """`file_offsets` places each mapped tensor (a view into a saved storage too) at the bytes the file holds for it,
    read back here with plain file reads; a placement that fits more than one way (two records of one size, only
    one of them loaded) is not guessed: {}, and the tensor is copied from the mapping instead."""
    base = torch.arange(12, dtype=torch.float32)
    state = {"a": torch.randn(5, dtype=torch.float64), "view": base[3:9], "b": torch.ones(7, dtype=torch.bfloat16)}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    mapped = load_mapped(str(path))
    offsets = load_in_place.file_offsets(str(path), list(mapped.values()))
    raw = path.read_bytes()
    for name, t in mapped.items():
        size = t.numel() * t.element_size()
        assert raw[offsets[id(t)]:offsets[id(t)] + size] == state[name].contiguous().view(torch.uint8).numpy().tobytes()
    torch.save({"x": torch.zeros(4), "y": torch.ones(4)}, path)
    one = load_mapped(str(path))["y"]
    assert load_in_place.file_offsets(str(path), [one]) == {}
    target = torch.zeros(4)
    container = {"y": one}
    load_in_place.read_into([(container, "y", target)], str(path))
    assert container["y"] is target and torch.equal(target, torch.ones(4))



def test_a_tensor_is_read_whole_however_short_each_read_is():
    """One read(2) returns at most 2 GiB on Linux (and less when interrupted): `read_exactly` reads on until the
    tensor is full, and says False only when the file ends first. A file object giving 5 bytes a read stands for
    that here (a 2 GiB tensor is too big for a test)."""
    import io

    class Short(io.BytesIO):
        def readinto(self, b):
            return super().readinto(memoryview(b)[:5])

    data = torch.arange(64, dtype=torch.float32)
    raw = bytes(16) + data.numpy().tobytes()
    out = torch.zeros(64)
    assert load_in_place.read_exactly(Short(raw), 16, out) and torch.equal(out, data)
    assert not load_in_place.read_exactly(Short(raw[:100]), 16, torch.zeros(64))
