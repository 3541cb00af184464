"""``resnet18-fmnist``: the project's ResNet-18 (1-channel stem) on Fashion-MNIST, SGD with a one-cycle LR.

Data: the Debian package ``dataset-fashion-mnist`` (60k train, 10k test). The default run is
the one in REFERENCE.md section 4: 400 steps of batch 128, SGD momentum 0.9, weight decay 5e-4,
one-cycle LR peaking at 0.1, seed 0, evaluated on the whole 10k test split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from daf.workloads.base import check_positive, check_positive_number, seeded
from daf.workloads.fashion_mnist import load_fashion_mnist, normalize
from daf.workloads.image_classification import ImageClassification
from daf.workloads.resnet import ResNet18

__all__ = ["ResNet18FashionMNIST"]


class ResNet18FashionMNIST(ImageClassification):
    """ResNet-18 (CIFAR layout, ``width`` channels in the first stage) on Fashion-MNIST 28x28.

    Options: ``width`` (64 is the standard ResNet-18; 16 is a quick demo), ``max_lr`` of the one-cycle schedule.
    """

    name = "resnet18-fmnist"
    summary = "ResNet-18 on Fashion-MNIST (Debian dataset-fashion-mnist), SGD + one-cycle LR, top-1 accuracy"
    default_steps = 400
    default_batch = 128

    def __init__(self, seed: int = 0, train_size: int | None = None, eval_size: int | None = None,
                 width: int = 64, max_lr: float = 0.1) -> None:
        super().__init__(seed, train_size, eval_size)
        check_positive("width", width)
        check_positive_number("max_lr", max_lr)
        self.width, self.max_lr = width, float(max_lr)

    def _load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (*load_fashion_mnist("train", pixels=True), *load_fashion_mnist("test", pixels=True))

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        return normalize(images)

    def build_model(self) -> nn.Module:
        seeded(self.seed)
        return ResNet18(num_classes=10, in_channels=1, width=self.width).train()

    def optimizer(self, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
        optimizer = torch.optim.SGD(model.parameters(), lr=self.max_lr, momentum=0.9, weight_decay=5e-4)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.max_lr, total_steps=max(steps, 2))
        return optimizer, schedule

    def options(self) -> dict[str, Any]:
        return {**super().options(), "width": self.width, "max_lr": self.max_lr}
