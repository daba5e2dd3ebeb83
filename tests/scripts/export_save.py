"""Write a sharded export of a seeded model with `learn.save_model`, optionally dying or running out of room.

Used by tests/test_export_atomic.py and bench/faults.py's kill_in_export row:
  export_save.py DIR --seed S [--kill-at-op KIND:N] [--fsize-limit BYTES] [--announce]
The model has four tensors of 16, 16, 160 and 16 KiB written one per shard (max_shard_size 20KB), so a
file-size limit between 16 and 160 KiB fails at shard 3 of 4, as a disk that fills up there would.
--kill-at-op: SIGKILL just before the N-th filesystem call (fs_kill.py's kinds) made inside save_model.
--fsize-limit: RLIMIT_FSIZE for this process (SIGXFSZ ignored, so writes fail with EFBIG).
--announce: print SAVING before the save and SAVED after (for a parent that kills at a random moment).
"""

import argparse
import resource
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import cadence.callbacks.checkpoint as checkpoint_pkg
from cadence import DataLoaders, Learner
from fs_kill import kill_at_filesystem_op


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False),
                         nn.Linear(640, 64, bias=False), nn.Linear(64, 64, bias=False))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--kill-at-op")
    p.add_argument("--fsize-limit", type=int)
    p.add_argument("--announce", action="store_true")
    p.add_argument("--shard-kib", type=int, default=20)
    args = p.parse_args()
    learn = Learner(DataLoaders([]), model(args.seed), loss_func=nn.MSELoss())
    if args.kill_at_op:
        kill_at_filesystem_op(args.kill_at_op, checkpoint_pkg, "save_model")
    if args.fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
    if args.announce:
        print("SAVING", flush=True)
    try:
        learn.save_model(Path(args.dir), max_shard_size=f"{args.shard_kib}KB")
    except Exception as e:  # the test reads the message
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    print("SAVED", flush=True)


if __name__ == "__main__":
    main()
