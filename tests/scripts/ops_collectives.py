"""Launched on 2 processes by tests/distributed/test_ops_multiprocess.py: every collective in ops.py.

Usage: ops_collectives.py TMPDIR. Prints "OPS OK" on rank 0 when every check passed.
"""

import logging
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from cadence.distributed import env, ops
from cadence.distributed.data import DistributedDL


def check_gather_and_pad(rank: int) -> None:
    t = torch.full((rank + 1, 2), rank)                        # rank 0: 1 row, rank 1: 2 rows
    assert ops.gather(t).tolist() == [[0, 0], [1, 1], [1, 1]]
    nested = ops.gather({"a": (t[:, 0], [torch.tensor(rank * 1.5)]), "m": t[:, 0] > 0})
    assert nested["a"][0].tolist() == [0, 1, 1] and nested["a"][1][0].tolist() == [0.0, 1.5]
    assert nested["m"].dtype == torch.bool and nested["m"].tolist() == [False, True, True]
    padded = ops.pad_across_processes(torch.ones(rank + 1), pad_index=-1)
    assert padded.tolist() == ([1, -1] if rank == 0 else [1, 1])
    padded = ops.pad_across_processes(torch.ones(2, rank + 2), dim=1, pad_first=True)
    assert padded.shape == (2, 3) and padded[0].tolist() == ([0, 1, 1] if rank == 0 else [1, 1, 1])
    assert ops.gather_object({"rank": rank}) == [{"rank": 0}, {"rank": 1}]


def check_broadcast_and_reduce(rank: int) -> None:
    obj = {"seed": 1234, "w": torch.arange(3.), "names": ["a", "b"]} if rank == 0 else None
    got = ops.broadcast(obj)
    assert got["seed"] == 1234 and got["w"].tolist() == [0, 1, 2] and got["names"] == ["a", "b"]
    t = torch.full((2,), float(rank))
    assert ops.broadcast(t, src=1) is t and t.tolist() == [1.0, 1.0]
    x = torch.tensor([rank + 1.0, 10.0])
    assert ops.reduce(x, "sum").tolist() == [3.0, 20.0] and x.tolist() == [rank + 1.0, 10.0]
    assert ops.reduce({"x": x}, "mean")["x"].tolist() == [1.5, 10.0]


def check_gather_for_metrics(rank: int) -> None:
    ds = torch.arange(11) * 10
    for shuffle in (False, True):
        ddl = DistributedDL(DataLoader(ds, batch_size=2, shuffle=shuffle))   # 6 per rank, 1 padded
        for epoch in range(2):
            ddl.set_epoch(epoch)
            rows, idxs, local = [], [], []
            for xb in ddl:
                rows.append(ops.gather_for_metrics(xb, ddl))
                idxs.append(ops.gather_for_metrics(ddl.last_batch_idxs(), ddl))
                local.append(xb)
            rows, idxs = torch.cat(rows), torch.cat(idxs)
            assert len(rows) == 11 and torch.equal(rows, ds[idxs]) and sorted(idxs.tolist()) == list(range(11))
            whole = ops.gather_for_metrics(torch.cat(local), ddl)
            assert torch.equal(whole, ds[ddl.sample_order()])
            assert torch.equal(ops.gather_for_metrics(torch.cat(local), ddl.dataset_len), whole)
            if not shuffle:
                assert torch.equal(whole, ds)                    # each sample once, in dataset order


def timestamped(path: Path, rank: int) -> float:
    """Rank 0 writes its finish time; the others must find it when they start, and write theirs after a while."""
    if rank == 0:
        time.sleep(0.5)
        path.write_text(str(time.time()))
    else:
        assert path.exists(), f"rank {rank} started before rank 0 finished"
        assert time.time() >= float(path.read_text())
        time.sleep(0.5)                                   # a slow re-download that rank 0 must not read half-done
        path.with_suffix(f".rank{rank}").write_text("done")
    return float(path.read_text())


def every_rank_left(path: Path) -> None:
    """No rank leaves the block while another is still in it (so none reads what another is writing)."""
    assert path.with_suffix(".rank1").exists(), f"{path.name}: rank 0 left before rank 1 finished"


def check_run_order(tmp: Path, rank: int) -> None:
    result = ops.rank0_first(timestamped, tmp / "rank0_first.txt", rank)
    every_rank_left(tmp / "rank0_first.txt")
    results = ops.gather_object(result)
    assert results[0] == results[1]
    with ops.main_process_first():
        timestamped(tmp / "main_first.txt", rank)
    every_rank_left(tmp / "main_first.txt")
    with ops.local_main_process_first():
        timestamped(tmp / "local_main_first.txt", rank)
    every_rank_left(tmp / "local_main_first.txt")
    ran = ops.gather_object(ops.on_main_process(lambda: "ran")())
    assert ran == ["ran", None]


def check_logger(tmp: Path, rank: int) -> None:
    handler = logging.FileHandler(tmp / f"log{rank}.txt")
    logger = ops.get_logger("cadence.ops_script", level="INFO")
    logger.logger.addHandler(handler)
    logger.info("once")
    logger.info("every rank", main_process_only=False)
    handler.close()
    ops.wait_for_everyone()
    logs = [(tmp / f"log{r}.txt").read_text().splitlines() for r in range(2)]
    assert logs == [["once", "every rank"], ["every rank"]], logs
    ops.main_print("MAIN_PRINT_MARKER")


def main() -> None:
    tmp = Path(sys.argv[1])
    created = env.setup_distrib()
    rank = env.rank()
    assert created and env.world_size() == 2
    check_gather_and_pad(rank)
    check_broadcast_and_reduce(rank)
    check_gather_for_metrics(rank)
    check_run_order(tmp, rank)
    check_logger(tmp, rank)
    ops.wait_for_everyone()
    ops.main_print("OPS OK")
    env.teardown_distrib()


if __name__ == "__main__":
    main()
