"""Launched on 2 processes by tests/distributed/test_pipeline.py: LastStageOutputs.share from rank 1 (the last
stage) to rank 0, as the pipeline calls it: a first batch of a kind, a second one of the same layout (one
broadcast), one whose output layout changed for the same kind (sent the first way), bf16 and no loss; each time
with rank 0's receive posted before the "step" (`expect`) while rank 1 is still busy, as the pipeline does, and
also without it. Rank 0 prints "OUTPUTS OK" when every received pred and loss equals what rank 1 had."""

import time

import torch
import torch.distributed as dist

from cadence.distributed.pipeline_outputs import LastStageOutputs

dist.init_process_group("gloo")
rank, outputs = dist.get_rank(), LastStageOutputs()
cases = [  # (kind, pred, loss) as rank 1 has them
    ("a", torch.arange(12.0).reshape(3, 4), torch.tensor(0.25)),
    ("a", torch.arange(12.0).reshape(3, 4) * 2, torch.tensor(0.5)),        # same layout: packed
    ("a", torch.arange(10.0).reshape(2, 5), torch.tensor(0.75)),           # same kind, another shape: the header way
    ("a", torch.arange(10.0).reshape(2, 5) + 1, torch.tensor(1.0)),        # the new layout, packed
    ("b", torch.linspace(-3, 3, 6, dtype=torch.bfloat16).reshape(2, 3), None),   # bf16, no targets
    ("b", torch.linspace(-2, 2, 6, dtype=torch.bfloat16).reshape(2, 3), None),
]
for i, (kind, pred, loss) in enumerate(cases + cases[-1:]):
    if i < len(cases):  # the last case again, without a posted receive
        outputs.expect(kind, src=1, group=dist.group.WORLD, device=torch.device("cpu"))
        assert (outputs._posted is not None) == (rank == 0 and kind in outputs.layouts), (i, outputs._posted)
    if rank == 1:
        time.sleep(0.05)  # the last stage still computing while rank 0 waits in `share`
    got_pred, got_loss = outputs.share(pred if rank == 1 else None, loss if rank == 1 else None, kind, src=1,
                                       group=dist.group.WORLD, device=torch.device("cpu"))
    assert got_pred.dtype == pred.dtype and torch.equal(got_pred, pred), (i, got_pred, pred)
    assert (got_loss is None) == (loss is None) and (loss is None or float(got_loss) == float(loss)), (i, got_loss)
assert outputs.layouts["a"][1] == (2, 5), outputs.layouts
if rank == 0:
    print("OUTPUTS OK", flush=True)
dist.barrier()
dist.destroy_process_group()
