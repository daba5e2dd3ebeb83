"""Launched on 2 processes by tests/distributed/test_deepspeed_optimizer_state.py: a Learner trains two steps under
DeepSpeed ZeRO-STAGE, `learn.save("saved")` (weights, and the optimizer as a one-process torch optimizer's
state_dict), then one more step. Rank 0 writes OUT/reference.pt: DeepSpeed's own gathered Adam moments of every
trained parameter at the save (`safe_get_full_optimizer_state`), by name; and OUT/final.pt: the fp32 weights after
the step that followed.

Every epoch is one global batch of the whole data set (4 rows per process), so a one-process Learner over the
same 8 rows in one batch of 8 takes the same steps whatever the order of the rows.

argv: OUT STAGE KIND; KIND "mlp" (two parameter groups from a splitter, a frozen weight, per-group learning
rates) or "lora" (a tiny peft LoRA Llama: its base model frozen).
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import DataLoaders, Learner
from cadence.distributed.env import rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))  # tests/hf/tiny_models.py


def mlp_learner(path: Path, bs: int) -> Learner:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    dl = DataLoader(TensorDataset(x, y), batch_size=bs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    model[2].weight.requires_grad_(False)   # frozen: numbered in its group, without state
    learn = Learner(DataLoaders(dl, dl, device="cpu"), model, loss_func=nn.MSELoss(), opt_func=torch.optim.AdamW,
                    lr=slice(1e-3, 1e-2), splitter=lambda m: [list(m[:2].parameters()), list(m[2:].parameters())],
                    path=path)
    learn.remove_cb(learn.progress)
    return learn


def lora_learner(path: Path, bs: int) -> Learner:
    from peft import LoraConfig, get_peft_model
    from tiny_models import tiny_model, token_data

    dl = DataLoader(token_data(8, seed=1), batch_size=bs)
    torch.manual_seed(1)
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    learn = Learner(DataLoaders(dl, dl, device="cpu"), model, loss_func=None, opt_func=torch.optim.AdamW, lr=1e-2,
                    path=path)
    learn.remove_cb(learn.progress)
    return learn


LEARNERS = {"mlp": mlp_learner, "lora": lora_learner}


def main() -> None:
    from deepspeed.utils import safe_get_full_optimizer_state

    from cadence.distributed.deepspeed_checkpoint import link_optimizer_state

    out, stage, kind = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    learn = LEARNERS[kind](out, bs=4)
    with learn.distrib_ctx(strategy="deepspeed", zero_stage=stage):
        learn.fit(2)
        learn.save("saved")
        link_optimizer_state(learn.strategy.engine.optimizer)   # DeepSpeed links a second group's views lazily
        moments = {name: {key: safe_get_full_optimizer_state(p, key).detach().cpu().reshape(
                              getattr(p, "ds_shape", p.shape)).clone() for key in ("exp_avg", "exp_avg_sq")}
                   for name, p in learn.strategy.unwrap(learn.model).named_parameters() if p.requires_grad}
        learn.fit(1)
        final = learn.strategy.model_state_dict(learn.model)
    if rank() == 0:
        torch.save(moments, out / "reference.pt")
        torch.save(final, out / "final.pt")


if __name__ == "__main__":
    main()
