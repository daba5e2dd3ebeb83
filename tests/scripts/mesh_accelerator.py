"""Launched on 2 processes by tests/accelerate/test_accelerate_sharded_load.py: `mesh_accelerator.py OUT`.

An Accelerate-style loop (`from cadence import Accelerator`) trains model_parallel_2d.py's tiny language model with
tensor parallelism (`ParallelismConfig(tp_size=2)`) and AdamW for two steps, then `save_state(OUT/ckpt)` (the
sharded format). Rank 0 writes the full trained weights (`get_state_dict`) to OUT/weights.pt.
`make_model()` is imported by the test, which loads the checkpoint on one process.
"""

import sys

import torch

from cadence import Accelerator
from cadence.utils import ParallelismConfig

from model_parallel import data, lm_loss
from model_parallel_2d import TinyLM, parallelize


def make_model():
    torch.manual_seed(0)
    return TinyLM()


def main(out: str) -> None:
    accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2, parallelize=parallelize))
    model = make_model()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = data(8, 1)
    for _ in range(2):
        accelerator.backward(lm_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    accelerator.save_state(f"{out}/ckpt")
    weights = accelerator.get_state_dict(model)   # every process: a gather
    if accelerator.is_main_process:
        torch.save(weights, f"{out}/weights.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
