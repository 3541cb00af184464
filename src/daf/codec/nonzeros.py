"""The nonzeros of a ReLU output, and the output rebuilt from them and ReLU's own 1-bit mask.

A ReLU output saved by a later op (the next convolution) may be stored as codes of its
nonzeros only: its zeros come exactly from the mask that ReLU's own save stored
(``daf.codec.mask.encode_relu_mask``), which also gives their positions, the shape,
strides order and dtype. Both directions are one op each (``daf::relu_nonzeros``,
``daf::mask_scatter``): C++ kernels on CPU once built, plain PyTorch otherwise, same results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from daf.codec.mask import MaskPacked, _ops
from daf.format import Packed, flatten_memory_order, restore_memory_order

__all__ = ["nonzeros_of", "scatter_nonzeros", "decode_nonzeros"]


def nonzeros_of(x: torch.Tensor, min_count: int) -> torch.Tensor | None:
    """The elements of ``x`` that are > 0, in memory order (the mask's order), or None when ``x`` holds
    anything but zeros and positives (a NaN: neither > 0 nor 0, so not where the mask says) or fewer
    than ``min_count`` positives. x: floating [*] -> x.dtype [count]. O(numel): on the kernels one
    counting pass (which refuses) and one compaction pass, no temporaries."""
    flat, _ = flatten_memory_order(x.detach())
    nonzeros, ok = _ops().relu_nonzeros(flat)
    if not bool(ok) or nonzeros.numel() < max(min_count, 1):
        return None
    return nonzeros


def scatter_nonzeros(nonzeros: torch.Tensor, mask: MaskPacked, site: str) -> torch.Tensor:
    """The ReLU output whose ``nonzeros`` are given: zeros where ``mask`` (its ReLU mask) says so.
    O(numel), read straight from the mask's bits (no bool tensor, no separate count).

    Raises ``RuntimeError`` naming ``site`` when the counts disagree: never returns wrong data."""
    try:
        flat = _ops().mask_scatter(nonzeros.to(mask.dtype).reshape(-1), mask.payload, mask.numel)
    except ValueError as error:
        raise RuntimeError(f"DAF: the record of site {site} holds {nonzeros.numel()} nonzeros but its ReLU mask "
                           f"disagrees ({error}); refusing to return wrong data") from error
    return restore_memory_order(flat, mask.shape, mask.order)


def decode_nonzeros(packed: Packed, mask: MaskPacked, site: str, decode: Callable[[Packed], torch.Tensor]) -> torch.Tensor:
    """The ReLU output whose nonzeros ``packed`` holds (``decode`` decodes it) and whose ReLU mask is ``mask``.

    float32 format-1 codes without exceptions go through one op (``daf::nonzeros_decode_scatter``:
    on the kernels one pass, no compact tensor between decode and scatter); any other record is decoded,
    then scattered. Same values either way. Raises ``RuntimeError`` naming ``site`` when the counts disagree."""
    exceptions = packed.exc_index is not None and packed.exc_index.numel() > 0
    if type(packed) is not Packed or exceptions or packed.dtype != torch.float32 or mask.dtype != torch.float32:
        return scatter_nonzeros(decode(packed), mask, site)
    try:
        flat = _ops().nonzeros_decode_scatter(packed.payload.reshape(-1), packed.numel, packed.bits, packed.group_size,
                                              mask.payload, mask.numel)
    except ValueError as error:
        raise RuntimeError(f"DAF: the record of site {site} holds {packed.numel} nonzeros but its ReLU mask "
                           f"disagrees ({error}); refusing to return wrong data") from error
    return restore_memory_order(flat, mask.shape, mask.order)
