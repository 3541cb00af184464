"""Which tensor is which: parameters (and views of them), and per-forward tables keyed by a tensor as it is now.

A key is the tensor's address, offset, shape, strides, dtype and device; an entry also keeps
a weak reference and the version counter, so that another tensor at a freed address, or the
same tensor modified in place since, never matches.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["TensorTable", "tensor_key", "parameter_storages", "is_parameter", "cast_of_parameter"]


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


# Nodes that only copy, cast or re-view their one input: what autocast makes of a weight.
_COPY_NODES = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                         "ViewBackward0", "UnsafeViewBackward0", "ExpandBackward0", "CloneBackward0"})
_MAX_COPIES = 4


def cast_of_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter cast or re-viewed, with nothing computed (autocast's bf16 copy of
    a weight, transposed for a matmul). Compressing it would quantize the weight that backward multiplies
    every input gradient by: under autocast at 2 bits, gradient cosine 0.88 against 0.95 when it is kept
    (tests/runtime/test_autocast.py). O(1): a few nodes."""
    node = tensor.grad_fn
    for _ in range(_MAX_COPIES):
        if node is None or type(node).__name__ not in _COPY_NODES or len(node.next_functions) != 1:
            return False
        node = node.next_functions[0][0]
        if node is not None and type(node).__name__ == "AccumulateGrad":
            return True
    return False
