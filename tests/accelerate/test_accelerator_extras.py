"""Accelerate's less common Accelerator methods on one process: objects prepared apart, evaluation-mode models,
save/load pre-hooks, a model's second optimizer in `save_state`, `unscale_gradients`, LOMO, decorators, facts."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cadence import Accelerator, GradScalerKwargs, set_seed
from scripts.regression import RegressionDataset, RegressionModel


def _batches(n=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _net():
    set_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_prepared_apart_trains_and_saves_like_prepared_together(tmp_path):
    weights = {}
    for mode in ("together", "apart"):
        acc = Accelerator()
        model = _net()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        loader = DataLoader(RegressionDataset(length=16, seed=0), batch_size=4)
        if mode == "together":
            model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
        else:
            model = acc.prepare_model(model)
            opt = acc.prepare_optimizer(opt)
            sched = acc.prepare_scheduler(sched)
            loader = acc.prepare_data_loader(loader)
        assert len(loader) == 4
        for x, y in _batches():
            acc.backward(F.mse_loss(model(x), y))
            opt.step(); sched.step(); opt.zero_grad()
        assert sched.get_last_lr() == [0.01 * 0.5 ** 4]
        acc.save_state(tmp_path / mode)
        weights[mode] = copy.deepcopy(acc.unwrap_model(model).state_dict())
    for name, value in weights["together"].items():
        torch.testing.assert_close(weights["apart"][name], value)
    # the optimizer prepared apart is saved with its model: the same files, the same Adam state
    assert sorted(p.name for p in (tmp_path / "apart").iterdir()) == \
        sorted(p.name for p in (tmp_path / "together").iterdir())
    apart = torch.load(tmp_path / "apart" / "optimizer.pt", weights_only=True)
    together = torch.load(tmp_path / "together" / "optimizer.pt", weights_only=True)
    torch.testing.assert_close(apart["state"], together["state"])


def test_prepare_data_loader_refuses_a_dispatch_slicer():
    with pytest.raises(ValueError, match="slice_fn_for_dispatch"):
        Accelerator().prepare_data_loader(DataLoader(list(range(8))), slice_fn_for_dispatch=lambda *a: a)


def test_evaluation_mode_runs_in_the_mixed_precision_without_joining_the_checkpoint(tmp_path):
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(_net())
    teacher = _net()
    seen = []
    teacher[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    prepared = acc.prepare_model(teacher, evaluation_mode=True)
    assert prepared is teacher and type(prepared) is torch.nn.Sequential      # no engine wrapper
    out = prepared(torch.randn(2, 4))
    assert seen == [torch.bfloat16] and out.dtype == torch.float32             # autocast inside, fp32 outside
    acc.save_state(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model_1").exists()                       # only the trained model is saved
    assert model is acc._models[0] and len(acc._models) == 1


class _SavesItself:
    """A diffusers-style pair of hooks: the model saved and loaded by hand in the checkpoint folder."""

    def __init__(self):
        self.saved_in, self.loaded_from = [], []

    def save(self, models, weights, output_dir):
        torch.save(models[0].state_dict(), f"{output_dir}/by_hand.pt")
        self.saved_in.append(output_dir)
        weights.pop()

    def load(self, models, input_dir):
        model = models.pop()
        model.load_state_dict(torch.load(f"{input_dir}/by_hand.pt", weights_only=True))
        self.loaded_from.append(input_dir)


def test_save_and_load_pre_hooks_take_the_models_place(tmp_path):
    acc = Accelerator()
    net = _net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    hooks = _SavesItself()
    save_handle = acc.register_save_state_pre_hook(hooks.save)
    load_handle = acc.register_load_state_pre_hook(hooks.load)
    for x, y in _batches(2):
        acc.backward(F.mse_loss(model(x), y)); opt.step(); opt.zero_grad()
    saved = copy.deepcopy(model.state_dict())
    momentum = copy.deepcopy(opt.state_dict()["state"])
    ckpt = tmp_path / "ckpt"
    acc.save_state(ckpt)
    files = sorted(p.name for p in ckpt.iterdir())
    assert "by_hand.pt" in files and "optimizer.pt" in files and "model.safetensors" not in files
    assert hooks.saved_in != [str(ckpt)]          # the hook wrote in the staged folder, committed with the rest
    for x, y in _batches(2):
        acc.backward(F.mse_loss(model(x), y)); opt.step(); opt.zero_grad()
    acc.load_state(ckpt)
    assert hooks.loaded_from == [str(ckpt)]
    for name, value in saved.items():
        torch.testing.assert_close(model.state_dict()[name], value)
    torch.testing.assert_close(opt.state_dict()["state"], momentum)   # the optimizer still came back
    save_handle.remove(), load_handle.remove()
    acc.save_state(tmp_path / "plain")
    assert (tmp_path / "plain" / "model.safetensors").is_file() and not (tmp_path / "plain" / "by_hand.pt").exists()
    acc.load_state(tmp_path / "plain")
    assert hooks.loaded_from == [str(ckpt)]      # removed: not called again


def test_load_state_without_the_model_file_says_so_when_no_hook_loads_it(tmp_path):
    acc = Accelerator()
    net = _net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    handle = acc.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    acc.save_state(tmp_path / "ckpt")
    handle.remove()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        acc.load_state(tmp_path / "ckpt")


def test_a_models_second_optimizer_is_saved_and_restored(tmp_path):
    acc = Accelerator()
    net = _net()
    first = torch.optim.SGD(net[0].parameters(), lr=0.1, momentum=0.9)
    second = torch.optim.Adam(net[2].parameters(), lr=0.01)
    model, first, second = acc.prepare(net, first, second)
    for x, y in _batches(2):
        acc.backward(F.mse_loss(model(x), y))
        first.step(); second.step(); first.zero_grad(); second.zero_grad()
    adam = copy.deepcopy(second.state_dict()["state"])
    acc.save_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "optimizer_0.pt").is_file()
    for x, y in _batches(2):
        acc.backward(F.mse_loss(model(x), y))
        first.step(); second.step(); first.zero_grad(); second.zero_grad()
    acc.load_state(tmp_path / "ckpt")
    torch.testing.assert_close(second.state_dict()["state"], adam)


def test_unscale_gradients_gives_true_gradients_once_under_fp16():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    net = RegressionModel(a=1, b=1)
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=1.0))
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    acc.backward(F.mse_loss(model(x), y))
    scaled = [p.grad.clone() for p in acc.unwrap_model(model).parameters()]
    acc.unscale_gradients()
    acc.unscale_gradients(opt)                    # again: no second division
    true = [p.grad.clone() for p in acc.unwrap_model(model).parameters()]
    for s, t in zip(scaled, true):
        torch.testing.assert_close(s / 1024.0, t)
    before = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    opt.step()
    for b, t, p in zip(before, true, acc.unwrap_model(model).parameters()):
        torch.testing.assert_close(p.detach(), b - t)           # the step used the true gradients, not /1024 again


def test_lomo_backward_updates_as_sgd_with_a_real_lomo_optimizer():
    lomo_optim = pytest.importorskip("lomo_optim", reason="lomo-optim is in the dev extra")
    acc = Accelerator()
    model = _net()
    reference = copy.deepcopy(model)
    model, opt = acc.prepare(model, lomo_optim.Lomo(model, lr=0.1))
    x, y = _batches(1)[0]
    acc.lomo_backward(F.mse_loss(model(x), y), learning_rate=0.1)
    F.mse_loss(reference(x), y).backward()
    for p, q in zip(acc.unwrap_model(model).parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach() - 0.1 * q.grad)


def test_lomo_backward_without_a_lomo_optimizer_is_refused():
    acc = Accelerator()
    net = _net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="LOMO"):
        acc.lomo_backward(model(torch.randn(2, 4)).sum(), learning_rate=0.1)


def test_process_decorators_facts_and_features_that_are_off(tmp_path, capsys):
    acc = Accelerator(project_dir=str(tmp_path))

    @acc.on_local_process(local_process_index=0)
    def here():
        return "ran"

    @acc.on_process(process_index=1)
    def elsewhere():
        return "ran"

    assert (here(), elsewhere()) == ("ran", None)
    assert (acc.is_fsdp2, acc.is_composable_parallelism_enabled, acc.multi_device) == (False, False, False)
    assert (acc.should_save_model, acc.fp8_backend, acc.context_parallel_rank, acc.pipeline_parallel_rank) == \
        (True, "NO", 0, 0)
    model = _net()
    assert not acc.verify_device_map(model)
    model[2].hf_device_map = {"a": 0, "b": "cpu"}
    assert acc.verify_device_map(model)
    buffers = [torch.arange(6).reshape(1, 6)]
    with acc.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1]):
        assert buffers[0].shape == (1, 6)
    loader = DataLoader(list(range(4)))
    assert acc.deepspeed_ulysses_dl_adapter(loader, model) is loader
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    iteration = acc.save_iteration
    acc.save_state(tmp_path / "ckpt")
    assert acc.save_iteration == iteration + 1
    assert acc.clear(model, opt) == [None, None] and acc._models == []


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_refuses_a_model_and_its_optimizer_prepared_apart(stage):
    """The engine is built from both: ZeRO-2 refuses the model alone, ZeRO-3 (inference-capable) the late optimizer."""
    pytest.importorskip("deepspeed")
    from cadence.utils import DeepSpeedPlugin

    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
    try:
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="model and its optimizer together"):
            acc.prepare_model(net)
            acc.prepare_optimizer(opt)
    finally:
        acc.strategy.teardown()   # the one-process group DeepSpeed needs must not outlive the test


ASYNC_FAILURE = """
import sys, torch
from cadence import Accelerator
acc = Accelerator()
net = torch.nn.Linear(256, 256)
model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
acc.backward(model(torch.randn(8, 256)).square().mean()); opt.step(); opt.zero_grad()
acc.save_state(sys.argv[1], async_save=True)          # the files are larger than the process may write
print("SAVE RETURNED", flush=True)
acc.backward(model(torch.randn(8, 256)).square().mean()); opt.step(); opt.zero_grad()
try:
    acc.end_training()
except OSError as e:
    print("ERROR", type(e).__name__, e, flush=True)
"""


def test_a_failed_async_save_state_is_raised_by_the_next_wait_naming_the_checkpoint(tmp_path):
    """A real write failure (the process's file size limit, as a full disk): save_state(async_save=True) returns,
    end_training raises it naming the checkpoint, and neither the checkpoint nor its staged folder is left."""
    import resource
    import subprocess
    import sys

    from helpers import cadence_env

    target = tmp_path / "ckpt"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # noqa: E731 (256x256 fp32 = 256 KB)
    proc = subprocess.run([sys.executable, "-c", ASYNC_FAILURE, str(target)], capture_output=True, text=True,
                          timeout=120, env=cadence_env(), preexec_fn=limit)
    assert "SAVE RETURNED" in proc.stdout, proc.stdout + proc.stderr
    error = proc.stdout.split("ERROR ", 1)[1] if "ERROR " in proc.stdout else proc.stdout + proc.stderr
    assert str(target) in error and "could not write" in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
