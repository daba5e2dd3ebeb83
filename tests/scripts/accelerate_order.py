"""The batches each process of a seeded Accelerator script sees, written as JSON: run with cadence or real Accelerate.

    python accelerate_order.py cadence|accelerate OUT_PREFIX [seedable] [drop_last] [split_batches] [weighted]

`weighted`: the training loader draws with a WeightedRandomSampler (weight only on items 0-4) and a worker.

Writes OUT_PREFIX.<rank>.json: {"rank", "epochs": [{"train", "valid", "rand"}]}, `rand` being torch.rand(1)
after each epoch (what a dropout would draw next).
"""

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

N, BS, VALID_BS, EPOCHS = 23, 4, 6, 3


def _worker_started(worker_id: int) -> None:
    print(f"worker {worker_id} started", flush=True)


def main() -> None:
    library, out, options = sys.argv[1], sys.argv[2], sys.argv[3:]
    if library == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, set_seed
    else:
        from cadence import Accelerator, DataLoaderConfiguration
        from cadence.utils import set_seed
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler="seedable" in options, split_batches="split_batches" in options))
    set_seed(42)
    model = nn.Linear(1, 1)                               # the global RNG is used between set_seed and prepare
    if "weighted" in options:   # the loader's own sampler and worker settings must survive prepare
        weights = torch.zeros(N)
        weights[:5] = 1.0
        train = DataLoader(torch.arange(N), batch_size=BS, sampler=torch.utils.data.WeightedRandomSampler(weights, N),
                           num_workers=1, worker_init_fn=_worker_started)
    else:
        train = DataLoader(torch.arange(N), batch_size=BS, shuffle=True, drop_last="drop_last" in options)
    valid = DataLoader(torch.arange(N), batch_size=VALID_BS)
    model, train, valid = accelerator.prepare(model, train, valid)
    epochs = []
    for _ in range(EPOCHS):
        epochs.append({"train": [b.tolist() for b in train], "valid": [b.tolist() for b in valid],
                       "rand": torch.rand(1).item()})
    with open(f"{out}.{accelerator.process_index}.json", "w") as f:
        json.dump({"rank": accelerator.process_index, "epochs": epochs}, f)
    if library == "accelerate" and torch.distributed.is_initialized():
        # real Accelerate leaves its gloo group alive at exit, where its destructor now and then aborts or hangs
        # (SIGABRT "terminate called without an active exception", or a hang in ~ProcessGroupGloo): end it here
        accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
