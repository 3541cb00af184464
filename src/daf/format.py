"""The packed layout of a compressed activation (format version 1), shared by every codec.

A tensor of ``numel`` elements is read in memory order and cut into groups of
``group_size`` consecutive elements (the last group may be short). Each group
becomes one *row* of ``row_bytes(bits, group_size)`` bytes::

    [lo: bfloat16][step: bfloat16][codes: group_size * bits / 8 bytes]

Codes are packed little-endian inside each byte: element ``j`` of a group sits
in byte ``j // (8 // bits)`` at bit offset ``(j % (8 // bits)) * bits``. The
rows of a tensor follow each other with no gap, so the payload is
``num_groups * row_bytes`` bytes. Elements past ``numel`` in the last group
have code 0. ``docs/format.md`` states the arithmetic that produces the codes.

This module depends on nothing but torch: both the reference codec and the
native kernels are written against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = [
    "FORMAT_VERSION", "ALLOWED_BITS", "META_BYTES", "EXCEPTION_LIMIT", "MIN_STEP", "TINY_LIMIT",
    "Packed", "row_bytes", "num_groups", "payload_bytes", "flatten_memory_order", "restore_memory_order", "dense_order",
    "MASK_INT_VIEW", "mask_bytes",
]

FORMAT_VERSION = 1
# The code widths of format 1: a byte holds a whole number of codes.
ALLOWED_BITS = (1, 2, 4, 8)
META_BYTES = 4
# Elements whose magnitude is above this (and NaN) are stored exactly beside the codes,
# so that lo and step always fit a bfloat16 and never overflow.
EXCEPTION_LIMIT = 2.0**126
# The smallest step: keeps 1/step finite for groups whose range is zero or tiny.
MIN_STEP = 2.0**-126
# A group whose nonzero elements are all below this in magnitude (float32 denormals and their
# neighbours) would lose its scale to MIN_STEP: its nonzero elements are stored exactly instead.
# 2**-100 keeps the step floor's error (2**-127) below float32's own precision (2**-24 relative)
# for every group that is quantized. Encoder rule only: decoding is unchanged (docs/format.md).
TINY_LIMIT = 2.0**-100
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def row_bytes(bits: int, group_size: int) -> int:
    """Bytes of one group's row: 4 bytes of metadata plus its codes. O(1).

    >>> row_bytes(2, 256)
    68
    """
    return META_BYTES + group_size * bits // 8


def num_groups(numel: int, group_size: int) -> int:
    """Groups needed for ``numel`` elements (the last may be short). O(1).

    >>> num_groups(257, 256)
    2
    """
    return -(-numel // group_size)


# 1-bit masks compare and copy bit patterns (NaN, -0.0): the integer type of each mask dtype's width.
MASK_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
                 torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def mask_bytes(numel: int) -> int:
    """Payload bytes of a 1-bit mask of ``numel`` elements. O(1).

    >>> mask_bytes(17)
    3
    """
    return -(-numel // 8)


def payload_bytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of the packed payload of a tensor of ``numel`` elements. O(1).

    >>> payload_bytes(1000, 2, 256)
    272
    """
    return num_groups(numel, group_size) * row_bytes(bits, group_size)


@dataclass
class Packed:
    """A compressed tensor: the payload in the layout above plus what restores its shape.

    ``order`` is the permutation that makes the original tensor contiguous
    (identity for contiguous tensors, NHWC for channels_last); decoding applies
    its inverse so that strides come back as they were. ``exc_index`` and
    ``exc_value`` hold, in memory order, the elements stored exactly (NaN, Inf,
    magnitudes above ``EXCEPTION_LIMIT``, nonzeros of groups below ``TINY_LIMIT``);
    both are None when there are none.
    """

    payload: torch.Tensor
    shape: tuple[int, ...]
    order: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    group_size: int
    exc_index: torch.Tensor | None = None
    exc_value: torch.Tensor | None = None
    # ``bits`` over the width the policy gave the tensor: 2 for a norm input split by a ReLU mask (codes at
    # twice the width on part of it, ``daf.codec.split``), so that demotion's ``min_bits`` means the same
    width_scale: ClassVar[int] = 1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes held: payload plus the exceptions side table."""
        extra = 0
        if self.exc_index is not None:
            extra = self.exc_index.nbytes + self.exc_value.nbytes
        return self.payload.nbytes + extra


def flatten_memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` as a 1-D contiguous tensor in memory order, and the permutation used.

    Dense tensors whose strides are a permutation of contiguous ones (channels_last,
    transposes) are read without a copy; other views are made contiguous first.
    O(1) for dense tensors, O(numel) otherwise.
    """
    order = dense_order(x)
    if order is None:
        return x.contiguous().reshape(-1), tuple(range(x.dim()))
    return x.permute(order).reshape(-1), order


def restore_memory_order(flat: torch.Tensor, shape: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``flatten_memory_order``: same shape, strides in the same order as the original."""
    permuted_shape = tuple(shape[d] for d in order)
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return flat.view(permuted_shape).permute(inverse)


def dense_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """Dimensions sorted by decreasing stride if ``x`` is dense and non-overlapping, else None."""
    if x.is_contiguous():
        return tuple(range(x.dim()))
    order = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), d)))
    expected = 1
    for d in reversed(order):
        if x.size(d) != 1 and x.stride(d) != expected:
            return None
        expected *= x.size(d)
    return order
