"""The multi-process XLA strategy (one process per device) on 2 processes under torchrun, in the XLA environment,
with XLA's collectives replaced by gloo: this stands in for a TPU, whose interconnect runs them (XLA's CPU device
cannot run collectives across processes, pytorch/xla issue 9089). What is checked is the strategy's own logic:
each rank trains on its own shard, one process writes the checkpoint, the reduced gradient is the average."""

import json

import pytest
import torch
import torch.nn.functional as F

from xla_env import run_xla

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # torch_xla subprocesses (compiles: minutes when loaded)


def test_ranks_shards_one_writer_and_averaged_gradients_with_gloo_for_xla_collectives(xla_python, tmp_path):
    proc = run_xla(xla_python, "xla_gloo_ranks.py", "--out", str(tmp_path / "r"), "--dir", str(tmp_path), torchrun=2)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r0, r1 = (json.loads((tmp_path / f"r.rank{rank}.json").read_text()) for rank in (0, 1))
    assert (r0["rank"], r0["world"], r0["is_main"], r1["rank"], r1["world"], r1["is_main"]) == (0, 2, True, 1, 2, False)
    assert r0["device"] == r1["device"] == "xla:0"

    # each rank its own half of the 24 training samples, every epoch (2 epochs of 3 batches of 4)
    ids = [sorted(sum(r["ids"][:3], [])) for r in (r0, r1)]
    assert sorted(ids[0] + ids[1]) == list(range(24)) and not set(ids[0]) & set(ids[1]), ids
    assert r0["ids"][3:] == r0["ids"][:3] and r1["ids"][3:] == r1["ids"][:3]

    # one writer: the main process wrote the model file of each epoch's checkpoint, rank 1 none
    assert r0["writers"] == [0, 0] and r1["writers"] == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "step-00000006"
    assert r0["all_sum"] == r1["all_sum"] == [3.0] and r0["gather"] == r1["gather"] == [0.0, 1.0]

    # a hand-written data-parallel loop: each step's gradient is the mean of the two ranks' batch gradients
    x, y = torch.tensor(r0["x"]), torch.tensor(r0["y"])
    w, b = (torch.tensor(t, requires_grad=True) for t in r0["initial"])
    for step in range(6):
        grads = []
        for r in (r0, r1):
            idx = torch.tensor(r["ids"][step])
            grads.append(torch.autograd.grad(F.mse_loss(x[idx] @ w.T + b, y[idx]), (w, b)))
        avg = [(g0 + g1) / 2 for g0, g1 in zip(*grads)]
        if step == 0:
            for r in (r0, r1):
                for got, want in zip(r["first_grads"], avg):
                    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            w -= 1e-3 * avg[0]
            b -= 1e-3 * avg[1]
    for r in (r0, r1):
        torch.testing.assert_close(torch.tensor(r["weights"][0]), w.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["weights"][1]), b.detach(), rtol=1e-5, atol=1e-5)
