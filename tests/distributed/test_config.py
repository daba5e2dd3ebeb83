"""The launcher's YAML config: location, defaults, Accelerate's format, validation, questions."""

import pytest
import yaml

from cadence.distributed.config import Config, default_config_path, from_dict, load_config, questionnaire, save

ACCELERATE_OLD = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "fp16": True,
                  "dynamo_backend": "NO", "fsdp_config": {}, "deepspeed_config": {}, "megatron_lm_config": {},
                  "gpu_ids": "all", "machine_rank": 0, "main_process_ip": None, "main_process_port": None,
                  "main_training_function": "main", "num_machines": 1, "num_processes": 4, "use_cpu": False,
                  "tpu_name": None, "tpu_zone": None, "command_file": None, "commands": None}


def test_location_honours_env_and_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_config_path() == tmp_path / "xdg" / "cadence" / "default_config.yaml"
    monkeypatch.setenv("CADENCE_CONFIG_FILE", str(tmp_path / "mine.yaml"))
    assert default_config_path() == tmp_path / "mine.yaml"


def test_defaults_without_a_file_and_round_trip(tmp_path):
    assert load_config() == Config()
    cfg = Config(num_processes=2, distributed_type="MULTI_CPU", use_cpu=True, mixed_precision="bf16", timeout=30)
    assert load_config(save(cfg)) == cfg and load_config() == cfg
    assert cfg.strategy == "ddp" and Config().strategy is None and Config(distributed_type="FSDP").strategy == "fsdp"


def test_explicit_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="cadence config"):
        load_config(tmp_path / "nope.yaml")


def test_accelerate_formats_are_accepted(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\ndowncast_bf16: 'no'\n"
                    "mixed_precision: no\nnum_processes: 1\nsame_network: true\ntpu_env: []\nuse_cpu: false\n"
                    "dynamo_config: {dynamo_backend: INDUCTOR}\nenable_cpu_affinity: false\n")
    # unquoted `no` is YAML's False: read as "no"; dynamo_config reaches the workers (torch.compile)
    assert load_config(path) == Config(dynamo_config={"dynamo_backend": "inductor"})
    old = from_dict(ACCELERATE_OLD, "old.yaml")
    assert (old.mixed_precision, old.distributed_type, old.num_processes) == ("fp16", "MULTI_GPU", 4)


@pytest.mark.parametrize("raw, words", [
    ({"num_procesess": 2}, ["'num_procesess'", "did you mean 'num_processes'", "bad.yaml"]),
    ({"mixed_precision": "fp8"}, ["mixed_precision", "no, fp16, bf16", "bad.yaml"]),
    ({"distributed_type": "MULTI_TPU"}, ["distributed_type", "MULTI_CPU", "FSDP"]),
    ({"num_processes": "two"}, ["num_processes", "int"]),
    ({"num_processes": 0}, ["num_processes", ">= 1"]),
    ({"main_process_port": 99999}, ["main_process_port", "<= 65535", "99999"]),
    ({"num_processes": 3, "num_machines": 2}, ["multiple of num_machines"]),
    ({"compute_environment": "AMAZON_SAGEMAKER"}, ["compute_environment", "LOCAL_MACHINE"]),
])
def test_bad_keys_and_values_name_the_key_and_the_allowed_values(raw, words):
    with pytest.raises(ValueError) as info:
        from_dict(raw, "bad.yaml")
    for word in words:
        assert word in str(info.value)


def test_bad_yaml_and_non_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(path)
    path.write_text("num_processes: [1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(path)


def test_questionnaire_asks_what_flags_leave_open_and_retries_bad_answers(capsys):
    answers = iter(["yes", "", "maybe", "2", "", "bf16", "120"])
    prompts = []

    def ask(prompt):
        prompts.append(prompt)
        return next(answers)

    cfg = questionnaire(Config(), {"gradient_accumulation_steps": 2}, ask)
    assert cfg == Config(use_cpu=True, num_processes=2, distributed_type="MULTI_CPU", mixed_precision="bf16",
                         gradient_accumulation_steps=2, timeout=120.0)
    assert "[1]" in prompts[1] and "[MULTI_CPU]" in prompts[4] and "(no/fp16/bf16) [no]" in prompts[5]
    assert not any("batches per optimizer step" in p for p in prompts)     # answered by a flag
    assert "expected a value of type int" in capsys.readouterr().out
    assert yaml.safe_load(yaml.safe_dump(cfg.to_dict()))["num_processes"] == 2


def test_gpu_ids_from_an_accelerate_file_are_honoured():
    # gpu_ids was accepted and ignored; YAML reads `gpu_ids: 1` as an int
    assert from_dict({"gpu_ids": 1}).gpu_ids == "1" and from_dict({"gpu_ids": None}).gpu_ids == "all"
    assert from_dict({"gpu_ids": "0,2", "num_processes": 2}).gpu_ids == "0,2"
    from cadence.distributed.launch import launch_env

    assert launch_env(from_dict({"gpu_ids": "0,2", "num_processes": 2}))["CUDA_VISIBLE_DEVICES"] == "0,2"
