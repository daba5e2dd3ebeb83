"""`Accelerator.save_model` as Accelerate's: the main process alone may call it under DDP, and a peft model's whole
state is written (Accelerate's `get_state_dict` of it), where `learn.save_model` writes the adapter."""

import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

from helpers import REPO, cadence_env, run_launch

SAVE_PEFT = textwrap.dedent("""
    import json, sys
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    if sys.argv[1] == "accelerate":
        from accelerate import Accelerator
    else:
        from cadence import Accelerator
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"]))
    accelerator = Accelerator()
    model = accelerator.prepare(model)
    accelerator.save_model(model, sys.argv[2])
""")


@pytest.mark.slow
def test_save_model_by_the_main_process_alone_under_ddp_does_not_wait_for_the_others(tmp_path):
    proc = run_launch("accelerate_main_only_save.py", tmp_path / "export", timeout=120)
    assert "gathered [0, 1]" in proc.stdout
    assert "weight" in load_file(str(tmp_path / "export" / "model.safetensors"))


def test_save_model_of_a_peft_model_writes_its_whole_state_as_accelerate_does(tmp_path):
    names = {}
    for library in ("accelerate", "cadence"):
        out = tmp_path / library
        subprocess.run([sys.executable, "-c", SAVE_PEFT, library, str(out)], check=True, timeout=120, cwd=REPO,
                       env=cadence_env(), capture_output=True)
        names[library] = sorted(load_file(str(out / "model.safetensors")))
    assert names["cadence"] == names["accelerate"]
    assert any(".lora_A." in n for n in names["cadence"]) and any(n.startswith("base_model.model.") for n in
                                                                    names["cadence"])
