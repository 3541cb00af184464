"""ResNet-18 in the CIFAR layout (3x3 stem, no max-pool), defined here because torchvision
does not install beside torch 2.13 on this machine."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

__all__ = ["ResNet18", "BasicBlock"]


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op per line, rebinding `out` (torchvision's style): a nested call keeps its inner results
        # alive in this frame until the outer one returns. Under fp32 autograd holds them anyway; under
        # DAF their stored form is compressed, and a frame holding the full-size tensor undoes that.
        out = self.conv1(x)
        out = self.bn1(out)
        out = F.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = out + self.shortcut(x)
        return F.relu(out)


class ResNet18(nn.Module):
    """ResNet-18 for small images. x: float32 [N, in_channels, H, W] -> logits [N, num_classes].

    >>> ResNet18(num_classes=10)(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, in_planes = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            planes = width * 2**i
            layers.append(nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)))
            in_planes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.linear = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(x)
        out = self.bn1(out)
        out = F.relu(out)
        # Block by block rather than stage by stage: calling a stage (an nn.Sequential) keeps its input,
        # a full-size tensor, alive in the call's arguments until the stage's last block returns.
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                out = block(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)
