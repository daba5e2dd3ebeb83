"""A saved optimizer state read from the mapped file straight into the tensors a trained optimizer holds
(`cadence/distributed/load_in_place.py`): the base engines' `load_state` (one device, DDP), real optimizers and files."""

from collections import defaultdict, namedtuple

import pytest
import torch
from torch import nn

from cadence import Checkpoint
from cadence.distributed.load_in_place import copied_out, load_mapped, load_optimizer_in_place, optimizer_state_into
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
    load_optimizer_in_place(opt, load_mapped(str(path)))
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


def test_what_cannot_stand_in_for_the_loaded_tensor_is_copied_out_and_loaded_as_torch_does(tmp_path):
    """Groups of other sizes: nothing is written into the optimizer (torch's `load_state_dict` refuses them). A step
    tensor shared by two parameters' states, a state of another dtype or shape, or a parameter of another dtype
    (torch would convert the loaded state): copied out of the mapping, the live tensor untouched."""
    torch.manual_seed(0)
    params, opt = trained_adam((3,), (3,))
    state = opt.state_dict()
    other_groups = {**state, "param_groups": [{**state["param_groups"][0], "params": [0, 1]},
                                              {**state["param_groups"][1], "params": []}]}
    before = {id(t): t.clone() for s in opt.state.values() for t in s.values()}
    assert optimizer_state_into(other_groups, opt.state, [g["params"] for g in opt.param_groups]) == []
    assert all(torch.equal(t, before[id(t)]) for s in opt.state.values() for t in s.values())

    shared = torch.tensor(7.0)
    for s in opt.state.values():
        s["step"] = shared
    opt.state[params[1]]["exp_avg"] = torch.zeros(3, dtype=torch.float64)
    saved = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(4)},
                       1: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}},
             "param_groups": state["param_groups"]}
    into = optimizer_state_into(saved, opt.state, [g["params"] for g in opt.param_groups])
    assert [id(t) for t in into] == [id(opt.state[params[0]]["exp_avg"]), id(opt.state[params[1]]["exp_avg_sq"])]
    assert shared == 7.0 and saved["state"][0]["step"] is not shared and saved["state"][1]["exp_avg"].dtype == torch.float32

    half = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    half_opt = torch.optim.AdamW([half])
    half_opt.state[half] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3)}  # live in fp32, the parameter fp16
    saved = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(3)}},
             "param_groups": half_opt.state_dict()["param_groups"]}
    assert optimizer_state_into(saved, half_opt.state, [[half]]) == [half_opt.state[half]["step"]]


def test_copied_out_keeps_views_and_containers_and_leaves_nothing_mapped(tmp_path):
    """Every tensor not kept is copied out of the file's pages (views of one storage still one copy); a defaultdict,
    a namedtuple and a plain tuple come back as what they were."""
    base = torch.arange(10.0)
    state = {"d": defaultdict(list, {"x": [base, base[2:5]]}), "p": Pair(torch.ones(2), 3), "t": (torch.zeros(1),)}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    kept = torch.full((2,), 5.0)
    loaded = load_mapped(str(path), weights_only=False)
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


def test_learn_load_state_mid_session_reads_into_the_optimizers_tensors_and_trains_on_as_from_the_file(dls, tmp_path):
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
