"""`accelerator.clip_grad_norm_` clips by the true global norm and returns it on every engine (issue 20 item 7).

A run_clm_no_trainer-style Accelerator loop (tiny GPT-2 with tied lm_head, real transformers) with
`clip_grad_norm_(model.parameters(), 0.5)` before each step, launched on 2 processes under DDP, FSDP2
(`fsdp_plugin=`), ZeRO-2 and ZeRO-3 (`deepspeed_plugin=`), against the same steps done by hand on one
process: global batch, norm of all gradients, clip coefficient, AdamW. Before the fix, ZeRO returned 0.0
and did not clip ("auto" clipping was off), so its loss curve left DDP's.
"""

import json
import sys

import pytest
import torch

from helpers import SCRIPTS, run_launch

sys.path.insert(0, str(SCRIPTS))
import accelerate_clm_clip as clm  # noqa: E402  (the launched script's model, data and constants)

ENGINES = ("ddp", "fsdp", "zero2", "zero3")


def by_hand() -> tuple[list[list[float]], list[float]]:
    """One process: each step's two per-rank batches, their mean loss, the global norm, clipping and AdamW by hand."""
    model, rows = clm.model(), clm.data()
    opt = torch.optim.AdamW(model.parameters(), lr=clm.LR)
    losses, norms = [], []
    for _ in range(clm.EPOCHS):
        for t in range(clm.STEPS_PER_EPOCH):
            batches = [rows[(2 * t + r) * clm.BS: (2 * t + r + 1) * clm.BS] for r in (0, 1)]   # dealt in turn
            step_losses = [model(input_ids=b, labels=b).loss for b in batches]
            (sum(step_losses) / 2).backward()   # what the 2-process average of gradients is
            grads = [p.grad for p in model.parameters()]
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
            for g in grads:
                g.mul_(min(1.0, clm.MAX_NORM / (norm + 1e-6)))
            opt.step()
            opt.zero_grad()
            losses.append([x.item() for x in step_losses])
            norms.append(norm)
    return losses, norms


@pytest.mark.slow
def test_clip_grad_norm_returns_the_global_norm_and_clips_alike_on_ddp_fsdp_zero2_zero3(tmp_path):
    out = tmp_path / "clip.json"
    run_launch("accelerate_clm_clip.py", str(out), *ENGINES, timeout=540)
    results = json.loads(out.read_text())
    losses, norms = by_hand()
    assert min(norms) > clm.MAX_NORM            # every step is clipped: the test sees whether clipping happened
    kinds = {e: results[e]["distributed_type"] for e in ENGINES}
    assert kinds == {"ddp": "MULTI_CPU", "fsdp": "FSDP", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}
    for engine in ENGINES:
        assert results[engine]["norms"] == pytest.approx(norms, rel=1e-4), engine
        flat = [x for step in results[engine]["losses"] for x in step]
        assert flat == pytest.approx([x for step in losses for x in step], rel=1e-5), engine

    for engine in ("ddp", "fsdp"):   # a part of the model: its own norm, the rest of the gradients untouched
        part = results[engine]["part"]
        assert part["returned"] == pytest.approx(part["part"], rel=1e-5) and part["rest"] > 1e-2, (engine, part)
        assert part["part_after"] == pytest.approx(1e-3, rel=1e-3) and part["rest_after"] == part["rest"], engine
    for engine in ("zero2", "zero3"):
        assert "clips the whole model inside its own step" in results[engine]["part"]["refused"], engine
