"""A sharded checkpoint of `strategy="model_parallel"` (TP, PP) resumes under `strategy="fsdp"` and the other way round,
though the two lay the optimizer state out differently (flattened per parameter; torch's nested per parameter group):
the weights and the optimizer state (AdamW's moments and step, the hyper-parameters) load bitwise, the step counter
goes on, and the rest of the epoch ends as the run that did not switch (fp32 tolerance)."""

import json
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from cadence.distributed.distcp_read import DirectReader
from helpers import SCRIPTS, run_launch

MESH_TP2 = {"strategy": "model_parallel", "processes": 2, "pp_size": 1, "dp_replicate_size": 1, "dp_shard_size": 1,
            "tp_size": 2}
MESH_FSDP2 = {"strategy": "fsdp", "processes": 2, "dp_replicate_size": 1, "dp_shard_size": 2}


def _model_and_opt(seed, groups=2, lr=1e-2):
    """An nn.Sequential (its parameters named "0.weight", ...) and AdamW with one lr per layer (`groups=2`: `lr` and
    3 x `lr`) or one."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    params = ([{"params": model[0].parameters(), "lr": lr}, {"params": model[2].parameters(), "lr": lr * 3}]
              if groups == 2 else model.parameters())
    return model, torch.optim.AdamW(params, lr=lr, betas=(0.8, 0.9), foreach=False)


def _trained_checkpoint(path, flat, lr=1e-2):
    """The sharded checkpoint (torch's format, one process) of a model after two AdamW steps, its optimizer state
    flat (model_parallel's layout) or nested (FSDP's); returns the model and optimizer."""
    model, opt = _model_and_opt(0, lr=lr)
    for _ in range(2):
        model(torch.randn(5, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    state = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    dcp.save(dict(zip(("model", "optimizer"), state)), checkpoint_id=path, no_dist=True)
    return model, opt


def _read(path, model, opt, flat):
    """What an engine whose layout is `flat` does: its own state dicts, read from `path`, set."""
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    state = dict(zip(("model", "optimizer"), get_state_dict(model, opt, options=options)))
    DirectReader(path).load(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)


@pytest.mark.parametrize("saved_flat, lr", [(True, 1e-2), (False, 1e-2), (True, torch.tensor(1e-2)),
                                            (False, torch.tensor(1e-2))],
                         ids=["model_parallel-read-by-fsdp", "fsdp-read-by-model_parallel", "tensor-lr-read-by-fsdp",
                              "tensor-lr-read-by-model_parallel"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_either_optimizer_layout_loads_exactly_into_the_other_with_each_groups_hyper_parameters(tmp_path, saved_flat,
                                                                                                lr):
    saved_model, saved_opt = _trained_checkpoint(tmp_path / "sharded", saved_flat, lr)
    assert DirectReader(tmp_path / "sharded").optimizer_layout() == ("flat" if saved_flat else "nested")
    model, opt = _model_and_opt(1, lr=lr * 2)
    _read(tmp_path / "sharded", model, opt, flat=not saved_flat)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved_model.state_dict().values()))
    got, expected = opt.state_dict(), saved_opt.state_dict()
    assert [{**g, "lr": float(g["lr"])} for g in got["param_groups"]] == [
        {**g, "lr": float(g["lr"])} for g in expected["param_groups"]]    # lr 1e-2 and 3e-2 (not 2e-2, 6e-2), betas
    assert all(type(g["lr"]) is type(lr) for g in got["param_groups"])
    assert got["state"].keys() == expected["state"].keys()
    for i, state in expected["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in state.items()), i


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_optimizer_whose_groups_do_not_match_the_checkpoint_is_refused_before_any_weight_loads(tmp_path):
    _trained_checkpoint(tmp_path / "flat", flat=True)        # two groups, lr 1e-2 and 3e-2
    model, opt = _model_and_opt(1, groups=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"flat: the checkpoint gives the parameters of this optimizer's group 0 "
                                         r"different 'lr' \(0.weight: 0.01, 2.weight: 0.03\): build the optimizer "
                                         r"with the parameter groups of the run that wrote it"):
        _read(tmp_path / "flat", model, opt, flat=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    _trained_checkpoint(tmp_path / "nested", flat=False)
    wider = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"nested: the checkpoint's optimizer has no parameter group holding "
                                         r"\['3.bias', '3.weight'\] \(it holds \['0.bias', '0.weight', '2.bias', "
                                         r"'2.weight'\]\): it was written for another model or optimizer"):
        _read(tmp_path / "nested", wider, torch.optim.AdamW(wider.parameters()), flat=True)


def _script():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import sharded_engine_switch
    finally:
        sys.path.remove(str(SCRIPTS))
    return sharded_engine_switch


def _learner(root, ckpt, out, *args, nproc=2):
    """The script's Learner run on `nproc` processes (its checkpoints in root/ckpt, its files root/out.*)."""
    run_launch("sharded_engine_switch.py", "learner", "--ckpt", root / ckpt, "--out", root / out, *args, nproc=nproc,
               timeout=300)


def _one_process(root, ckpt, out, *args):
    """The script's Learner in this process: the plain model on the global batches of one dp group."""
    _script().learner_run(_script().parse(["learner", "--ckpt", str(root / ckpt), "--out", str(root / out), *args]))
    return torch.load(root / out)


def _resume_from(root, source, name, step):
    """A copy of the checkpoints `source` whose latest is step `step` (the later ones dropped)."""
    shutil.copytree(root / source, root / name)
    for later in (root / name).glob("step-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    (root / name / "latest").write_text(f"step-{step:08d}")


def _mesh(root, ckpt, step):
    return json.loads((root / ckpt / f"step-{step:08d}" / "state.json").read_text())["mesh"]


def _assert_same_state(got, expected):
    """Weights, optimizer state tensors and hyper-parameters equal bitwise (full state dicts keyed by names)."""
    assert got["step"] == expected["step"]
    assert got["model"].keys() == expected["model"].keys()
    for k, v in expected["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for name, state in expected["optimizer"]["state"].items():
        assert state.keys() == got["optimizer"]["state"][name].keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][name][key], value), f"{name}.{key}"


def _assert_close(got, expected):
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _loaded_in_one_process(root, engine, checkpoint, **sizes):
    """A fresh Learner in this process inside distrib_ctx(strategy=`engine`) after load_state(`checkpoint`): its
    state as the script's snapshot gives it (full, keyed by names)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    learn = _script().learner_for(_script().parse(["learner", "--ckpt", str(root / "unused"), "--out",
                                                   str(root / "unused.pt"), "--engine", engine]))
    with learn.distrib_ctx(strategy=engine, **sizes):
        learn.load_state(checkpoint)
        return {"model": learn.model.state_dict(), "optimizer": get_optimizer_state_dict(learn.model, learn.opt),
                "step": learn.step}


@pytest.fixture(scope="module")
def tp2_then_fsdp(tmp_path_factory):
    """run/: tp=2 on 2 processes stopped after step 4 (tp2.pt.4); switched/: resumed under strategy="fsdp" on 2
    processes to the end of the epoch (fsdp.pt.start, fsdp.pt.6, fsdp.pt); reference.pt: the one-process run."""
    root = tmp_path_factory.mktemp("tp2_then_fsdp")
    _learner(root, "run", "tp2.pt", "--engine", "model_parallel", "--tp", "2", "--stop-at", "4")
    shutil.copytree(root / "run", root / "switched")
    _learner(root, "switched", "fsdp.pt", "--engine", "fsdp", "--snapshot-at", "6")
    _one_process(root, "reference", "reference.pt", "--engine", "fsdp")
    return root


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # torch's reader on one process
def test_a_tp2_checkpoint_resumes_exactly_under_fsdp_and_fsdps_checkpoint_loads_exactly_under_model_parallel(
        tp2_then_fsdp):
    root = tp2_then_fsdp
    assert _mesh(root, "run", 4) == MESH_TP2 and _mesh(root, "switched", 6) == MESH_FSDP2
    _assert_same_state(torch.load(root / "fsdp.pt.start"), torch.load(root / "tp2.pt.4"))
    _assert_close(torch.load(root / "fsdp.pt"), torch.load(root / "reference.pt"))   # as if it had not switched
    assert _mesh(root, "switched", 8) == MESH_FSDP2                                    # the steps went on

    older = root / "older"             # FSDP's, written before state.json recorded the mesh: told by its .metadata
    shutil.copytree(root / "switched" / "step-00000006", older)
    state = json.loads((older / "state.json").read_text())
    (older / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "mesh"}))
    in_one = _loaded_in_one_process(root, "model_parallel", older, tp_size=1)
    _assert_same_state(in_one, torch.load(root / "fsdp.pt.6"))
    in_one = _loaded_in_one_process(root, "fsdp", root / "run" / "step-00000004")
    _assert_same_state(in_one, torch.load(root / "tp2.pt.4"))


@pytest.mark.slow
@pytest.mark.long
def test_fsdps_checkpoint_resumes_exactly_under_tp2_on_two_processes(tp2_then_fsdp):
    root = tp2_then_fsdp
    _resume_from(root, "switched", "back", 6)
    _learner(root, "back", "back.pt", "--engine", "model_parallel", "--tp", "2")
    _assert_same_state(torch.load(root / "back.pt.start"), torch.load(root / "fsdp.pt.6"))
    _assert_close(torch.load(root / "back.pt"), torch.load(root / "reference.pt"))
    assert _mesh(root, "back", 8) == MESH_TP2


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_pipeline_checkpoint_resumes_exactly_under_fsdp_and_fsdps_under_the_pipeline(tmp_path):
    """pp=2 (nn.Sequential cut before child 4, a tie inside stage 0) -> fsdp -> pp=2, on 2 processes."""
    seq = ("--model", "seq")
    _learner(tmp_path, "run", "pp.pt", *seq, "--engine", "model_parallel", "--pp", "2", "--stop-at", "4")
    assert _mesh(tmp_path, "run", 4) == {**MESH_TP2, "pp_size": 2, "tp_size": 1}
    shutil.copytree(tmp_path / "run", tmp_path / "switched")
    _learner(tmp_path, "switched", "fsdp.pt", *seq, "--engine", "fsdp", "--stop-at", "6")
    _assert_same_state(torch.load(tmp_path / "fsdp.pt.start"), torch.load(tmp_path / "pp.pt.4"))
    _learner(tmp_path, "switched", "back.pt", *seq, "--engine", "model_parallel", "--pp", "2")
    _assert_same_state(torch.load(tmp_path / "back.pt.start"), torch.load(tmp_path / "fsdp.pt.6"))
    _assert_close(torch.load(tmp_path / "back.pt"), _one_process(tmp_path, "reference", "reference.pt", *seq,
                                                                 "--engine", "fsdp"))


@pytest.mark.slow
@pytest.mark.long
def test_accelerators_tp2_save_state_loads_exactly_under_dp_shard_2_and_trains_on_as_if_unswitched(tmp_path):
    """save_state under ParallelismConfig(tp_size=2), load_state under ParallelismConfig(tp_size=1, dp_shard_size=2)
    (plain FSDP2), both on 2 processes; a StepLR prepared with them goes on."""
    run_launch("sharded_engine_switch.py", "accelerator", tmp_path, "save", nproc=2, timeout=300)
    run_launch("sharded_engine_switch.py", "accelerator", tmp_path, "load", nproc=2, timeout=300)
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["mesh"] == MESH_TP2
    saved, loaded = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt")
    _assert_same_state(loaded, saved)
    assert loaded["lr"] == saved["lr"] and saved["step"] > 0
    _assert_close(torch.load(tmp_path / "switched.pt"), torch.load(tmp_path / "unswitched.pt"))
