"""What a training workload is: a seeded model, a fixed data order, a loss, an evaluation, an optimizer.

Every workload is built from data and weights that installed packages ship, so nothing
reaches the network; two runs with the same seed see the same initial weights and the
same batches in the same order, which is what makes an fp32 run and a DAF run comparable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["Workload", "Batch", "index_stream", "check_positive", "seeded"]

# A batch is whatever the workload's ``loss`` takes: a tuple of tensors or a dict of tensors.
Batch = Any


def check_positive(name: str, value: Any, allow_none: bool = False) -> None:
    """``ValueError`` unless ``value`` is a positive int (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive integer" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_positive_number(name: str, value: Any) -> None:
    """``ValueError`` unless ``value`` is a positive int or float (a learning rate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def index_stream(n: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """``steps`` index tensors int64 [batch_size] into ``range(n)``: seeded epoch permutations, concatenated.

    Epoch ``e`` is ``randperm(n)`` under seed ``seed * 1000003 + e``, so the order depends only on
    ``(n, batch_size, seed)``; a batch may straddle two epochs. O(n) per epoch.

    >>> [t.tolist() for t in index_stream(4, 3, 2, seed=0)] == [t.tolist() for t in index_stream(4, 3, 2, seed=0)]
    True
    """
    check_positive("n", n)
    check_positive("batch_size", batch_size)
    epoch, pool = 0, torch.empty(0, dtype=torch.int64)
    for _ in range(steps):
        while len(pool) < batch_size:
            generator = torch.Generator().manual_seed(seed * 1000003 + epoch)
            pool = torch.cat([pool, torch.randperm(n, generator=generator)])
            epoch += 1
        yield pool[:batch_size]
        pool = pool[batch_size:]


class Workload(ABC):
    """One training job on real data, built fresh and seeded.

    Subclasses set the class attributes and implement the four abstract methods. Data is loaded
    lazily and kept on the instance (never at module level). ``options()`` lists the constructor
    options that shape the run, for the JSON record.

    Attributes:
        name: registry name, e.g. ``"resnet18-fmnist"``.
        summary: one line for ``daf workloads``.
        metric: the headline key of ``evaluate()`` (``"accuracy"`` or ``"eval_loss"``).
        higher_is_better: whether a larger ``metric`` is better.
        default_steps, default_batch: a run long enough to mean something (see docs/results.md).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    metric: ClassVar[str]
    higher_is_better: ClassVar[bool]
    default_steps: ClassVar[int]
    default_batch: ClassVar[int]

    def __init__(self, seed: int = 0, train_size: int | None = None, eval_size: int | None = None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        check_positive("train_size", train_size, allow_none=True)
        check_positive("eval_size", eval_size, allow_none=True)
        self.seed, self.train_size, self.eval_size = seed, train_size, eval_size

    # -- what a subclass provides --------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model in training mode; its initial weights depend only on ``seed``."""

    @abstractmethod
    def batches(self, batch_size: int, steps: int) -> Iterator[Batch]:
        """``steps`` training batches of ``batch_size`` in the fixed order given by ``seed``."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The scalar training loss of ``model`` on ``batch`` (forward pass included)."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Figures on the fixed held-out split, ``metric`` among them; runs under ``no_grad`` in eval mode
        and puts the model back into training mode."""

    def optimizer(self, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer,
                                                                  torch.optim.lr_scheduler.LRScheduler | None]:
        """The default optimizer over the trainable parameters, and an LR schedule stepped once per step."""
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-3), None

    def options(self) -> dict[str, Any]:
        """The options this instance was built with (JSON-ready)."""
        return {"seed": self.seed, "train_size": self.train_size, "eval_size": self.eval_size}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def seeded(seed: int) -> None:
    """Seed torch's global generator (model construction, dropout)."""
    torch.manual_seed(seed)
