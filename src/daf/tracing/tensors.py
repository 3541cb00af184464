"""Which tensor is which: parameters (and views of them), and per-forward tables keyed by a tensor as it is now.

A key is the tensor's address, offset, shape, strides, dtype and device; an entry also keeps
a weak reference and the version counter, so that another tensor at a freed address, or the
same tensor modified in place since, never matches.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["TensorTable", "tensor_key", "parameter_storages", "is_parameter"]


def tensor_key(tensor: torch.Tensor) -> tuple:
    return (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
            tensor.dtype, tensor.device)


class TensorTable:
    """``tensor -> value`` for the tensors of one forward. O(1) per operation."""

    def __init__(self, check_version: bool = True) -> None:
        self._entries: dict[tuple, tuple[weakref.ref, int, Any]] = {}
        self._check_version = check_version

    def get(self, tensor: torch.Tensor) -> Any | None:
        entry = self._entries.get(tensor_key(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        if self._check_version and entry[1] != tensor._version:
            return None
        return entry[2]

    def put(self, tensor: torch.Tensor, value: Any) -> None:
        self._entries[tensor_key(tensor)] = (weakref.ref(tensor), tensor._version, value)

    def clear(self) -> None:
        self._entries.clear()


def parameter_storages(model: torch.nn.Module | None) -> set[int]:
    """The storage addresses of ``model``'s parameters and buffers (empty for None)."""
    if model is None:
        return set()
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


def is_parameter(tensor: torch.Tensor, storages: set[int] = frozenset()) -> bool:
    """A parameter, a leaf that requires grad, or a view of a tensor in ``storages``
    (``parameter_storages``): autograd keeps it alive anyway, so saving it costs nothing."""
    if isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        return True
    return bool(storages) and tensor.untyped_storage().data_ptr() in storages
