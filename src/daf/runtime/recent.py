"""The tensors backward decoded last, kept while their records live, so that a second reader does not decode again.

A tensor saved by two ops (a ReLU output that the next conv saves too; a norm's input, which the norm
saves and from which its output is remade for the next linear) is usually unpacked twice close together.
One slot would do if nothing came between; in a LoRA layer the adapter's small input is decoded between
the remake of the norm's output and the norm's own backward, and evicted the norm's input. So there are two
slots: the last decoded tensor, and beside it the last one at most ``SMALL`` of its size, which does not
evict it. What this holds beyond one decoded tensor is thus at most a sixteenth of it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["RecentDecodes", "SMALL"]

SMALL = 1 / 16  # a decode this fraction of the large slot's bytes, or less, takes the small slot


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class RecentDecodes:
    """Up to two decoded tensors by their record (held weakly: a record's death drops its tensor)."""

    def __init__(self) -> None:
        self._large: tuple[weakref.ref, torch.Tensor] | None = None
        self._small: tuple[weakref.ref, torch.Tensor] | None = None

    def get(self, record: Any) -> torch.Tensor | None:
        for slot in (self._large, self._small):
            if slot is not None and slot[0]() is record:
                return slot[1]
        return None

    def put(self, record: Any, tensor: torch.Tensor) -> None:
        entry = (weakref.ref(record, self._forget), tensor)
        if self._large is not None and _nbytes(tensor) <= SMALL * _nbytes(self._large[1]):
            self._small = entry
        else:
            self._large, self._small = entry, None

    def clear(self) -> None:
        self._large = self._small = None

    def __len__(self) -> int:
        return (self._large is not None) + (self._small is not None)

    def _forget(self, dead: weakref.ref) -> None:
        if self._large is not None and self._large[0] is dead:
            self._large = None
        if self._small is not None and self._small[0] is dead:
            self._small = None
