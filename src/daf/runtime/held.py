"""Norm inputs held as they are until the op after the norm is known, then split by its ReLU mask.

A batch or group norm's input is saved before the ReLU that may follow the norm has run. The session
holds it (at most ``MOST_HELD`` at a time, each one activation for one or two ops); when a ReLU saves its
mask and its input is the norm's output (``relu(norm(x))``) or a sum of norm outputs
(``relu(norm(x) + shortcut)``), each held input behind it is coded split by that mask
(``daf.codec.split``: codes at twice the width where the mask passes the gradient, group means elsewhere)
and keeps a reference to the mask's record, which it decodes with. An input no ReLU claims is coded as
plain codes when a third is held, when the forward ends or when backward asks for it first.

The split assumes what a CNN block does: the norm's output is read by the ReLU path only, so its gradient
is zero where the mask is. A norm output that something else also reads gets its input's masked-out
elements back as group means; the gradient audit (``daf.runtime.audit``) measures what that costs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from daf.codec import Spec
from daf.format import dense_order
from daf.runtime.records import Saved

__all__ = ["Held", "HeldInputs", "MOST_HELD", "NORM_NODES", "SPLIT_READERS", "keeps_held", "norms_under_relu",
           "splittable"]

MOST_HELD = 2  # a ResNet block with a downsampling shortcut holds two (bn2's and the shortcut norm's input)
NORM_NODES = frozenset({"NativeBatchNormBackward0", "NativeGroupNormBackward0"})
SPLIT_READERS = frozenset({"batch_norm", "group_norm"})  # ops that may read a split record (its others: means)
# Saves between a norm and its ReLU that leave the held inputs held: the norm's own, a shortcut's conv and norm
_BETWEEN = frozenset({*SPLIT_READERS, "conv1d", "conv2d", "conv3d"})


@dataclass(eq=False)
class Held:
    """A norm input waiting for its ReLU: the record handed to autograd, the tensor, how it is coded plainly
    (``codec``, ``spec``), its importance and report row."""

    saved: Saved
    tensor: torch.Tensor
    codec: str
    spec: Spec
    importance: float
    row: int = -1


class HeldInputs:
    """The held norm inputs of the forwards in progress, oldest first. Thread-safe: two threads may run
    forward on one wrapped model at once, and each entry is taken by exactly one of them."""

    def __init__(self) -> None:
        self._held: list[Held] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def add(self, held: Held) -> Held | None:
        """Hold ``held``; returns the oldest one when that makes more than ``MOST_HELD`` (to be coded plainly)."""
        with self._lock:
            self._held.append(held)
            return self._held.pop(0) if len(self._held) > MOST_HELD else None

    def take(self, saved: Any) -> Held | None:
        """The held entry of record ``saved``, removed; None if ``saved`` is not held."""
        with self._lock:
            for i, held in enumerate(self._held):
                if held.saved is saved:
                    return self._held.pop(i)
        return None

    def take_all(self) -> list[Held]:
        with self._lock:
            held, self._held = self._held, []
        return held


def keeps_held(op: Any) -> bool:
    """Whether a save by ``op`` (an ``OpCall`` or None) may come between a norm and the ReLU after it."""
    return op is None or op.is_relu or op.name in _BETWEEN


def norms_under_relu(relu_output: torch.Tensor) -> list[Any]:
    """The batch or group norm nodes whose output a ReLU output is ``relu`` of, alone or summed:
    ``relu(norm(x))`` -> [norm]; ``relu(norm(x) + norm2(y))`` -> [norm, norm2]; ``relu(norm(x) + y)`` -> [norm]."""
    node = relu_output.grad_fn
    if node is None or type(node).__name__ != "ReluBackward0":
        return []
    below, output_nr = node.next_functions[0]
    if below is not None and type(below).__name__ == "AddBackward0" and output_nr == 0:
        operands = list(below.next_functions)
    else:
        operands = [(below, output_nr)]
    return [n for n, nr in operands if n is not None and nr == 0 and type(n).__name__ in NORM_NODES]


def splittable(x: torch.Tensor, relu_output: torch.Tensor) -> bool:
    """Whether ``x`` lines up element for element with the ReLU output's mask: same shape and device, both
    dense in the same memory order."""
    if x.shape != relu_output.shape or x.device != relu_output.device or not x.dtype.is_floating_point:
        return False
    order = dense_order(relu_output)
    return order is not None and dense_order(x) == order
