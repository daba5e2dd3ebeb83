"""Launched on 2 processes by tests/distributed/test_ops_multiprocess.py: the DDP strategy.

Checks that 2 processes with batch size B and plain SGD end with the weights of 1 process
with batch size 2B over the same data order, and that set_gradient_sync(False) accumulates without syncing.
Prints "DDP OK" on rank 0 when every check passed.
"""

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.distributed import env, ops
from cadence.distributed.ddp import DDP

B, N, EPOCHS, LR = 4, 30, 2, 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (N,), generator=gen))


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, xb: torch.Tensor, yb: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    opt.zero_grad()


def train_ddp(strategy: DDP, ds: TensorDataset) -> tuple[nn.Module, list]:
    model = make_model()
    model, opt = strategy.setup(model, lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    dl = strategy.shard(DataLoader(ds, batch_size=B, shuffle=True))
    orders = []
    for epoch in range(EPOCHS):
        dl.set_epoch(epoch)
        orders.append([dl.get_idxs(r) for r in range(2)])
        for xb, yb in dl:
            sgd_step(model, opt, xb, yb)
    return model, orders


def train_reference(ds: TensorDataset, orders: list) -> nn.Module:
    """One process, batch size 2B: batch k is batch k of rank 0 followed by batch k of rank 1."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for shards in orders:
        for k in range(0, len(shards[0]), B):
            idx = torch.tensor(shards[0][k:k + B] + shards[1][k:k + B])
            sgd_step(model, opt, *ds[idx])
    return model


def check_no_sync(strategy: DDP, ds: TensorDataset, rank: int) -> None:
    model = make_model()
    plain = copy.deepcopy(model)
    ddp_model, _ = strategy.setup(model, lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    x, y = ds.tensors
    halves = [(x[rank * 10 + i * 5:rank * 10 + i * 5 + 5], y[rank * 10 + i * 5:rank * 10 + i * 5 + 5]) for i in range(2)]
    strategy.set_gradient_sync(ddp_model, False)  # before the forward: DDP decides there
    nn.functional.cross_entropy(ddp_model(halves[0][0]), halves[0][1]).backward()
    strategy.set_gradient_sync(ddp_model, True)
    local = [p.grad.clone() for p in ddp_model.parameters()]
    others = ops.gather(torch.cat([g.flatten() for g in local]).unsqueeze(0))
    assert not torch.allclose(others[0], others[1]), "no_sync must leave gradients unsynced"
    nn.functional.cross_entropy(ddp_model(halves[1][0]), halves[1][1]).backward()
    for xb, yb in halves:
        nn.functional.cross_entropy(plain(xb), yb).backward()
    expected = ops.reduce([p.grad for p in plain.parameters()], "mean")
    for got, want in zip(ddp_model.parameters(), expected):
        torch.testing.assert_close(got.grad, want)


def main() -> None:
    strategy = DDP(device="cpu")
    strategy.setup_environment()
    rank = env.rank()
    assert strategy.created_group and env.world_size() == 2
    ds = make_data()
    model, orders = train_ddp(strategy, ds)
    weights = strategy.model_state_dict(model)
    assert not any(k.startswith("module.") for k in weights)
    gathered = ops.gather_object(weights)
    for k in weights:
        torch.testing.assert_close(gathered[0][k], gathered[1][k])
    if rank == 0:
        reference = train_reference(ds, orders).state_dict()
        for k in weights:
            torch.testing.assert_close(weights[k], reference[k], rtol=1e-9, atol=1e-12)
        assert not torch.allclose(weights["0.weight"], make_model().state_dict()["0.weight"])
    check_no_sync(strategy, ds, rank)
    ops.main_print("DDP OK")
    strategy.teardown()
    assert not env.is_initialized() and not strategy.created_group


if __name__ == "__main__":
    main()
