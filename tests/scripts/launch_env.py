"""Launched on N processes: all-reduce over gloo, then rank 0 prints one JSON line of what it saw."""

import json
import os

import torch
import torch.distributed as dist

from cadence.distributed.env import setup_distrib, teardown_distrib

setup_distrib()
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, (os.environ["RANK"], os.environ["LOCAL_RANK"]))
if dist.get_rank() == 0:
    per_launch = ("CADENCE_LAUNCHER_PID", "CADENCE_STATUS_DIR", "CADENCE_WORKER_EXITS")   # differ on every launch
    seen = {k: v for k, v in os.environ.items()
            if (k.startswith("CADENCE_") and k not in per_launch) or k in ("WORLD_SIZE", "OMP_NUM_THREADS", "MASTER_ADDR")}
    print("RESULT " + json.dumps({"ranks": ranks, "sum": total.item(), "env": seen}), flush=True)
teardown_distrib()
