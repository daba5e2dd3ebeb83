"""The Strategy interface in one process: options reach only the engine that takes them, bad FSDP input is
refused before training, and leaving distrib_ctx gives back a plain module with a working optimizer."""

import json

import pytest
import torch
from torch import nn

from cadence import Learner
from cadence.distributed.fsdp import FSDP


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x)


def blocks_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Block(), nn.Linear(8, 3))


def test_fsdp_layer_name_that_matches_nothing_is_refused_before_training(dls):
    learn = Learner(dls, blocks_model(), loss_func=nn.CrossEntropyLoss())
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"\['Blok'\] matches no layer.*'Block'"):
        with learn.distrib_ctx(strategy="fsdp", transformer_layer_cls_to_wrap="Blok"):
            learn.fit(1)
    assert all(torch.equal(before[k], v) for k, v in learn.model.state_dict().items())
    assert learn.step == 0


@pytest.mark.parametrize("options, message", [
    (dict(sharding_strategy="FULL"), "sharding_strategy 'FULL' does not exist"),
    (dict(sharding_strategy=7), "sharding_strategy 7 does not exist"),
    (dict(auto_wrap_policy="LAYER_WRAP"), "auto_wrap_policy 'LAYER_WRAP' does not exist"),
    (dict(state_dict_type="LOCAL"), "state_dict_type 'LOCAL' does not exist"),
    (dict(shard_everything=True), r"unknown FSDP option\(s\) \['shard_everything'\]"),
])
def test_fsdp_bad_options_name_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        FSDP(**options)


def test_hybrid_shard_that_does_not_divide_the_world_is_refused_before_connecting(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # no process group is ever created: the check comes first
    with pytest.raises(ValueError, match="hybrid_shard_size 3 does not divide the 4 processes"):
        FSDP(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=3).setup_environment()


def test_accelerate_fsdp_config_keys_and_numbers_reach_the_strategy(monkeypatch):
    monkeypatch.setenv("CADENCE_FSDP_CONFIG", json.dumps({
        "fsdp_sharding_strategy": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "Block,Attention", "fsdp_offload_params": "false",
        "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_version": 2, "fsdp_use_orig_params": True}))
    s = FSDP()
    assert (s.sharding, s.auto_wrap, s.layer_classes, s.offload, s.state_dict_type) == (
        "SHARD_GRAD_OP", "TRANSFORMER_BASED_WRAP", {"Block", "Attention"}, False, "FULL_STATE_DICT")
    assert FSDP(sharding_strategy="NO_SHARD").sharding == "NO_SHARD"  # an argument wins over the config


def test_fsdp_in_one_process_trains_and_ddp_only_options_do_not_reach_it(dls):
    learn = Learner(dls, blocks_model(), loss_func=nn.CrossEntropyLoss())
    with learn.no_bar(), learn.distrib_ctx(strategy="fsdp", sync_bn=True, transformer_layer_cls_to_wrap="Block"):
        learn.fit(1)
    assert learn.step == len(dls.train)


def test_leaving_distrib_ctx_gives_back_the_module_and_an_optimizer_over_it(dls, model):
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss())
    with learn.no_bar():
        learn.fit(1)
        with learn.distrib_ctx():
            learn.fit(1)
    assert learn.model is model
    params = {id(p) for g in learn.opt.param_groups for p in g["params"]}
    assert params == {id(p) for p in model.parameters()}
    assert all(learn.opt.state[p]["step"] == 2 * len(dls.train) for p in model.parameters())  # state carried over


def test_strategy_instance_with_options_is_refused():
    from cadence.distributed import get_strategy
    from cadence.distributed.ddp import DDP

    with pytest.raises(ValueError, match="give the options to its constructor"):
        get_strategy(DDP(), sync_bn=True)
    with pytest.raises(TypeError, match=r"unknown DDP option\(s\) \[.zero_stage.\]"):
        get_strategy("ddp", zero_stage=3)
    with pytest.raises(ValueError, match=r"comm_hook='fp16': pass a DDP communication hook function, None for DDP's own"):
        get_strategy("ddp", comm_hook="fp16")


def test_fastai_style_star_import():
    namespace = {}
    exec("from cadence.distributed import *", namespace)
    assert {"DistributedDL", "setup_distrib", "teardown_distrib", "rank0_first", "get_strategy"} <= namespace.keys()


def test_meta_copy_is_a_weightless_skeleton_that_rebuilds_the_plain_module():
    from cadence.distributed.strategy import meta_copy

    model = blocks_model()
    model[0].weight.requires_grad_(False)
    skeleton = meta_copy(model)
    assert all(t.is_meta for t in (*skeleton.parameters(), *skeleton.buffers()))
    assert not any(t.is_meta for t in model.parameters())  # the model itself keeps its weights
    rebuilt = skeleton.to_empty(device="cpu")
    rebuilt.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    assert torch.equal(rebuilt(x), model(x)) and type(rebuilt[1]) is Block
    assert not rebuilt[0].weight.requires_grad and rebuilt[2].weight.requires_grad
