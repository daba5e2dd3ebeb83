"""DistributedDL.gathered_order: rows gathered rank by rank, put back in the loader's order; loader_settings."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence.distributed.data import DistributedDL
from cadence.loader_settings import LOADER_SETTINGS, loader_settings
from cadence.distributed.ops import gather_for_metrics


class Tens(IterableDataset):
    """A stream of n items 0, 10, 20, ...: values that are not their positions."""

    def __init__(self, n):
        self.items = torch.arange(n) * 10

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


def gathered(ddls):
    """Every rank's items, padding removed, rank by rank: what `gather_for_metrics` gives for whole shards."""
    return torch.cat([gather_for_metrics(torch.cat(list(d)), d) for d in ddls])


# Derived by hand from the module docstring, item k of the stream being k:
# - contiguous: item i goes to rank i % ws; e.g. n=7, ws=2: rank 0 holds 0 2 4 6, rank 1 holds 1 3 5, gathered
#   [0 2 4 6 1 3 5]; item k sits at gathered position order[k]: 0->0 1->4 2->1 3->5 4->2 5->6 6->3.
# - strided (Accelerate's IterableDatasetShard): each step takes bs * ws items, rank r the r-th slice of bs; e.g.
#   n=8, ws=2, bs=3: step 0 gives rank 0 items 0 1 2 and rank 1 items 3 4 5, step 1 gives rank 0 items 6 7 (rank 1
#   padding only): gathered [0 1 2 6 7 3 4 5].
# - dispatched (DataLoaderDispatcher): each step's batch of up to bs * ws items is split evenly; a short last batch
#   splits short: n=8, ws=2, bs=3: step 1's items 6 7 give rank 0 [6], rank 1 [7]: gathered [0 1 2 6 3 4 5 7].
EXPECTED = {
    ("contiguous", 11, 3, 2): [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7],   # gathered [0 3 6 9 | 1 4 7 10 | 2 5 8]
    ("contiguous", 7, 2, 2): [0, 4, 1, 5, 2, 6, 3],                 # gathered [0 2 4 6 | 1 3 5]
    ("contiguous", 8, 2, 3): [0, 4, 1, 5, 2, 6, 3, 7],              # gathered [0 2 4 6 | 1 3 5 7]
    ("strided", 11, 3, 2): [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10],      # gathered [0 1 6 7 | 2 3 8 9 | 4 5 10]
    ("strided", 7, 2, 2): [0, 1, 4, 5, 2, 3, 6],                    # gathered [0 1 4 5 | 2 3 6]
    ("strided", 8, 2, 3): [0, 1, 2, 5, 6, 7, 3, 4],                 # gathered [0 1 2 6 7 | 3 4 5]
    ("dispatched", 11, 3, 2): [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10],   # gathered [0 1 6 7 | 2 3 8 9 | 4 5 10]
    ("dispatched", 7, 2, 2): [0, 1, 4, 5, 2, 3, 6],                 # gathered [0 1 4 5 | 2 3 6]
    ("dispatched", 8, 2, 3): [0, 1, 2, 4, 5, 6, 3, 7],              # gathered [0 1 2 6 | 3 4 5 7]
}


@pytest.mark.parametrize("layout", ["contiguous", "strided", "dispatched"])
@pytest.mark.parametrize("n,ws,bs", [(11, 3, 2), (7, 2, 2), (8, 2, 3)])
def test_gathered_order_puts_a_streams_rows_in_stream_order(layout, n, ws, bs):
    ddls = [DistributedDL(DataLoader(Tens(n), batch_size=bs), rank=r, world_size=ws, layout=layout)
            for r in range(ws)]
    rows = gathered(ddls)
    order = ddls[0].gathered_order()
    assert order.tolist() == EXPECTED[layout, n, ws, bs]
    assert rows.index_select(0, order).tolist() == list(range(0, 10 * n, 10))


def test_gathered_order_is_none_where_rows_stay_in_rank_order():
    ddls = [DistributedDL(DataLoader(torch.arange(11), batch_size=2), rank=r, world_size=2) for r in range(2)]
    assert ddls[0].gathered_order() is None and gathered(ddls).tolist() == list(range(11))   # contiguous shards
    assert DistributedDL(DataLoader(Tens(5), batch_size=2), rank=0, world_size=1).gathered_order() is None


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_settings_are_the_named_settings_a_rebuilt_loader_takes(workers):
    dl = DataLoader(torch.arange(6), batch_size=2, num_workers=workers, pin_memory=False, timeout=3)
    kw = loader_settings(dl)
    assert set(kw) == set(LOADER_SETTINGS) - ({"prefetch_factor"} if workers == 0 else set())
    assert all(kw[name] == getattr(dl, name) for name in kw)
    assert DataLoader(dl.dataset, batch_size=3, **kw).num_workers == workers
