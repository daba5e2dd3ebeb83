"""A flag choosing another engine than the config file's is refused when the file holds settings for its own (before: an
Accelerate DeepSpeed config launched with `--tpu` trained with XLA, with `--fsdp_sharding_strategy` with FSDP, the
DeepSpeed block dropped unsaid; `--use_deepspeed --parallelism_config_tp_size 2` trained model_parallel)."""

import pytest

from cadence.cli import build_parser
from cadence.distributed.launch_flags import resolve_config

# as `accelerate config` writes them: the other engine's block is there, empty
DEEPSPEED_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
  offload_optimizer_device: none
fsdp_config: {}
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""
FSDP_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_version: 2
deepspeed_config: {}
machine_rank: 0
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""
PARALLELISM_YAML = """distributed_type: MULTI_CPU
num_processes: 4
use_cpu: true
parallelism_config:
  parallelism_config_tp_size: 2
"""


def _resolve(tmp_path, text, *flags):
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    return resolve_config(build_parser().parse_args(["launch", "--config_file", str(path), *flags, "train.py"]))


@pytest.mark.parametrize("text, flags, said", [
    (DEEPSPEED_YAML, ["--tpu"], r"^--tpu \(XLA\) would replace the engine of the config file .*accelerate.yaml "
                                r"\(distributed_type: DEEPSPEED, deepspeed_config: \{'zero_stage': 2"),
    (DEEPSPEED_YAML, ["--fsdp_sharding_strategy", "FULL_SHARD"],
     r"^--fsdp_sharding_strategy \(FSDP\) would replace .*distributed_type: DEEPSPEED"),
    (DEEPSPEED_YAML, ["--use_parallelism_config", "--parallelism_config_tp_size", "2"],
     r"^--use_parallelism_config --parallelism_config_tp_size \(model parallel\) would replace .*DEEPSPEED"),
    (FSDP_YAML, ["--use_deepspeed"], r"^--use_deepspeed \(DeepSpeed\) would replace .*distributed_type: FSDP, "
                                     r"fsdp_config: \{'fsdp_sharding_strategy': 'FULL_SHARD'"),
    (FSDP_YAML, ["--tpu"], r"^--tpu \(XLA\) would replace .*distributed_type: FSDP"),
    (PARALLELISM_YAML, ["--use_deepspeed"], r"^--use_deepspeed \(DeepSpeed\) would replace .*parallelism_config: "),
    (PARALLELISM_YAML, ["--tpu"], r"^--tpu \(XLA\) would replace .*parallelism_config: .*leave its settings unused"),
])
def test_a_flag_choosing_another_engine_than_the_files_is_refused_naming_both(tmp_path, text, flags, said):
    with pytest.raises(ValueError, match=said):
        _resolve(tmp_path, text, *flags)


@pytest.mark.parametrize("text, flags, distributed_type, strategy", [
    (DEEPSPEED_YAML, [], "DEEPSPEED", "deepspeed"),   # its empty fsdp_config is no setting
    (DEEPSPEED_YAML, ["--zero_stage", "3"], "DEEPSPEED", "deepspeed"),   # the file's own engine
    (FSDP_YAML, [], "FSDP", "fsdp"),
    (FSDP_YAML, ["--fsdp_sharding_strategy", "SHARD_GRAD_OP"], "FSDP", "fsdp"),
    (FSDP_YAML, ["--use_parallelism_config", "--parallelism_config_tp_size", "2"], "FSDP", "model_parallel"),  # 2-D
    (PARALLELISM_YAML, ["--use_fsdp"], "FSDP", "model_parallel"),
    (DEEPSPEED_YAML.replace("  zero_stage: 2\n  offload_optimizer_device: none\n", "").replace(
        "deepspeed_config:\n", "deepspeed_config: {}\n"), ["--use_fsdp"], "FSDP", "fsdp"),   # an empty block: none
])
def test_the_files_own_engine_empty_blocks_and_tp_inside_fsdp_are_not_refused(tmp_path, text, flags,
                                                                              distributed_type, strategy):
    config = _resolve(tmp_path, text, *flags)
    assert (config.distributed_type, config.strategy) == (distributed_type, strategy)


@pytest.mark.parametrize("flags, said", [
    (["--use_deepspeed", "--use_parallelism_config", "--parallelism_config_tp_size", "2"],
     r"^--use_deepspeed \(DeepSpeed\) and --use_parallelism_config --parallelism_config_tp_size \(model parallel\) "
     r"each choose the engine .*--use_fsdp with --parallelism_config_tp_size\)$"),
    (["--tpu", "--parallelism_config_tp_size", "2"],
     r"^--tpu \(XLA\) and --parallelism_config_tp_size \(model parallel\) each choose .*fsdp=True\)\)$"),
])
def test_parallelism_flags_with_deepspeed_or_xla_flags_are_refused(flags, said):
    args = build_parser().parse_args(["launch", *flags, "--cpu", "--num_processes", "2", "train.py"])
    with pytest.raises(ValueError, match=said):
        resolve_config(args)


def test_parallelism_flags_with_fsdp_flags_are_2d_parallelism():
    args = build_parser().parse_args(["launch", "--use_fsdp", "--use_parallelism_config", "--parallelism_config_tp_size",
                                      "2", "--cpu", "--num_processes", "4", "train.py"])
    config = resolve_config(args)
    assert (config.distributed_type, config.strategy) == ("FSDP", "model_parallel")
