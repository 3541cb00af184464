"""1-bit masks: exact storage for tensors that hold two values, and for ReLU's saved output.

Two cases, both safe whatever the consumer is:

* A tensor whose elements take at most two distinct values (dropout's scaled noise
  ``{0, 1/(1-p)}``, boolean masks) is stored as one bit per element plus the two
  values: decoding gives back the same bits (lossless, the sign of zero included).
* ReLU's own saved output: ``relu`` saves its result only for ``threshold_backward``,
  which reads nothing but ``result > 0``. That save alone is stored as the bit
  ``x > 0`` and decodes to 0/1. Other ops that save the same tensor (the next
  convolution) get their own record: the session never shares a ReLU mask.

>>> x = torch.tensor([0.0, 1.25, 1.25, 0.0, 1.25])
>>> p = encode_mask(x, two_values(x))
>>> p.payload.numel(), torch.equal(decode_mask(p), x)
(1, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from daf.format import Packed, flatten_memory_order, restore_memory_order

__all__ = ["MaskPacked", "two_values", "encode_mask", "encode_relu_mask", "decode_mask", "mask_bits", "mask_bytes",
           "MASK_DTYPES"]

_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16, torch.bool: torch.uint8}
MASK_DTYPES = tuple(_INT_VIEW)
_SAMPLE = 4096


@dataclass
class MaskPacked(Packed):
    """A ``Packed`` whose payload is one bit per element (little-endian in each byte, memory order).

    Element ``j`` decodes to ``high`` where its bit is set and to ``low`` elsewhere.
    ``bits`` is 1 and ``group_size`` 0 (there are no groups); a mask is never demoted.
    """

    low: float = 0.0
    high: float = 1.0


def mask_bytes(numel: int) -> int:
    """Payload bytes of a mask of ``numel`` elements. O(1).

    >>> mask_bytes(17)
    3
    """
    return -(-numel // 8)


def two_values(x: torch.Tensor) -> tuple[float, float] | None:
    """``(low, high)`` if every element of ``x`` is bit-for-bit one of two values, else None.

    x: float16|bfloat16|float32|float64|bool [*]. Looks at the first 4096 elements in
    memory order before reading the rest, so most tensors are refused in O(4096).
    ``low`` is the value of the first element. O(numel) worst case.
    """
    if x.dtype not in _INT_VIEW or x.numel() == 0 or x.is_meta:
        return None
    flat, _ = flatten_memory_order(x.detach())
    codes = flat.view(_INT_VIEW[x.dtype])
    first = codes[:1]
    for part in (codes[:_SAMPLE], codes):
        other = part != first
        hits = torch.nonzero(other)
        if hits.numel() == 0:
            if part.numel() == codes.numel():
                value = _scalar(flat[0])
                return value, value
            continue
        second = part[hits[0, 0]]
        if not bool(((part == first) | (part == second)).all()):
            return None
        pick = flat[: part.numel()]
        low, high = _scalar(pick[0]), _scalar(pick[int(hits[0, 0])])
        if part.numel() == codes.numel():
            return low, high
    return None  # pragma: no cover - the loop returns on its last pass


def _scalar(t: torch.Tensor) -> float:
    return bool(t) if t.dtype == torch.bool else float(t)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [n] -> uint8 [ceil(n / 8)], bit ``j % 8`` of byte ``j // 8``."""
    n = bits.numel()
    padded = torch.zeros(mask_bytes(n) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (padded.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(payload: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    return ((payload.view(-1, 1) >> shifts) & 1).view(-1)[:numel].bool()


def encode_mask(x: torch.Tensor, values: tuple[float, float]) -> MaskPacked:
    """Store a two-valued ``x`` exactly; ``values`` is ``two_values(x)``. O(numel).

    x: [*] of a dtype in ``MASK_DTYPES`` -> MaskPacked with payload uint8 [ceil(numel / 8)].
    """
    if values is None:
        raise ValueError("encode_mask needs the two values of x (two_values(x)); got None: x has more than two")
    flat, order = flatten_memory_order(x.detach())
    low, high = values
    codes = flat.view(_INT_VIEW[x.dtype])
    bits = codes != codes[:1]  # the first element holds ``low``: compare bit patterns, NaN and -0.0 included
    return MaskPacked(_pack_bits(bits), tuple(x.shape), order, x.dtype, 1, 0, low=low, high=high)


def encode_relu_mask(result: torch.Tensor) -> MaskPacked:
    """ReLU's saved output as the bit ``result > 0``; decodes to 0/1 in ``result.dtype``. O(numel).

    Only ``threshold_backward`` may read it: it looks at nothing but ``result > 0``.
    """
    if not result.dtype.is_floating_point:
        raise ValueError(f"encode_relu_mask takes ReLU's floating-point output, got {result.dtype}")
    flat, order = flatten_memory_order(result.detach())
    return MaskPacked(_pack_bits(flat > 0), tuple(result.shape), order, result.dtype, 1, 0, low=0.0, high=1.0)


def mask_bits(packed: MaskPacked) -> torch.Tensor:
    """The mask's bits in memory order: bool [numel] (for a ReLU mask, where the output is > 0). O(numel)."""
    return _unpack_bits(packed.payload, packed.numel)


def decode_mask(packed: MaskPacked) -> torch.Tensor:
    """The tensor of ``packed``: ``high`` where the bit is set, ``low`` elsewhere; same shape and strides order."""
    bits = _unpack_bits(packed.payload, packed.numel)
    low = torch.tensor(packed.low, dtype=packed.dtype, device=bits.device)
    high = torch.tensor(packed.high, dtype=packed.dtype, device=bits.device)
    flat = torch.where(bits, high, low)
    return restore_memory_order(flat, packed.shape, packed.order)
