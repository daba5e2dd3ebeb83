"""Write a sharded export of a seeded model with `learn.save_model`, optionally dying or running out of room.

Used by tests/test_export_atomic.py and bench/faults.py's kill_in_export row:
  export_save.py DIR --seed S [--scale K] [--kill-at-op KIND:N] [--fsize-limit BYTES] [--announce]
The model has four tensors of 16, 16, 160 and 16 KiB (times K squared with --scale K) written one per
shard (max_shard_size 20KB times K squared), so a file-size limit between 16 and 160 KiB fails at shard
3 of 4, as a disk that fills up there would.
--kill-at-op: SIGKILL just before the N-th filesystem call (fs_kill.py's kinds) made inside save_model.
--fsize-limit: RLIMIT_FSIZE for this process (SIGXFSZ ignored, so writes fail with EFBIG).
--announce: print SAVING before the save and `SAVED <seconds>` after (for a parent that kills at a random moment).
"""

import argparse
import resource
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import cadence.callbacks.checkpoint as checkpoint_pkg
from cadence import DataLoaders, Learner
from fs_kill import kill_at_filesystem_op


def model(seed: int, scale: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    d = 64 * scale
    return nn.Sequential(nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(10 * d, d, bias=False),
                         nn.Linear(d, d, bias=False))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--kill-at-op")
    p.add_argument("--fsize-limit", type=int)
    p.add_argument("--announce", action="store_true")
    p.add_argument("--scale", type=int, default=1)
    args = p.parse_args()
    learn = Learner(DataLoaders([]), model(args.seed, args.scale), loss_func=nn.MSELoss())
    if args.kill_at_op:
        kill_at_filesystem_op(args.kill_at_op, checkpoint_pkg, "save_model")
    if args.fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
    if args.announce:
        print("SAVING", flush=True)
    start = time.monotonic()
    try:
        learn.save_model(Path(args.dir), max_shard_size=20_000 * args.scale**2)
    except Exception as e:  # the test reads the message
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    print(f"SAVED {time.monotonic() - start:.4f}", flush=True)


if __name__ == "__main__":
    main()
