"""Launched on 2 or 4 processes by tests/distributed/test_pipeline.py: `pipeline.py CLIP VARIANT...`.

An nn.Sequential classifier (a tie inside its first stage) trained by the Learner under
`distrib_ctx(strategy="model_parallel", pp_size=2, pp_schedule=...)` (dp = world // 2, FSDP2 over dp) with
GradClip(CLIP), once per VARIANT in the same processes. A variant is `SCHEDULE/MICROBATCHES`: the batch of 8 cut
into that many micro-batches (3 leaves a padded one); `+tp` adds tp_size=2 (children 4 and 6 sliced inside their
stage), so pp x dp x tp on 4 processes is 2 x 1 x 2; `+split` cuts with a `split` function whose stages name
their layers their own way; `+bf16` trains with learn.to_bf16() (compared at bf16's precision). Rank 0 prints `CHECK <variant>:<name> ok` for each check
against a hand-written one-process loop over the same global batches (computed here, without cadence):
- the loss of every step (the same on every rank of a pipeline), the clipped norm, the weights after training;
- the valid loss and accuracy, get_preds (valid batches of 8 and 2 per dp group: micro-batches padded);
- validating with gradients pending leaves them as they were (`schedule.eval` would divide them);
- the tie inside a stage holds while cut and after the context.
"""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence import Callback, DataLoaders, GradClip, Learner, accuracy
from cadence.distributed.env import rank, world_size

import model_parallel   # the one-process reference loop on the global batches

DIM, CLASSES, N_TRAIN, N_VALID, BS, EPOCHS, LR, PP = 16, 4, 32, 20, 8, 2, 0.3, 2
SPLITS = {2: ["4"], 4: ["4", "6", "8"]}  # stages: [0..3] [4..8] or [0..3] [4,5] [6,7] [8]


def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM),
                          nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, CLASSES))
    model[2].weight = model[0].weight  # tied inside stage 0
    return model


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def global_batches(x, y, dp):
    return model_parallel.global_batches(x, y, dp, BS)


def reference(x, y, dp, clip):
    return model_parallel.reference(x, y, dp, clip, make_model, nn.functional.cross_entropy, BS, EPOCHS, LR)


class Record(Callback):
    def before_fit(self):
        self.losses, self.norms = [], []

    def after_batch(self):
        if self.training:
            self.losses.append(float(self.learn.loss))
            self.norms.append(float(getattr(self.learn, "grad_norm", float("nan"))))


def local(t):
    """A gradient sharded by FSDP2 (a DTensor) as this rank's shard."""
    return t.to_local() if hasattr(t, "to_local") else t


def ok(variant, name):
    if rank() == 0:
        print(f"CHECK {variant}:{name} ok", flush=True)


def parallelize(stage, tp_mesh):
    """TP inside a stage: children 4 (column-wise) and 6 (row-wise) where the stage holds them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = dict(stage.named_children())
    plan = {name: style for name, style in (("4", ColwiseParallel()), ("6", RowwiseParallel())) if name in names}
    parallelize_module(stage, tp_mesh, plan)


def split(model, stage, num_stages):
    """A user's cut: plain nn.Sequentials of the model's layers, named 0, 1, ... (not the model's names)."""
    bounds = [0, 4, 6, 8, 9] if num_stages == 4 else [0, 4, 9]
    return nn.Sequential(*list(model)[bounds[stage]:bounds[stage + 1]])


def run(variant, clip):
    variant, _, extra = variant.partition("+")
    tp = 2 if extra == "tp" else 1
    bf16 = extra == "bf16"
    schedule, microbatches = variant.split("/")
    variant = f"{variant}+{extra}" if extra else variant
    x, y = data(N_TRAIN, 1)
    xv, yv = data(N_VALID, 2)
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), DataLoader(TensorDataset(xv, yv), batch_size=BS),
                      device="cpu")
    record = Record()
    learn = Learner(dls, make_model(), loss_func=nn.functional.cross_entropy, opt_func=torch.optim.SGD, lr=LR,
                    metrics=accuracy, cbs=[record, GradClip(clip)])
    if bf16:
        learn.to_bf16()
    multi = schedule not in ("GPipe", "1F1B")
    cut = {"split": split} if extra == "split" else {"pp_split_points": SPLITS[2 * PP if multi else PP]}
    if extra == "hsdp":                                   # the stages' FSDP2 over (dp_replicate 2, dp_shard)
        cut["dp_replicate_size"] = 2
    with learn.distrib_ctx(strategy="model_parallel", pp_size=PP, pp_schedule=schedule, tp_size=tp,
                           parallelize=parallelize if tp > 1 else None, pp_microbatches=int(microbatches), **cut):
        dp = world_size() // (PP * tp)
        held = learn.model
        if tp > 1 and "4" in dict(held.named_children()):
            assert hasattr(held.get_submodule("4").weight, "to_local"), "the stage's layers must be sliced over tp"
        if "0" in dict(held.named_children()) and extra != "split":
            assert held[2].weight is held[0].weight, "the tie inside a stage must hold while cut"
        if dp > 1:
            assert all(hasattr(p, "to_local") for p in held.parameters()), "the stages must be sharded over dp"
        learn.fit(EPOCHS)
        got = learn.validate()
        preds, targs = learn.get_preds()

        xb, yb = next(iter(learn.dls.train))                     # gradients pending, then a validation
        learn.strategy.forward_backward(learn.model, (xb,), (yb,), nn.functional.cross_entropy, True)
        pending = [local(p.grad).clone() for p in learn.model.parameters() if p.grad is not None]
        learn.validate()
        after = [local(p.grad) for p in learn.model.parameters() if p.grad is not None]
        assert pending and all(torch.equal(a, b) for a, b in zip(pending, after)), "validation changed pending gradients"
        learn.opt.zero_grad()
        losses = [None] * world_size()
        dist.all_gather_object(losses, record.losses)
    ok(variant, "eval_leaves_pending_gradients")
    ref_model, ref_losses, ref_norms = reference(x, y, dp, clip)
    rtol, atol = (0.1, 0.05) if bf16 else (1e-4, 1e-5)  # bf16 compute against the fp32 reference

    # ranks laid out (pp, dp, tp): the ranks of one pipeline and tp group (r % (dp * tp) equal) record the same loss
    assert all(losses[r] == losses[r % (dp * tp) // tp * tp] for r in range(world_size())), f"ranks disagree: {losses}"
    if dp == 1:  # a dp group's loss is its share of the global batch
        torch.testing.assert_close(torch.tensor(record.losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(record.norms), torch.tensor(ref_norms), rtol=rtol, atol=atol)
    assert max(ref_norms) > clip, "the clip never acted: the test would not see a wrong norm"
    ok(variant, "losses_and_norms")

    plain = learn.model
    assert isinstance(plain, nn.Sequential) and plain[2].weight is plain[0].weight, "the tie must hold after the context"
    for (name, a), b in zip(ref_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    ok(variant, "weights_equal_reference")

    with torch.no_grad():
        ref_logits = ref_model(xv)
    torch.testing.assert_close(torch.tensor(got["valid_loss"]), nn.functional.cross_entropy(ref_logits, yv),
                               rtol=rtol, atol=atol)
    if not bf16:  # a rounding flips an argmax
        torch.testing.assert_close(torch.tensor(got["accuracy"]), (ref_logits.argmax(1) == yv).float().mean())
    assert preds.shape == ref_logits.shape and torch.equal(targs, yv), (preds.shape, ref_logits.shape)
    torch.testing.assert_close(preds.float(), ref_logits, rtol=rtol, atol=atol)
    ok(variant, "valid_and_get_preds")


def refuse_grad_accum_then_save_and_load(path, cut):
    """GradAccum under PP: refused at the first accumulation micro-step, on every rank, naming what to do. Then
    learn.save / learn.load (weights and SGD momentum) inside the pipeline, against a hand-written one-process loop:
    the saved files hold the loop's weights and momentum and load into a plain torch optimizer; a pipeline that
    loads them (or the loop's own `opt.state_dict()`, saved by position) trains on like the loop. `cut` "split": the
    stages cut by `split` (their own names); on 4 processes the stages are sharded over dp=2 by FSDP2."""
    from functools import partial

    from cadence import GradAccum
    from cadence.serialization import load_weights, save_weights

    x, y = data(N_TRAIN, 1)
    batches = list(global_batches(x, y, world_size() // PP))
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    snapshots = []
    for _ in range(2):                                            # epoch 1 is saved, epoch 2 resumes from it
        for xb, yb in batches:
            nn.functional.cross_entropy(ref(xb), yb).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        snapshots.append(({k: v.clone() for k, v in ref.state_dict().items()}, copy.deepcopy(ref_opt.state_dict())))
    part = {k: v for k, v in snapshots[0][0].items() if k.startswith("8.")}   # the head only, and a stray key
    if rank() == 0:                                               # a one-process save: optimizer state by position
        (Path(path) / "models" / "one").mkdir(parents=True)
        save_weights(snapshots[0][0], Path(path) / "models" / "one" / "model.safetensors")
        torch.save(snapshots[0][1], Path(path) / "models" / "one" / "optimizer.pt")
        (Path(path) / "models" / "part").mkdir(parents=True)
        save_weights({**part, "stray.weight": torch.zeros(2)}, Path(path) / "models" / "part" / "model.safetensors")
    dls = DataLoaders(DataLoader(TensorDataset(x, y), batch_size=BS), device="cpu")
    learn = Learner(dls, make_model(), loss_func=nn.functional.cross_entropy, cbs=[GradAccum(2 * BS)], path=path,
                    opt_func=partial(torch.optim.SGD, momentum=0.9), lr=LR)
    how = {"split": split} if cut == "split" else {"pp_split_points": SPLITS[PP]}
    with learn.distrib_ctx(strategy="model_parallel", pp_size=PP, **how):
        try:
            learn.fit(1)
        except ValueError as e:
            assert "raise pp_microbatches" in str(e), e
        else:
            raise AssertionError("GradAccum under PP was not refused")
        learn.remove_cb(learn.grad_accum)
        learn.opt.zero_grad()                                     # the refused step's gradients
        learn.fit(1)
        learn.save("inside")
        trained = []
        for name in ("inside", "inside", "one"):                  # a second fit from each load equals the loop's
            learn.load(name)
            learn.fit(1)
            trained.append(learn.strategy.model_state_dict(learn.model))
        before = learn.strategy.model_state_dict(learn.model)
        learn.load("part", with_opt=False, strict=False)          # fastai's partial load, e.g. a body without its head
        after = learn.strategy.model_state_dict(learn.model)
    if rank() != 0:
        return
    for k, v in after.items():                                    # the file's layer loaded, every other one kept
        torch.testing.assert_close(v, part[k] if k in part else before[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    weights, opt_state = snapshots[0]
    saved = load_weights(Path(path) / "models" / "inside" / "model.safetensors")
    assert saved.keys() == weights.keys(), (saved.keys(), weights.keys())
    for k in weights:
        torch.testing.assert_close(saved[k], weights[k], rtol=1e-5, atol=1e-6)
    plain = make_model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)
    plain_opt.load_state_dict(torch.load(Path(path) / "models" / "inside" / "optimizer.pt"))  # in one process
    for i, s in opt_state["state"].items():
        torch.testing.assert_close(plain_opt.state_dict()["state"][i]["momentum_buffer"], s["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6)
    for state in trained:
        for k, v in snapshots[1][0].items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    ok("grad_accum", "refused")
    ok(f"save_load+{cut}" if cut else "save_load", "equals_one_process")


def main():
    clip = float(sys.argv[1])
    for variant in sys.argv[2:]:
        if variant.startswith("save_load"):       # save_load[+split]=DIR
            name, _, path = variant.partition("=")
            refuse_grad_accum_then_save_and_load(path, name.partition("+")[2])
        else:
            run(variant, clip)


if __name__ == "__main__":
    main()
