"""Launched on 2 processes by tests/distributed/test_pipeline_hf.py: a tiny Llama (built from a config) with a
LoRA adapter (peft's `get_peft_model`), cut into 2 pipeline stages by pipeline_hf.py's `Stage` and fine-tuned
under `distrib_ctx(strategy="model_parallel", pp_size=2)` with a Checkpoint (OUT/ckpt); inside the block
`learn.save_model(OUT/adapter)` (peft's adapter) and `learn.save_model(OUT/merged, merge_adapter=True)`. Rank 0
writes the trained model's weights after the block (whole again) to OUT/weights.pt. Usage: `pipeline_peft.py OUT`.
`peft_learner()`, `make_peft_model()` and `split` are imported by the test, which loads what was saved on one process.
"""

import sys

import torch

from cadence import Checkpoint, Learner
from pipeline_hf import Stage, learner, make_model


def make_peft_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    lora_dropout=0.0))
    torch.manual_seed(1)
    for name, p in model.named_parameters():   # LoRA's B starts at zero: give the adapter weights of its own
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def split(model, stage, num_stages):
    """A peft model's stages: `Stage` of the Llama inside it (the LoRA layers are in place there)."""
    return Stage(model.get_base_model(), stage, num_stages)


def peft_learner() -> Learner:
    return learner(make_peft_model(), train_rows=16)


def main(out: str) -> None:
    from cadence.distributed.env import rank

    learn = peft_learner()
    with learn.distrib_ctx(strategy="model_parallel", pp_size=2, pp_schedule="1F1B", pp_microbatches=2, split=split):
        learn.fit(1, cbs=Checkpoint(f"{out}/ckpt"))
        learn.save_model(f"{out}/adapter")
        learn.save_model(f"{out}/merged", merge_adapter=True)
    if rank() == 0:
        torch.save({k: v.detach().clone() for k, v in learn.model.state_dict().items()}, f"{out}/weights.pt")


if __name__ == "__main__":
    main(sys.argv[1])
