"""`accelerator.clip_grad_norm_` under DeepSpeed clips the step it is called on, no other (QA t2 (a), (b)).

A loop on 2 processes with ZeRO-2 (`deepspeed_plugin=`) against the same SGD steps done by hand on one process
(global batch, L2 norm of all gradients, clip coefficient). Before the fix, one call left the engine clipping every
later step, and a config's own `gradient_clipping` (1.0, Accelerate's usual, or 0.0) or `norm_type=1` made the
first call raise "the DeepSpeed config sets gradient_clipping=... but GradClip asks for ...".
"""

import json
import math
import sys

import pytest
import torch

from helpers import SCRIPTS, run_launch

sys.path.insert(0, str(SCRIPTS))
import accelerate_ds_clip_calls as script  # noqa: E402  (the launched script's model, data and cases)


def by_hand(case: str) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process: weights after the case's steps, the norms its calls should return, every step's norm."""
    config_clip, calls = script.CASES[case]
    net, (x, y) = script.model(), script.data()
    opt = torch.optim.SGD(net.parameters(), lr=script.LR)
    returned, every = [], []
    for t in range(script.STEPS):
        rows = [slice((2 * t + r) * script.BS, (2 * t + r + 1) * script.BS) for r in (0, 1)]
        (sum(((net(x[s]) - y[s]) ** 2).mean() for s in rows) / 2).backward()   # the 2-process gradient average
        grads = [p.grad for p in net.parameters()]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()   # L2, whatever norm_type asked
        limits = [v for v in (config_clip, calls.get(t, (math.inf,))[0]) if v and v < math.inf]
        if limits:
            for g in grads:
                g.mul_(min(1.0, min(limits) / (norm + 1e-6)))
        if t in calls:
            returned.append(norm)
        every.append(norm)
        opt.step()
        opt.zero_grad()
    return net.state_dict(), returned, every


@pytest.mark.slow
def test_clip_grad_norm_under_zero2_clips_its_own_step_on_top_of_the_configs_clipping(tmp_path):
    out = tmp_path / "clip_calls.json"
    run_launch("accelerate_ds_clip_calls.py", str(out), *script.CASES, timeout=400)
    results = json.loads(out.read_text())
    for case, got in results.items():
        assert got["error"] is None, (case, got["error"])
        weights, norms, every = by_hand(case)
        assert min(every) > 1.0, case   # every step would be clipped: the test sees which steps were
        assert got["norms"] == pytest.approx(norms, rel=1e-4), case
        for name, w in weights.items():
            torch.testing.assert_close(torch.tensor(got["weights"][name]), w, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, case=case, name=name: f"{case} {name}: {m}")
    first = results["first_step_only"]
    assert first["warnings"] == []
    config = results["config_and_calls"]["warnings"]   # once, though two calls differ from the config
    assert len(config) == 1 and "gradient_clipping=1.0" in config[0] and "clipped at the smaller" in config[0]
    norm1 = results["config_off_norm_type_1"]["warnings"]
    assert len(norm1) == 1 and "norm_type=1" in norm1[0] and "L2" in norm1[0]
    assert results["monitor"]["warnings"] == []


@pytest.mark.parametrize("clip, message", [
    ({"max_norm": 0.5}, r"config sets gradient_clipping=1.0 but GradClip asks for 0.5"),
    ({"max_norm": 1.0, "norm_type": 1}, r"L2 norm only: use GradClip\(1.0\) without norm_type=1"),
])
def test_a_learners_gradclip_that_the_deepspeed_config_contradicts_is_still_refused_before_training(
        dls, tmp_path, clip, message):
    """The Learner path keeps its check: GradClip configures the engine for the whole fit, so a config clipping
    elsewhere, or a norm DeepSpeed cannot clip by, is refused before any step (the weights are untouched)."""
    from fixtures import make_learner

    from cadence.callbacks.clip import GradClip

    learn = make_learner(dls, tmp_path, cbs=[GradClip(**clip)])
    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}
    before = {k: v.clone() for k, v in learn.model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        with learn.distrib_ctx(strategy="deepspeed", config=config):
            learn.fit(1)
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k, v in before.items())
