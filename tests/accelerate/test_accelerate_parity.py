"""What a user moving from Accelerate 1.15 notices: `save_model(safe_serialization=False)`, `find_executable_batch_size`'s
reduction, `get_state_dict(unwrap=False)`, a prepared loader's `total_batch_size` / `total_dataset_length`,
`accelerator.step` under accumulation, and `load_state` of a checkpoint Accelerate's `save_state` wrote.

Expected values are written by hand or come from the real Accelerate (tests/scripts/accelerate_parity_reference.py,
one process on the CPU, run once for this module); the DDP cases run in one launch of
tests/scripts/accelerate_parity_ddp.py.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Accelerator, ProjectConfiguration, find_executable_batch_size
from helpers import SCRIPTS, Counter, cadence_env, run_launch


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


# ---------------------------------------------------------------------------- save_model(safe_serialization=False)
def test_save_model_without_safetensors_writes_pytorch_model_bin_that_torch_load_reads(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(_model())
    acc.save_model(model, tmp_path / "export", safe_serialization=False)
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["pytorch_model.bin"]
    loaded = torch.load(tmp_path / "export" / "pytorch_model.bin", weights_only=True)
    assert list(loaded) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_save_model_without_safetensors_shards_as_accelerate_and_load_checkpoint_in_model_reads_it(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(_model())
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "pytorch_model.bin").write_bytes(b"an earlier, unsharded save")
    acc.save_model(model, tmp_path / "export", max_shard_size=60, safe_serialization=False)
    # by hand: 0.weight 48 bytes, 0.bias 16 (48 + 16 > 60: next shard), 2.weight 16, 2.bias 4
    first, second = "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [first, second, "pytorch_model.bin.index.json"]
    index = json.loads((tmp_path / "export" / "pytorch_model.bin.index.json").read_text())
    assert index == {"metadata": {"total_size": 84},
                     "weight_map": {"0.weight": first, "0.bias": second, "2.weight": second, "2.bias": second}}
    accelerate_utils = pytest.importorskip("accelerate.utils")
    fresh = _model(seed=1)
    accelerate_utils.load_checkpoint_in_model(fresh, str(tmp_path / "export"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_save_model_without_safetensors_names_the_files_as_the_real_accelerate(reference, tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(_model())
    acc.save_model(model, tmp_path / "export", max_shard_size=60, safe_serialization=False)
    ours = {p.name: p for p in (tmp_path / "export").iterdir()}
    theirs = {p.name: p for p in (reference / "model_bin").iterdir()}
    assert sorted(ours) == sorted(theirs)
    assert json.loads(ours["pytorch_model.bin.index.json"].read_text()) == \
        json.loads(theirs["pytorch_model.bin.index.json"].read_text())
    for name in ours.keys() - {"pytorch_model.bin.index.json"}:
        assert list(torch.load(ours[name], weights_only=True)) == list(torch.load(theirs[name], weights_only=True))


def test_a_tied_weight_goes_to_the_shard_of_its_first_name_and_stays_tied(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight                  # 160 bytes, stored once; the bias 40 bytes
    acc = Accelerator(cpu=True)
    acc.save_model(acc.prepare(model), tmp_path, max_shard_size=100, safe_serialization=False)
    # by hand: 0.weight is over the limit, alone in shard 1 with its alias; the bias starts shard 2
    first, second = "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    assert index == {"metadata": {"total_size": 200}, "weight_map": {"0.weight": first, "1.weight": first,
                                                                    "1.bias": second}}
    loaded = torch.load(tmp_path / first, weights_only=True)
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()


def test_an_export_of_one_format_replaces_the_others_weights_and_keeps_other_files(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(_model())
    acc.save_model(model, tmp_path, safe_serialization=True)
    (tmp_path / "tokenizer.json").write_text("{}")
    acc.save_model(model, tmp_path, max_shard_size=60, safe_serialization=False)
    shards = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [*shards, "tokenizer.json"]   # no model.safetensors left
    acc.save_model(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "tokenizer.json"]


def test_a_bin_export_that_fails_leaves_the_previous_export_whole(tmp_path, monkeypatch):
    from cadence.callbacks.checkpoint import bin_export

    acc = Accelerator(cpu=True)
    model = acc.prepare(_model())
    acc.save_model(model, tmp_path / "export", max_shard_size=60, safe_serialization=False)
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    written = []

    def full_disk(obj, path, **kwargs):   # the second file's write fails, as on a full disk
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        torch.save(obj, path)
    monkeypatch.setattr(bin_export, "save_torch", full_disk)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(OSError, match="could not write the export .*export.*The previous export there, if any, is untouched"):
        acc.save_model(model, tmp_path / "export", max_shard_size=60, safe_serialization=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]                # no staged directory left behind


# ---------------------------------------------------------------------------- find_executable_batch_size
def _out_of_memory_above(limit: int, tried: list):
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size
    return train


def test_find_executable_batch_size_multiplies_by_0_9_as_accelerate_1_15():
    tried = []
    train = find_executable_batch_size(_out_of_memory_above(100, tried), starting_batch_size=128)
    assert train() == 92 and tried == [128, 115, 103, 92]   # int(128*.9)=115, int(115*.9)=103, int(103*.9)=92
    assert train() == 92 and tried[4:] == [92]              # the size found is kept: the next call starts there


def test_find_executable_batch_size_takes_the_size_reduce_batch_size_fn_returns():
    tried, sizes = [], iter([64, 32, 16, 8])
    train = find_executable_batch_size(_out_of_memory_above(20, tried), starting_batch_size=128,
                                       reduce_batch_size_fn=lambda: next(sizes))
    assert train() == 16 and tried == [128, 64, 32, 16]


def test_find_executable_batch_size_stops_at_zero_and_refuses_a_batch_size_given():
    @find_executable_batch_size(starting_batch_size=4, reduce_batch_size_fn=lambda: 0)
    def never_fits(batch_size):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(RuntimeError, match="reached zero"):
        never_fits()

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size, model):
        return batch_size

    with pytest.raises(TypeError, match=r"train\(model="):
        train(32, "model")
    assert train("model") == 4


# ---------------------------------------------------------------------------- get_state_dict, loaders, step
def test_get_state_dict_unwrap_false_on_one_process_is_the_models_own():
    acc = Accelerator(cpu=True)
    model = acc.prepare(_model())
    assert list(acc.get_state_dict(model, unwrap=False)) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_total_batch_size_and_total_dataset_length_on_one_process():
    acc = Accelerator(cpu=True)
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    assert (dl.total_batch_size, dl.total_dataset_length, len(dl)) == (4, 10, 3)


def test_step_counts_accumulate_blocks_until_the_loader_ends_as_accelerate(reference):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(model, opt, DataLoader(TensorDataset(torch.randn(10, 3), torch.randn(10, 1)),
                                                        batch_size=2))
    seen = []
    for _ in range(2):
        for x, y in dl:
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            seen.append([acc.step, acc.sync_gradients])
    by_hand = [[1, False], [2, True], [3, False], [4, True], [0, True]] * 2
    assert seen == by_hand == json.loads((reference / "reference.json").read_text())["accumulation_steps"]


# ---------------------------------------------------------------------------- load_state of Accelerate's checkpoint
_LAUNCHED = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What the real Accelerate wrote and did (tests/scripts/accelerate_parity_reference.py), run once."""
    out = tmp_path_factory.mktemp("accelerate_reference")
    env = {k: v for k, v in cadence_env().items() if k not in _LAUNCHED}   # one plain process, whatever ran before
    proc = subprocess.run([sys.executable, str(SCRIPTS / "accelerate_parity_reference.py"), str(out)],
                          env=env, timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, f"the reference run with Accelerate failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _resuming_run():
    """The objects the Accelerate run prepared, built afresh (other weights, no optimizer state) on cadence."""
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model(seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    model, opt, dl, sched = acc.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=True), sched)
    return acc, model, opt, sched, counter


@pytest.mark.parametrize("variant", ["checkpoint_safetensors", "checkpoint_bin"])
def test_load_state_resumes_from_a_checkpoint_accelerate_wrote(reference, variant):
    expected = torch.load(reference / "expected.pt", weights_only=True)
    acc, model, opt, sched, counter = _resuming_run()
    acc.load_state(reference / variant)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())
    state = opt.state_dict()["state"]
    assert len(state) == 4
    for i, saved in expected["optimizer"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[i][moment], saved[moment]), (i, moment)
    assert sched.last_epoch == expected["last_epoch"] == 1
    assert counter.n == expected["counter"] == 3
    assert acc.step == expected["step"] == 3
    import random
    draws = expected["draws"]
    assert random.random() == draws["python"] and np.random.rand() == draws["numpy"]
    assert torch.equal(torch.rand(3), draws["torch"])


def test_load_state_reads_ddp_names_of_an_accelerate_checkpoint(reference, tmp_path):
    """Under DDP Accelerate saves the wrapper's state dict: every name starts with `module.`."""
    expected = torch.load(reference / "expected.pt", weights_only=True)
    shutil.copytree(reference / "checkpoint_bin", tmp_path / "ckpt")
    torch.save({f"module.{k}": v for k, v in expected["model"].items()}, tmp_path / "ckpt" / "pytorch_model.bin")
    acc, model, *_ = _resuming_run()
    acc.load_state(tmp_path / "ckpt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())


def test_load_state_of_a_tied_gpt2_fills_the_name_accelerate_left_out_and_keeps_it_tied(reference):
    """Accelerate's safetensors keep one name of a tied weight (GPT-2's embedding and head): both load, still one."""
    import safetensors.torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "hf"))
    from tiny_models import tiny_model

    assert len(safetensors.torch.load_file(reference / "gpt2" / "model.safetensors")) < len(
        torch.load(reference / "gpt2_expected.pt", weights_only=True))           # a name left out of the file
    expected = torch.load(reference / "gpt2_expected.pt", weights_only=True)
    acc = Accelerator(cpu=True)
    model = acc.prepare(tiny_model("gpt2", seed=3))
    acc.load_state(reference / "gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


class _RunsCode:
    """Unpickling this runs `marker.mkdir()`: what a hostile checkpoint file could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.mkdir, (self.marker,))


def test_load_state_refuses_a_file_holding_objects_without_running_them(reference, tmp_path):
    shutil.copytree(reference / "checkpoint_safetensors", tmp_path / "ckpt")
    marker = tmp_path / "code_ran"
    torch.save({"n": _RunsCode(marker)}, tmp_path / "ckpt" / "custom_checkpoint_0.pkl")
    acc, *_ = _resuming_run()
    with pytest.raises(ValueError, match=r"custom_checkpoint_0\.pkl holds Python objects .*weights_only=False"):
        acc.load_state(tmp_path / "ckpt")
    assert not marker.exists()


def test_load_state_of_an_accelerate_checkpoint_checks_what_was_prepared(reference):
    acc = Accelerator(cpu=True)
    acc.prepare(_model(), torch.optim.Adam(_model().parameters()))     # no scheduler, no registered object
    with pytest.raises(ValueError, match="holds 1 scheduler file"):
        acc.load_state(reference / "checkpoint_bin")


def test_load_state_finds_the_newest_accelerate_checkpoint_and_warns_of_the_files_it_does_not_read(reference,
                                                                                                       tmp_path):
    expected = torch.load(reference / "expected.pt", weights_only=True)
    shutil.copytree(reference / "checkpoint_safetensors", tmp_path / "checkpoints" / "checkpoint_0")
    shutil.copytree(reference / "checkpoint_bin", tmp_path / "checkpoints" / "checkpoint_1")
    torch.save({"epoch": 0}, tmp_path / "checkpoints" / "checkpoint_1" / "dl_state_dict.bin")
    (tmp_path / "checkpoints" / "checkpoint_1" / "pytorch_model.bin").rename(
        tmp_path / "checkpoints" / "checkpoint_1" / "stale")           # the newest is the one read: it must fail
    acc, model, *_ = _resuming_run()
    acc.project_configuration = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    with pytest.raises(FileNotFoundError, match=r"checkpoint_1 has no weights for prepared model 0"):
        acc.load_state()
    (tmp_path / "checkpoints" / "checkpoint_1" / "stale").rename(
        tmp_path / "checkpoints" / "checkpoint_1" / "pytorch_model.bin")
    with pytest.warns(UserWarning, match=r"dl_state_dict\.bin not read"):
        acc.load_state()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())


def test_a_load_hook_that_removes_the_model_reads_its_weights_itself_as_with_accelerate(reference, tmp_path):
    """An Accelerate save hook that popped the weights left no model file; the matching load hook loads them."""
    expected = torch.load(reference / "expected.pt", weights_only=True)
    shutil.copytree(reference / "checkpoint_bin", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "pytorch_model.bin").rename(tmp_path / "own_weights.bin")
    acc, model, opt, *_ = _resuming_run()

    def load_own_way(models, input_dir):
        models.pop().load_state_dict(torch.load(tmp_path / "own_weights.bin", weights_only=True))

    acc.register_load_state_pre_hook(load_own_way)
    acc.load_state(tmp_path / "ckpt")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])


def test_load_state_refuses_a_checkpoint_accelerate_wrote_under_fsdp(reference, tmp_path):
    shutil.copytree(reference / "checkpoint_bin", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "pytorch_model.bin").unlink()
    (tmp_path / "ckpt" / "pytorch_model_fsdp_0").mkdir()                 # Accelerate's sharded FSDP weights
    acc, *_ = _resuming_run()
    with pytest.raises(ValueError, match="written by Accelerate under FSDP or DeepSpeed"):
        acc.load_state(tmp_path / "ckpt")


# ---------------------------------------------------------------------------- on 2 processes (DDP)
@pytest.mark.slow
def test_unwrap_false_total_batch_size_and_save_model_bin_under_ddp(tmp_path):
    proc = run_launch("accelerate_parity_ddp.py", str(tmp_path), timeout=240)
    assert [line.removeprefix("ok ") for line in proc.stdout.splitlines() if line.startswith("ok ")] == \
        ["get_state_dict unwrap=False", "total_batch_size", "save_model bin"]
