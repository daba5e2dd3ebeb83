"""examples/accelerate_nlp.py (Accelerate's nlp_example loop with `from cadence import Accelerator`) trains on
2 processes under DDP, FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3, unchanged: evaluates every sample exactly once, and leaves
a complete checkpoint (DeepSpeed's own partition files under deepspeed/)."""

import re

import pytest

from helpers import REPO, run_launch

SCRIPT = REPO / "examples" / "accelerate_nlp.py"


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), pytest.param(("--use_fsdp",), marks=pytest.mark.long),
                                   pytest.param(("--use_deepspeed", "--zero_stage", "2"), marks=pytest.mark.long),
                                   ("--use_deepspeed", "--zero_stage", "3")], ids=["ddp", "fsdp", "zero2", "zero3"])
def test_nlp_example_trains_on_2_processes(tmp_path, flags):
    out = tmp_path / "ckpt"
    proc = run_launch(SCRIPT, "--gradient_accumulation_steps", "2", "--output_dir", str(out), nproc=2, flags=flags,
                      timeout=300)
    epochs = re.findall(r"^epoch \d+: accuracy ([0-9.]+) on (\d+) samples$", proc.stdout, flags=re.M)
    assert len(epochs) == 4, proc.stdout                                   # printed once, by the main process
    assert all(n == "203" for _, n in epochs), proc.stdout                 # the padded shard counted once
    assert float(epochs[-1][0]) >= 0.9, proc.stdout
    # 512 items, 2 processes, batch 16, windows of 2: 8 optimizer steps per epoch
    # and the one-cycle schedule sized from the whole loader (64 windows) ended with the training, as in Accelerate
    assert "trained on 2 processes, 32 optimizer steps, schedule at 64 of 64" in proc.stdout, proc.stdout
    if "--use_deepspeed" in flags:
        assert list((out / "deepspeed").rglob("*optim_states.pt")), "DeepSpeed's partitions were not saved"
    assert (out / "state.json").is_file() and {"rng-rank0.pt", "rng-rank1.pt"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".*tmp")), "a temporary checkpoint directory was left behind"
