"""DIVISION (dual activation precision, ICML'23): a bf16 low-frequency part plus a quantized residual.

For a 4-D activation ``x`` [N, C, H, W]::

    low  = avg_pool2d(x, 8, stride=8, ceil_mode=True)      bfloat16 [N, C, ceil(H/8), ceil(W/8)]
    high = x - upsample_nearest(low)                         quantized by the minmax codec at ``bits``
    x'   = decode(high) + upsample_nearest(low)

Backward mostly needs the low-frequency content of activation maps, which ``low`` keeps
in 16 bits; the residual is centred on zero with a small range, so its groups quantize
finely. Cost per element: ``bits`` + 32/``group_size`` (the residual's format-1 rows) +
16/64 (``low``). Other tensors (not 4-D, or smaller than one 8x8 block per plane) use the
minmax codec unchanged.

The residual is an ordinary format-1 ``Packed`` (same ``numel``, bits and group size as
``x``), so the page pool stores and spills it like any record; ``low`` rides along in the
record's header, counted in its side bytes. Demotion (``reencode``) re-quantizes the
residual at fewer bits and keeps ``low``.

>>> import daf
>>> codec = DivisionCodec(MinMaxCodec(daf.Config(backend="reference")))
>>> x = torch.randn(2, 3, 16, 16)
>>> p = codec.encode(x, Spec(2, seed=0))
>>> isinstance(p, DivisionPacked), tuple(p.low.shape), codec.decode(p).shape
(True, (2, 3, 2, 2), torch.Size([2, 3, 16, 16]))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from daf.codec.minmax import MinMaxCodec
from daf.codec.spec import Spec
from daf.format import Packed

__all__ = ["DivisionCodec", "DivisionPacked", "BLOCK", "SPATIAL_CONSUMERS", "split", "join"]

BLOCK = 8
# The ops whose saved 4-D input is a convolutional feature map. Other 4-D tensors (attention
# probabilities [batch, heads, query, key]) are not images: padding makes exact zeros there that
# the residual turns into noise (MiniLM's relative gradient error went from 1.07 to 356).
SPATIAL_CONSUMERS = frozenset({"conv1d", "conv2d", "conv3d", "batch_norm", "relu", "relu_", "max_pool2d",
                               "avg_pool2d", "adaptive_avg_pool2d"})


@dataclass
class DivisionPacked(Packed):
    """The residual's format-1 record plus ``low``: bfloat16 [N, C, ceil(H/8), ceil(W/8)]."""

    low: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return super().nbytes + (self.low.nbytes if self.low is not None else 0)

    @classmethod
    def of(cls, residual: Packed, low: torch.Tensor) -> "DivisionPacked":
        """The record of ``residual`` (a format-1 ``Packed``) with ``low`` beside it."""
        return cls(**{f.name: getattr(residual, f.name) for f in dataclasses.fields(Packed)}, low=low)

    def residual(self) -> Packed:
        """The format-1 record of the residual alone."""
        return Packed(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Packed)})


def _applies(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.shape[-1] * x.shape[-2] >= 2 and x.numel() > 0


def _upsample(low: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Nearest upsampling of ``low`` by BLOCK, cropped to ``shape``. O(numel)."""
    h, w = shape[-2], shape[-1]
    up = low.to(dtype).repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return up[..., :h, :w]


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low bfloat16 [N, C, ceil(H/8), ceil(W/8)], high x.dtype [N, C, H, W]) with
    ``high = x - upsample(low)``. O(numel)."""
    if not _applies(x):
        raise ValueError(f"split takes a 4-D activation [N, C, H, W] with H * W >= 2, got shape {tuple(x.shape)}")
    x = x.detach()
    # ceil_mode averages a partial block over the elements inside the map
    low = F.avg_pool2d(x.float(), BLOCK, stride=BLOCK, ceil_mode=True).to(torch.bfloat16)
    high = x - _upsample(low, x.shape, x.dtype)
    return low, high


def join(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``high + upsample(low)``: the inverse of ``split`` up to the residual's quantization. O(numel)."""
    return high + _upsample(low, high.shape, high.dtype)


class DivisionCodec:
    """DIVISION for convolutional feature maps, ``minmax`` (whose backend it shares) for everything else."""

    packed_type = DivisionPacked

    def __init__(self, minmax: MinMaxCodec) -> None:
        self.minmax = minmax

    @property
    def name(self) -> str:
        return f"division/{self.minmax.backend.name}"

    def encode(self, x: torch.Tensor, spec: Spec) -> Packed:
        """DIVISION for a 4-D ``x``, unless ``spec.consumer`` (the op saving it, when known) is not one of
        ``SPATIAL_CONSUMERS``; minmax otherwise."""
        if not _applies(x) or (spec.consumer is not None and spec.consumer not in SPATIAL_CONSUMERS):
            return self.minmax.encode(x, spec)
        low, high = split(x)
        return DivisionPacked.of(self.minmax.encode(high, spec), low)

    def decode(self, packed: Packed) -> torch.Tensor:
        if isinstance(packed, DivisionPacked):
            return join(packed.low, self.minmax.decode(packed.residual()))
        return self.minmax.decode(packed)

    def reencode(self, packed: Packed, bits: int, seed: int) -> Packed:
        """The residual at fewer ``bits``; ``low`` is kept as it is."""
        if not isinstance(packed, DivisionPacked):
            return self.minmax.reencode(packed, bits, seed)
        return DivisionPacked.of(self.minmax.reencode(packed.residual(), bits, seed), packed.low)
