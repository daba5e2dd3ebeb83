"""Launched by tests/distributed/test_shm_allreduce.py: SharedMemoryAllReduce against gloo's all-reduce.

argv: OUT_DIR MODE. "compare": average tensors of several sizes and dtypes (some of many chunks) both
ways; rank 0 writes OUT_DIR/compare.json. "noroom": rank 1 cannot allocate its region (a file-size limit
stands in for a full /dev/shm); rank 0 writes what every rank got to OUT_DIR/noroom.json. "late": rank 1 never joins the average (sleeps past the
timeout, then exits); "gone": rank 1 exits at once; rank 0 writes the error it got to OUT_DIR/error.txt.
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cadence.distributed.env import setup_distrib, teardown_distrib
from cadence.distributed.shm_allreduce import SharedMemoryAllReduce, SharedMemoryUnavailable

CASES = [(1, torch.float32), (1001, torch.float32), (70_000, torch.float32), (70_001, torch.bfloat16),
         (33_333, torch.float64), (0, torch.float32)]


def compare(out: Path, shm: SharedMemoryAllReduce) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    free_mib = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize / 2**20
    result = {"available": SharedMemoryAllReduce.available(torch.device("cpu")), "cases": [],
              "available_with_chunks_of_all_free_space": SharedMemoryAllReduce.available(torch.device("cpu"),
                                                                                         chunk_mb=free_mib)}
    for numel, dtype in CASES * 3:       # three rounds: both slots reused
        mine = torch.randn(numel, generator=g).to(dtype)
        via_gloo = mine / world
        dist.all_reduce(via_gloo)
        via_shm = shm.average_(mine.clone())
        gathered = [torch.empty_like(via_shm) for _ in range(world)]
        dist.all_gather(gathered, via_shm)
        result["cases"].append({"numel": numel, "dtype": str(dtype),
                                "same_on_every_rank": all(torch.equal(t, via_shm) for t in gathered),
                                "bitwise_gloo": torch.equal(via_shm, via_gloo),
                                "max_abs_diff": float((via_shm.double() - via_gloo.double()).abs().max()) if numel else 0.0})
    if rank == 0:
        (out / "compare.json").write_text(json.dumps(result))


def no_room(out: Path) -> None:
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))   # fallocate: EFBIG (Python ignores SIGXFSZ)
    try:
        SharedMemoryAllReduce()
        outcome = "made"
    except SharedMemoryUnavailable as e:
        outcome = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    if dist.get_rank() == 0:
        (out / "noroom.json").write_text(json.dumps(outcomes))


def main():
    out, mode = Path(sys.argv[1]), sys.argv[2]
    setup_distrib()
    shm = SharedMemoryAllReduce(chunk_mb=0.0625)         # 64 KiB slots: the larger cases pass in several chunks
    if mode == "compare":
        compare(out, shm)
    elif mode == "noroom":
        no_room(out)
    elif dist.get_rank() == 1:
        if mode == "late":
            time.sleep(8)
        os._exit(0)
    else:
        start = time.monotonic()
        try:
            shm.average_(torch.ones(10))
        except RuntimeError as e:
            (out / "error.txt").write_text(f"{e}\n{time.monotonic() - start:.1f}")
        os._exit(0)
    teardown_distrib()


if __name__ == "__main__":
    main()
