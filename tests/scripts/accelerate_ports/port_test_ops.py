"""Port of Accelerate's test_utils/scripts/test_ops.py (the import swapped to cadence)."""

import torch

from cadence import PartialState, broadcast, gather, pad_across_processes, reduce   # was: from accelerate ...
from cadence import Accelerator


def create_tensor(state):
    return (torch.arange(state.num_processes) + 1.0 + (state.num_processes * state.process_index)).to(state.device)


def main():
    state = PartialState()
    n = state.num_processes
    assert gather(create_tensor(state)).tolist() == list(range(1, n**2 + 1))
    assert Accelerator().gather_object([state.process_index]) == list(range(n))
    tensor = torch.arange(12).view(4, 3).t()
    assert not tensor.is_contiguous() and gather(tensor).shape == (3 * n, 4)
    assert broadcast(create_tensor(state)).tolist() == list(range(1, n + 1))
    tensor = torch.arange(n + 1) if state.is_main_process else torch.arange(n)
    padded = pad_across_processes(tensor)
    assert padded.shape == (n + 1,)
    if not state.is_main_process:
        assert padded.tolist() == list(range(n)) + [0]
    if n == 2:
        assert reduce(create_tensor(state), "sum").tolist() == [4.0, 6.0]
        assert reduce(create_tensor(state), "mean").tolist() == [2.0, 3.0]
        assert Accelerator().reduce(create_tensor(state), "max").tolist() == [3.0, 4.0]
    state.print("ops passing")
