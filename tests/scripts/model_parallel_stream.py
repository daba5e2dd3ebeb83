"""Launched on 4 processes (tp=2, dp=2) by tests/distributed/test_model_parallel.py: the tiny tied LM of
model_parallel.py trained on an IterableDataset without a length, so the dp groups must agree on when an
epoch ends (33 items: one group has a fifth batch, the other pads). Rank 0 prints `CHECK <name> ok`:
- every rank took the same number of steps (5), and the ranks of a tp group saw the same batches;
- the valid loss over a 13-item stream equals the one-process loss of the trained weights on every item once.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from cadence import Callback, DataLoaders, Learner
from cadence.distributed.env import rank, world_size
from model_parallel import BS, data, lm_loss, make_model, parallelize


class Stream(IterableDataset):
    def __init__(self, n, seed):
        self.x, self.y = data(n, seed)

    def __iter__(self):
        return iter(zip(self.x, self.y))


class Firsts(Callback):
    def before_fit(self):
        self.seen = []

    def after_batch(self):
        if self.training:
            self.seen.append(self.learn.xb[0][:, 0].tolist())


def ok(name):
    if rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def main():
    train, valid = Stream(33, 1), Stream(13, 2)
    dls = DataLoaders(DataLoader(train, batch_size=BS), DataLoader(valid, batch_size=BS), device="cpu")
    firsts = Firsts()
    learn = Learner(dls, make_model(), loss_func=lm_loss, opt_func=torch.optim.SGD, lr=0.1, cbs=[firsts])
    with learn.distrib_ctx(strategy="model_parallel", tp_size=2, parallelize=parallelize):
        learn.fit(1)
        valid_loss = learn.validate()["valid_loss"]
        seen = [None] * world_size()
        dist.all_gather_object(seen, firsts.seen)
    assert all(len(s) == 5 for s in seen), [len(s) for s in seen]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2], seen
    ok("steps_agreed_over_dp")
    with torch.no_grad():
        expected = lm_loss(learn.model(valid.x), valid.y)
    torch.testing.assert_close(torch.tensor(valid_loss), expected, rtol=1e-5, atol=1e-6)
    ok("valid_loss_exact")


if __name__ == "__main__":
    main()
