"""A `model_parallel` checkpoint records the mesh that wrote it and resumes exactly on another one (torch reshards it
as it loads: other tp, dp, pp sizes, another pipeline split, another number of processes), compared with a run that
did not stop; a Learner outside distrib_ctx, which cannot read it, is refused naming its mesh."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import SCRIPTS, cadence_env, run_launch

LAYOUT_TP2 = {"strategy": "model_parallel", "processes": 2, "pp_size": 1, "dp_replicate_size": 1, "dp_shard_size": 1,
              "tp_size": 2}


def _launch(tmp_path, nproc, ckpt, out, *args):
    return run_launch("mesh_resume.py", "--ckpt", tmp_path / ckpt, "--out", tmp_path / out, *args, nproc=nproc,
                      timeout=300)


def _one_process(tmp_path, ckpt, out, *args):
    """The script without the launcher: the plain model, the global batches of a mesh with one dp group."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "mesh_resume.py"), "--ckpt", str(tmp_path / ckpt),
                           "--out", str(tmp_path / out), *args], capture_output=True, text=True, timeout=300,
                          env=cadence_env(PYTHONPATH=str(SCRIPTS)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / out)


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _learner(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        from mesh_resume import learner
    finally:
        sys.path.remove(str(SCRIPTS))
    return learner("lm", tmp_path / "unused")


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """A tp=2 run on 2 processes stopped after step 4 (its checkpoint in run/step-00000004, its weights stopped.pt)."""
    out = tmp_path_factory.mktemp("tp2_run")
    _launch(out, 2, "run", "stopped.pt", "--tp", "2", "--stop-at", "4")
    return out


@pytest.mark.slow
def test_a_tp2_checkpoint_records_its_mesh_and_resumes_exactly_as_fsdp2_over_the_same_processes(tmp_path, tp2_run):
    state = json.loads((tp2_run / "run" / "step-00000004" / "state.json").read_text())
    assert state["mesh"] == LAYOUT_TP2
    stopped = torch.load(tp2_run / "stopped.pt")
    reference = _one_process(tmp_path, "reference", "reference.pt", "--tp", "2")   # tp=2's batches, never stopped

    shutil.copytree(tp2_run / "run", tmp_path / "run")
    _launch(tmp_path, 2, "run", "resumed.pt", "--tp", "1")                      # FSDP2 over dp=2 (tp_size=1)
    _assert_equal(torch.load(tmp_path / "resumed.pt.start"), stopped)            # the saved weights, loaded exactly
    _assert_close(torch.load(tmp_path / "resumed.pt"), reference)               # and the epoch ends as if unstopped
    assert json.loads((tmp_path / "run" / "step-00000008" / "state.json").read_text())["mesh"] == {
        **LAYOUT_TP2, "dp_shard_size": 2, "tp_size": 1}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # torch's reader on one process
def test_a_tp2_checkpoint_loads_under_fsdp_is_refused_outside_distrib_ctx_and_loads_without_the_record(
        tmp_path, tp2_run):
    checkpoint = tp2_run / "run" / "step-00000004"
    stopped = torch.load(tp2_run / "stopped.pt")
    fsdp = _learner(tmp_path)
    with fsdp.distrib_ctx(strategy="fsdp"):
        fsdp.load_state(checkpoint)
    _assert_equal(fsdp.model.state_dict(), stopped)
    plain = _learner(tmp_path)
    with pytest.raises(ValueError, match=r"tp_size=2\), which a Learner outside distrib_ctx cannot read.*"
                                         r"dcp_to_torch_save"):
        plain.load_state(checkpoint)

    older = tmp_path / "older"      # written before the mesh was recorded: loads as before
    shutil.copytree(checkpoint, older)
    state = json.loads((older / "state.json").read_text())
    (older / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "mesh"}))
    inside = _learner(tmp_path)
    with inside.distrib_ctx(strategy="model_parallel", tp_size=1):
        inside.load_state(older)
    _assert_equal(inside.model.state_dict(), stopped)


@pytest.mark.slow
@pytest.mark.long
def test_a_pipeline_checkpoint_resumes_exactly_with_another_split_more_stages_and_tp_inside_the_stages(tmp_path):
    reference = _one_process(tmp_path, "reference", "reference.pt", "--model", "seq")   # pp x tp: dp=1's batches
    _launch(tmp_path, 2, "run", "stopped.pt", "--model", "seq", "--pp", "2", "--split", "4", "--stop-at", "4")
    state = json.loads((tmp_path / "run" / "step-00000004" / "state.json").read_text())
    assert state["mesh"] == {**LAYOUT_TP2, "pp_size": 2, "tp_size": 1}
    stopped = torch.load(tmp_path / "stopped.pt")
    for name, nproc, mesh in (("split6", 2, ("--pp", "2", "--split", "6")),
                              ("pp4", 4, ("--pp", "4", "--split", "4,6,8")),
                              ("pp2xtp2", 4, ("--pp", "2", "--tp", "2", "--split", "4"))):
        shutil.copytree(tmp_path / "run", tmp_path / name)
        _launch(tmp_path, nproc, name, f"{name}.pt", "--model", "seq", *mesh)
        _assert_equal(torch.load(tmp_path / f"{name}.pt.start"), stopped)
        _assert_close(torch.load(tmp_path / f"{name}.pt"), reference)


@pytest.mark.slow
@pytest.mark.long
def test_a_2x2_checkpoint_resumes_exactly_on_tp4_and_on_hsdp(tmp_path):
    """tp=2 x dp=2 on 4 processes stopped after step 2, resumed with tp_size=4 and with tp_size=1 on (dp_replicate 2,
    dp_shard 2): the rest of the epoch keeps the saved global batches, so it ends as the run that did not stop."""
    _launch(tmp_path, 4, "reference", "reference.pt", "--tp", "2")
    _launch(tmp_path, 4, "run", "stopped.pt", "--tp", "2", "--stop-at", "2")
    stopped, reference = torch.load(tmp_path / "stopped.pt"), torch.load(tmp_path / "reference.pt")
    two_by_two = {**LAYOUT_TP2, "processes": 4, "dp_shard_size": 2}
    assert json.loads((tmp_path / "run" / "step-00000002" / "state.json").read_text())["mesh"] == two_by_two
    for name, mesh, sizes in (("tp4", ("--tp", "4"), {"dp_shard_size": 1, "tp_size": 4}),
                              ("hsdp", ("--tp", "1", "--replicate", "2"), {"dp_replicate_size": 2, "tp_size": 1})):
        shutil.copytree(tmp_path / "run", tmp_path / name)
        _launch(tmp_path, 4, name, f"{name}.pt", *mesh)
        _assert_equal(torch.load(tmp_path / f"{name}.pt.start"), stopped)
        _assert_close(torch.load(tmp_path / f"{name}.pt"), reference)
        resumed = json.loads((tmp_path / name / "step-00000004" / "state.json").read_text())
        assert resumed["mesh"] == {**two_by_two, **sizes}, name           # each checkpoint records its own mesh
