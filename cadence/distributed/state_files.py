"""The files of the base checkpoint format: `model.safetensors` (full weights) and `optimizer.pt`.

>>> save_model_file(model.state_dict(), directory); state = load_model_file(directory, model)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..serialization import check_state_dict, load_torch, load_weights, save_torch, save_weights

MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.pt"


def save_model_file(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Write a full model state dict as `directory/model.safetensors` (atomically)."""
    save_weights(state, Path(directory) / MODEL_FILE)


def save_optimizer_file(state: dict, directory: Path) -> None:
    """Write a full optimizer state dict as `directory/optimizer.pt` (atomically)."""
    save_torch(state, Path(directory) / OPTIMIZER_FILE)


def load_model_file(directory: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """Read `directory/model.safetensors`, checked against `model` before anything is loaded."""
    file = Path(directory) / MODEL_FILE
    state = load_weights(file)
    check_state_dict(model, state, source=str(file))
    return state


def load_optimizer_file(directory: Path) -> dict:
    """Read `directory/optimizer.pt` (tensors and plain containers only)."""
    file = Path(directory) / OPTIMIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{directory} has no {OPTIMIZER_FILE}: the checkpoint is incomplete; "
                                f"resume from another checkpoint or load only the weights")
    return load_torch(file)
