"""Port of Accelerate's test_utils/scripts/test_script.py (the import swapped to cadence).

A prepared loader deals its batches to the processes in turn, as Accelerate's does: gathering
every step gives the dataset in order. The single-process baseline trains on exactly the
(gathered) batches a distributed step saw.
"""

import contextlib
import io
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cadence import Accelerator, DistributedDataParallelKwargs, PartialState, set_seed   # was: from accelerate import ...
from regression import RegressionDataset, RegressionModel


def process_execution_check():
    accelerator = Accelerator()
    path = Path("check_main_process_first.txt")
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            time.sleep(0.1)  # the main process takes longest, yet writes first
            path.open("a+").write("Currently in the main process\n")
        else:
            path.open("a+").write("Now on another process\n")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        text = path.read_text()
        path.unlink()
        assert text.startswith("Currently in the main process\n"), "Main process was not first"
        assert text.count("Now on another process\n") == accelerator.num_processes - 1
    accelerator.wait_for_everyone()
    for decorate, expected in ((accelerator.on_main_process, accelerator.is_main_process),
                               (accelerator.on_local_main_process, accelerator.is_local_main_process),
                               (accelerator.on_last_process, accelerator.is_last_process)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            decorate(lambda: print(f"Printing from {accelerator.process_index}"))()
        assert out.getvalue() == (f"Printing from {accelerator.process_index}\n" if expected else "")
    for idx in range(accelerator.num_processes):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            accelerator.on_process(lambda: print("me"), process_index=idx)()
        assert out.getvalue() == ("me\n" if idx == accelerator.process_index else "")


def dl_preparation_check():
    accelerator = Accelerator()
    n = accelerator.num_processes
    length = 32 * n
    dl = accelerator.prepare(DataLoader(range(length), batch_size=8))
    result = torch.cat([accelerator.gather(batch) for batch in dl])
    assert torch.equal(result.cpu(), torch.arange(length)), f"Wrong non-shuffled dataloader result: {result}"
    assert sorted(result.tolist()) == list(range(length))
    dl = accelerator.prepare(DataLoader(range(length), batch_size=8, shuffle=True))
    result = torch.cat([accelerator.gather(batch) for batch in dl]).tolist()
    assert sorted(result) == list(range(length)), "Wrong shuffled dataloader result."
    assert result != list(range(length))
    accelerator.print("Dataloader preparation passing.")


def training_check():
    accelerator = Accelerator()
    n, batch_size = accelerator.num_processes, 8
    train_set = RegressionDataset(length=batch_size * 4 * n, seed=42)
    set_seed(42)
    dl = accelerator.prepare(DataLoader(train_set, batch_size=batch_size, shuffle=True))
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    baseline = RegressionModel()
    base_opt = torch.optim.SGD(baseline.parameters(), lr=0.1)
    for _ in range(3):
        for batch in dl:
            optimizer.zero_grad()
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            # the same step in one process, on the batches every process saw together
            x, y = accelerator.gather((batch["x"], batch["y"]))
            base_opt.zero_grad()
            F.mse_loss(baseline(x), y).backward()
            base_opt.step()
    model = accelerator.unwrap_model(model).cpu()
    torch.testing.assert_close(baseline.a, model.a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(baseline.b, model.b, atol=1e-6, rtol=1e-6)
    assert abs(model.a.item() - 2) < 1 and abs(model.b.item() - 3) < 1.5, "did not learn y = 2x + 3"
    accelerator.print("Training yielded the same results on one CPU or distributed setup.")

    accelerator = Accelerator(split_batches=True)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(train_set, batch_size=batch_size * n)
    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    assert dl.batch_size == batch_size and len(dl) == 4
    accelerator.print("split_batches splits the global batch.")

    # cadence addition: the kwargs handler reaches DistributedDataParallel
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model = accelerator.prepare(RegressionModel())
    assert n == 1 or model.find_unused_parameters is True


def test_split_between_processes():
    state = PartialState()
    n, i = state.num_processes, state.process_index
    with state.split_between_processes(list(range(2 * n))) as results:
        assert results == [2 * i, 2 * i + 1]
    for data in (list(range(2 * n)), list(range(2 * n - 1))):
        with state.split_between_processes(data, apply_padding=True) as results:
            assert len(results) == math.ceil(len(data) / n)
            gathered = Accelerator().gather_object(results)
        assert gathered[:len(data)] == data
    data = {"a": [1, 2, 3, 4, 5, 6, 7, 8], "b": list("abcdefgh"), "c": torch.arange(1, 9)}
    with state.split_between_processes(data) as results:
        k = 8 // n
        assert results["a"] == data["a"][i * k:(i + 1) * k] and results["b"] == data["b"][i * k:(i + 1) * k]
        assert torch.equal(results["c"], data["c"][i * k:(i + 1) * k])
    with state.split_between_processes(list(range(17))) as results:
        assert len(results) == 17 // n + (i < 17 % n)
    state.wait_for_everyone()


def test_trigger():
    accelerator = Accelerator()
    assert accelerator.check_trigger() is False
    if accelerator.is_main_process:
        accelerator.set_trigger()
    assert accelerator.check_trigger() is True      # seen by every process
    assert accelerator.check_trigger() is False     # and reset


def main():
    process_execution_check()
    dl_preparation_check()
    training_check()
    test_split_between_processes()
    test_trigger()
