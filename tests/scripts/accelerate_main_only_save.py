"""`accelerator.save_model` called by the main process alone under DDP, as Accelerate allows (`if
accelerator.is_main_process: accelerator.save_model(...)`): it must not wait for the other processes. Prints
"gathered [0, 1]" on the main process once both went on to a collective.

    cadence launch --cpu --num_processes 2 tests/scripts/accelerate_main_only_save.py OUT_DIR
"""

import sys

import torch
from torch import nn

from cadence import Accelerator


def main() -> None:
    out = sys.argv[1]
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(4, 2))
    if accelerator.is_main_process:
        accelerator.save_model(model, out)
    ranks = accelerator.gather(torch.tensor([accelerator.process_index]))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print("gathered", ranks.tolist())
    accelerator.end_training()


if __name__ == "__main__":
    main()
