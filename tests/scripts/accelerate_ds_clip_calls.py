"""Launched on 2 processes by tests/accelerate/test_accelerate_deepspeed_clip_calls.py: `clip_grad_norm_` calls
under DeepSpeed ZeRO-2 that clip some steps only, with and without the config's own `gradient_clipping`.

argv: OUT_JSON CASE... Each CASE (see CASES: config clipping, which steps call `clip_grad_norm_` and with what)
trains the same small model from the same seed on the same data with SGD; rank 0 writes {case: {"weights",
"norms" (what each call returned), "warnings", "error"}} to OUT_JSON.
"""

import json
import math
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Accelerator, DeepSpeedPlugin

LR, BS, STEPS = 0.1, 4, 4
# case: (config gradient_clipping (None: "auto"), {step: (max_norm, norm_type)} the steps that call clip_grad_norm_)
CASES = {
    "first_step_only": (None, {0: (0.05, 2.0)}),             # a warm-up clip: later steps unclipped
    "config_and_calls": (1.0, {0: (0.5, 2.0), 2: (5.0, 2.0)}),  # config every step, a call: the smaller, that step
    "config_off_norm_type_1": (0.0, {1: (0.5, 1)}),          # DeepSpeed clips by L2 only: warned, clipped by L2
    "monitor": (None, {t: (math.inf, 2.0) for t in range(STEPS)}),   # the norm alone: nothing clipped
}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """Step t's batch on rank r is the loader's batch 2t + r (batches dealt to the ranks in turn)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(2 * STEPS * BS, 8, generator=g), torch.randn(2 * STEPS * BS, 4, generator=g) * 10


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(case: str) -> dict:
    config_clip, calls = CASES[case]
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=config_clip)
    acc = Accelerator(cpu=True, deepspeed_plugin=plugin)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    net, opt, dl = acc.prepare(net, opt, DataLoader(TensorDataset(*data()), batch_size=BS))
    norms, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t, (x, y) in enumerate(dl):
            acc.backward(((net(x) - y) ** 2).mean())
            if t in calls:
                try:
                    norms.append(float(acc.clip_grad_norm_(net.parameters(), calls[t][0], norm_type=calls[t][1])))
                except Exception as e:   # the test reports it: a common config must not stop training
                    error = f"{type(e).__name__}: {e}"
            opt.step()
            opt.zero_grad()
    weights = {k: v.float().tolist() for k, v in acc.get_state_dict(net).items()}
    acc.end_training()
    return {"weights": weights, "norms": norms, "error": error,
            "warnings": [str(w.message) for w in caught if "clip" in str(w.message)]}


if __name__ == "__main__":
    out, cases = sys.argv[1], sys.argv[2:]
    results = {case: train(case) for case in cases}
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
