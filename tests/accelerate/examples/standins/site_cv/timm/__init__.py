"""Offline stand-in for `timm.create_model("resnet50d", pretrained=True, num_classes=n)`, as cv_example uses it.

The "pretrained" backbone is fixed (no download): each image's mean colour per channel, then a linear
classifier (`get_classifier()`, zero: chance until trained) the example trains; `default_cfg` carries ImageNet's mean and std.
"""

from __future__ import annotations

import torch
from torch import nn


class ColourNet(nn.Module):
    default_cfg = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}

    def __init__(self, num_classes: int):
        super().__init__()
        self.stem = nn.Conv2d(3, 3, kernel_size=1)          # the frozen "pretrained" part
        with torch.no_grad():
            self.stem.weight.copy_(torch.eye(3)[:, :, None, None])
            self.stem.bias.zero_()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(3, num_classes)
        nn.init.zeros_(self.fc.weight)                      # a new head: chance until trained
        nn.init.zeros_(self.fc.bias)

    def get_classifier(self) -> nn.Module:
        return self.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stem(x)).flatten(1))


def create_model(name: str, pretrained: bool = False, num_classes: int = 1000, **_ignored) -> nn.Module:
    if name != "resnet50d":
        raise ValueError(f"offline stand-in for timm has only 'resnet50d', not {name!r}")
    return ColourNet(num_classes)
