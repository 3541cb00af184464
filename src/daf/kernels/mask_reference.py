"""Exact 1-bit masks and a ReLU output's nonzeros, in plain PyTorch: the default implementation of the
``daf::mask_*``/``daf::relu_*`` ops (``daf.kernels.mask_ops``), which the C++ kernels (``csrc/masks.h``)
reproduce byte for byte.

A mask of ``n`` elements is ``ceil(n / 8)`` bytes: bit ``j % 8`` of byte ``j // 8`` belongs to element
``j`` (little-endian in each byte), the last byte zero-padded. Every function takes flat contiguous
tensors in memory order (the codec's business, ``daf.codec.mask``) and works slice by slice: its
temporaries are 1-2 bytes per element of a slice, never of the tensor.

On CPU the bits are packed by numpy's ``packbits``/``unpackbits`` (6x and 30x faster than the torch
shifts: a fallback that stays usable when the C++ kernels do not build); ``pack_slice_torch`` and
``unpack_slice_torch`` are the same functions in plain PyTorch, for every device, and the tests hold
all three byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from daf.format import MASK_INT_VIEW, mask_bytes

__all__ = ["relu_mask_encode", "mask_encode", "mask_second", "mask_unpack", "mask_select", "relu_nonzeros",
           "mask_scatter", "split_by_mask", "split_join", "mask_bytes", "INT_VIEW"]

INT_VIEW = MASK_INT_VIEW
# Elements per slice (a multiple of 8): a whole-tensor bool and its shifted copy would add up to
# 75% of a float32 activation.
CHUNK = 1 << 20


def chunks(numel: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive slices of ``numel`` elements, ``CHUNK`` long (the last shorter)."""
    start, size = 0, CHUNK
    while start < numel:
        yield start, min(start + size, numel)
        start, size = start + size, CHUNK


def relu_mask_encode(x: torch.Tensor) -> torch.Tensor:
    """x: floating [n] -> uint8 [ceil(n / 8)], bit ``not (x <= 0)`` (``threshold_backward``'s test
    negated: NaN gets 1). O(n)."""
    return _pack_bits(x, lambda part: (part <= 0).logical_not_())


def mask_encode(x: torch.Tensor) -> torch.Tensor:
    """x: [n] of a dtype in ``INT_VIEW`` -> uint8 [ceil(n / 8)], bit set where the element differs
    bitwise from ``x[0]`` (NaN and -0.0 compared by their bits). O(n)."""
    codes = x.view(INT_VIEW[x.dtype])
    first = codes[:1]
    return _pack_bits(codes, lambda part: part != first)


# The first slice that mask_second reads: most tensors with more than two values show a third within it.
SAMPLE = 4096


def mask_second(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds at most two bit patterns, and where the second is: x [n >= 1] of a dtype in
    ``INT_VIEW`` -> int64 []: the index of the first element that differs bitwise from ``x[0]``, 0 when
    none does, -1 when ``x`` holds three or more. O(n), and it stops at the slice where a third shows."""
    codes = x.view(INT_VIEW[x.dtype])
    first, second, where = codes[:1], None, 0
    start, size = 0, SAMPLE
    while start < codes.numel():
        part = codes[start:start + size]
        if second is None:
            other = part != first
            if bool(other.any()):
                where = start + int(other.view(torch.uint8).argmax())  # the first element that differs
                second = codes[where:where + 1]
        if second is not None and not bool(((part == first) | (part == second)).all()):
            return torch.tensor(-1, device=x.device)
        start, size = start + size, CHUNK
    return torch.tensor(where, device=x.device)


def mask_unpack(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 [ceil(numel / 8)] -> bool [numel]. O(numel)."""
    out = torch.empty(numel, dtype=torch.bool, device=bits.device)
    for start, end in chunks(numel):
        out[start:end] = _unpack_bits(bits, start, end)
    return out


def mask_count(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """The set bits among the first ``numel``: int64 []. O(numel)."""
    return mask_unpack(bits, numel).sum(dtype=torch.int64)


def mask_select(bits: torch.Tensor, numel: int, values: torch.Tensor) -> torch.Tensor:
    """``values[bit]`` per element: values [2] (low, high) of a dtype in ``INT_VIEW``, copied bitwise
    -> values.dtype [numel]. O(numel)."""
    out = torch.empty(numel, dtype=values.dtype, device=bits.device)
    low, high = values.view(INT_VIEW[values.dtype]).to(bits.device)
    codes = out.view(INT_VIEW[values.dtype])
    # +0.0 and 1.0 (a ReLU mask's values) are the bits converted: 4x faster than selecting
    zero_one = values.dtype.is_floating_point and values[0].item() == 0 and values[1].item() == 1 \
        and not bool(torch.signbit(values[0]))
    for start, end in chunks(numel):
        part = _unpack_bits(bits, start, end)
        if zero_one:
            out[start:end].copy_(part.view(torch.uint8))
        else:
            torch.where(part, high, low, out=codes[start:end])
    return out


def relu_nonzeros(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the elements > 0 of x in order, ok): x floating [n] -> (x.dtype [count], bool []). ``ok`` is
    False, and the values empty, when an element is neither > 0 nor a zero (negative, NaN). O(n)."""
    positive = x > 0
    values = x[positive]
    ok = values.numel() + int((x == 0).sum()) == x.numel()
    return (values if ok else x.new_empty(0)), torch.tensor(ok, device=x.device)


def mask_scatter(values: torch.Tensor, bits: torch.Tensor, numel: int) -> torch.Tensor:
    """``values`` where the bit is set, in order, +0 elsewhere: values [count] -> values.dtype [numel].

    ValueError when the mask does not have exactly ``count`` set bits (never wrong data). O(numel)."""
    positive = mask_unpack(bits, numel)
    check_count(int(positive.sum()), values.numel())
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out[positive] = values
    return out


def split_by_mask(x: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the elements of x whose bit is set, the others), each in memory order: x [n] -> (x.dtype [count],
    x.dtype [n - count]). O(n)."""
    kept = mask_unpack(bits, x.numel())
    return x[kept], x[~kept]


def split_join(kept: torch.Tensor, means: torch.Tensor, group_size: int, bits: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of ``split_by_mask`` with the others given as the means of their runs of ``group_size``:
    kept [count] where the bit is set, ``means[i // group_size]`` at the i-th other element -> kept.dtype
    [numel]. ValueError when the mask does not have exactly ``count`` set bits (never wrong data). O(numel)."""
    mask = mask_unpack(bits, numel)
    check_count(int(mask.sum()), kept.numel())
    out = torch.empty(numel, dtype=kept.dtype, device=kept.device)
    out[mask] = kept
    out[~mask] = means.to(kept.dtype).repeat_interleave(group_size)[:numel - kept.numel()]
    return out


def check_count(set_bits: int, count: int) -> None:
    if set_bits != count:
        raise ValueError(f"the mask has {set_bits} set bits for {count} values")


# ---- bit packing, slice by slice --------------------------------------------------------------

def _pack_bits(flat: torch.Tensor, bit_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """[n] -> uint8 [ceil(n / 8)]: bit ``j % 8`` of byte ``j // 8`` is ``bit_of(flat)[j]``."""
    n = flat.numel()
    payload = torch.empty(mask_bytes(n), dtype=torch.uint8, device=flat.device)
    pack = pack_slice_numpy if flat.device.type == "cpu" else pack_slice_torch
    for start, end in chunks(n):
        payload[start // 8: mask_bytes(end)] = pack(bit_of(flat[start:end]))
    return payload


def pack_slice_torch(bits: torch.Tensor) -> torch.Tensor:
    """bool [m] -> uint8 [ceil(m / 8)], little-endian within each byte, the last byte zero-padded."""
    bits = bits.view(torch.uint8)
    if bits.numel() % 8:
        bits = torch.cat([bits, bits.new_zeros(8 - bits.numel() % 8)])
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def pack_slice_numpy(bits: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(bits.contiguous().numpy(), bitorder="little"))


def _unpack_bits(payload: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """bool [end - start]: bits ``start`` to ``end`` of ``payload`` (``start`` a multiple of 8)."""
    bytes_ = payload[start // 8: mask_bytes(end)]
    if payload.device.type == "cpu":
        return unpack_slice_numpy(bytes_, end - start)
    return unpack_slice_torch(bytes_, end - start)


def unpack_slice_numpy(bytes_: torch.Tensor, count: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(bytes_.contiguous().numpy(), count=count, bitorder="little")).view(torch.bool)


def unpack_slice_torch(bytes_: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bytes_.device)
    return ((bytes_.view(-1, 1) >> shifts) & 1).view(-1)[:count].bool()
