"""Which tensor is which: parameters (and views of them), and per-forward tables keyed by a tensor as it is now.

A key is the tensor's address, offset, shape, strides, dtype and device; an entry also keeps
a weak reference and the version counter, so that another tensor at a freed address, or the
same tensor modified in place since, never matches.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from daf.format import dense_order

__all__ = ["TensorTable", "tensor_key", "storage_addresses", "shares_storage", "parameter_storages", "is_parameter",
           "cast_of_parameter", "parameter_of_cast", "frozen_parameter_of_cast", "made_in_call", "is_dense"]


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


def storage_addresses(tensor: torch.Tensor) -> frozenset[int]:
    """The addresses of the storages that hold ``tensor``'s elements: its own storage's, or for a wrapper
    subclass the wrapped tensors' (a DTensor, such as FSDP2's sharded parameters, has no storage of its own:
    reading it raises "invalid python storage"; its local shard has one). 0 for a storage freed or
    resized to nothing (FSDP2's unsharded parameters between uses), which holds no element. O(1) per
    wrapped tensor."""
    if is_traceable_wrapper_subclass(tensor):
        inner = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]  # DTensor's lists its mesh too
        return frozenset().union(*(storage_addresses(t) for t in inner if isinstance(t, torch.Tensor)))
    return frozenset((tensor.untyped_storage().data_ptr(),))


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold elements in one storage (views of one tensor, or one tensor). O(1)."""
    return not storage_addresses(a).isdisjoint(storage_addresses(b) - {0})


def parameter_storages(model: torch.nn.Module | None) -> set[int]:
    """The storage addresses of ``model``'s parameters and buffers (empty for None); for DTensor parameters
    (FSDP2) those of their local shards. Never 0: an empty storage must not make every empty tensor one."""
    if model is None:
        return set()
    return set().union(*(storage_addresses(t) for t in [*model.parameters(), *model.buffers()])) - {0}


def is_parameter(tensor: torch.Tensor, storages: set[int] = frozenset()) -> bool:
    """A parameter (a DTensor one too), a leaf that requires grad, or a view of a tensor in ``storages``
    (``parameter_storages``): autograd keeps it alive anyway, so saving it costs nothing."""
    if isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        return True
    return (bool(storages) and not storages.isdisjoint(storage_addresses(tensor))) or _view_of_leaf(tensor)


def _view_of_leaf(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view (a transpose for a matmul) of a leaf that requires grad, found through
    autograd rather than by address: FSDP2 gathers a parameter into a storage allocated after the forward
    began (so ``parameter_storages`` cannot know it) and frees it after. O(a few nodes)."""
    node = tensor.grad_fn
    for _ in range(_MAX_COPIES):
        if node is None or len(node.next_functions) != 1:
            return False
        node = node.next_functions[0][0]
        if node is not None and type(node).__name__ == "AccumulateGrad":
            return shares_storage(tensor, node.variable)  # a view, not a copy (a clone holds its own storage)
    return False


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


# Views that rearrange the dimensions of their input, replayed from what their nodes save (a view node
# that does not save its arguments, such as ViewBackward0, cannot be replayed: such casts stay raw).
_REARRANGING_VIEWS = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0"})


def parameter_of_cast(tensor: torch.Tensor) -> torch.Tensor | None:
    """The parameter (a leaf that requires grad) that ``tensor`` is an exact cast of, re-viewed: autocast's
    bf16 copy of a weight, transposed for a matmul; else None.

    When it is one, the copy (``tensor``'s base) holds the cast of the parameter's elements in the
    parameter's memory order, so casting the parameter's block of memory and viewing it with ``tensor``'s
    size, strides and offset gives ``tensor`` bit for bit. That holds when the copy is made by one
    ``ToCopyBackward0`` of the dense parameter, or of a transpose or permute of it (found through
    autograd's public ``AccumulateGrad.variable``), with the strides of what it cast (``Tensor.to`` keeps
    a dense input's strides; ``memory_format=`` changes them); when the copy is unchanged since (version 0:
    a change in place, even under no_grad, bumps it); and when it is dense from offset 0 in a storage of
    exactly its elements. A clone, a slice, a cast of a cast or any computation keeps the answer None.
    O(ndim * a few nodes)."""
    base = tensor if tensor._base is None else tensor._base
    node = base.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0" or base._version != 0:
        return None
    found = _cast_input(node)
    if found is None:
        return None
    parameter, views = found
    if (tensor.dtype != base.dtype or not tensor.dtype.is_floating_point or tensor.is_neg()
            or tensor.layout != torch.strided or tensor.is_meta or parameter.layout != torch.strided
            or not is_dense(parameter) or base.storage_offset() != 0
            or base.untyped_storage().nbytes() != base.numel() * base.element_size()
            or not _same_layout(_replay(parameter, views), base)):
        return None
    return parameter


def frozen_parameter_of_cast(tensor: torch.Tensor, args: list[torch.Tensor]) -> torch.Tensor | None:
    """The frozen parameter among ``args`` (the tensors given to the weight op that is saving ``tensor``:
    a linear, matmul or convolution) whose autocast copy ``tensor`` is, or a view of it; else None.

    A frozen weight's copy (LoRA's base weights, a frozen backbone) has no autograd history, so
    ``parameter_of_cast`` cannot see where it came from. These ops take their arguments in one dtype,
    so a save in another dtype than the parameter's was cast inside the call: by autocast, which casts
    each argument to its dtype (``torch.is_autocast_enabled`` cannot tell: the hook runs below autocast's
    dispatch, where it reads False). The copy of the weight is told from the copy of the input by its
    size and strides, which must be the parameter's and no other argument's. That copy is dense from offset 0, unchanged since
    (version 0), and a few of its elements, spread over it, equal the parameter's cast (a guard against a
    tensor that only looks like one, at a cost of microseconds). O(len(args) + 16)."""
    base = tensor if tensor._base is None else tensor._base
    if (tensor.grad_fn is not None or base.grad_fn is not None or not tensor.dtype.is_floating_point
            or base._version != 0 or base.storage_offset() != 0 or tensor.layout != torch.strided
            or base.untyped_storage().nbytes() != base.numel() * base.element_size() or base.numel() == 0):
        return None
    alike = [a for a in args if a is not base and _same_layout((list(a.shape), list(a.stride())), base)]
    if len(alike) != 1:
        return None
    parameter = alike[0]
    if (not isinstance(parameter, torch.nn.Parameter) or parameter.requires_grad or parameter.dtype == tensor.dtype
            or not parameter.dtype.is_floating_point or parameter.device != tensor.device or not is_dense(parameter)):
        return None
    return parameter if _samples_agree(base, parameter) else None


def made_in_call(tensor: torch.Tensor, args: list[torch.Tensor]) -> bool:
    """Whether ``tensor``, saved by the call that got tensors ``args``, is a copy made inside it (a matmul's
    reshaped operand, autocast's cast of an input): no argument shares its memory, so nobody but autograd
    holds it. Not when it has the size of a parameter argument: that may be a weight's copy, never
    quantized (``frozen_parameter_of_cast`` derives the ones it can prove)."""
    return all(not shares_storage(a, tensor) and not (isinstance(a, torch.nn.Parameter) and a.numel() == tensor.numel())
               for a in args)


def _samples_agree(copy: torch.Tensor, parameter: torch.Tensor, count: int = 16) -> bool:
    """Whether ``count`` elements spread over ``copy``'s memory are the cast of ``parameter``'s, bit for bit."""
    numel = copy.numel()
    index = torch.linspace(0, numel - 1, min(count, numel), device=copy.device).long()
    kept = copy.as_strided((numel,), (1,), 0)[index]
    cast = parameter.detach().as_strided((numel,), (1,), parameter.storage_offset())[index].to(copy.dtype)
    return torch.equal(kept.view(torch.int16) if kept.element_size() == 2 else kept,
                       cast.view(torch.int16) if cast.element_size() == 2 else cast)


def _cast_input(node: Any) -> tuple[torch.Tensor, list[Any]] | None:
    """The leaf that ``node`` (a ``ToCopyBackward0``) casts, and the view nodes between them (the leaf's
    first), or None when anything else is between them."""
    views = []
    for _ in range(_MAX_COPIES):
        node = node.next_functions[0][0] if len(node.next_functions) == 1 else None
        name = type(node).__name__
        if name == "AccumulateGrad":
            return node.variable, views[::-1]
        if name not in _REARRANGING_VIEWS:
            return None
        views.append(node)
    return None


def _replay(parameter: torch.Tensor, views: list[Any]) -> tuple[list[int], list[int]]:
    """The sizes and strides of what the cast read: ``parameter`` through ``views``."""
    sizes, strides = list(parameter.shape), list(parameter.stride())
    for view in views:
        name = type(view).__name__
        order = list(range(len(sizes)))
        if name == "PermuteBackward0":
            order = [_dim(d, len(sizes)) for d in view._saved_dims]
        elif len(sizes) >= 2:  # TBackward0 swaps the two dimensions of a matrix (keeps a vector), TransposeBackward0 any two
            first, second = (0, len(sizes) - 1) if name == "TBackward0" else (view._saved_dim0, view._saved_dim1)
            first, second = _dim(first, len(sizes)), _dim(second, len(sizes))
            order[first], order[second] = order[second], order[first]
        sizes, strides = [sizes[d] for d in order], [strides[d] for d in order]
    return sizes, strides


def _dim(saved: int, ndim: int) -> int:
    """A dimension as a node saves it (negative ones wrapped to unsigned 64 bits), in [0, ndim)."""
    signed = saved - 2**64 if saved >= 2**63 else saved
    return signed % max(ndim, 1)


def _same_layout(layout: tuple[list[int], list[int]], base: torch.Tensor) -> bool:
    """Whether ``base`` has these sizes, and these strides wherever a size is above 1 (elsewhere a stride
    places nothing), so that it holds its elements in the same memory order."""
    sizes, strides = layout
    return sizes == list(base.shape) and all(n == 1 or s == t for n, s, t in zip(sizes, strides, base.stride()))


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of memory from its offset, each once, in some order of its
    dimensions (what ``Tensor.to`` keeps the strides of): the test the packed format makes too."""
    return dense_order(tensor) is not None
