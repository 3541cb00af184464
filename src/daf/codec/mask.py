"""1-bit masks: exact storage for tensors that hold two values, and for ReLU's saved output.

Two cases, both safe whatever the consumer is:

* A tensor whose elements take at most two distinct values (dropout's scaled noise
  ``{0, 1/(1-p)}``, boolean masks) is stored as one bit per element plus the two
  values: decoding gives back the same bits (lossless, the sign of zero included).
* ReLU's own saved output: ``relu`` saves its result only for ``threshold_backward``,
  which reads nothing but whether ``result <= 0`` (it zeroes the gradient there and
  passes it elsewhere, where the output is NaN included). That save alone is stored as
  the bit ``not (x <= 0)`` (``x > 0`` or NaN) and decodes to a bool tensor, which
  ``threshold_backward`` reads as it reads the output (1 byte per element in backward instead
  of 4 for float32, and faster to read and write). Other ops that save
  the same tensor (the next convolution) get their own record: the session never
  shares a ReLU mask.

>>> x = torch.tensor([0.0, 1.25, 1.25, 0.0, 1.25])
>>> p = encode_mask(x, two_values(x))
>>> p.payload.numel(), torch.equal(decode_mask(p), x)
(1, True)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from daf.codec.spec import Spec
from daf.format import MASK_INT_VIEW, Packed, dense_order, flatten_memory_order, mask_bytes, restore_memory_order

__all__ = ["MaskPacked", "ReluMaskPacked", "MaskCodec", "ReluMaskCodec", "two_values", "encode_mask",
           "encode_relu_mask", "decode_mask", "decode_relu_mask", "mask_bits", "mask_bytes", "MASK_DTYPES"]

MASK_DTYPES = tuple(MASK_INT_VIEW)
# Elements read first, as Python ints: three distinct values among them refuse most activations
# with two torch calls instead of the sample's dozen (two_values runs on every coded save).
_HEAD = 16


def _ops() -> Any:
    """``torch.ops.daf`` with the mask ops defined: imported on first use, so that importing daf loads
    nothing. Their CPU implementation is the C++ kernels once the extension is loaded in this process
    (a native or auto codec backend loads it), the plain-PyTorch reference otherwise: same bytes."""
    import daf.kernels.mask_ops  # noqa: F401  (defines the ops)

    return torch.ops.daf


@dataclass
class MaskPacked(Packed):
    """A ``Packed`` whose payload is one bit per element (little-endian in each byte, memory order).

    Element ``j`` decodes to ``high`` where its bit is set and to ``low`` elsewhere.
    ``bits`` is 1 and ``group_size`` 0 (there are no groups); a mask is never demoted.
    """

    low: float = 0.0
    high: float = 1.0


@dataclass
class ReluMaskPacked(MaskPacked):
    """ReLU's own saved output (``encode_relu_mask``): for ``threshold_backward`` only, which takes
    the 0/1 tensor ``decode_relu_mask`` gives in place of the output."""


def two_values(x: torch.Tensor) -> tuple[float, float] | None:
    """``(low, high)`` if every element of ``x`` is bit-for-bit one of two values, else None.

    x: float16|bfloat16|float32|float64|bool [*]. Reads the first 16 elements in memory order first,
    which refuse most activations, then the rest in one pass (``daf::mask_second``: on the kernels,
    no temporaries; the reference stops at the slice where a third value shows). ``low`` is the value
    of the first element. O(numel) worst case.
    """
    if x.dtype not in MASK_INT_VIEW or x.numel() == 0 or x.is_meta:
        return None
    x = x.detach().resolve_neg()  # a negative view's bytes are not its values
    if _head_holds_three(x):
        return None
    flat, _ = flatten_memory_order(x)
    where = int(_ops().mask_second(flat))  # one pass on the kernels (the reference: slices of the tensor)
    if where < 0:
        return None
    return _scalar(flat[0]), _scalar(flat[where])


def _head_holds_three(x: torch.Tensor) -> bool:
    """Whether the first ``_HEAD`` elements of ``x`` (no negative bit) in memory order hold three bit
    patterns or more. A dense CPU tensor's are its first bytes, read as such: the torch calls this took
    (a flattening view, a reinterpreting view, a slice, a list) cost 25-60 us per coded save inside a
    training step."""
    if x.is_cpu and x.layout == torch.strided and (x.is_contiguous() or dense_order(x) is not None):
        width = x.element_size()
        head = ctypes.string_at(x.data_ptr(), min(_HEAD, x.numel()) * width)
        return len({head[i: i + width] for i in range(0, len(head), width)}) > 2
    flat, _ = flatten_memory_order(x)
    return len(set(flat.view(MASK_INT_VIEW[x.dtype])[:_HEAD].tolist())) > 2


def _scalar(t: torch.Tensor) -> float:
    return bool(t) if t.dtype == torch.bool else float(t)


def encode_mask(x: torch.Tensor, values: tuple[float, float]) -> MaskPacked:
    """Store a two-valued ``x`` exactly; ``values`` is ``two_values(x)``. O(numel), one pass
    (``daf::mask_encode``: the bit says whether an element differs bitwise from the first).

    x: [*] of a dtype in ``MASK_DTYPES`` -> MaskPacked with payload uint8 [ceil(numel / 8)].
    """
    if values is None:
        raise ValueError("encode_mask needs the two values of x (two_values(x)); got None: x has more than two")
    flat, order = flatten_memory_order(x.detach().resolve_neg())
    low, high = values
    return MaskPacked(_ops().mask_encode(flat), tuple(x.shape), order, x.dtype, 1, 0, low=low, high=high)


def encode_relu_mask(result: torch.Tensor) -> MaskPacked:
    """ReLU's saved output as the bit ``not (result <= 0)``; decodes to 0/1 in ``result.dtype``. O(numel),
    one pass (``daf::relu_mask_encode``).

    Only ``threshold_backward`` may read it: it zeroes the gradient where ``result <= 0`` and passes
    it elsewhere, so a NaN output (for which ``result > 0`` is false too) gets bit 1, as ``+inf`` does.

    >>> decode_mask(encode_relu_mask(torch.tensor([0.0, 2.0, float("nan"), -0.0]))).tolist()
    [0.0, 1.0, 1.0, 0.0]
    """
    if not result.dtype.is_floating_point:
        raise ValueError(f"encode_relu_mask takes ReLU's floating-point output, got {result.dtype}")
    flat, order = flatten_memory_order(result.detach())
    payload = _ops().relu_mask_encode(flat)  # threshold_backward's own test, negated
    return ReluMaskPacked(payload, tuple(result.shape), order, result.dtype, 1, 0, low=0.0, high=1.0)


def mask_bits(packed: MaskPacked) -> torch.Tensor:
    """The mask's bits in memory order: bool [numel]. O(numel).

    For a ReLU mask, where the output is > 0 or NaN (where its gradient passes)."""
    return _ops().mask_unpack(packed.payload, packed.numel)


def decode_relu_mask(packed: MaskPacked, channels_last: bool = False) -> torch.Tensor:
    """ReLU's saved output as ``threshold_backward`` needs it: 1 where the gradient passes (output > 0
    or NaN), 0 elsewhere, in the output's dtype; same shape and strides order (``channels_last``: see
    ``decode_mask``). O(numel).

    In the output's dtype rather than bool: ``threshold_backward`` casts a bool ``self`` to the
    gradient's dtype inside the call, a full-size copy that cost a ResNet-18 step at batch 128 about
    10 ms and made a float tensor beside the bool one anyway (docs/memory.md).

    >>> decode_relu_mask(encode_relu_mask(torch.tensor([0.0, 2.0, float("nan"), -0.0]))).tolist()
    [0.0, 1.0, 1.0, 0.0]
    """
    return decode_mask(packed, channels_last)


def decode_mask(packed: MaskPacked, channels_last: bool = False) -> torch.Tensor:
    """The tensor of ``packed``: ``high`` where the bit is set, ``low`` elsewhere; same shape and strides
    order. With ``channels_last`` a 4-D record saved NCHW comes back channels-last, written in that
    layout by one pass (the caller copies any other record into the layout it wants)."""
    values = torch.tensor([packed.low, packed.high], dtype=packed.dtype, device=packed.payload.device)
    if channels_last and _nchw(packed):
        return _ops().mask_select_channels_last(packed.payload, list(packed.shape), values)
    flat = _ops().mask_select(packed.payload, packed.numel, values)
    return restore_memory_order(flat, packed.shape, packed.order)


def _nchw(packed: MaskPacked) -> bool:
    return len(packed.shape) == 4 and packed.order == (0, 1, 2, 3)


class MaskCodec:
    """A two-valued tensor, exactly: ``spec.values`` is ``two_values(x)``."""

    name = "mask"
    packed_type = MaskPacked

    def encode(self, x: torch.Tensor, spec: Spec) -> MaskPacked:
        return encode_mask(x, spec.values)

    def decode(self, packed: MaskPacked, channels_last: bool = False) -> torch.Tensor:
        return decode_mask(packed, channels_last)


class ReluMaskCodec(MaskCodec):
    """ReLU's own saved output as the bit ``not (result <= 0)``: for ``threshold_backward`` only. Decoded
    as any mask (``decode_relu_mask`` is ``decode_mask``: 0 and 1 in the output's dtype)."""

    name = "relu_mask"

    packed_type = ReluMaskPacked

    def encode(self, x: torch.Tensor, spec: Spec) -> MaskPacked:
        return encode_relu_mask(x)
