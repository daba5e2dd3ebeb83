"""`accelerate.data_loader` under cadence: `from accelerate.data_loader import skip_first_batches` becomes
`from cadence.data_loader import skip_first_batches`. `DataLoaderShard` is what `accelerator.prepare(loader)`
returns; `BatchSamplerShard` is its batch sampler on several processes.

>>> from cadence.data_loader import DataLoaderShard, skip_first_batches
>>> train_dl = accelerator.prepare(DataLoader(range(8), batch_size=2))
>>> isinstance(train_dl, DataLoaderShard), [b.tolist() for b in skip_first_batches(train_dl, 3)]
(True, [[6, 7]])
>>> [b.tolist() for b in prepare_data_loader(DataLoader(range(8), batch_size=2), num_processes=2, process_index=1)]
[[2, 3], [6, 7]]
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from .accelerate.prepared import BatchSamplerShard
from .accelerate.prepared import PreparedDataLoader as DataLoaderShard
from .accelerate.skip_batches import skip_first_batches
from .accelerate.state import GradientState, PartialState
from .accelerate.plugins import DistributedType
from .accelerate.enums import RNGType
from .distributed import env
from .distributed.data import DistributedDL
from .utils.unavailable import module_getattr

__all__ = ["prepare_data_loader", "skip_first_batches", "DataLoaderShard", "BatchSamplerShard", "GradientState", "PartialState",
           "DistributedType", "RNGType"]

_PREPARE = "accelerator.prepare(data_loader) (or accelerator.prepare_data_loader) gives this process's shard"


def prepare_data_loader(dataloader: DataLoader, device: Any = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list | None = None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False, use_stateful_dataloader: bool = False,
                        torch_device_mesh: Any = None) -> DataLoaderShard:
    """Process `process_index`'s shard of `dataloader` out of `num_processes` (default: this run's), the loader's
    batches dealt to the processes in turn as Accelerate deals them; on `device` (default: this process's) with
    `put_on_device`. A shuffled order is drawn from `data_seed`, else from a seed the processes share. Options
    cadence's loaders do not take are refused; `accelerator.prepare(dataloader)` does the same for an Accelerator."""
    unsupported = {"split_batches": split_batches, "dispatch_batches": bool(dispatch_batches),
                   "even_batches=False": not even_batches, "slice_fn_for_dispatch": slice_fn_for_dispatch is not None,
                   "non_blocking": non_blocking, "use_stateful_dataloader": use_stateful_dataloader,
                   "torch_device_mesh": torch_device_mesh is not None}
    refused = [name for name, asked in unsupported.items() if asked]
    if refused:
        raise ValueError(f"prepare_data_loader: {', '.join(refused)} not supported by cadence's free function; leave "
                         f"them at their defaults, or give the loader to accelerator.prepare (Accelerator("
                         f"dataloader_config=DataLoaderConfiguration(...)))")
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader takes a torch DataLoader, got {type(dataloader).__name__}")
    world = env.world_size() if num_processes is None else num_processes
    rank = env.rank() if process_index is None else process_index
    where = (device if device is not None else env.default_device()) if put_on_device else None
    shard = DistributedDL(dataloader, rank=rank, world_size=world, device=where,
                          seed=data_seed if use_seedable_sampler or data_seed is not None else None,
                          layout="strided" if world > 1 else "contiguous")
    return DataLoaderShard(shard, GradientState(), rng_types or [])


_DISPATCH = ("cadence does not dispatch batches from the main process: every process reads its own shard "
             "(accelerator.prepare(data_loader))")
__getattr__ = module_getattr(__name__, {
    **dict.fromkeys(["IterableDatasetShard", "DataLoaderAdapter", "DataLoaderStateMixin"],
                    _PREPARE),
    "DataLoaderDispatcher": _DISPATCH,
    **dict.fromkeys(["SkipBatchSampler", "SkipDataLoader"], "skip_first_batches(data_loader, num_batches)"),
    "SeedableRandomSampler": "DataLoaderConfiguration(use_seedable_sampler=True, data_seed=...) given to "
                             "Accelerator(dataloader_config=...) shuffles each epoch from the seed",
}, "accelerate.data_loader")
