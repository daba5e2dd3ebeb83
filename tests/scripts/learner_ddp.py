"""Launched on 2 processes by tests/distributed/test_learner_distributed.py.

Checks, printing one `CHECK <name> ok` line per passed check on rank 0:
- DDP with batch size b equals one process with batch size 2b over the same data order;
- validation metrics under distrib_ctx equal single-process metrics of the same weights (padding dropped);
- get_preds under distrib_ctx returns the whole validation set in dataset order;
- after distrib_ctx the learner trains and predicts in one process again.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import AccumMetric, DataLoaders, Learner, accuracy
from cadence.distributed.env import rank, world_size
from toy import classification, two_rank_epoch

N_TRAIN, N_VALID, BS = 64, 37, 8   # 37 valid items: the last shard is padded


def data():
    x, y = classification(N_TRAIN + N_VALID, features=6)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def reference_weights(x, y, epochs):
    """One process, batch 2*BS made of rank 0's and rank 1's batch k (the same data order)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        two_rank_epoch(model, opt, x, y, BS)
    return model


def macro_recall(p, t):
    cls = p.argmax(1)
    return torch.stack([(cls[t == c] == c).float().mean() for c in t.unique()]).mean()


def main():
    x, y, xv, yv = data()
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), DataLoader(TensorDataset(xv, yv), batch_size=BS),
                      device="cpu")
    learn = Learner(dls, make_model(), loss_func=nn.CrossEntropyLoss(), opt_func=torch.optim.SGD, lr=0.1,
                    metrics=[accuracy, AccumMetric(macro_recall, "recall")])
    with learn.distrib_ctx():
        assert world_size() == 2 and dist.is_initialized()
        assert len(learn.dls.train) == N_TRAIN // 2 // BS
        learn.fit(2)
        res = learn.validate()
        preds, targs = learn.get_preds()
        fit_row = learn.recorder.values[-1]
    assert not dist.is_initialized(), "distrib_ctx created the group, so it must destroy it"
    model = learn.model
    assert isinstance(model, nn.Sequential) and isinstance(learn.dls.train, DataLoader)

    ref = reference_weights(x, y, 2)
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print_ok("ddp_equals_double_batch")

    with torch.no_grad():
        out = model(xv)
    direct = {"valid_loss": nn.functional.cross_entropy(out, yv).item(),
              "accuracy": (out.argmax(1) == yv).float().mean().item(), "recall": macro_recall(out, yv).item()}
    for k, v in direct.items():
        assert abs(res[k] - v) < 1e-5, (k, res[k], v)
        assert abs(fit_row[k] - v) < 1e-5, (k, fit_row[k], v)
    print_ok("metrics_equal_single_process")

    assert preds.shape == (N_VALID, 3) and torch.equal(targs, yv)
    torch.testing.assert_close(preds, out)
    print_ok("get_preds_dataset_order")

    learn.fit(1)  # one process again: each rank trains alone, no collective
    assert learn.predict(xv[0]).shape == (3,)
    print_ok("single_process_after_ctx")


def print_ok(name):
    if rank() == 0:
        print(f"CHECK {name} ok", flush=True)


if __name__ == "__main__":
    main()
