"""Launched on 2 or 4 processes by tests/accelerate/test_parallelism_config.py:
`accelerate_parallelism.py OUT [--launched] [--bf16] [--replicas] [--presliced]`.

An Accelerate-style loop (`from cadence import Accelerator`, `cadence.utils.ParallelismConfig`) trains a tiny
language model with tensor parallelism over 2 processes (and FSDP2 over the dp groups on 4). With `--launched` the
script is a plain `Accelerator()` and the model carries its own `parallelize(tp_mesh)`: `cadence launch
--use_parallelism_config --parallelism_config_tp_size 2` gives the sizes. With `--replicas` the dp groups are
replicas (dp_replicate_size, HSDP under TP) rather than FSDP shards; with `--presliced` the script slices the model
itself on `accelerator.torch_device_mesh["tp"]` before `prepare`, as `from_pretrained(tp_plan="auto")` does.
Rank 0 prints `CHECK <name> ok` for each check against a hand-written
one-process loop over the same global batches (computed here, without cadence):
- mesh: `torch_device_mesh` has Accelerate's dimensions (dp_shard or dp_replicate, tp; "dp" of size 1 with tp
  alone) and its flattened "dp_cp", the tp/dp ranks are the process's coordinates, the model is sliced;
- batches: the ranks of a tp group get the same batches, dp groups different ones;
- losses_and_norms: the loss (averaged over dp) and `clip_grad_norm_` equal the reference's, step by step;
- metrics: `gather_for_metrics` over the validation set gives every sample once (not once per tp rank, padding
  dropped), its logits equal to the reference's;
- state_dict: `get_state_dict` is the full trained model on the main process, equal to the reference;
- save_model: the exported safetensors equal the reference, written by the main process alone;
- save_load_state: `load_state` after one more step brings back the saved weights exactly.
- the same with `--bf16` (mixed_precision="bf16", compared within bf16's rounding) and with the launcher's
  `--gradient_accumulation_steps` (`accumulate`, clipping on the synchronising micro-step only);
- presliced_without_tp_refused: a sliced model given to an Accelerator without tensor parallelism is refused;
- presliced_refused (4 processes): a model sliced on another mesh than the Accelerator's is refused, saying which.
"""

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from cadence import Accelerator
from cadence.utils import ParallelismConfig

from model_parallel import data, lm_loss   # the same tokens and loss (VOCAB, SEQ as there)
from model_parallel_2d import TinyLM, parallelize   # the same model and tensor-parallel plan as the Learner's 2-D test

VOCAB, DIM, SEQ, N_TRAIN, N_VALID, BS, EPOCHS, LR, CLIP = 16, 8, 6, 32, 13, 4, 2, 0.5, 0.3


class PlannedLM(TinyLM):
    """The same model, carrying its own tensor-parallel plan."""

    def parallelize(self, tp_mesh):
        parallelize(self, tp_mesh)


def make_model(cls=TinyLM):
    torch.manual_seed(0)
    return cls()


def reference(x, y, dp, accum):
    """One process, plain torch: micro-step k trains on the loader's batches k*dp .. k*dp + dp-1 together (Accelerate
    deals a loader's batches to the dp groups in turn); the optimizer steps (clipped) every `accum` micro-steps, the
    loss divided by `accum` as Accelerate does."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    share, losses, norms = len(x) // dp, [], []
    for _ in range(EPOCHS):
        for k in range(share // BS):
            idx = torch.arange(k * dp * BS, (k + 1) * dp * BS)
            loss = lm_loss(model(x[idx]), y[idx])
            (loss / accum).backward()
            if (k + 1) % accum == 0:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    return model, losses, norms


def ok(accelerator, name):
    if accelerator.is_main_process:
        print(f"CHECK {name} ok", flush=True)


def main():
    out, launched = Path(sys.argv[1]), "--launched" in sys.argv
    world = int(os.environ.get("WORLD_SIZE", "1"))
    replicas, presliced = "--replicas" in sys.argv, "--presliced" in sys.argv
    dp_sizes = {"dp_replicate_size": world // 2} if replicas else {"dp_shard_size": world // 2}
    if launched:
        accelerator = Accelerator()
    else:
        accelerator = Accelerator(mixed_precision="bf16" if "--bf16" in sys.argv else "no",
                                  parallelism_config=ParallelismConfig(tp_size=2, **dp_sizes,
                                                                       parallelize=None if presliced else parallelize))
    accum = accelerator.gradient_accumulation_steps
    # bf16 compute against the fp32 reference: rounding-level agreement only
    rtol, atol = (0.15, 0.05) if accelerator.mixed_precision == "bf16" else (1e-4, 1e-5)
    tp, dp, rank = 2, accelerator.num_processes // 2, accelerator.process_index
    x, y = data(N_TRAIN, 1)
    xv, yv = data(N_VALID, 2)
    model = make_model(PlannedLM if launched else TinyLM)
    if presliced:   # as from_pretrained(..., tp_plan="auto", device_mesh=accelerator.torch_device_mesh) does
        parallelize(model, accelerator.torch_device_mesh["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    train_dl = DataLoader(TensorDataset(x, y), batch_size=BS)
    valid_dl = DataLoader(TensorDataset(xv, yv), batch_size=BS)
    model, opt, train_dl, valid_dl = accelerator.prepare(model, opt, train_dl, valid_dl)

    mesh, config = accelerator.torch_device_mesh, accelerator.parallelism_config
    names, shape, shard = ((("dp_replicate", "dp_shard", "tp"), (dp, 1, tp), 1) if replicas else
                           (("dp_shard", "tp"), (dp, tp), dp) if dp > 1 else (("dp", "tp"), (1, tp), 1))
    assert mesh.mesh_dim_names == names and tuple(mesh.shape) == shape, (mesh.mesh_dim_names, mesh.shape)
    assert config.dp_cp_dim_names == ([] if dp == 1 else ["dp_replicate"] if replicas else ["dp_shard"])
    if dp > 1:   # the group nd_parallel.py averages its loss over: the processes of this tp rank
        assert mesh["dp_cp"].mesh.tolist() == list(range(rank % tp, world, tp)), mesh["dp_cp"]
    assert accelerator.tensor_parallel_rank == rank % tp
    assert (accelerator.data_parallel_rank, accelerator.data_parallel_shard_rank) == ((rank // tp, 0) if replicas
                                                                                      else (0, rank // tp))
    assert config.tp_size == tp and config.data_parallel_size == dp
    from torch.distributed.tensor import DTensor
    fc1 = accelerator.unwrap_model(model).fc1.weight
    assert isinstance(fc1, DTensor) and fc1.to_local().shape[0] == 4 * DIM // (tp * shard), fc1.to_local().shape
    ok(accelerator, "mesh")

    losses, norms, firsts = [], [], []
    for _ in range(EPOCHS):
        model.train()
        for xb, yb in train_dl:
            with accelerator.accumulate(model):
                loss = lm_loss(model(xb), yb)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                opt.zero_grad()
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))   # tp ranks hold the same loss
            firsts.append(xb[0].tolist())
    everyone = accelerator.gather_object([firsts])
    ref_model, ref_losses, ref_norms = reference(x, y, dp, accum)

    for r in range(accelerator.num_processes):
        assert everyone[r] == everyone[(r // tp) * tp], f"rank {r} saw other batches than its tp group"
    assert dp == 1 or everyone[0] != everyone[tp], "dp groups saw the same batches"
    ok(accelerator, "batches")
    assert len(norms) == len(ref_norms) == EPOCHS * (N_TRAIN // (dp * BS)) // accum, (len(norms), len(ref_norms))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=atol)
    if accelerator.mixed_precision == "bf16":   # the forward did run in bf16: not fp32's losses to the last bits
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) > 1e-5, "bf16 changed nothing"
    assert min(ref_norms) > CLIP, "every step must clip for the norm check to mean something"
    ok(accelerator, "losses_and_norms")

    model.eval()
    logits, targets = [], []
    with torch.no_grad():
        for xb, yb in valid_dl:
            lg, tg = accelerator.gather_for_metrics((model(xb), yb))
            logits.append(lg)
            targets.append(tg)
    logits, targets = torch.cat(logits), torch.cat(targets)
    with torch.no_grad():
        ref_logits = ref_model(xv)
    # gathered batch by batch, dp group after dp group: match each gathered row to its sample (rows are distinct)
    assert len({tuple(row) for row in yv.tolist()}) == N_VALID
    order = [yv.tolist().index(row) for row in targets.tolist()]
    assert sorted(order) == list(range(N_VALID)), f"samples gathered {order}, not each of the {N_VALID} once"
    torch.testing.assert_close(logits, ref_logits[order], rtol=rtol, atol=10 * atol)
    ok(accelerator, "metrics")

    full = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        ref = ref_model.state_dict()
        assert full.keys() == ref.keys(), (sorted(full), sorted(ref))
        for k in ref:
            torch.testing.assert_close(full[k].cpu(), ref[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
    ok(accelerator, "state_dict")

    accelerator.save_model(model, out / "export")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        from safetensors.torch import load_file
        files = sorted(p.name for p in (out / "export").iterdir())
        assert files == ["model.safetensors"], files
        saved = load_file(out / "export" / "model.safetensors")
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(saved[k], v, rtol=rtol, atol=atol)
    ok(accelerator, "save_model")

    accelerator.save_state(out / "state")
    before = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    model.train()
    xb, yb = next(iter(train_dl))
    accelerator.backward(lm_loss(model(xb), yb))
    opt.step()
    opt.zero_grad()
    changed = accelerator.get_state_dict(model)
    accelerator.load_state(out / "state")
    after = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        assert any(not torch.equal(changed[k], before[k]) for k in before), "the extra step changed nothing"
        assert all(torch.equal(after[k], before[k]) for k in before), "load_state did not restore the weights"
    ok(accelerator, "save_load_state")

    from cadence.accelerate.parallelism import ParallelismConfig as Sizes, refuse_presliced
    sliced = make_model()
    parallelize(sliced, accelerator.torch_device_mesh["tp"])
    for sizes in (None, Sizes(tp_size=1, dp_shard_size=world)):   # DDP, FSDP: they take no sliced model
        try:
            refuse_presliced(sliced, sizes)
            raise AssertionError("a sliced model was taken without tensor parallelism")
        except ValueError as e:
            assert "already sliced" in str(e) and "ParallelismConfig(tp_size=...)" in str(e), e
    ok(accelerator, "presliced_without_tp_refused")

    if world == 4:   # tp groups {0, 2} and {1, 3}: not the Accelerator's ({0, 1}, {2, 3}), which FSDP2 builds on
        from torch.distributed.device_mesh import init_device_mesh
        sliced = make_model()
        parallelize(sliced, init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "other"))["tp"])
        try:
            accelerator.prepare(sliced)
            raise AssertionError("a model sliced on another mesh was taken")
        except ValueError as e:
            assert "is sliced on" in str(e) and "accelerator.torch_device_mesh['tp']" in str(e), e
        ok(accelerator, "presliced_refused")
    accelerator.end_training()


if __name__ == "__main__":
    main()
