"""`cadence estimate-memory`: model-state bytes per process, checked against the ZeRO paper and DeepSpeed's estimator."""

import sys

import pytest
from torch import nn

from cadence.cli import main
from cadence.distributed.estimate import deepspeed_estimate, model_sizes, model_state_bytes


def seventy_billion() -> nn.Module:
    """~69B parameters: built on the meta device by estimate-memory, so it costs no memory."""
    return nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(1024)], nn.Linear(8192, 10))


def test_the_zero_papers_figure_1_numbers():
    # Rajbhandari et al. 2020, Figure 1: a 7.5B-parameter model on 64 GPUs, mixed precision Adam (K = 12)
    gb = lambda engine: model_state_bytes(7.5e9, engine, 64, mixed=True).device / 1e9
    assert gb("DDP") == pytest.approx(120, rel=1e-3)
    assert gb("ZeRO-1") == pytest.approx(31.4, abs=0.05)
    assert gb("ZeRO-2") == pytest.approx(16.6, abs=0.05)
    assert gb("ZeRO-3") == pytest.approx(1.88, abs=0.01)


@pytest.mark.parametrize("n, machines", [(8, 1), (16, 2), (2, 1)])
def test_deepspeed_column_equals_deepspeeds_own_estimator(n, machines):
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    psi, layer, per = 1_300_000_000, 50_000_000, n // machines
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(psi, per, machines, cpu_offload=offload)
        ours = deepspeed_estimate(psi, "ZeRO-2", n, machines, "optimizer" if offload else "none")
        assert (ours.device, ours.cpu) == pytest.approx((gpu, cpu))
    for opt, params, name in ((False, False, "none"), (True, False, "optimizer"), (True, True, "optimizer+param")):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(psi, layer, per, machines, cpu_offload=opt,
                                                            cpu_offload_params=params, zero_init=True)
        ours = deepspeed_estimate(psi, "ZeRO-3", n, machines, name, largest_layer_params=layer)
        assert (ours.device, ours.cpu) == pytest.approx((gpu, cpu))
    assert deepspeed is not None


def test_fp32_and_offload_accounting():
    psi, n = 1e9, 4
    # fp32: torch keeps 4 + 4 + 8 bytes; DeepSpeed adds its fp32 master copy (K = 12)
    assert model_state_bytes(psi, "DDP", n, mixed=False).device == 16 * psi
    assert model_state_bytes(psi, "FSDP", n, mixed=False).device == 16 * psi / n
    assert model_state_bytes(psi, "ZeRO-3", n, mixed=False).device == 20 * psi / n
    offloaded = model_state_bytes(psi, "ZeRO-3", n, mixed=True, offload="optimizer+param")
    assert offloaded.device == 0 and offloaded.cpu == 18 * psi / n
    with pytest.raises(ValueError, match="DDP has no 'optimizer' offload"):
        model_state_bytes(psi, "DDP", n, offload="optimizer")


def test_cli_builds_a_70b_model_on_meta_and_prints_the_table(capsys):
    total, largest = model_sizes(f"{__name__}:seventy_billion")
    assert total == 1024 * (8192 * 8192 + 8192) + 8192 * 10 + 10 and largest == 8192 * 8192 + 8192
    assert main(["estimate-memory", f"{__name__}:seventy_billion", "--num_processes", "8", "64"]) == 0
    out = capsys.readouterr().out
    assert f"Model states for {total:,} parameters on 8 processes" in out and "on 64 processes" in out
    ddp_row = next(line for line in out.splitlines() if line.startswith("| DDP | none"))
    assert f"| {16 * total / 2**30:.2f} |" in ddp_row


@pytest.mark.parametrize("argv, message", [(["12X"], "'12X' is neither a parameter count"),
                                           (["no_such_module:f"], "cannot load 'no_such_module:f'"),
                                           (["1B", "--num_processes", "3", "--num_machines", "2"], "multiple of")])
def test_bad_model_or_sizes_are_refused(argv, message, capsys):
    assert main(["estimate-memory", *argv]) == 2
    assert message in capsys.readouterr().err


def deepspeeds_own_estimates(model, per_machine, machines, monkeypatch):
    """What DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs_all_live` compute for `model`, exactly.

    They print rounded GB; the exact (cpu, gpu) bytes are recorded from the estimators they call, with
    the parameter counts DeepSpeed derives from the live model itself.
    """
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    seen = {}

    def recording(module, name, key):
        original = getattr(module, name)

        def record(**kw):
            result = original(**kw)
            seen[key(kw)] = result[:2]
            return result
        monkeypatch.setattr(module, name, record)

    recording(stage_1_and_2, "estimate_zero2_model_states_mem_needs",
              lambda kw: ("ZeRO-2", "optimizer" if kw["cpu_offload"] else "none"))
    recording(stage3, "estimate_zero3_model_states_mem_needs",
              lambda kw: ("ZeRO-3", {(False, False): "none", (True, False): "optimizer", (True, True): "optimizer+param"}[
                  (kw["cpu_offload"], kw["cpu_offload_params"])]) if kw["zero_init"] else None)
    stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live(model, per_machine, machines)
    stage3.estimate_zero3_model_states_mem_needs_all_live(model, per_machine, machines)
    seen.pop(None)  # zero_init=False: cadence's ZeRO-3 builds under zero.Init
    return seen


def hf_configs():
    transformers = pytest.importorskip("transformers")
    return {"gpt2-tied": transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64),
            "llama": transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)}


@pytest.mark.parametrize("name, as_file, n, machines", [("gpt2-tied", False, 8, 1), ("llama", True, 16, 2)])
def test_a_hugging_face_config_is_sized_offline_as_deepspeeds_estimators_size_the_model(tmp_path, monkeypatch, capsys,
                                                                                         name, as_file, n, machines):
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    config = hf_configs()[name]
    config.save_pretrained(tmp_path / name)                          # a local directory: config.json, nothing else
    spec = str(tmp_path / name / "config.json") if as_file else str(tmp_path / name)
    expected = deepspeeds_own_estimates(AutoModelForCausalLM.from_config(config), n // machines, machines, monkeypatch)
    assert len(expected) == 5

    total, largest = model_sizes(spec)
    for (engine, offload), (cpu, gpu) in expected.items():
        ours = deepspeed_estimate(total, engine, n, machines, offload, largest_layer_params=largest)
        assert (ours.device, ours.cpu) == pytest.approx((gpu, cpu), rel=1e-12), (engine, offload)

    capsys.readouterr()
    assert main(["estimate-memory", spec, "--num_processes", str(n), "--num_machines", str(machines)]) == 0
    out = capsys.readouterr().out
    assert f"Model states for {total:,} parameters on {n} processes" in out
    cpu, gpu = expected["ZeRO-3", "optimizer"]
    assert f"| ZeRO-3 | optimizer |" in out and f"| {gpu / 2**30:.2f} / {cpu / 2**30:.2f} |" in out


def test_module_function_is_imported_from_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models_here.py").write_text("from torch import nn\n"
                                                "def build():\n    return nn.Linear(1000, 1000)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert main(["estimate-memory", "my_models_here:build", "--num_processes", "2"]) == 0
    assert "Model states for 1,001,000 parameters on 2 processes" in capsys.readouterr().out


@pytest.mark.parametrize("make, message", [(lambda d: d.mkdir(), "config.json does not exist"),
                                           (lambda d: None, "config.json does not exist"),
                                           (lambda d: (d.mkdir(), (d / "config.json").write_text("{}")),
                                            "is not a Hugging Face model config")])
def test_a_config_directory_without_a_usable_config_is_refused(tmp_path, capsys, make, message):
    pytest.importorskip("transformers")
    make(tmp_path / "cfg")
    spec = tmp_path / "cfg" if (tmp_path / "cfg").is_dir() else tmp_path / "cfg" / "config.json"
    assert main(["estimate-memory", str(spec)]) == 2
    assert message in capsys.readouterr().err
