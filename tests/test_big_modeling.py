"""Big models on the CPU and the disk: empty init, device maps, dispatch, sharded checkpoints, memory held.

No GPU here: device maps with GPUs are exercised only through `infer_auto_device_map` with budgets
given by hand (nothing is placed on them).
"""

import collections
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.big_modeling import (dispatch_model, infer_auto_device_map, init_empty_weights, init_on_device,
                                  load_checkpoint_and_dispatch, module_sizes)
from helpers import REPO, SCRIPTS, cadence_env
from tests.big_models import Net, block_bytes, memory_kib, net_bytes


def trained_net(d=64, n_blocks=6, seed=0):
    torch.manual_seed(seed)
    net = Net(d, n_blocks)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)    # LayerNorm weights away from 1, biases away from 0
    return net


def test_init_empty_weights_allocates_nothing_and_keeps_buffers_real():
    before = memory_kib()["VmRSS"]
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(8192, 8192), nn.BatchNorm1d(8192))   # 256 MiB of weights if allocated
    assert memory_kib()["VmRSS"] - before < 64 * 1024
    assert all(p.is_meta for p in model.parameters()) and model[0].weight.shape == (8192, 8192)
    assert not model[1].running_mean.is_meta                                  # buffers stay real by default
    with init_empty_weights(include_buffers=True):
        bn = nn.BatchNorm1d(4)
    assert bn.running_mean.is_meta
    with init_on_device("cpu"):
        assert nn.Linear(2, 2).weight.device.type == "cpu"
    assert not nn.Linear(2, 2).weight.is_meta                                  # the patch ends with the block


def test_auto_device_map_fills_devices_in_order_without_splitting_blocks():
    with init_empty_weights():
        model = Net(d=64, n_blocks=6)
    d, blk = 64, block_bytes(64)
    assert module_sizes(model)[""] == net_bytes(64, 6) and module_sizes(model)["blocks.0"] == blk
    inp = (16 * d + d) * 4
    # GPU 0 holds the model's own buffer (first), inp and two blocks, the CPU three blocks, the rest goes to disk
    budgets = {0: inp + 2 * blk + 10, "cpu": 3 * blk + 10, "disk": "1GB"}
    assert infer_auto_device_map(model, budgets, no_split_module_classes=["Block"]) == {
        "scale": 0, "inp": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": "cpu", "blocks.3": "cpu", "blocks.4": "cpu",
        "blocks.5": "disk", "head": "disk"}
    # everything fits on the CPU: one entry for the whole model
    assert infer_auto_device_map(model, {"cpu": "1GB"}) == {"": "cpu"}
    # without no_split the block that straddles the budget is split between its fc and its norm
    split = infer_auto_device_map(model, {"cpu": inp + blk + (d * d + d) * 4 + 10, "disk": "1GB"})
    assert split["blocks.1.fc"] == "cpu" and split["blocks.1.norm"] == "disk"


@pytest.mark.parametrize("max_memory, words", [
    ({"cpu": "10KB", "disk": "20KB"}, ["does not fit in max_memory", "'disk'"]),
    ({"cpu": "lots"}, ["max_memory['cpu']", "'2GB'", "'lots'"]),
    ({"gpu0": "1GB"}, ["'gpu0' is not a device", "'cuda:1'"]),
])
def test_bad_budgets_name_the_value(max_memory, words):
    with init_empty_weights():
        model = Net()
    with pytest.raises(ValueError) as info:
        infer_auto_device_map(model, max_memory, no_split_module_classes=["Block"])
    for word in words:
        assert word in str(info.value)


def test_dispatch_model_over_cpu_and_disk_equals_the_plain_model(tmp_path):
    net = trained_net()
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = net(x)
    device_map = {"inp": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "disk", "blocks.3": "cpu",
                  "blocks.4": "disk", "blocks.5": "disk", "head": "disk", "scale": "cpu"}
    with pytest.raises(ValueError, match="offload_dir"):
        dispatch_model(trained_net(), device_map)                  # refused before anything moved
    model = dispatch_model(net, device_map, offload_dir=tmp_path / "offload")
    assert model.hf_device_map == device_map
    assert sorted(p.name for p in (tmp_path / "offload").iterdir()) == sorted(
        f"{m}.safetensors" for m in ("blocks.1.fc", "blocks.1.norm", "blocks.2.fc", "blocks.2.norm", "blocks.4.fc",
                                     "blocks.4.norm", "blocks.5.fc", "blocks.5.norm", "head"))
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert model.blocks[1].fc.weight.is_meta and model.head.weight.is_meta     # dropped again after forward
    assert not model.blocks[0].fc.weight.is_meta


def test_load_sharded_checkpoint_over_a_budget_equals_the_plain_model(tmp_path, dls):
    net = trained_net()
    learn = Learner(dls, net, loss_func=nn.MSELoss(), path=tmp_path)
    learn.save_model(tmp_path / "export", max_shard_size="20KB")                    # shards + index json
    assert (tmp_path / "export" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "export").glob("model-*.safetensors"))) > 3
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = net(x)
    with init_empty_weights():
        model = Net()
    budget = (16 * 64 + 64) * 4 + 2 * block_bytes(64) + 4 + 10      # inp, two blocks, the scale buffer
    model = load_checkpoint_and_dispatch(model, tmp_path / "export", max_memory={"cpu": budget},
                                         no_split_module_classes=["Block"])
    assert model.hf_device_map == {"inp": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "disk",
                                   "blocks.3": "disk", "blocks.4": "disk", "blocks.5": "disk", "head": "disk",
                                   "scale": "cpu"}
    with torch.no_grad():
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)                                      # streamed again, same result
    in_memory = sum(t.numel() * t.element_size() for t in model.state_dict().values() if not t.is_meta)
    assert in_memory == budget - 10


def test_checkpoint_checks_and_other_formats(tmp_path):
    net = trained_net()
    torch.save(net.state_dict(), tmp_path / "weights.pt")
    save_file({f"_orig_mod.{k}": v.contiguous() for k, v in net.state_dict().items()}, str(tmp_path / "compiled.safetensors"))
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = net(x)
    with init_empty_weights():
        wrong = Net(d=32)
    with pytest.raises(ValueError, match="shape mismatches: inp.weight"):
        load_checkpoint_and_dispatch(wrong, tmp_path / "weights.pt")
    budget = {"cpu": 20_000, "disk": "1GB"}
    with init_empty_weights():
        model = Net()
    with pytest.raises(ValueError, match="offload_dir"):
        load_checkpoint_and_dispatch(model, tmp_path / "weights.pt", max_memory=budget, no_split_module_classes=["Block"])
    model = load_checkpoint_and_dispatch(model, tmp_path / "weights.pt", max_memory=budget,
                                         no_split_module_classes=["Block"], offload_folder=tmp_path / "off")
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with init_empty_weights():
        model = Net()
    model = load_checkpoint_and_dispatch(model, tmp_path / "compiled.safetensors", device_map={"": "cpu"})
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_checkpoint_and_dispatch(model, tmp_path / "off")


def run_rss(tmp_path, checkpoint, x, d, n_blocks, budget, name):
    """Run tests/scripts/big_model_rss.py; return the output and its memory report.

    glibc serves allocations under 32 MiB (these test weights: 4 MiB) from its heap once one such
    block was freed, and may keep a freed block resident, by where small allocations fall: growth
    12.8-21.1 MiB over 6 runs of the same load, measured. A fixed 1 MiB mmap threshold gives each
    block back when freed, as glibc does with weights over 32 MiB (a large model's): the growth is
    then what the loader holds (9.1-9.2 MiB over 6 runs).
    """
    torch.save(x, tmp_path / f"{name}.x.pt")
    out = tmp_path / f"{name}.y.pt"
    subprocess.run([sys.executable, str(SCRIPTS / "big_model_rss.py"), str(checkpoint), str(tmp_path / f"{name}.x.pt"),
                    str(out), str(d), str(n_blocks), str(budget)], check=True, timeout=300,
                   env=cadence_env(MALLOC_MMAP_THRESHOLD_=str(2**20)), cwd=REPO)
    return torch.load(out, weights_only=True), json.loads((tmp_path / f"{name}.y.pt.json").read_text())


@pytest.mark.slow
def test_weights_over_the_memory_budget_stream_from_disk_and_peak_rss_stays_below_the_model(tmp_path):
    d, n_blocks = 1024, 16
    size = net_bytes(d, n_blocks)                                       # ~67 MB of float32 weights
    net = trained_net(d, n_blocks)
    Learner(DataLoaders(DataLoader(TensorDataset(torch.zeros(1, 16), torch.zeros(1, 4)))), net,
            loss_func=nn.MSELoss()).save_model(tmp_path / "export", max_shard_size="16MB")
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = net(x)
    del net

    budget = 8 * 2**20                                                  # the CPU holds about 1/8 of the weights
    y, report = run_rss(tmp_path, tmp_path / "export", x, d, n_blocks, budget, "budget")
    assert torch.equal(y, expected)
    assert list(report["device_map"].values()).count("disk") >= 12
    growth = (report["peak_kib"] - report["baseline_kib"]) * 1024
    print(f"model {size / 2**20:.1f} MiB, cpu budget {budget / 2**20:.0f} MiB: peak RSS growth {growth / 2**20:.1f} MiB")
    assert growth < size / 2, (f"peak RSS grew by {growth / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB model; at the end "
                               f"private memory had grown {report['anon_kib'] / 1024:.1f} MiB, mapped files {report['file_kib'] / 1024:.1f} MiB")

    # the same measurement without a budget sees the whole model arrive: it can see what it checks
    y, report = run_rss(tmp_path, tmp_path / "export", x, d, n_blocks, 10 * size, "all")
    assert torch.equal(y, expected) and report["device_map"] == {"": "cpu"}
    growth = (report["peak_kib"] - report["baseline_kib"]) * 1024
    print(f"no budget: peak RSS growth {growth / 2**20:.1f} MiB")
    assert growth > 0.9 * size


class Tied(nn.Module):
    """A language-model shape: the output layer shares the embedding's weight."""

    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.mid(self.emb(ids)).tanh())


@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"emb": "cpu", "mid": "disk", "head": "disk"}], ids=["cpu", "disk"])
def test_tied_weights_load_once_and_stay_tied(tmp_path, device_map):
    from cadence.serialization import save_weights

    torch.manual_seed(0)
    net = Tied()
    save_weights(net.state_dict(), tmp_path / "model.safetensors")            # the tied weight is stored once
    ids = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        expected = net(ids)
    assert module_sizes(net)[""] == (50 * 32 + 32 * 32 + 32) * 4             # counted once
    with init_empty_weights():
        model = Tied()
    model = load_checkpoint_and_dispatch(model, tmp_path, device_map=device_map)
    with torch.no_grad():
        assert torch.equal(model(ids), expected)
    if device_map == {"": "cpu"}:
        assert model.head.weight is model.emb.weight


def test_dtype_loads_floating_weights_in_that_dtype(tmp_path):
    net = trained_net()
    torch.save(net.state_dict(), tmp_path / "w.pt")
    with init_empty_weights():
        model = Net()
    assert module_sizes(model, dtype=torch.bfloat16)[""] == (net_bytes(64, 6)) // 2
    model = load_checkpoint_and_dispatch(model, tmp_path / "w.pt", device_map=None, dtype=torch.bfloat16)
    assert model.inp.weight.dtype == torch.bfloat16
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x.bfloat16()), net.to(torch.bfloat16)(x.bfloat16()))


def test_a_tied_weight_stored_once_under_one_name_loads_tied_and_a_truly_missing_one_is_refused(tmp_path):
    # transformers' save_pretrained stores a tied weight under one name only, with no alias metadata
    torch.manual_seed(0)
    net = Tied()
    state = {k: v.contiguous() for k, v in net.state_dict().items() if k != "head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        expected = net(ids)
    with init_empty_weights():
        model = Tied()
    model = load_checkpoint_and_dispatch(model, tmp_path, device_map={"emb": "cpu", "mid": "disk", "head": "cpu"})
    assert model.head.weight is model.emb.weight
    with torch.no_grad():
        assert torch.equal(model(ids), expected)

    for dropped, missing in (({"mid.weight"}, "missing keys: mid.weight"),
                             ({"emb.weight"}, "missing keys: emb.weight, head.weight")):
        save_file({k: v for k, v in state.items() if k not in dropped}, str(tmp_path / "model.safetensors"))
        with init_empty_weights():
            model = Tied()
        with pytest.raises(ValueError, match=missing):
            load_checkpoint_and_dispatch(model, tmp_path, device_map={"": "cpu"})


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: dict


Pair = collections.namedtuple("Pair", "a b")


def test_outputs_moved_between_devices_keep_their_types():
    # a second device cannot exist here: "meta" stands in for it (the move a GPU model's output makes)
    from cadence.big_modeling.dispatch import _move
    CausalLMOutputWithPast = pytest.importorskip("transformers.modeling_outputs").CausalLMOutputWithPast

    t = torch.ones(2)
    hf = CausalLMOutputWithPast(logits=t, hidden_states=(t, t))
    moved = _move({"hf": hf, "dc": Output(t, {"p": Pair(t, [t, "keep"])}), "n": 3}, torch.device("meta"))
    assert type(moved["hf"]) is CausalLMOutputWithPast and moved["hf"].logits.is_meta
    assert moved["hf"].loss is None and list(moved["hf"].keys()) == ["logits", "hidden_states"]
    assert type(moved["dc"]) is Output and type(moved["dc"].extra["p"]) is Pair
    assert moved["dc"].extra["p"].b[0].is_meta and moved["dc"].extra["p"].b[1] == "keep" and moved["n"] == 3
    same = {"hf": hf, "cache": object()}
    assert _move(same, torch.device("cpu")) is same                  # nothing moves: the very same objects
