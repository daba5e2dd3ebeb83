"""Prepared loaders next to Accelerate 1.15: DataLoader attributes, skip_first_batches, end_of_dataloader /
remainder, the shuffle after a `break`, and a stream's split. Each rank writes what it saw to OUT/rank{r}.json.

  cadence launch --cpu --num_processes 2 accelerate_loaders.py OUT
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from cadence import Accelerator, skip_first_batches
from cadence.utils import set_seed


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


def batches(dl):
    return [b.tolist() for b in dl]


def main(out: Path) -> None:
    acc = Accelerator()
    res = {}
    dl = acc.prepare(DataLoader(list(range(8)), batch_size=2, shuffle=True))
    res["attrs"] = {a: type(getattr(dl, a)).__name__ for a in
                    ("sampler", "batch_sampler", "collate_fn", "num_workers", "pin_memory", "generator",
                     "persistent_workers", "dataset", "batch_size", "drop_last")}
    res["values"] = [dl.batch_size, dl.num_workers, dl.pin_memory, dl.persistent_workers, len(dl.sampler),
                     dl.batch_sampler.batch_size, dl.batch_sampler.num_processes, dl.batch_sampler.process_index,
                     len(dl.batch_sampler), dl.batch_sampler.total_length,
                     type(dl.batch_sampler.batch_sampler.sampler).__name__]

    plain = DataLoader(list(range(10)), batch_size=3)
    p = acc.prepare(DataLoader(list(range(10)), batch_size=3))
    s = skip_first_batches(p, 1)
    res["skip"] = [batches(skip_first_batches(plain, 2)), len(s), batches(s), len(p), batches(p)]
    s = skip_first_batches(p, 10)
    res["skip_too_many"] = [batches(s), batches(p)]   # (Accelerate's len() here raises: negative)

    ev = acc.prepare(DataLoader(list(range(11)), batch_size=4))
    res["eod"] = [ev.end_of_dataloader, ev.remainder]
    flags = [(ev.end_of_dataloader, ev.remainder) for _ in ev]
    res["eod"] += [flags, ev.end_of_dataloader, ev.remainder]

    set_seed(0)
    sh = acc.prepare(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    epochs = []
    for e in range(3):
        seen = []
        for i, b in enumerate(sh):
            seen.append(b.tolist())
            if e == 0 and i == 1:
                break
        epochs.append(seen)
    res["shuffle_break"] = epochs

    res["stream"] = {}
    for n, bs in ((7, 2), (8, 2), (7, 3), (3, 2)):
        st = acc.prepare(DataLoader(Stream(n), batch_size=bs))
        got, gathered = [], []
        for b in st:
            got.append(b.tolist())
            gathered += acc.gather_for_metrics(b).tolist()
        res["stream"][f"{n}/{bs}"] = [got, gathered, st.remainder]
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
