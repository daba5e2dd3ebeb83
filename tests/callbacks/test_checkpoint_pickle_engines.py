"""The engines' own checkpoint files cannot run code on resume: a real checkpoint, saved by cadence, with a pickle
payload added to one of DeepSpeed's files or to torch's distributed checkpoint (its `.metadata`, a non-tensor item)
is refused naming the file, the payload never runs, and the same checkpoint unpoisoned resumes exactly."""

import io
import pickle
import re
import shutil

import pytest
import torch
from fixtures import make_learner

from cadence.callbacks.checkpoint import Checkpoint
from tests.helpers import REPO, run_launch


class Payload:
    """Unpickled, it creates the file `marker` (through `open`, which no checkpoint format allows)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def poison(file, marker):
    """`file` (a `torch.save` of a dict) with a payload added; checked live: an unrestricted load runs it."""
    state = torch.load(file, weights_only=False)
    state["extra"] = Payload(marker)
    torch.save(state, file)
    torch.load(file, weights_only=False)
    assert marker.exists()
    marker.unlink()


def full_state(learn):
    return comparable(learn.strategy.model_state_dict(learn.model),
                      learn.strategy.optimizer_state_dict(learn.model, learn.opt))


def comparable(weights, opt):
    """Weights and optimizer state, the parameters' states in parameter order (a sharded engine keys them by name,
    one process by position)."""
    return weights, list(opt["state"].values()), [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]


def assert_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b) and all(assert_equal(x, y) is None for x, y in zip(a, b))
    else:
        assert a == b


@pytest.mark.parametrize("stage, poisoned", [(1, "mp_rank_00_model_states.pt"),
                                             (3, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                                             (3, "zero_pp_rank_0_mp_rank_00_model_states.pt")])
def test_a_deepspeed_file_holding_code_is_refused_and_the_checkpoint_resumes_exactly(dls, tmp_path, stage, poisoned):
    pytest.importorskip("deepspeed")

    def learner():
        return make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2, every_epoch=False)])

    learn = learner()
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
        learn.fit(1)                                                        # 4 steps: step-00000002, step-00000004
        saved = full_state(learn)
    checkpoint, marker = tmp_path / "checkpoints" / "step-00000004", tmp_path / "PWNED"
    hostile = tmp_path / "hostile" / checkpoint.name
    shutil.copytree(checkpoint, hostile)
    poison(hostile / "deepspeed" / poisoned, marker)

    learn = learner()
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
        with pytest.raises(ValueError, match=re.escape(str(hostile / "deepspeed" / poisoned)) + r" holds a reference "
                           r"to \S*open, which DeepSpeed's own checkpoint files never hold.*refuses it"):
            learn.fit(1, resume=hostile)
    assert not marker.exists()

    learn = learner()
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
        learn.fit(1, resume=checkpoint)                                     # the epoch was complete: nothing to train
        assert learn.step == 4
        assert_equal(full_state(learn), saved)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_zero3_checkpoint_holding_code_is_refused_before_its_universal_conversion(tmp_path):
    """Resumed on another number of processes, every file of the checkpoint is checked before DeepSpeed's converter
    (which unpickles them all unchecked) reads one: here rank 1's, which a 1-process resume would not read itself."""
    pytest.importorskip("deepspeed")
    ckpt, out, marker = tmp_path / "ckpt", tmp_path / "out", tmp_path / "PWNED"
    out.mkdir()
    run_launch("deepspeed_universal.py", str(ckpt), str(out), "3", timeout=240)
    engine_files = ckpt / "zero3" / "step-00000003" / "deepspeed"
    file = engine_files / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy2(file, tmp_path / "clean.pt")
    poison(file, marker)
    resumed = run_launch("deepspeed_universal.py", str(ckpt), str(out), "3", "--resume", nproc=1, timeout=240,
                         check=False)
    assert resumed.returncode != 0
    assert f"{file} holds a reference to" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    assert not marker.exists() and not list((ckpt / "zero3").glob(".*universal*"))

    shutil.copy2(tmp_path / "clean.pt", file)
    resumed = run_launch("deepspeed_universal.py", str(ckpt), str(out), "3", "--resume", nproc=1, timeout=240)
    assert "ZERO3 LOADED True True True" in resumed.stdout                  # weights, Adam moments, groups: bitwise


FSDP_SAVE = """
import sys, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from fixtures import make_data, make_learner
from torch.utils.data import DataLoader
from cadence import DataLoaders
from cadence.callbacks.checkpoint import Checkpoint
from cadence.distributed.env import is_main_process

root = Path(sys.argv[1])
train, valid = make_data()
dls = DataLoaders(DataLoader(train, batch_size=16), DataLoader(valid, batch_size=16), device="cpu")
learn = make_learner(dls, root, [Checkpoint(every_n_steps=2, every_epoch=False)])
with learn.distrib_ctx(strategy="fsdp"):
    learn.fit(1)                                   # 2 steps on 2 processes: step-00000002 is sharded
    state = (learn.strategy.model_state_dict(learn.model), learn.strategy.optimizer_state_dict(learn.model, learn.opt))
if is_main_process():
    torch.save(state, root / "saved.pt")
"""


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    """A checkpoint FSDP2 wrote sharded on 2 processes, and the full state it holds."""
    root = tmp_path_factory.mktemp("fsdp")
    script = root / "save.py"
    script.write_text(FSDP_SAVE.format(tests=str(REPO / "tests")))
    run_launch(script, str(root), timeout=240)
    checkpoint = root / "checkpoints" / "step-00000002"
    assert (checkpoint / "sharded" / ".metadata").is_file()
    return checkpoint, comparable(*torch.load(root / "saved.pt", weights_only=True))


def resume_fsdp(dls, tmp_path, checkpoint):
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2, every_epoch=False)])
    with learn.distrib_ctx(strategy="fsdp"):
        learn.fit(1, resume=checkpoint)
        return learn, full_state(learn)


def hostile_copy(checkpoint, tmp_path):
    hostile = tmp_path / "hostile" / checkpoint.name
    shutil.copytree(checkpoint, hostile)
    return hostile


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_fsdp_metadata_holding_code_is_refused(fsdp_checkpoint, dls, tmp_path):
    hostile, marker = hostile_copy(fsdp_checkpoint[0], tmp_path), tmp_path / "PWNED"
    metadata = hostile / "sharded" / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match=re.escape(str(metadata)) + r" holds a reference to \S*open, which torch's "
                                         r"checkpoint metadata never holds"):
        resume_fsdp(dls, tmp_path, hostile)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_fsdp_item_holding_code_is_refused(fsdp_checkpoint, dls, tmp_path):
    """A valid `.metadata` that points a non-tensor item (the learning rate) at a pickle of code of the attacker's."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    hostile, marker = hostile_copy(fsdp_checkpoint[0], tmp_path), tmp_path / "PWNED"
    metadata = pickle.loads((hostile / "sharded" / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    shard = hostile / "sharded" / metadata.storage_data[index].relative_path
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)                                    # as torch's save writes an item
    payload = payload.getvalue()
    with open(shard, "ab") as f:
        offset = f.tell()
        f.write(payload)
    metadata.storage_data[index] = _StorageInfo(shard.name, offset, len(payload))
    (hostile / "sharded" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=re.escape(f"{shard} (item {index.fqn}) holds objects other than numbers")):
        resume_fsdp(dls, tmp_path, hostile)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_fsdp_sharded_checkpoint_resumes_exactly_on_one_process(fsdp_checkpoint, dls, tmp_path):
    checkpoint, saved = fsdp_checkpoint
    learn, state = resume_fsdp(dls, tmp_path, checkpoint)
    assert learn.step == 2
    assert_equal(state, saved)


def test_a_sharded_folder_the_checkpoint_does_not_list_is_not_read(dls, tmp_path):
    """One process writes the base format; a `sharded/` dropped in beside it (not in state.json) is never opened."""
    learn = make_learner(dls, tmp_path, [Checkpoint(every_n_steps=2, every_epoch=False)])
    with learn.distrib_ctx(strategy="fsdp"):
        learn.fit(1)
        saved = full_state(learn)
    checkpoint, marker = tmp_path / "checkpoints" / "step-00000004", tmp_path / "PWNED"
    (checkpoint / "sharded").mkdir()
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    learn, state = resume_fsdp(dls, tmp_path, checkpoint)
    assert not marker.exists() and learn.step == 4
    assert_equal(state, saved)


def test_the_deepspeed_classes_fp16_checkpoints_hold_load_as_data(tmp_path):
    """fp16 (no fp16 on this CPU's DeepSpeed) saves its dynamic loss scaler, dtype included, in the optimizer file."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from cadence.distributed.safe_load import load_deepspeed_file

    file = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    scaler = DynamicLossScaler(2.0**16, 1000, 1.0, 2, False, dtype=torch.float16)
    torch.save({"loss_scaler": scaler, "zero_stage": ZeroStageEnum.weights, "slices": {"w": fragment_address(4, 0)},
                "state": torch.ones(2)}, file)
    loaded = load_deepspeed_file(file, "cpu")
    assert vars(loaded["loss_scaler"]) == vars(scaler) and loaded["zero_stage"] is ZeroStageEnum.weights
    assert loaded["slices"] == {"w": fragment_address(4, 0)} and torch.equal(loaded["state"], torch.ones(2))
