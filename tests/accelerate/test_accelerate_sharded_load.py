"""`Accelerator.load_state` of a sharded checkpoint (tensor parallelism's, written on 2 processes): an Accelerator
whose engine cannot read it (plain, one process) refuses it before anything loads, naming the format, what wrote it
and how to load it; one on FSDP2 reads it exactly; state.json records the engine and mesh; the conversion the
message names gives the trained weights."""

import json
import shutil
import sys

import pytest
import torch

from helpers import SCRIPTS, run_launch


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """OUT/ckpt (save_state under ParallelismConfig(tp_size=2) on 2 processes) and OUT/weights.pt (its weights)."""
    out = tmp_path_factory.mktemp("tp_run")
    run_launch("mesh_accelerator.py", out, nproc=2, timeout=300)
    return out


def _make_model():
    sys.path.insert(0, str(SCRIPTS))
    try:
        from mesh_accelerator import make_model
    finally:
        sys.path.remove(str(SCRIPTS))
    return make_model()


def _prepared(accelerator):
    model = _make_model()
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model


def _unchanged(accelerator, model):
    """Whether the model still holds its initial weights (the refused load changed nothing)."""
    fresh = _make_model().state_dict()
    return all(torch.equal(v, fresh[k]) for k, v in accelerator.unwrap_model(model).state_dict().items())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # torch's reader on one process
def test_a_plain_accelerator_refuses_a_tensor_parallel_checkpoint_naming_its_mesh_and_how_to_load_it(tmp_path, tp_run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from cadence import Accelerator

    state = json.loads((tp_run / "ckpt" / "state.json").read_text())
    assert state["mesh"] == {"strategy": "model_parallel", "processes": 2, "pp_size": 1, "dp_replicate_size": 1,
                             "dp_shard_size": 1, "tp_size": 2}
    accelerator = Accelerator(cpu=True)
    model = _prepared(accelerator)
    with pytest.raises(ValueError, match=r"is a sharded checkpoint \(torch.distributed.checkpoint's format in sharded/\) "
                                         r"written by 2 processes under strategy=\"model_parallel\" \(pp_size=1, "
                                         r"dp_replicate_size=1, dp_shard_size=1, tp_size=2\), which this Accelerator "
                                         r"\(DDP on 1 process\) cannot read.*ParallelismConfig\(tp_size=\.\.\.\).*"
                                         r"dcp_to_torch_save"):
        accelerator.load_state(tp_run / "ckpt")
    assert _unchanged(accelerator, model)
    dcp_to_torch_save(tp_run / "ckpt" / "sharded", tmp_path / "full.pt")   # the conversion it names: the trained weights
    converted, trained = torch.load(tmp_path / "full.pt")["model"], torch.load(tp_run / "weights.pt")
    assert converted.keys() == trained.keys() and all(torch.equal(converted[k], trained[k]) for k in trained)

    older = tmp_path / "older"        # a checkpoint written before the mesh was recorded: refused all the same
    shutil.copytree(tp_run / "ckpt", older)
    (older / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "mesh"}))
    with pytest.raises(ValueError, match=r"written by 2 processes under strategy=\"model_parallel\" \(TP, 2-D, PP\) or "
                                         r"\"fsdp\", which this Accelerator \(DDP on 1 process\) cannot read"):
        accelerator.load_state(older)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdps_engine_loads_a_tensor_parallel_checkpoint_exactly(tmp_path, tp_run):
    """An Accelerator on FSDP2 reads tensor parallelism's checkpoint (its optimizer state laid out per parameter, FSDP's
    per parameter group): the trained weights and AdamW's moments and step, bitwise."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from cadence import Accelerator

    accelerator = Accelerator(cpu=True, strategy="fsdp")
    model = _make_model()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.load_state(tp_run / "ckpt")
    trained, loaded = torch.load(tp_run / "weights.pt"), accelerator.unwrap_model(model).state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
    dcp_to_torch_save(tp_run / "ckpt" / "sharded", tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt")["optimizer"]
    state = get_optimizer_state_dict(accelerator.unwrap_model(model), opt.optimizer)["state"]
    assert {f"state.{n}.{k}" for n, s in state.items() for k in s} == {k for k in saved if k.startswith("state.")}
    assert all(torch.equal(v, saved[f"state.{n}.{k}"]) for n, s in state.items() for k, v in s.items())
