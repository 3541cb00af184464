"""Small models shared by the tests."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from daf.config import Outliers


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


class SmallCNN(nn.Module):
    """conv, BatchNorm, ReLU, pooling and a residual add."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.stem(x)))
        h = F.max_pool2d(h, 2)
        h = F.relu(self.bn2(self.conv(h)) + h)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm, softmax attention, GELU MLP."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def gradients(model: nn.Module, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """All parameter gradients of one loss, flattened into one vector."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, target) if target is not None else out.square().mean()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def narrow_outliers(**fields) -> Outliers:
    """``Outliers`` that splits from 16 channels (its default: 128), the widths these tests' models have."""
    return Outliers(**{"min_channels": 16, **fields})


def node_named(root: torch.Tensor, name: str) -> object:
    """The first autograd node called ``name`` behind ``root`` (depth first)."""
    seen, todo = set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == name:
            return node
        todo.extend(edge[0] for edge in node.next_functions)
    raise AssertionError(f"no {name} behind the output")


def without_rule(model: nn.Module, name: str) -> None:
    """Turn one remake rule off in ``model``'s session (the save is stored as before the rule existed)."""
    import daf
    from daf.runtime.remakes import Remakes

    session = daf.session_of(model)
    assert name in session.remakes.names, (name, session.remakes.names)
    session.remakes = Remakes([rule for rule in session.remakes.rules if rule.name != name])
