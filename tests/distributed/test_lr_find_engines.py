"""lr_find under each engine on 2 processes: it restores the weights and optimizer state (DeepSpeed's through its own
checkpoint: a copy of its partitioned state cannot be loaded back), so training after it is training without it."""

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_launch


@pytest.mark.slow
@pytest.mark.parametrize("engine", [pytest.param(("ddp",), marks=pytest.mark.long),
                                    pytest.param(("fsdp",), marks=pytest.mark.long),
                                    ("deepspeed", "2"), ("deepspeed", "3")])
def test_a_fit_after_lr_find_ends_with_the_weights_of_one_without_it(tmp_path, engine):
    out = tmp_path / "weights.safetensors"
    proc = run_launch("lr_find_engines.py", *engine, out, timeout=400)
    assert proc.stdout.count("SWEPT rank") == 2, proc.stdout
    weights = load_file(str(out))
    plain = {k.removeprefix("plain."): v for k, v in weights.items() if k.startswith("plain.")}
    swept = {k.removeprefix("swept."): v for k, v in weights.items() if k.startswith("swept.")}
    assert plain.keys() == swept.keys() and len(plain) == 4
    for name, value in plain.items():
        assert torch.equal(value, swept[name]), name
