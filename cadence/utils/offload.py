"""Accelerate's offload folder format (`accelerate.utils.offload`): each tensor a raw `<name>.dat` memory map,
`index.json` giving its dtype and shape, for code that writes or reads such a folder itself. cadence's own
`disk_offload` / `load_checkpoint_and_dispatch(offload_folder=...)` write safetensors files instead.

>>> offload_state_dict("offload", {"w": torch.arange(3.0)})
>>> load_offloaded_weight("offload/w.dat", {"dtype": "float32", "shape": [3]})
tensor([0., 1., 2.])
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

__all__ = ["offload_weight", "offload_state_dict", "save_offload_index", "load_offloaded_weight"]


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike,
                   index: dict | None = None) -> dict | None:
    """Write `weight` to `offload_folder/<weight_name>.dat` (bf16 as int16) and add its dtype and shape to
    `index`, which is returned."""
    dtype = None
    if weight.dtype == torch.bfloat16:
        weight, dtype = weight.view(torch.int16), "bfloat16"
    array = weight.detach().cpu().numpy()
    if index is not None:
        index[weight_name] = {"dtype": dtype or str(array.dtype), "shape": list(array.shape)}
    array = array[None] if array.ndim == 0 else array
    stored = np.memmap(os.path.join(offload_folder, f"{weight_name}.dat"), dtype=array.dtype, mode="w+",
                       shape=array.shape)
    stored[:] = array[:]
    stored.flush()
    return index


def save_offload_index(index: dict, offload_folder: str | os.PathLike) -> None:
    """Merge `index` into `offload_folder/index.json` (nothing written for an empty one)."""
    if not index:
        return
    path = os.path.join(offload_folder, "index.json")
    current = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            current = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**current, **index}, f, indent=2)


def offload_state_dict(save_dir: str | os.PathLike, state_dict: dict[str, torch.Tensor]) -> None:
    """Write every tensor of `state_dict` to `save_dir` (`offload_weight`) and their `index.json`."""
    os.makedirs(save_dir, exist_ok=True)
    index: dict = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index)
    save_offload_index(index, save_dir)


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: dict) -> torch.Tensor:
    """The tensor `offload_weight` wrote to `weight_file`, whose `index.json` entry is `weight_info`."""
    shape = tuple(weight_info["shape"]) or (1,)
    bf16 = weight_info["dtype"] == "bfloat16"
    weight = torch.tensor(np.memmap(weight_file, dtype="int16" if bf16 else weight_info["dtype"], shape=shape, mode="r"))
    weight = weight[0] if not weight_info["shape"] else weight
    return weight.view(torch.bfloat16) if bf16 else weight
