"""The nonzeros of a ReLU output, and the output rebuilt from them and ReLU's own 1-bit mask.

A ReLU output saved by a later op (the next convolution) may be stored as codes of its
nonzeros only: its zeros come exactly from the mask that ReLU's own save stored
(``daf.codec.mask.encode_relu_mask``), which also gives their positions, the shape,
strides order and dtype.
"""

from __future__ import annotations

import torch

from daf.codec.mask import MaskPacked, mask_bits
from daf.format import flatten_memory_order, restore_memory_order

__all__ = ["nonzeros_of", "scatter_nonzeros"]


def nonzeros_of(x: torch.Tensor, min_count: int) -> torch.Tensor | None:
    """The elements of ``x`` that are > 0, in memory order (the mask's order), or None when ``x`` holds
    anything but zeros and positives (a NaN: neither > 0 nor 0, so not where the mask says) or fewer
    than ``min_count`` positives. O(numel)."""
    flat, _ = flatten_memory_order(x.detach())
    nonzeros = flat[flat > 0]
    if nonzeros.numel() < max(min_count, 1) or nonzeros.numel() + int((flat == 0).sum()) != flat.numel():
        return None
    return nonzeros


def scatter_nonzeros(nonzeros: torch.Tensor, mask: MaskPacked, site: str) -> torch.Tensor:
    """The ReLU output whose ``nonzeros`` are given: zeros where ``mask`` (its ReLU mask) says so.

    Raises ``RuntimeError`` naming ``site`` when the counts disagree: never returns wrong data."""
    positive = mask_bits(mask)
    count = int(positive.sum())
    if count != nonzeros.numel():
        raise RuntimeError(f"DAF: the record of site {site} holds {nonzeros.numel()} nonzeros but its "
                           f"ReLU mask has {count} set bits; refusing to return wrong data")
    flat = torch.zeros(positive.numel(), dtype=mask.dtype, device=nonzeros.device)
    flat[positive] = nonzeros.to(mask.dtype)
    return restore_memory_order(flat, mask.shape, mask.order)
