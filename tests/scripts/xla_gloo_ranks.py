"""The multi-process XLA strategy (one process per device, as on a TPU host) under torchrun, with XLA's collectives
replaced by gloo: XLA's CPU device cannot run collectives across processes (pytorch/xla issue 9089), so gloo stands
in for a TPU's interconnect. Everything else is the strategy's own code: the process group's world-size check,
ranks, the data shard, the gradient all-reduce's scale, the main process that writes.

Each rank writes `--out`.rank<N>.json: the sample ids of its batches, its first step's reduced gradients, its
final weights, is_main, and the ranks that wrote checkpoint files. Run by tests/xla/test_xla_gloo.py.
"""

import argparse
import json
import os

import torch_xla  # the XLA device must exist before the first backward of the process (autograd sizes its queues)

torch_xla.device()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cadence.callbacks.checkpoint import Checkpoint  # noqa: E402
from cadence.distributed import state_files  # noqa: E402
from cadence.trainer.callback import Callback  # noqa: E402
from cadence.trainer.data import DataLoaders  # noqa: E402
from cadence.trainer.learner import Learner  # noqa: E402

# ---- the stand-in: the "xla" process group and torch_xla's collectives, done by gloo on CPU copies
_init, _all_reduce, _all_gather, _broadcast = dist.init_process_group, dist.all_reduce, dist.all_gather, dist.broadcast


def gloo_group(backend=None, init_method=None, **kw):
    assert backend == "xla" and init_method == "xla://", (backend, init_method)  # what the strategy asks XLA for
    _init("gloo", init_method="env://", **kw)


def on_host(collective):
    """torch.distributed's collective on XLA tensors (what the "xla" backend takes): gloo on CPU copies."""
    def run(tensor, *args, **kw):
        if isinstance(tensor, list):
            hosts = [t.cpu() for t in tensor]
            out = collective(hosts, *args, **kw)
            for t, h in zip(tensor, hosts):
                t.copy_(h.to(t.device))
            return out
        host = tensor.cpu()
        out = collective(host, *args, **kw)
        tensor.copy_(host.to(tensor.device))
        return out
    return run


def host_all_gather(out, tensor, *args, **kw):
    hosts = [t.cpu() for t in out]
    result = _all_gather(hosts, tensor.cpu(), *args, **kw)
    for t, h in zip(out, hosts):
        t.copy_(h.to(t.device))
    return result


def gloo_all_reduce(reduce_type, inputs, scale=1.0, **kw):
    assert reduce_type == xm.REDUCE_SUM
    tensors = inputs if isinstance(inputs, list) else [inputs]
    out = []
    for t in tensors:
        host = t.detach().cpu()
        _all_reduce(host)
        out.append((host * scale).to(t.device))
    if isinstance(inputs, list):  # torch_xla reduces a list in place
        for t, r in zip(inputs, out):
            t.copy_(r)
        return inputs
    return out[0]


def gloo_all_gather(t, dim=0, **kw):
    parts = [torch.empty_like(t.cpu()) for _ in range(dist.get_world_size())]
    _all_gather(parts, t.detach().cpu())
    return torch.cat(parts, dim).to(t.device)


dist.init_process_group = gloo_group
dist.all_reduce, dist.broadcast, dist.all_gather = on_host(_all_reduce), on_host(_broadcast), host_all_gather
xm.all_reduce, xm.all_gather = gloo_all_reduce, gloo_all_gather
xm.rendezvous = lambda tag, *a, **kw: dist.barrier()

# ---- who writes checkpoint files
writers = []
_save = state_files.save_model_file


def recorded_save(state, directory):
    writers.append(int(os.environ["RANK"]))
    return _save(state, directory)


state_files.save_model_file = recorded_save   # what `write_state_files` calls


class Record(Callback):
    """The sample ids of each batch this rank trains on; the reduced gradients of the first step."""
    order = 100

    def before_fit(self):
        self.ids, self.first_grads = [], None

    def after_backward(self):
        if self.training:
            self.ids.append(self.xb[0][:, 0].cpu().round().long().tolist())
            if self.first_grads is None:
                self.first_grads = [p.grad.cpu().tolist() for p in self.model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    x[:, 0] = torch.arange(32).float()  # column 0: the sample's id (a feature too, so it is trained on)
    y = torch.randn(32, 1, generator=g)
    dls = DataLoaders(DataLoader(TensorDataset(x[:24], y[:24]), batch_size=4),
                      DataLoader(TensorDataset(x[24:], y[24:]), batch_size=4))
    torch.manual_seed(1)
    model = nn.Linear(4, 1)
    initial = [p.detach().clone().tolist() for p in model.parameters()]
    record = Record()
    learn = Learner(dls, model, loss_func=F.mse_loss, lr=1e-3, opt_func=torch.optim.SGD, path=args.dir,
                    cbs=[record, Checkpoint(every_epoch=True)])
    with learn.distrib_ctx(strategy="xla"):
        rank, world, is_main = learn.strategy.dp_rank, learn.strategy.dp_size, learn.strategy.is_main
        device = str(next(learn.model.parameters()).device)
        learn.fit(2)
        learn.strategy.barrier()
        total = learn.strategy.all_sum(torch.tensor([float(rank + 1)])).tolist()
        gathered = learn.strategy.gather(torch.tensor([float(rank)])).tolist()
    weights = [p.detach().cpu().tolist() for p in learn.model.parameters()]
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world": world, "is_main": is_main, "device": device, "ids": record.ids,
                   "first_grads": record.first_grads, "weights": weights, "writers": writers, "all_sum": total,
                   "gather": gathered, "x": x.tolist(), "y": y.tolist(),
                   "initial": initial}, f)


if __name__ == "__main__":
    main()
