"""Exact copies of the inputs a remake reads in backward that DAF does not own: the attention masks that
attention's probabilities are remade with (``daf.tracing.products.attention_map_of``).

A caller's mask can change before backward where no version counter sees it (``torch.from_numpy`` over
a numpy buffer reused for the next batch, a write through ``.data``), or where one does (a second
forward refreshing the buffer in place before one backward over both). Plain autograd saved the
probabilities and is unaffected by either, so the remake reads a copy taken in forward instead. Every
layer of a model gets the same mask: one copy per forward serves them all, compared element by element
before it is shared (a cheap check beside the attention it serves; the mask's bytes are few:
a broadcast [B, 1, 1, T] padding mask is copied as such).
"""

from __future__ import annotations

import torch

from daf.tracing.products import exact_copy

__all__ = ["MaskCopies"]


class MaskCopies:
    """The copies of this forward's attention masks (the last few distinct ones), so that the layers that
    read an equal mask share one. Owned by a session; ``clear`` at each forward's start and end (the
    remakes keep the copies they took)."""

    __slots__ = ("_copies", "_most")

    def __init__(self, most: int = 4) -> None:
        self._copies: list[torch.Tensor] = []
        self._most = most

    def copy_of(self, mask: torch.Tensor) -> torch.Tensor:
        """An exact copy of ``mask`` no later write to it reaches; O(mask's stored elements)."""
        for copy in self._copies:
            if _same(copy, mask):
                return copy
        copy = exact_copy(mask)
        self._copies = [copy, *self._copies][: self._most]
        return copy

    def clear(self) -> None:
        self._copies = []


def _same(copy: torch.Tensor, mask: torch.Tensor) -> bool:
    return (copy.shape == mask.shape and copy.dtype == mask.dtype and copy.device == mask.device
            and torch.equal(copy, mask))
