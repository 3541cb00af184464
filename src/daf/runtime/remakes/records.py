"""What a remake rule may read of the forward in progress (``Records``, which the session implements)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Records", "ABSENT"]

ABSENT = object()  # record_behind: the node saved None there (an optional tensor it was not given)


class Records(Protocol):
    min_numel: int
    # Typed Any, not by name: the rules' modules import this one (remakes.heads.LinearCalls, blocks.NormCalls)
    linears: Any  # LinearCalls: linear calls of this forward, by their output's node
    norms: Any  # NormCalls: batch and group norm calls of this forward, by their output's node

    def record_of(self, node: Any, output_nr: int, reader: str | None = None) -> Any:
        """The record stored in this forward of output ``output_nr`` of ``node``, if it decodes to that
        tensor for every op (codes read by all, not an exact mask) or for op ``reader``; else None."""

    def remade_output(self, node: Any, output_nr: int) -> Any:
        """The remade save of this forward of output ``output_nr`` of ``node``, else None."""

    def record_behind(self, node: Any, attribute: str) -> Any:
        """What the pack hook returned for the tensor ``node`` saved as ``attribute`` (``ABSENT`` for a
        None there, None where nothing is known)."""

    def readable(self, node: Any) -> bool:
        """Whether ``node``'s saves went through this session's pack hook (reading one only names it)."""

    def relu_mask(self, tensor: torch.Tensor) -> Any:
        """The record of ReLU's exact mask of ``tensor`` (a ReLU output), if one is stored; else None."""

    def hold_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """An exact copy of an attention mask, held until backward."""
