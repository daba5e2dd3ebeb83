"""A config file names one engine (before: `distributed_type: DEEPSPEED` with a parallelism_config block trained
model_parallel, the DeepSpeed settings dropped unsaid; so did `distributed_type: XLA`; a `distributed_type: XLA` file
launched with `--use_deepspeed` trained DeepSpeed; `--gradient_accumulation_steps 1` on a DeepSpeed file was
ignored)."""

import json
import subprocess
import sys

import pytest

from cadence.cli import build_parser
from cadence.distributed.config import Config, load_config
from cadence.distributed.launch import free_port, launch_env
from cadence.distributed.launch_flags import resolve_config
from tests.helpers import REPO, cadence_env

# as `accelerate config` writes them
DEEPSPEED_TP_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
  offload_optimizer_device: none
fsdp_config: {}
parallelism_config:
  parallelism_config_tp_size: 2
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""
XLA_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: XLA
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: true
"""
XLA_TP_YAML = XLA_YAML.replace("num_processes: 1\n", "num_processes: 2\nparallelism_config:\n  "
                                                    "parallelism_config_tp_size: 2\n")
BARE_DEEPSPEED_YAML = "distributed_type: DEEPSPEED\ndeepspeed_config: {}\nnum_processes: 2\nuse_cpu: true\n"


def _file(tmp_path, text, name="accelerate.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _resolve(path, *flags):
    return resolve_config(build_parser().parse_args(["launch", "--config_file", str(path), *flags, "train.py"]))


@pytest.mark.parametrize("text, flags, said", [
    (DEEPSPEED_TP_YAML, [], ["distributed_type: DEEPSPEED, deepspeed_config: {'zero_stage': 2",
                             "parallelism_config: {'parallelism_config_tp_size': 2} (model parallel)",
                             "to train with DeepSpeed, remove the parallelism_config block",
                             "set distributed_type: FSDP and remove the deepspeed_config block"]),
    (XLA_TP_YAML, [], ["distributed_type: XLA (XLA) and parallelism_config: {'parallelism_config_tp_size': 2}",
                       "to train with XLA, remove the parallelism_config block",
                       "strategy='xla', spmd=True, fsdp=True"]),
    (XLA_YAML, ["--use_deepspeed"], ["--use_deepspeed (DeepSpeed) would replace the engine of the config file",
                                     "(distributed_type: XLA)",
                                     "drop the flag, or give --config_file a file for DeepSpeed"]),
])
def test_cadence_launch_refuses_a_config_file_choosing_two_engines_before_any_worker_starts(tmp_path, text, flags,
                                                                                             said):
    marker = tmp_path / "worker_ran"
    script = _file(tmp_path, f"open({str(marker)!r}, 'w').close()\n", "train.py")
    config = _file(tmp_path, text)
    proc = subprocess.run([sys.executable, "-m", "cadence.cli", "launch", "--config_file", str(config), *flags,
                           "--main_process_port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=cadence_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not marker.exists()
    assert str(config) in proc.stderr
    for words in said:
        assert words in proc.stderr, proc.stderr


@pytest.mark.parametrize("options, said", [
    ({"distributed_type": "DEEPSPEED", "parallelism_config": {"parallelism_config_tp_size": 2}},
     r"^distributed_type: DEEPSPEED \(DeepSpeed\) and parallelism_config: .* to train with model parallel, set "
     r"distributed_type: FSDP \(tensor and pipeline parallelism train inside FSDP2\)$"),
    ({"distributed_type": "XLA", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}},
     r"^distributed_type: XLA \(XLA\) and fsdp_config: .*to train with XLA, remove the fsdp_config block; to train "
     r"with FSDP, set distributed_type: FSDP \(on XLA, the xla strategy shards weights with its own FSDP"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"},
      "deepspeed_config": {"zero_stage": 2}},
     r"to train with FSDP, remove the deepspeed_config block; to train with DeepSpeed, set distributed_type: "
     r"DEEPSPEED and remove the fsdp_config block$"),
    ({"distributed_type": "MULTI_GPU", "deepspeed_config": {"zero_stage": 2},
      "parallelism_config": {"parallelism_config_tp_size": 2}},
     r"to train with DeepSpeed, set distributed_type: DEEPSPEED and remove the parallelism_config block"),
])
def test_a_config_built_in_python_naming_two_engines_is_refused_saying_what_to_change(options, said):
    with pytest.raises(ValueError, match=said):
        Config(num_processes=2, **options)


def test_only_tensor_parallelism_trains_together_with_another_engine():
    fsdp = {"fsdp_reshard_after_forward": True}
    tp = {"parallelism_config_tp_size": 2}
    assert Config(num_processes=2, distributed_type="FSDP", fsdp_config=fsdp, parallelism_config=tp).strategy \
        == "model_parallel"                                                            # tensor parallelism inside FSDP2
    assert Config(num_processes=2, distributed_type="MULTI_CPU", parallelism_config=tp).strategy == "model_parallel"
    assert Config(num_processes=2, distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 2},
                  fsdp_config={}).strategy == "deepspeed"                              # an empty block names no engine
    assert Config(num_processes=2, distributed_type="XLA", deepspeed_config={}, fsdp_config={}).strategy == "xla"
    with pytest.raises(ValueError, match="each choose the engine the workers train with"):
        Config(num_processes=2, distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 2}, parallelism_config=tp)


def test_the_files_error_names_the_file(tmp_path):
    path = _file(tmp_path, DEEPSPEED_TP_YAML)
    with pytest.raises(ValueError, match=f"^{path}: distributed_type: DEEPSPEED"):
        load_config(path)


@pytest.mark.parametrize("flags", [["--use_fsdp"], ["--fsdp_sharding_strategy", "FULL_SHARD"], ["--zero_stage", "2"],
                                   ["--parallelism_config_tp_size", "2"], ["--multi_gpu"]])
def test_a_flag_choosing_another_engine_than_an_xla_files_is_refused(tmp_path, flags):
    path = _file(tmp_path, XLA_YAML)
    with pytest.raises(ValueError, match=rf"^{flags[0]} \(\w[\w ]*\) would replace the engine of the config file "
                                         rf"{path} \(distributed_type: XLA\) .*\(or change the file's "
                                         r"distributed_type\)$"):
        _resolve(path, *flags)


def test_engine_flags_replace_a_bare_deepspeed_file_and_parallelism_flags_alone_are_refused(tmp_path):
    path = _file(tmp_path, BARE_DEEPSPEED_YAML)
    # `distributed_type: DEEPSPEED` with an empty block holds no DeepSpeed setting: a flag choosing another engine
    # replaces it, as flags replace the file's values; the parallelism flags add to the file's engine instead
    assert (_resolve(path, "--tpu").strategy, _resolve(path, "--use_fsdp").strategy) == ("xla", "fsdp")
    with pytest.raises(ValueError, match=r"^--use_parallelism_config --parallelism_config_tp_size \(model parallel\) "
                                         rf"would replace the engine of the config file {path} \(distributed_type: "
                                         r"DEEPSPEED\) .*train inside FSDP2: add --use_fsdp$"):
        _resolve(path, "--use_parallelism_config", "--parallelism_config_tp_size", "2")
    config = _resolve(path, "--use_fsdp", "--use_parallelism_config", "--parallelism_config_tp_size", "2")
    assert (config.distributed_type, config.strategy) == ("FSDP", "model_parallel")


def test_a_flag_choosing_another_engine_than_a_block_of_a_multi_gpu_file_is_refused_naming_it(tmp_path):
    path = _file(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 2\n")
    with pytest.raises(ValueError, match=rf"^--use_fsdp \(FSDP\) would replace the engine of the config file {path} "
                                         r"\(deepspeed_config: \{'zero_stage': 2\}\)"):
        _resolve(path, "--use_fsdp")


def test_tpu_agrees_with_an_xla_file_and_refuses_multi_gpu(tmp_path):
    assert _resolve(_file(tmp_path, XLA_YAML), "--tpu").strategy == "xla"
    args = build_parser().parse_args(["launch", "--tpu", "--multi_gpu", "--num_processes", "2", "train.py"])
    with pytest.raises(ValueError, match=r"^--tpu \(XLA\) and --multi_gpu \(GPUs\) each choose the engine"):
        resolve_config(args)


DEEPSPEED_GA_YAML = """distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 2
  zero_stage: 2
num_processes: 2
use_cpu: true
"""


@pytest.mark.parametrize("steps", [1, 4])
def test_gradient_accumulation_steps_flag_replaces_deepspeeds_value(tmp_path, monkeypatch, steps):
    from cadence.distributed.deepspeed import DeepSpeed

    variables = launch_env(_resolve(_file(tmp_path, DEEPSPEED_GA_YAML), "--gradient_accumulation_steps", str(steps)))
    assert variables["CADENCE_GRADIENT_ACCUMULATION_STEPS"] == str(steps)
    monkeypatch.setenv("CADENCE_DEEPSPEED_CONFIG", variables["CADENCE_DEEPSPEED_CONFIG"])
    strategy = DeepSpeed(device="cpu")   # what a worker builds from the launcher's variables
    assert strategy.config["gradient_accumulation_steps"] == steps
    strategy.configure_accumulation(steps)   # the launcher's GradAccum(steps): refused when DeepSpeed says otherwise
    # without a number of DeepSpeed's own, "auto" stays: GradAccum (the launcher's, or the script's own) decides
    flags_only = build_parser().parse_args(["launch", "--use_deepspeed", "--gradient_accumulation_steps", str(steps),
                                            "--cpu", "--num_processes", "2", "train.py"])
    assert "gradient_accumulation_steps" not in resolve_config(flags_only).deepspeed_config


def test_a_files_gradient_accumulation_steps_against_deepspeeds_is_refused(tmp_path):
    path = _file(tmp_path, DEEPSPEED_GA_YAML + "gradient_accumulation_steps: 4\n")
    with pytest.raises(ValueError, match=r"^gradient_accumulation_steps is 4 but DeepSpeed's config \(the "
                                         r"deepspeed_config block\) sets 2: set it in one place"):
        _resolve(path)


def test_mixed_precision_against_deepspeeds_dtype_is_refused(tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}))
    path = _file(tmp_path, f"distributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\nmixed_precision: bf16\n"
                           f"deepspeed_config:\n  deepspeed_config_file: {ds_json}\n")
    with pytest.raises(ValueError, match=rf"^mixed_precision is bf16 but DeepSpeed's config \(deepspeed_config_file "
                                         rf"{ds_json}\) enables fp16: set its \"enabled\" to \"auto\""):
        _resolve(path)
    assert _resolve(path, "--mixed_precision", "fp16").mixed_precision == "fp16"
    assert _resolve(path, "--mixed_precision", "no").strategy == "deepspeed"   # the script's own precision decides
    ds_json.write_text(json.dumps({"bf16": {"enabled": False}}))
    with pytest.raises(ValueError, match=r"mixed_precision is bf16 but DeepSpeed's config .* disables bf16"):
        _resolve(path)
