"""A norm's input split by the ReLU mask that follows it: codes of the elements where the mask passes the
gradient, one mean per group of the others.

In ``relu(norm(x) [+ shortcut])`` the gradient reaching the norm is zero wherever ReLU's mask is. The norm's
backward then reads ``x`` at those elements only through sums over the whole batch (or group) and one
term per element that a per-group mean carries well: the elements that matter are the mask's. So ``x``
is stored as format-1 codes of its masked-in elements at twice the width plain codes would have, plus
one float32 mean per ``group_size`` of the rest (the C++ kernels ``daf::split_by_mask`` and
``daf::split_decode`` on a CPU, their plain-PyTorch reference elsewhere: same results); with about half the elements on each side that costs
what plain codes of the whole tensor cost, and the next convolution's input (remade from ``x`` by rule
``norm_block``) gets four times the levels. The mask is not stored again: ReLU's own 1-bit record
(``mask``, a ``MaskPacked`` in ``x``'s memory order) is read at encode and at decode. Measured: docs/results.md.

A ``SplitPacked`` is the masked-in elements' ``Packed`` (shape ``(count,)``: what the store pages, spills
and demotes) with what restores ``x`` beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from daf.codec.mask import MaskPacked, _ops
from daf.format import Packed, flatten_memory_order, num_groups, restore_memory_order

__all__ = ["SplitPacked", "split_means", "encode_split", "encode_split_codes", "decode_split", "reencode_split",
           "mask_count"]


CHUNK_ELEMENTS = 1 << 20  # elements of held codes decoded at a time into the two halves (4 MiB of float32)


@dataclass
class SplitPacked(Packed):
    """Codes of ``x``'s masked-in elements (this ``Packed``'s own fields) and ``negative_means`` float32
    [ceil(others / group_size)], the mean of each run of ``group_size`` other elements in memory order;
    ``full_shape``, ``full_order``: ``x``'s shape and strides order."""

    full_shape: tuple[int, ...] = ()
    full_order: tuple[int, ...] = ()
    negative_means: torch.Tensor | None = None
    width_scale: ClassVar[int] = 2  # codes at twice the policy's width: demotion's min_bits counts half

    @property
    def full_numel(self) -> int:
        n = 1
        for s in self.full_shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return super().nbytes + (self.negative_means.nbytes if self.negative_means is not None else 0)


def split_means(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """The mean of each run of ``group_size`` elements of 1-D ``values`` (the last run may be shorter),
    in float32. O(numel), no copy of ``values`` (a padded copy was a third of a norm input at the forward's
    peak where the split is made)."""
    n = values.numel()
    whole = n // group_size * group_size
    means = values[:whole].view(-1, group_size).sum(1, dtype=torch.float32) / group_size
    if whole < n:
        tail = values[whole:].sum(dtype=torch.float32).reshape(1) / (n - whole)
        means = torch.cat([means, tail])
    return means


def encode_split(x: torch.Tensor, mask: MaskPacked, encode_flat: Callable[[torch.Tensor], Packed],
                 group_size: int) -> SplitPacked | None:
    """``x`` split by ``mask`` (a ReLU mask record of ``x``'s shape, in its memory order): ``encode_flat``
    codes the masked-in elements (a 1-D tensor). None when the other elements' means are not finite (an
    infinite element there): plain codes keep such a tensor (as exceptions). O(numel): one pass splits
    (``daf::split_by_mask``)."""
    flat, order = flatten_memory_order(x.detach())
    _check_mask(mask, tuple(x.shape), order)
    halves = list(_ops().split_by_mask(flat, mask.payload))
    del flat
    return _coded(halves, encode_flat, group_size, tuple(x.shape), order)


def encode_split_codes(held: Packed, mask: MaskPacked, decode_flat: Callable[[Packed], torch.Tensor],
                       encode_flat: Callable[[torch.Tensor], Packed], group_size: int,
                       chunk: int = CHUNK_ELEMENTS) -> SplitPacked | None:
    """``encode_split`` of the tensor that format-1 codes ``held`` hold, decoded ``chunk`` elements at a time
    into the two halves: the whole tensor is never decoded at once (a held norm input decoded to float32 was
    the split's extra at the forward's peak, 24.5 MiB on resnet18-fmnist's layer 1). Same result as
    ``encode_split(decode(held), ...)``."""
    shape, order, n = tuple(held.shape), tuple(held.order), held.numel
    _check_mask(mask, shape, order)
    # Whole groups (a power of two, 16 at least: Config), so that every chunk starts on a byte of the mask
    rows_per_chunk = max(1, chunk // held.group_size)
    count = mask_count(mask.payload, n)
    device = held.payload.device
    kept, others = torch.empty(count, dtype=held.dtype, device=device), torch.empty(n - count, dtype=held.dtype, device=device)
    rows = held.payload.view(num_groups(n, held.group_size), -1)
    done_kept = done_others = 0
    for first in range(0, rows.shape[0], rows_per_chunk):
        start, end = first * held.group_size, min(n, (first + rows_per_chunk) * held.group_size)
        part = _rows(held, rows[first:first + rows_per_chunk], start, end)
        k, o = _ops().split_by_mask(decode_flat(part), mask.payload[start // 8:-(-end // 8)])
        kept[done_kept:done_kept + k.numel()] = k
        others[done_others:done_others + o.numel()] = o
        done_kept, done_others = done_kept + k.numel(), done_others + o.numel()
    halves = [kept, others]
    del kept, others
    return _coded(halves, encode_flat, group_size, shape, order)


def mask_count(payload: torch.Tensor, n: int) -> int:
    """Set bits among the first ``n`` of a little-endian bit array (``daf::mask_count``). O(n / 8)."""
    return int(_ops().mask_count(payload[: -(-n // 8)], n))


def _rows(held: Packed, rows: torch.Tensor, start: int, end: int) -> Packed:
    """Elements ``start:end`` of ``held`` (whole groups) as a ``Packed`` of their own: its rows and exceptions."""
    index = value = None
    if held.exc_index is not None:
        inside = (held.exc_index >= start) & (held.exc_index < end)
        if bool(inside.any()):
            index, value = held.exc_index[inside] - start, held.exc_value[inside]
    return Packed(rows.reshape(-1), (end - start,), (0,), held.dtype, held.bits, held.group_size, index, value)


def _check_mask(mask: MaskPacked, shape: tuple[int, ...], order: tuple[int, ...]) -> None:
    if tuple(mask.shape) != shape or tuple(mask.order) != order:
        raise ValueError(f"encode_split takes a mask of x's shape {list(shape)} and memory order {list(order)}; "
                         f"got {list(mask.shape)}, {list(mask.order)}")


def _coded(halves: list[torch.Tensor], encode_flat: Callable[[torch.Tensor], Packed], group_size: int,
           shape: tuple[int, ...], order: tuple[int, ...]) -> SplitPacked | None:
    """The record from ``halves`` = [kept, others], taken out of the list so that the others are freed once
    their means are made, before the codes of the kept ones (the forward's peak is here)."""
    others = halves.pop()
    kept = halves.pop()
    means = split_means(others, group_size)
    del others
    if not bool(torch.isfinite(means).all()):
        return None
    inner = encode_flat(kept)
    fields = {name: getattr(inner, name) for name in ("payload", "shape", "order", "dtype", "bits", "group_size",
                                                       "exc_index", "exc_value")}
    return SplitPacked(**fields, full_shape=shape, full_order=order, negative_means=means)


def decode_split(packed: SplitPacked, mask: MaskPacked, decode_flat: Callable[[Packed], torch.Tensor],
                 site: str) -> torch.Tensor:
    """The tensor ``packed`` holds: decoded codes where ``mask`` is set, the group means elsewhere; same shape
    and strides order. Raises ``RuntimeError`` naming ``site`` when the mask does not match the record
    (never returns wrong data). O(numel): one pass for float32 codes (``daf::split_decode``)."""
    n = packed.full_numel
    if mask.numel != n:
        raise RuntimeError(f"DAF: the record of site {site} holds {n} elements but the ReLU mask it was split by has "
                           f"{mask.numel}; refusing to return wrong data")
    try:
        flat = _joined(packed, mask, decode_flat)
    except ValueError as error:
        raise RuntimeError(f"DAF: the record of site {site} holds {packed.numel} of {n} elements as codes but the "
                           f"ReLU mask it was split by disagrees ({error}); refusing to return wrong data") from error
    return restore_memory_order(flat, packed.full_shape, packed.full_order)


def _joined(packed: SplitPacked, mask: MaskPacked, decode_flat: Callable[[Packed], torch.Tensor]) -> torch.Tensor:
    """The record flat, in memory order: float32 codes without exceptions in one pass (``daf::split_decode``);
    any other record decoded, its values put in place, the means beside them."""
    exceptions = packed.exc_index is not None and packed.exc_index.numel() > 0
    if packed.dtype == torch.float32 and not exceptions:
        return _ops().split_decode(packed.payload.reshape(-1), packed.numel, packed.bits, packed.group_size,
                                   packed.negative_means, mask.payload, mask.numel)
    n = packed.full_numel
    kept = _ops().mask_scatter(decode_flat(packed).reshape(-1), mask.payload, n)
    means = packed.negative_means.to(packed.dtype).repeat_interleave(packed.group_size)[:n - packed.numel]
    return kept.add_(_ops().mask_scatter(means, _inverted(mask.payload, n), n))


def _inverted(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """The mask's bits flipped, the last byte's padding bits left clear."""
    inverted = torch.bitwise_not(bits)
    if numel % 8:
        inverted[-1] &= (1 << (numel % 8)) - 1
    return inverted


def reencode_split(packed: SplitPacked, reencode: Callable[[Packed], Packed]) -> SplitPacked:
    """``packed`` with its codes re-coded by ``reencode`` (demotion to fewer bits); the means as they are."""
    inner = reencode(Packed(packed.payload, packed.shape, packed.order, packed.dtype, packed.bits, packed.group_size,
                            packed.exc_index, packed.exc_value))
    return SplitPacked(inner.payload, inner.shape, inner.order, inner.dtype, inner.bits, inner.group_size,
                       inner.exc_index, inner.exc_value, packed.full_shape, packed.full_order, packed.negative_means)
