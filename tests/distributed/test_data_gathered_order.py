"""DistributedDL.gathered_order: rows gathered rank by rank, put back in the loader's order; loader_settings."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence.distributed.data import DistributedDL
from cadence.distributed.data_rebuild import LOADER_SETTINGS, loader_settings
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


@pytest.mark.parametrize("layout", ["contiguous", "strided", "dispatched"])
@pytest.mark.parametrize("n,ws,bs", [(11, 3, 2), (7, 2, 2), (8, 2, 3)])
def test_gathered_order_puts_a_streams_rows_in_stream_order(layout, n, ws, bs):
    ddls = [DistributedDL(DataLoader(Tens(n), batch_size=bs), rank=r, world_size=ws, layout=layout)
            for r in range(ws)]
    rows = gathered(ddls)
    order = ddls[0].gathered_order()
    assert torch.equal(order, torch.argsort(ddls[0].sample_order()))
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
