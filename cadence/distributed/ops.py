"""Collectives and main-process helpers that work the same in one process and in many.

Every function here is plain single-process code when no process group exists: `gather`
returns its input, `broadcast` returns its argument, barriers do nothing.

>>> total = reduce(torch.tensor(loss), op="sum")       # summed over every rank
>>> preds = gather_for_metrics(preds, valid_dl)        # each sample once, DistributedDL padding removed
>>> path = rank0_first(download, url)                  # rank 0 downloads, the others then read the cache
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..nested import leaves, map_leaves, map_tensors
from . import env

__all__ = ["map_leaves", "map_tensors", "wait_for_everyone", "broadcast", "reduce", "gather", "gather_object",
           "gather_for_metrics", "pad_across_processes", "main_process_first", "local_main_process_first",
           "rank0_first", "on_main_process", "on_local_main_process", "main_print", "get_logger"]

T = TypeVar("T")
_REDUCE_OPS = ("mean", "sum", "max", "min")


def _check_tensors_only(data: Any, what: str) -> None:
    bad = [type(o).__name__ for o in leaves(data) if not isinstance(o, torch.Tensor)]
    if bad:
        raise TypeError(f"{what} works on tensors in nested tuples/lists/dicts, got {bad[0]}; "
                        f"use gather_object / broadcast for other Python objects")


def wait_for_everyone() -> None:
    """Barrier: block until every rank reaches this line (nothing to wait for in one process).

    >>> wait_for_everyone()
    """
    if env.is_initialized():
        dist.barrier()


def broadcast(obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` on every rank.

    A tensor is broadcast in place (it must have the same shape and dtype on every rank);
    anything else (nested containers, numbers, strings, tensors inside containers) is pickled,
    and tensors inside it arrive on the CPU of the receiving ranks.

    >>> seed = broadcast(random.randrange(2**31) if is_main_process() else None)
    """
    if not env.is_initialized():
        return obj
    if isinstance(obj, torch.Tensor):
        dist.broadcast(obj, src=src)
        return obj
    payload = [map_tensors(lambda t: t.detach().cpu(), obj) if env.rank() == src else None]
    dist.broadcast_object_list(payload, src=src)
    return obj if env.rank() == src else payload[0]


def reduce(data: T, op: str = "mean") -> T:
    """Sum, mean, max or min of `data` (a tensor or nested tensors) over all ranks, returned as new tensors.

    >>> reduce(torch.tensor(rank() + 1.0), op="sum")     # on 2 ranks
    tensor(3.)
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {_REDUCE_OPS}, got {op!r}")
    _check_tensors_only(data, "reduce")
    if not env.is_initialized():
        return data

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(op, dist.ReduceOp.SUM))
        return out / env.world_size() if op == "mean" else out
    return map_tensors(_reduce, data)


def _all_gather(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """One tensor per rank (of `group`, default all); every rank's `t` must have the same shape. Bool goes over the
    wire as uint8."""
    wire = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()
    out = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, wire, group=group)
    return [o.to(t.dtype) for o in out]


def _sizes(t: torch.Tensor, dim: int, group: Any = None) -> list[int]:
    size = torch.tensor([t.shape[dim]], device=t.device)
    return [int(s) for s in _all_gather(size, group)]


def _gather_parts(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's `t` (first dims may differ; 0-d tensors become 1-element), unpadded."""
    t = t.detach()
    t = t.reshape(1) if t.ndim == 0 else t
    sizes = _sizes(t, 0, group)
    padded = _pad_to(t, 0, max(sizes), pad_index=0, pad_first=False)
    return [part[:n] for part, n in zip(_all_gather(padded, group), sizes)]


def gather(data: T, group: Any = None) -> T:
    """Concatenate `data` (a tensor or nested tensors) on dim 0 across ranks (of `group`, default all), in rank order.

    Ranks may hold different numbers of rows; 0-d tensors give one row per rank.

    >>> gather(torch.full((rank() + 1,), rank()))      # on 2 ranks
    tensor([0, 1, 1])
    """
    _check_tensors_only(data, "gather")
    if not env.is_initialized():
        return data
    return map_tensors(lambda t: torch.cat(_gather_parts(t, group)), data)


def gather_object(obj: Any, group: Any = None) -> list[Any]:
    """A list with every rank's picklable `obj`, in rank order (the ranks of `group`, default all).

    >>> gather_object({"rank": rank()})                # on 2 ranks
    [{'rank': 0}, {'rank': 1}]
    """
    if not env.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _keep_mask(source: Any, rank: int, start: int, length: int) -> torch.Tensor:
    if isinstance(source, int):
        return torch.ones(length, dtype=torch.bool)
    return source.real_mask(rank, start, length)


def _check_source(source: Any, group: Any) -> None:
    if not (isinstance(source, int) or hasattr(source, "real_mask")):
        raise TypeError(f"gather_for_metrics needs a DistributedDL or a number of samples, got {type(source).__name__}")
    size = dist.get_world_size(group) if env.is_initialized() else 1
    if env.is_initialized() and getattr(source, "world_size", size) != size:
        raise ValueError(f"the DistributedDL was built for world_size={source.world_size} but gather_for_metrics "
                         f"gathers over {size} processes; build it without an explicit world_size, or pass the "
                         f"group it shards over (group=, e.g. the data-parallel group under tensor parallelism)")


def gather_for_metrics(data: T, source: Any, start: int | None = None, group: Any = None) -> T:
    """`gather(data)` without the samples DistributedDL added as padding, so each sample counts once.

    `source` is the DistributedDL that produced `data`, or the number of samples in the dataset.
    With a DistributedDL, `data` holds this rank's samples from position `start` of its shard;
    by default the batch it yielded last when `data` has that batch's length, else the whole
    shard from its beginning. With a number n, `data` must be whole shards and the first n
    gathered rows are kept. Data that is not one row per sample of the last batch (a loss repeated
    to a fixed length on a smaller last batch) keeps as many gathered rows as that step had real
    samples over all ranks, as Accelerate does.

    >>> for xb, yb in valid_dl: preds.append(gather_for_metrics(model(xb), valid_dl))
    >>> all_preds = gather_for_metrics(torch.cat(local_preds), valid_dl)     # after the loop

    `group`: the process group the loader shards over (its ranks in order), default every process; under tensor
    parallelism the data-parallel group, since the ranks of a tensor-parallel group hold the same samples.
    """
    _check_tensors_only(data, "gather_for_metrics")
    _check_source(source, group)
    ranks = range(dist.get_world_size(group)) if env.is_initialized() else [getattr(source, "rank", 0)]

    def _gather(t: torch.Tensor) -> torch.Tensor:
        parts = _gather_parts(t, group) if env.is_initialized() else [t.reshape(1) if t.ndim == 0 else t]
        kept = [p[m.to(p.device)] for p, m in zip(parts, _keep_masks(source, list(ranks), parts, start))]
        out = torch.cat(kept)
        return out[:source] if isinstance(source, int) else out
    return map_tensors(_gather, data)


def _keep_masks(source: Any, ranks: list[int], parts: list[torch.Tensor], start: int | None) -> list[torch.Tensor]:
    """Per rank, which gathered rows are real; for a DistributedDL's last batch each rank's own batch of that step."""
    if start is None and callable(getattr(source, "last_batch_masks", None)):
        masks = source.last_batch_masks(ranks)
        if masks is not None and [len(m) for m in masks] == [len(p) for p in parts]:
            return masks
        if masks is not None and any(len(p) != _shard_len(source) for p in parts):
            # not one row per sample (`loss.repeat(batch_size)` on a smaller last batch): as Accelerate does, keep
            # as many gathered rows as this step had real samples over all ranks
            return _first_rows([len(p) for p in parts], int(sum(int(m.sum()) for m in masks)))
    first = start if start is not None else _default_start(source, len(parts[0]))
    return [_keep_mask(source, r, first, len(p)) for r, p in zip(ranks, parts)]


def _shard_len(source: Any) -> int | None:
    """Items in each rank's whole shard (None when the loader cannot tell: an unsized iterable)."""
    try:
        return source.per_rank
    except (AttributeError, TypeError):
        return None


def _first_rows(lengths: list[int], keep: int) -> list[torch.Tensor]:
    """Masks over parts of `lengths` rows that keep the first `keep` rows of their concatenation."""
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return [torch.arange(o, o + n) < keep for o, n in zip(offsets, lengths)]


def _default_start(source: Any, length: int) -> int:
    last = getattr(source, "last_batch", None)
    return last[0] if last is not None and last[1] == length else 0


def _pad_to(t: torch.Tensor, dim: int, size: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    filler = t.new_full(shape, pad_index)
    return torch.cat([filler, t] if pad_first else [t, filler], dim=dim)


def pad_across_processes(data: T, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> T:
    """Pad each tensor in `data` along `dim` with `pad_index` to the largest size any rank has.

    >>> pad_across_processes(torch.ones(rank() + 1))   # on 2 ranks: rank 0 gets tensor([1., 0.])
    """
    _check_tensors_only(data, "pad_across_processes")
    if not env.is_initialized():
        return data

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0:
            return t
        if not -t.ndim <= dim < t.ndim:
            raise ValueError(f"dim={dim} is out of range for a tensor with {t.ndim} dims")
        return _pad_to(t, dim, max(_sizes(t, dim)), pad_index, pad_first)
    return map_tensors(_pad, data)


@contextlib.contextmanager
def _first(is_first: bool) -> Iterator[None]:
    # launched on several processes but no group yet (fastai's recipe calls rank0_first before
    # distrib_ctx): create the group now; distrib_ctx uses it and leaves it to its creator
    env.setup_distrib()
    if not is_first:
        wait_for_everyone()
    yield
    if is_first:
        wait_for_everyone()
    # and every rank leaves together: without it, rank 0 goes on to read what it wrote while the others, running
    # the block now, may still be rewriting it (a non-idempotent "download")
    wait_for_everyone()


def main_process_first() -> contextlib.AbstractContextManager[None]:
    """Run the block on global rank 0 first, then on the other ranks; every rank leaves it together.

    >>> with main_process_first():
    ...     ds = load_dataset("mnist")          # rank 0 downloads, the others read the cache
    """
    return _first(env.is_main_process())


def local_main_process_first() -> contextlib.AbstractContextManager[None]:
    """Run the block on local rank 0 of every machine first, then on the other ranks; every rank leaves it together.

    >>> with local_main_process_first():
    ...     tokenizer = prepare_tokenizer()
    """
    return _first(env.is_local_main_process())


def rank0_first(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call `func(*args, **kwargs)` on rank 0, then on the other ranks; all return its result together.

    Every rank leaves once every rank has called it: none goes on to read what another is still writing.

    >>> path = rank0_first(untar_data, URLs.MNIST)
    """
    with main_process_first():
        return func(*args, **kwargs)


def _only_if(predicate: Callable[[], bool], func: Callable[..., T]) -> Callable[..., T | None]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        return func(*args, **kwargs) if predicate() else None
    return wrapper


def on_main_process(func: Callable[..., T]) -> Callable[..., T | None]:
    """Decorator: run `func` on global rank 0 only; other ranks get None.

    >>> @on_main_process
    ... def save_report(metrics): ...
    """
    return _only_if(env.is_main_process, func)


def on_local_main_process(func: Callable[..., T]) -> Callable[..., T | None]:
    """Decorator: run `func` on local rank 0 of each machine only; other ranks get None.

    >>> @on_local_main_process
    ... def clear_local_cache(): ...
    """
    return _only_if(env.is_local_main_process, func)


def main_print(*args: Any, **kwargs: Any) -> None:
    """`print` on the main process only (Accelerate's `accelerator.print`).

    >>> main_print(f"epoch {epoch}: loss {loss:.3f}")
    """
    if env.is_main_process():
        # one write with its newline, so lines of processes sharing the terminal do not interleave
        sep, end = kwargs.pop("sep", " "), kwargs.pop("end", "\n")
        builtins.print(sep.join(map(str, args)) + end, end="", flush=True, **kwargs)


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logger adapter whose calls log on the main process only, unless called with `main_process_only=False`
    (then `in_order=True` logs process by process, in rank order; every process must make that call)."""

    def log(self, level: int, msg: object, *args: Any, main_process_only: bool = True, in_order: bool = False,
            **kwargs: Any) -> None:
        if main_process_only:
            if env.is_main_process():
                super().log(level, msg, *args, **kwargs)
            return
        if not in_order:
            super().log(level, msg, *args, **kwargs)
            return
        for i in range(env.world_size()):
            if i == env.rank():
                super().log(level, msg, *args, **kwargs)
            wait_for_everyone()


def get_logger(name: str, level: int | str | None = None) -> MultiProcessAdapter:
    """A logger whose `info`, `warning`, ... log once (on rank 0); pass `main_process_only=False` to log on every rank.

    >>> logger = get_logger(__name__)
    >>> logger.info("starting")                            # printed once
    >>> logger.info("rank ready", main_process_only=False)  # printed by every rank
    """
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level)
    return MultiProcessAdapter(logger, {})
