"""What every codec is: ``encode(tensor, spec) -> Packed`` and ``decode(packed) -> tensor``.

``Spec`` carries everything an encoder may need, in one value, so that no path (the
background packer included) can drop a field on the way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from daf.format import Packed

__all__ = ["Spec", "Codec"]


@dataclass(frozen=True)
class Spec:
    """How to encode one tensor.

    ``bits``: code width (1 for masks); ``seed``: of stochastic rounding; ``consumer``: the name of the
    op saving the tensor, when known (DIVISION treats only convolutional feature maps); ``values``: the
    two values of a two-valued tensor (``daf.codec.mask.two_values``), for the exact mask codec.
    """

    bits: int
    seed: int = 0
    consumer: str | None = None
    values: tuple[float, float] | None = None


class Codec(Protocol):
    """One stored form. ``packed_type`` is what ``encode`` returns and what ``decode`` is dispatched on."""

    name: str
    packed_type: type[Packed]

    def encode(self, x: torch.Tensor, spec: Spec) -> Packed: ...

    def decode(self, packed: Packed) -> torch.Tensor: ...
