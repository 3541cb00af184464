"""Remade records of one forward by the value they remake, so that a second save of that value shares one.

``F.linear`` flattens a 3-D input for each linear that reads it: a LayerNorm's output read by a query's and a
value's LoRA adapter is saved as two tensor objects, views of one value. Remade apart, backward would decode
the norm's input and normalize it once per view. A rule that knows which autograd node's output it remakes
(``Remake.made_by``, behind views) lets the session hand the second save the first one's record, where shape,
dtype and the records it is remade from are the same.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RemadeValues"]


class RemadeValues:
    """``(node, output number) -> (node, (shape, dtype), record)`` for one forward; the node is held with its
    entry, so that its id cannot be reused while the entry lives."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], tuple[Any, tuple, Any]] = {}

    def put(self, remake: Any, tensor: torch.Tensor, record: Any) -> None:
        if remake.made_by is not None:
            node, output_nr = remake.made_by
            self._entries[(id(node), output_nr)] = (node, (tuple(tensor.shape), tensor.dtype), record)

    def get(self, remake: Any, tensor: torch.Tensor) -> Any | None:
        """The record that ``tensor``, remade by ``remake``, equals: the same value, shape, dtype and records."""
        if remake.made_by is None:
            return None
        node, output_nr = remake.made_by
        entry = self._entries.get((id(node), output_nr))
        if entry is None or entry[0] is not node or entry[1] != (tuple(tensor.shape), tensor.dtype):
            return None
        record = entry[2]
        same = len(record.records) == len(remake.records) and all(a is b for a, b in zip(record.records, remake.records))
        return record if same else None

    def clear(self) -> None:
        self._entries.clear()
