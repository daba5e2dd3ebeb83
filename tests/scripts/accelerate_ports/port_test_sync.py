"""Port of Accelerate's test_utils/scripts/test_sync.py (the import swapped to cadence).

A prepared scheduler moves num_processes steps per optimizer step really taken, as in Accelerate.
Where cadence deliberately differs, the check says so: Accelerate's `trigger_sync_in_backward` (DDP internals) is not
part of cadence: forward and backward under `no_sync` stay local, as DDP decides at forward time.
"""

from copy import deepcopy

import torch
import torch.nn.functional as F
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from cadence import Accelerator, set_seed   # was: from accelerate import Accelerator ...
from regression import RegressionDataset, RegressionModel


def check_model_parameters(model_a, model_b, did_step, iteration, **kwargs):
    for param, grad_param in zip(model_a.parameters(), model_b.parameters()):
        if not did_step:
            assert not torch.allclose(param.grad, grad_param.grad), f"grads in sync at iteration {iteration}"
        else:
            assert torch.allclose(param.grad, grad_param.grad, **kwargs), f"grads not in sync at iteration {iteration}"


def step_model(model, input, target, accelerator, do_backward=True):
    model.train()
    loss = F.mse_loss(model(input), target.to(input.device))
    if not do_backward:
        (loss / accelerator.gradient_accumulation_steps).backward()
    else:
        accelerator.backward(loss)


def get_training_setup(accelerator, sched=False):
    set_seed(42)
    model = RegressionModel()
    ddp_model = deepcopy(model)
    dataloader = DataLoader(RegressionDataset(length=80), batch_size=16)
    if sched:
        opt = AdamW(params=model.parameters(), lr=1e-3)
        ddp_opt = AdamW(params=ddp_model.parameters(), lr=1e-3)
        sched = LambdaLR(opt, lr_lambda=lambda epoch: epoch**0.65)
        ddp_sched = LambdaLR(ddp_opt, lr_lambda=lambda epoch: epoch**0.65)
        ddp_model, ddp_opt, ddp_sched, dataloader = accelerator.prepare(ddp_model, ddp_opt, ddp_sched, dataloader)
        return model, opt, sched, dataloader, ddp_model, ddp_opt, ddp_sched
    ddp_model, dataloader = accelerator.prepare(ddp_model, dataloader)
    return model, ddp_model, dataloader


def test_sync(accelerator):
    """no_sync: gradients agree with the one-process model only on the iterations that synchronise."""
    model, ddp_model, dataloader = get_training_setup(accelerator)
    ddp_input, ddp_target = next(iter(dataloader)).values()
    for iteration in range(3):
        input, target = accelerator.gather((ddp_input, ddp_target))
        step_model(model, input, target, accelerator)
        if iteration % 2 == 0:
            with accelerator.no_sync(ddp_model):
                step_model(ddp_model, ddp_input, ddp_target, accelerator)
        else:
            step_model(ddp_model, ddp_input, ddp_target, accelerator)
        # one process: no_sync is a no-op, always in sync
        check_model_parameters(model, ddp_model, iteration % 2 == 1 or accelerator.num_processes == 1, iteration)
        torch.manual_seed(1337 + iteration)
        ddp_input = ddp_input[torch.randperm(len(ddp_input))]


def test_gradient_accumulation():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, ddp_model, dataloader = get_training_setup(accelerator)
    for iteration, batch in enumerate(dataloader):
        ddp_input, ddp_target = batch.values()
        input, target = accelerator.gather((ddp_input, ddp_target))
        step_model(model, input, target, accelerator, False)
        with accelerator.accumulate(ddp_model):
            step_model(ddp_model, ddp_input, ddp_target, accelerator)
        in_sync = (iteration + 1) % 2 == 0 or iteration == len(dataloader) - 1
        check_model_parameters(model, ddp_model, in_sync or accelerator.num_processes == 1, iteration)


def test_gradient_accumulation_with_opt_and_scheduler():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, opt, sched, dataloader, ddp_model, ddp_opt, ddp_sched = get_training_setup(accelerator, True)
    for iteration, batch in enumerate(dataloader):
        ddp_input, ddp_target = batch.values()
        input, target = accelerator.gather((ddp_input, ddp_target))
        model.train()
        ddp_model.train()
        step_model(model, input, target, accelerator, False)
        opt.step()
        did_step = (iteration + 1) % 2 == 0 or (iteration + 1) == len(dataloader)
        if did_step:
            for _ in range(accelerator.num_processes):
                sched.step()
        with accelerator.accumulate(ddp_model):
            step_model(ddp_model, ddp_input, ddp_target, accelerator)
            ddp_opt.step()
            ddp_sched.step()
        assert opt.param_groups[0]["lr"] == ddp_opt.param_groups[0]["lr"], "learning rates differ"
        assert accelerator.sync_gradients == did_step
        if accelerator.num_processes > 1:
            check_model_parameters(model, ddp_model, did_step, iteration, rtol=1e-2)
        if did_step:
            opt.zero_grad()
        ddp_opt.zero_grad()     # a no-op on micro-steps: the gradients keep accumulating
    # num_processes steps per window of 2 (the last window may hold 1 batch)
    assert ddp_sched.scheduler.last_epoch == accelerator.num_processes * ((len(dataloader) + 1) // 2)


def test_dataloader_break():
    accelerator = Accelerator()
    first_dl, second_dl = accelerator.prepare(DataLoader(RegressionDataset(length=80), batch_size=16),
                                              DataLoader(RegressionDataset(length=96), batch_size=16))
    state = accelerator.gradient_state
    assert state.active_dataloader is None
    for iteration, _ in enumerate(first_dl):
        assert state.active_dataloader is first_dl
        assert state.end_of_dataloader == (iteration == len(first_dl) - 1)
        if iteration == 1:
            for batch_num, _ in enumerate(second_dl):
                assert state.active_dataloader is second_dl
                assert state.end_of_dataloader == (batch_num == len(second_dl) - 1)
    assert state.active_dataloader is None


def main():
    accelerator = Accelerator()
    test_dataloader_break()
    test_sync(accelerator)
    test_gradient_accumulation()
    test_gradient_accumulation_with_opt_and_scheduler()
