"""Fit with a Checkpoint, or `learn.save`, where writes fail: under a file-size limit, or in a given directory.

  write_limit.py --dir DIR --what checkpoint|save [--fsize BYTES]
--fsize: RLIMIT_FSIZE for this process, set just before the fit (SIGXFSZ ignored, so a write past it fails
  with EFBIG as on a full disk instead of killing the process).
Prints `ERROR <type>: <message>` (or `OK`), `STEP <n>` and `HIDDEN <names>` (hidden entries left in DIR and
its model directory).
"""

import argparse
import json
import resource
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.callbacks.checkpoint import Checkpoint


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--what", choices=("checkpoint", "save"), required=True)
    p.add_argument("--fsize", type=int)
    args = p.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=16), device="cpu")
    model = nn.Sequential(nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 3))  # ~90 KB of weights, Adam twice that
    directory = Path(args.dir)
    cbs = [Checkpoint(directory)] if args.what == "checkpoint" else []
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=cbs, path=directory.parent,
                    model_dir=directory.name)
    learn.remove_cb(learn.progress)
    if args.fsize:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, args.fsize))
    try:
        if args.what == "checkpoint":
            learn.fit(1)
        else:
            learn.fit(1)
            learn.save("m")
        print("OK")
    except Exception as e:
        print(f"ERROR {type(e).__name__}: {e}")
    print(f"STEP {learn.step}")
    hidden = sorted(str(q.relative_to(directory)) for q in directory.rglob(".*")) if directory.is_dir() else []
    print(f"HIDDEN {json.dumps(hidden)}")


if __name__ == "__main__":
    main()
