"""GradAccum, GradClip, MixedPrecision and the launcher's settings under DDP on 2 processes."""

import pytest

from helpers import run_launch

pytestmark = pytest.mark.slow


def test_accumulation_clipping_and_fp16_under_ddp():
    out = run_launch("features_ddp.py", "accum").stdout
    for r in (0, 1):
        assert f"CHECK rank{r} accum_clip_equals_big_batch ok" in out, out
        assert f"CHECK rank{r} fp16_ddp ok" in out, out


def test_rank0_first_and_launcher_flags_reach_the_learner(tmp_path):
    out = run_launch("features_ddp.py", "launcher", tmp_path,
                     flags=("--mixed_precision", "bf16", "--gradient_accumulation_steps", "2")).stdout
    for check in ("rank0_first_without_group", "launcher_settings"):
        assert f"CHECK rank0 {check} ok" in out and f"CHECK rank1 {check} ok" in out, out
