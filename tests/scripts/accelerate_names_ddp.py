"""Launched on 2 processes by tests/accelerate/test_accelerate_names_multiprocess.py: Accelerate's names that need
several processes, each checked here against Accelerate's documented behaviour; prints "ok <check>" per check.

- accelerator.distributed_type is MULTI_CPU under DDP;
- DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...) registers torch's hook on the DDP model;
- gather_for_metrics(loss.repeat(bs)) on a smaller last batch keeps the real number of samples;
- a stream without __len__ (IterableDataset): gather_for_metrics gives each sample once, as tensors and as objects,
  and the last batch ends the dataloader and its accumulation window;
- LocalSGD: weights drift apart between averagings and are equal after one, also with accumulation inside;
- trigger_sync_in_backward: a backward after a no_sync forward averages the gradients;
- GradientAccumulationPlugin(sync_each_batch=True) averages gradients on every micro-step, False only at the end;
- synchronize_rng_states(["torch"]): every process draws the main process's numbers; so does each process once a
  loader prepared by Accelerator(rng_types=["torch"]) starts an iteration;
- model.no_sync() on an FSDP-prepared model: a micro-step without sync then a synced one gives DDP's weights;
- Accelerate's inference ending: split_between_processes, gather_object, then PartialState().destroy_process_group()
  (the processes go on alone, and the launch still ends cleanly).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from cadence import (Accelerator, DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType,
                     GradientAccumulationPlugin)
from cadence.local_sgd import LocalSGD
from cadence.utils import set_seed, synchronize_rng_states


def same_on_all_ranks(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(parts[0], p) for p in parts)


def ok(check: str) -> None:
    if dist.get_rank() == 0:
        print("ok", check, flush=True)


def linear(seed: int = 0) -> nn.Module:
    set_seed(seed)
    return nn.Linear(4, 2)


def rank_input() -> torch.Tensor:
    return torch.full((3, 4), float(dist.get_rank() + 1))


def distributed_type_and_comm_hooks() -> None:
    assert Accelerator(cpu=True).distributed_type == DistributedType.MULTI_CPU
    hooks = {"fp16_compress_hook": DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16),
             "powerSGD_hook": DistributedDataParallelKwargs(comm_hook="power_sgd",
                                                            comm_state_option={"matrix_approximation_rank": 1}),
             "fp16_compress_wrapper_hook": DistributedDataParallelKwargs(comm_hook="batched_power_sgd",
                                                                         comm_wrapper="fp16")}
    for name, kwargs in hooks.items():
        acc = Accelerator(cpu=True, kwargs_handlers=[kwargs])
        model = acc.prepare(linear())
        acc.backward(model(rank_input()).sum())
        assert model._get_ddp_logging_data()["comm_hook"].endswith(name), model._get_ddp_logging_data()["comm_hook"]
        assert same_on_all_ranks(model.module.weight.grad), name
    try:   # torch sends bf16 only over NCCL/XCCL: refused before any work, with what to use instead
        Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="bf16")])
        raise AssertionError("the bf16 hook was accepted on the CPU")
    except ValueError as e:
        assert "bf16" in str(e) and "fp16" in str(e), e
    ok("distributed_type and comm hooks")


def gather_for_metrics_of_a_repeated_loss() -> None:
    acc = Accelerator(cpu=True)
    dl = acc.prepare(DataLoader(torch.arange(10.0), batch_size=4))   # shards of 5: batches of 4 and 1
    counts = [acc.gather_for_metrics(batch.mean().repeat(4)).numel() for batch in dl]
    assert counts == [8, 2], counts
    ok("gather_for_metrics of a repeated loss")


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(11.0))


def gather_for_metrics_over_a_stream() -> None:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = acc.prepare(nn.Linear(1, 1))
    dl = acc.prepare(DataLoader(Stream(), batch_size=2))     # 3 steps of 2 batches of 2: the last holds 2 + 1 items
    seen, names, ends, syncs = [], [], [], []
    for batch in dl:
        with acc.accumulate(model):
            acc.backward(model(batch[:, None]).sum())
        seen += acc.gather_for_metrics(batch).tolist()
        names += acc.gather_for_metrics([f"item {int(x)}" for x in batch])
        ends.append(acc.gradient_state.end_of_dataloader)
        syncs.append(acc.sync_gradients)
    assert sorted(seen) == list(range(11)), seen
    assert sorted(names) == sorted(f"item {i}" for i in range(11)), names
    assert (ends, syncs) == ([False, False, True], [False, True, True]), (ends, syncs)
    ok("gather_for_metrics over a stream without length")


def local_sgd(accumulation: int) -> None:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    steps = []
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2) as sgd:
        for _ in range(2 * accumulation):
            with acc.accumulate(model):
                acc.backward(model(rank_input()).pow(2).sum())
                opt.step()
                opt.zero_grad()
                if acc.sync_gradients:
                    sgd.step()
                    steps.append(same_on_all_ranks(model.module.weight.detach()))
    assert steps == [False, True], steps   # ranks apart after their own step, equal after the averaging one
    ok(f"LocalSGD with accumulation {accumulation}")


def trigger_sync_in_backward() -> None:
    acc = Accelerator(cpu=True)
    model = acc.prepare(linear())
    with acc.no_sync(model):
        loss = model(rank_input()).sum()
    with acc.trigger_sync_in_backward(model):
        acc.backward(loss)
    grad = model.module.weight.grad
    assert same_on_all_ranks(grad) and torch.allclose(grad, torch.full_like(grad, 3 * 1.5)), grad
    ok("trigger_sync_in_backward")


def sync_each_batch() -> None:
    synced = {}
    for each in (False, True):
        acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2,
                                                                                            sync_each_batch=each))
        model = acc.prepare(linear())
        with acc.accumulate(model):                    # the first micro-step of a window of 2
            acc.backward(model(rank_input()).sum())
        synced[each] = same_on_all_ranks(model.module.weight.grad)
    assert synced == {False: False, True: True}, synced
    ok("sync_each_batch")


def rng_states() -> None:
    set_seed(dist.get_rank())
    synchronize_rng_states(["torch"])
    assert same_on_all_ranks(torch.rand(4))
    ok("synchronize_rng_states")
    accelerator = Accelerator(cpu=True, rng_types=["torch", "generator"])   # Accelerate: synced when a loader starts
    dl = accelerator.prepare(DataLoader(torch.arange(8), batch_size=2))
    set_seed(dist.get_rank())
    assert not same_on_all_ranks(torch.rand(4))
    next(iter(dl))
    assert same_on_all_ranks(torch.rand(4))
    ok("rng_types")


def fsdp_no_sync_matches_ddp() -> None:
    weights = {}
    for engine in ("ddp", "fsdp"):
        acc = Accelerator(cpu=True, strategy=engine)
        model = linear()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        with model.no_sync():                          # Accelerate's examples call it on the prepared model
            acc.backward(model(rank_input()).pow(2).sum())
        acc.backward(model(2 * rank_input()).pow(2).sum())
        opt.step()
        weights[engine] = acc.get_state_dict(model)     # complete on the main process
    if dist.get_rank() == 0:
        assert torch.allclose(weights["ddp"]["weight"], weights["fsdp"]["weight"], atol=1e-6), weights
    ok("FSDP model.no_sync")


def inference_then_destroy_process_group():
    """The end of Accelerate's examples/inference/distributed scripts."""
    from cadence import PartialState
    from cadence.utils import gather_object

    state = PartialState()
    with state.split_between_processes(["a", "b", "c"], apply_padding=True) as mine:
        answers = [prompt.upper() for prompt in mine]
    gathered = gather_object(answers)
    assert gathered == ["A", "B", "C", "C"], gathered   # process 1's part padded with its last prompt
    state.destroy_process_group()
    assert not dist.is_initialized()
    if state.process_index == 0:
        print("ok destroy_process_group", flush=True)


if __name__ == "__main__":
    distributed_type_and_comm_hooks()
    gather_for_metrics_of_a_repeated_loss()
    gather_for_metrics_over_a_stream()
    local_sgd(accumulation=1)
    local_sgd(accumulation=2)
    trigger_sync_in_backward()
    sync_each_batch()
    rng_states()
    fsdp_no_sync_matches_ddp()
    inference_then_destroy_process_group()
