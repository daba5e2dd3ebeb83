"""FSDP chosen by the launcher: `accelerator.state.fsdp_plugin` is the plugin its settings stand for, as Accelerate
builds one from its environment (code such as PEFT's `if getattr(accelerator.state, "fsdp_plugin", None)` reads it);
it was None unless the script passed a plugin."""

import json

import pytest

from helpers import run_launch


@pytest.mark.slow
def test_the_launchers_fsdp_settings_are_the_states_fsdp_plugin():
    flags = ("--use_fsdp", "--fsdp_version", "2", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
             "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Linear",
             "--fsdp_offload_params", "false")
    out = run_launch("accelerate_fsdp_plugin.py", flags=flags, timeout=180).stdout
    ranks = [json.loads(line.split(" ", 2)[2]) for line in out.splitlines() if line.startswith("RANK ")]
    assert len(ranks) == 2
    for got in ranks:
        assert got == {"distributed_type": "DistributedType.FSDP", "plugin": "FullyShardedDataParallelPlugin",
                       "is_fsdp2": True, "state_dict_type": "SHARDED_STATE_DICT", "wrap": "Linear", "offload": False}


def test_a_plugin_from_the_launchers_variable_takes_accelerates_config_keys(monkeypatch):
    from cadence.accelerate import FullyShardedDataParallelPlugin

    monkeypatch.setenv("CADENCE_FSDP_CONFIG", json.dumps({"fsdp_version": 2, "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                                                          "fsdp_min_num_params": 100,
                                                          "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}))
    plugin = FullyShardedDataParallelPlugin.from_launcher()
    assert (plugin.fsdp_version, plugin.sharding_strategy, plugin.min_num_params) == (2, "SHARD_GRAD_OP", 100)
    assert plugin.strategy_options() == {"sharding_strategy": "SHARD_GRAD_OP", "auto_wrap_policy": "SIZE_BASED_WRAP",
                                         "min_num_params": 100}


def test_the_launchers_flags_as_strings_and_both_sharding_keys_make_a_plugin(monkeypatch):
    from cadence.accelerate import FullyShardedDataParallelPlugin

    monkeypatch.setenv("CADENCE_FSDP_CONFIG", json.dumps({"fsdp_sharding_strategy": "FULL_SHARD",
                                                          "fsdp_reshard_after_forward": "true",
                                                          "fsdp_offload_params": "false",
                                                          "fsdp_activation_checkpointing": "true"}))
    plugin = FullyShardedDataParallelPlugin.from_launcher()   # the plugin alone refuses both sharding keys
    assert plugin.strategy_options() == {"sharding_strategy": "FULL_SHARD", "offload_params": False,
                                         "activation_checkpointing": True}

