"""examples/accelerate_nlp.py (Accelerate's nlp_example loop with `from cadence import Accelerator`) trains on
2 processes under DDP and FSDP, evaluates every sample exactly once, and leaves a complete checkpoint."""

import re

import pytest

from helpers import REPO, run_launch

SCRIPT = REPO / "examples" / "accelerate_nlp.py"


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--use_fsdp",)], ids=["ddp", "fsdp"])
def test_nlp_example_trains_on_2_processes(tmp_path, flags):
    out = tmp_path / "ckpt"
    proc = run_launch(SCRIPT, "--gradient_accumulation_steps", "2", "--output_dir", str(out), nproc=2, flags=flags,
                      timeout=300)
    epochs = re.findall(r"^epoch \d+: accuracy ([0-9.]+) on (\d+) samples$", proc.stdout, flags=re.M)
    assert len(epochs) == 4, proc.stdout                                   # printed once, by the main process
    assert all(n == "203" for _, n in epochs), proc.stdout                 # the padded shard counted once
    assert float(epochs[-1][0]) >= 0.9, proc.stdout
    # 512 items, 2 processes, batch 16, windows of 2: 8 optimizer steps per epoch
    assert "trained on 2 processes, 32 optimizer steps" in proc.stdout, proc.stdout
    assert (out / "state.json").is_file() and {"rng-rank0.pt", "rng-rank1.pt"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".*tmp")), "a temporary checkpoint directory was left behind"
