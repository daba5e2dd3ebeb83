"""`Compose`, `RandomResizedCrop`, `Resize`, `ToTensor` on PIL images, as torchvision.transforms defines them."""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from PIL import Image  # noqa: F401  (as torchvision: cv_example calls PIL.Image.open after `import PIL`)


def _size(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, image):
        for t in self.transforms:
            image = t(image)
        return image


class Resize:
    def __init__(self, size):
        self.size = _size(size)

    def __call__(self, image):
        h, w = self.size
        return image.resize((w, h))


class RandomResizedCrop:
    """A random crop of `scale` of the area (aspect 3/4 to 4/3), resized to `size`."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = _size(size), scale, ratio

    def __call__(self, image):
        width, height = image.size
        area = width * height * random.uniform(*self.scale)
        aspect = math.exp(random.uniform(*map(math.log, self.ratio)))
        w = min(width, max(1, round(math.sqrt(area * aspect))))
        h = min(height, max(1, round(math.sqrt(area / aspect))))
        left, top = random.randint(0, width - w), random.randint(0, height - h)
        out_h, out_w = self.size
        return image.crop((left, top, left + w, top + h)).resize((out_w, out_h))


class ToTensor:
    def __call__(self, image):
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()
