"""`split_batches=True` over an IterableDataset (13 items, global batches of 4): each rank prints its batches and
what `gather_for_metrics` gave it. Launched by tests/accelerate/test_accelerate_split_stream.py."""

import json

from torch.utils.data import DataLoader, IterableDataset

from cadence import Accelerator
from cadence.utils import DataLoaderConfiguration


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(13))


acc = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
dl = acc.prepare(DataLoader(Stream(), batch_size=4))
batches = [b.tolist() for b in dl]
gathered = sorted(i for b in dl for i in acc.gather_for_metrics(b).tolist())
print(f"RANK {acc.process_index} " + json.dumps({"batches": batches, "gathered": gathered}), flush=True)
