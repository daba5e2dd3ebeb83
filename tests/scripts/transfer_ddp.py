"""Launched on 2 processes by tests/trainer/test_transfer.py: freezing and discriminative rates under DDP and FSDP2.

For each engine: one epoch with the body frozen, then one with everything trainable at rates
slice(LR / 10, LR) (body, head), plain SGD,
against a hand-written single-process loop over the same samples (rank 0's and rank 1's batch k
make one batch of 2*BS). Prints `CHECK <engine>_<name> ok` on rank 0 per passed check.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.distributed.env import rank, setup_distrib, world_size
from toy import classification, two_rank_epoch

N_TRAIN, BS, LR = 64, 8, 0.2


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def body_and_head(m):
    return [list(m[:-1].parameters()), list(m[-1].parameters())]


def reference(x, y):
    """Epoch 1 trains the head only, epoch 2 everything (the body at LR / 10): what a 2-process run must equal."""
    model = make_model()
    body, head = body_and_head(model)
    opt = torch.optim.SGD([{"params": body}, {"params": head}], lr=LR)
    for frozen in (True, False):
        for p in body:
            p.requires_grad_(not frozen)
        opt.param_groups[0]["lr"] = LR if frozen else LR / 10
        two_rank_epoch(model, opt, x, y, BS)
    return model


def check(engine, x, y, ref):
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), None, device="cpu")
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=LR,
                    splitter=body_and_head)
    start = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(), learn.distrib_ctx(strategy=engine):
        assert len(learn.opt.param_groups) == 2, "the splitter's groups survive wrapping"
        learn.freeze()
        learn.fit(1)
        plain = learn.strategy.model_state_dict(learn.model)   # every rank calls it (FSDP gathers on rank 0)
        if rank() == 0:
            moved = [not torch.equal(a, b) for a, b in zip(start, plain.values())]
            assert moved == [False] * 4 + [True] * 2, moved   # body frozen, head trained
            print_ok(engine, "frozen_body_unchanged")
        learn.unfreeze()
        learn.fit(1, lr=slice(LR / 10, LR))
        assert [g["lr"] for g in learn.opt.param_groups] == [LR / 10, LR]
    for a, b in zip(ref.parameters(), learn.model.parameters()):   # after distrib_ctx: the full module, every rank
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print_ok(engine, "equals_single_process_loop")


def print_ok(engine, name):
    if rank() == 0:
        print(f"CHECK {engine}_{name} ok", flush=True)


def main():
    setup_distrib()
    assert world_size() == 2
    x, y = classification(N_TRAIN, features=6)
    ref = reference(x, y)
    for engine in sys.argv[1:]:
        check(engine, x, y, ref)


if __name__ == "__main__":
    main()
