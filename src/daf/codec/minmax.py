"""The format-1 codec: any floating-point tensor in, ``Packed`` out, and back. Shapes and memory formats live here."""

from __future__ import annotations

import torch

from daf.codec.backends import REFERENCE, Backend, select_backend
from daf.codec.spec import Spec
from daf.config import Config, stochastic_at
from daf.format import ALLOWED_BITS, FLOAT_DTYPES, Packed, flatten_memory_order, restore_memory_order

__all__ = ["encode", "decode", "MinMaxCodec"]


def encode(x: torch.Tensor, bits: int, group_size: int = 256, rounding: str = "stochastic", seed: int = 0,
           backend: Backend = REFERENCE) -> Packed:
    """Compress ``x`` to ``bits`` per element with per-group min/step.

    x: float32|float16|bfloat16|float64 [*] (any strides) -> Packed; O(numel).

    >>> p = encode(torch.linspace(-1, 1, 1000), bits=2, rounding="nearest")
    >>> p.payload.numel(), p.numel
    (272, 1000)
    """
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"encode takes a floating-point tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {x.dtype}")
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits must be one of {ALLOWED_BITS}, got {bits}")
    stochastic = stochastic_at(rounding, bits)
    flat, order = flatten_memory_order(x.detach())
    payload, exc_index, exc_value = backend.encode_flat(flat, bits, group_size, stochastic, seed)
    return Packed(payload, tuple(x.shape), order, x.dtype, bits, group_size, exc_index, exc_value)


def decode(packed: Packed, backend: Backend = REFERENCE, channels_last: bool = False) -> torch.Tensor:
    """The tensor ``packed`` was made from, up to quantization error; same shape, dtype, device, strides
    order, or channels-last when ``channels_last`` and ``packed`` is a contiguous 4-D tensor's (decoded
    straight into that layout: no second pass over the values)."""
    if channels_last and len(packed.shape) == 4 and packed.order == (0, 1, 2, 3):
        out = torch.empty(packed.shape, dtype=packed.dtype, device=packed.payload.device,
                          memory_format=torch.channels_last)
        return backend.decode_into(packed.payload, packed.bits, packed.group_size, out, packed.exc_index,
                                   packed.exc_value)
    flat = backend.decode_flat(packed.payload, packed.numel, packed.bits, packed.group_size, packed.dtype,
                               packed.exc_index, packed.exc_value)
    return restore_memory_order(flat, packed.shape, packed.order)


class MinMaxCodec:
    """Format-1 codes: per-group min/step, group size, rounding and backend fixed by the Config."""

    packed_type = Packed

    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self.group_size = config.group_size
        self.rounding = config.rounding
        self.backend = backend if backend is not None else select_backend(config.backend)

    @property
    def name(self) -> str:
        return f"minmax/{self.backend.name}"

    def encode(self, x: torch.Tensor, spec: Spec) -> Packed:
        return encode(x, spec.bits, self.group_size, self.rounding, spec.seed, self.backend)

    def decode(self, packed: Packed) -> torch.Tensor:
        return decode(packed, self.backend)

    def reencode(self, packed: Packed, bits: int, seed: int) -> Packed:
        """``packed`` at fewer ``bits`` (demotion under a memory budget)."""
        return self.encode(self.decode(packed), Spec(bits, seed))
