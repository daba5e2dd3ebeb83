"""`accelerate_resume_world.py save|load DIR SHUFFLE`: `save` takes one step and `save_state(DIR)`; `load` runs
`load_state(DIR)` and prints, per rank, the rows of the rest of the epoch and of the next one (16 rows, batches
of 2). Launched by tests/accelerate/test_accelerate_resume_world_size.py on different numbers of processes."""

import json
import sys
import warnings

import torch
from torch.utils.data import DataLoader

from cadence import Accelerator

phase, directory, shuffle = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
acc = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
dl = DataLoader(torch.arange(32.).view(16, 2), batch_size=2, shuffle=shuffle)
model, opt, dl = acc.prepare(model, opt, dl)
if phase == "save":
    for x in dl:
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
        break
    acc.save_state(directory)
else:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(directory)
    rows = [[int(r) for x in dl for r in x[:, 0] // 2] for _ in range(2)]
    print(f"RANK {acc.process_index} " + json.dumps({"rows": rows, "len": len(dl),
                                                     "warnings": [str(w.message) for w in caught]}), flush=True)
