"""Outlier channels exact, the rest in format-1 codes: the residual stream of a trained transformer.

A trained LM's hidden states have a few channels (dimensions) hundreds of times larger than the
others; a group of 256 consecutive elements of a token then spans an outlier's range, and 2-bit
codes round every other element of the group to its minimum. For a save ``x`` [..., C] (2-D or 3-D,
``C >= Outliers.min_channels``, 128 by default) seen as ``m`` [R, C] (R = rows = tokens)::

    outliers = the k = ceil(fraction * C) channels of largest max |m|      int64 [k], ascending
    exact    = m[:, outliers]                                              x.dtype [R, k]
    axis "channel" (default): s = max |m[r, inliers]| per row (float32 [R]); format-1 codes of
                    (m[:, inliers] / s).T, [C - k, R]: a group runs along the tokens of a channel
                    (its size the largest power of two <= G dividing R), each token at its own scale
    axis "token":   format-1 codes of m with each outlier column replaced by its nearest inlier
                    column, [R, C]: a group runs along the channels of a token, aligned as in MinMax

The codes are an ordinary format-1 ``Packed`` of that matrix (reference or native kernels,
whatever the session's backend is), so the page pool stores and spills it like any record;
``exact``, ``outliers`` and ``s`` ride in the record's header (side bytes). Cost per element:
``bits + 32 / G`` for the codes plus ``k * dtype_bits / C`` (+ ``32 / C`` for ``s``); with 1% of 576
channels in float32, 0.39 bit. Other saves (1-D; 4-D attention maps and NCHW feature maps; fewer
channels, where that side cost would reach a bit per element) use MinMax unchanged, except an NCHW
feature map read by a convolution at 4 bits or more (a ConvNeXt's LayerNorm output, whose large
channels sit in dimension 1): it is split as ``x.movedim(1, -1)`` and put back after decoding
(``channel_dim`` 1). 2-bit feature maps (``daf.Auto``'s ReLU-CNN path, validated without the split)
are not checked, which saves the pass over them that the check costs. Why per channel with token scales: docs/transformers.md, section 2.
The packed form is format 1's ``Packed`` plus these fields: docs/format.md, "Outlier channels".

>>> import daf
>>> codec = ChannelCodec(MinMaxCodec(daf.Config(backend="reference")), daf.config.Outliers(fraction=0.05, min_channels=16))
>>> x = torch.randn(64, 40); x[:, 7] *= 100
>>> p = codec.encode(x, Spec(2, seed=0))
>>> 7 in p.outlier_index.tolist(), torch.equal(codec.decode(p)[:, 7], x[:, 7])
(True, True)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from daf.codec.derivative import DerivativeCodec, DerivativePacked
from daf.codec.minmax import MinMaxCodec, encode
from daf.codec.spec import Spec
from daf.config import Outliers
from daf.format import Packed

__all__ = ["ChannelCodec", "ChannelPacked", "applies", "channel_dim", "outlier_channels", "split_channels", "join_channels",
           "MIN_CHANNELS", "CHANNELS_LAST_CONSUMERS", "CHANNELS_FIRST_CONSUMERS"]

MIN_CHANNELS = 16
CHANNELS_LAST_CONSUMERS = frozenset({"layer_norm", "linear"})
# Ops that read an [N, C, ...] feature map, whose channels are dimension 1.
CHANNELS_FIRST_CONSUMERS = frozenset({"conv1d", "conv2d", "conv3d"})
# Feature maps coded with fewer bits are not checked for large channels (module docstring).
_CHANNELS_FIRST_MIN_BITS = 4
# Groups along tokens shorter than this cost more metadata than they save in range (32/16 = 2 bits each).
_MIN_TOKEN_GROUP = 16


@dataclass
class ChannelPacked(Packed):
    """Format-1 record of the coded matrix (``shape`` [R, C], or [C - k, R] for axis "channel")
    plus what restores ``x``: ``full_shape``, ``axis``, ``outlier_index`` int64 [k],
    ``outlier_values`` x.dtype [R, k], for axis "channel", ``row_scale`` float32 [R], and ``channel_dim``:
    -1, or 1 where ``x`` was an NCHW feature map split as ``x.movedim(1, -1)`` (``full_shape`` is that
    view's)."""

    full_shape: tuple[int, ...] = ()
    axis: str = "channel"
    outlier_index: torch.Tensor | None = None
    outlier_values: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    channel_dim: int = -1

    @property
    def nbytes(self) -> int:
        side = 0 if self.outlier_index is None else self.outlier_index.nbytes + self.outlier_values.nbytes
        return super().nbytes + side + (0 if self.row_scale is None else self.row_scale.nbytes)

    @classmethod
    def of(cls, coded: Packed, full_shape: tuple[int, ...], axis: str, index: torch.Tensor,
           values: torch.Tensor, row_scale: torch.Tensor | None, channel_dim: int = -1) -> "ChannelPacked":
        return cls(**{f.name: getattr(coded, f.name) for f in dataclasses.fields(Packed)},
                   full_shape=full_shape, axis=axis, outlier_index=index, outlier_values=values,
                   row_scale=row_scale, channel_dim=channel_dim)

    def codes(self) -> Packed:
        """The format-1 record of the coded matrix alone."""
        return Packed(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Packed)})


def applies(x: torch.Tensor, consumer: str | None = None, min_channels: int = MIN_CHANNELS) -> bool:
    """Whether ``x`` is a save the codec splits: [tokens, channels] or [batch, tokens, channels] with at
    least ``min_channels`` channels; 4-D only when a LayerNorm or a Linear reads it (a channels-last map
    [N, H, W, C]), since the last dimension of other 4-D saves (attention maps [B, heads, T, T], feature
    maps [N, C, H, W]) is no channel."""
    dims = (2, 3, 4) if consumer in CHANNELS_LAST_CONSUMERS else (2, 3)
    return x.dim() in dims and x.shape[-1] >= max(min_channels, MIN_CHANNELS) and x.numel() // x.shape[-1] >= 2


def channel_dim(x: torch.Tensor, spec: Spec, min_channels: int = MIN_CHANNELS) -> int | None:
    """The dimension of ``x`` holding the channels the codec may split: -1 where ``applies``, 1 for an
    NCHW feature map [N, C, ...] that a convolution reads at ``_CHANNELS_FIRST_MIN_BITS`` or more; None
    where the codec does not split ``x``."""
    if applies(x, spec.consumer, min_channels):
        return -1
    first = (spec.consumer in CHANNELS_FIRST_CONSUMERS and spec.bits >= _CHANNELS_FIRST_MIN_BITS
             and 3 <= x.dim() <= 5 and x.shape[1] >= max(min_channels, MIN_CHANNELS))
    return 1 if first and x.numel() // x.shape[1] >= 2 else None


def outlier_channels(m: torch.Tensor, count: int, peak: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` channels (columns) of ``m`` [R, C] with the largest max |m|, ascending. O(R * C).

    >>> outlier_channels(torch.tensor([[1.0, -9.0, 2.0], [0.0, 1.0, 3.0]]), 1).tolist()
    [1]
    """
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=m.device)
    peak = (largest_magnitude(m) if peak is None else peak).float().nan_to_num(posinf=float("inf"), nan=float("inf"))
    return torch.topk(peak, count, sorted=False).indices.sort().values


def largest_magnitude(m: torch.Tensor) -> torch.Tensor:
    """max |m| of each column of ``m`` [R, C] (NaN where a NaN is): ``daf.kernels.reduce_ops.column_absmax``,
    imported when first needed (``import daf`` loads no kernels); one pass on the kernels."""
    from daf.kernels.reduce_ops import column_absmax
    return column_absmax(m)


def _channel_ops():
    """``daf.kernels.channel_ops`` (the split and join along axis "channel": one pass each on the kernels),
    imported when first needed (``import daf`` loads no kernels)."""
    from daf.kernels import channel_ops
    return channel_ops


def _inlier_channels(index: torch.Tensor, channels: int) -> torch.Tensor:
    keep = torch.ones(channels, dtype=torch.bool, device=index.device)
    keep[index] = False
    return keep.nonzero().flatten()


def _stand_ins(index: torch.Tensor, channels: int) -> torch.Tensor:
    """For each outlier channel, the nearest inlier channel (left first): its values stand in for the
    outlier's in the codes, so that the outlier widens no group's range. O(C)."""
    inliers = _inlier_channels(index, channels)
    if inliers.numel() == 0:
        return index
    position = torch.searchsorted(inliers, index).clamp(max=inliers.numel() - 1)
    left = inliers[(position - 1).clamp(min=0)]
    right = inliers[position]
    return torch.where((index - left).abs() <= (right - index).abs(), left, right)


def split_channels(x: torch.Tensor, count: int, axis: str, peak: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor | None]:
    """(outlier index int64 [k], outlier values x.dtype [R, k], the matrix to code (contiguous), row scales).

    Axis "token": [R, C] in x.dtype, the outlier columns replaced by their nearest inlier column, so that
    groups stay aligned with tokens as in MinMax; no row scales. Axis "channel": the inlier columns,
    each row divided by its largest |inlier| (float32 [R], 1 for rows of zeros), transposed: float32
    [C - k, R]. The row scales keep a token far larger than the others (an attention sink, ViT's class
    token) from setting the range of every channel's group. O(numel).
    """
    m = x.detach().reshape(-1, x.shape[-1])
    index = outlier_channels(m, count, peak)  # peak: the columns' max |m|, when the caller has it
    values = m.index_select(1, index)
    if axis == "channel":
        coded, scale = _channel_ops().channel_split(m, _inlier_channels(index, m.shape[1]))
        return index, values, coded, scale
    coded = m.clone(memory_format=torch.contiguous_format)
    coded[:, index] = m.index_select(1, _stand_ins(index, m.shape[1]))
    return index, values, coded, None


def join_channels(coded: torch.Tensor, index: torch.Tensor, values: torch.Tensor, full_shape: tuple[int, ...],
                  axis: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``split_channels``: a contiguous tensor of ``full_shape`` and ``values.dtype``. O(numel)."""
    channels = full_shape[-1]
    if axis == "channel":
        restored = _channel_ops().channel_join(coded, scale, _inlier_channels(index, channels), index, values)
        return restored.view(full_shape)
    out = coded.reshape(-1, channels)
    out[:, index] = values
    return out.view(full_shape)


def _joins_from_payload(packed: ChannelPacked) -> bool:
    """Whether the join can read the coded matrix from its payload (``daf::channel_decode_join``, which takes
    other dtypes and shapes through its statement): axis "channel" (float32 codes [C - k, R] in row-major
    order), no side table."""
    return (packed.axis == "channel" and packed.exc_index is None and packed.dtype == torch.float32
            and packed.order == (0, 1) and packed.outlier_values is not None)


def _decoded_and_joined(packed: ChannelPacked) -> torch.Tensor:
    """``join_channels(decode(codes), ...)`` in one op: the same bits, without the decoded matrix in between."""
    index = packed.outlier_index
    inliers = _inlier_channels(index, packed.full_shape[-1])
    restored = _channel_ops().channel_decode_join(packed.payload, packed.bits, packed.group_size, packed.row_scale,
                                                  inliers, index, packed.outlier_values)
    return restored.view(packed.full_shape)


def _token_group(rows: int, group_size: int) -> int:
    """Group size along the tokens of a channel: ``group_size`` if it divides ``rows``, else the largest
    power of two that does (so that no group mixes two channels), unless that is below 16."""
    if rows % group_size == 0:
        return group_size
    divisor = rows & -rows
    return divisor if divisor >= _MIN_TOKEN_GROUP else group_size


class ChannelCodec:
    """Outlier channels exact, the rest coded along ``config.axis``; ``minmax`` (whose backend it shares)
    for saves it does not split; GELU/SiLU inputs as derivative codes when ``config.derivatives``."""

    packed_type = ChannelPacked

    def __init__(self, minmax: MinMaxCodec, config: Outliers) -> None:
        self.minmax = minmax
        self.config = config
        self.derivative = DerivativeCodec(minmax.backend, minmax.group_size)

    @property
    def name(self) -> str:
        return f"outliers/{self.minmax.backend.name}"

    def outlier_count(self, channels: int) -> int:
        """ceil(fraction * channels) (rounded to 6 decimals first: 0.1 * 30 is 3.0000000000000004),
        at least 1 when ``fraction`` > 0, at most ``channels - 1``."""
        fraction = self.config.fraction
        return 0 if fraction == 0 else max(1, min(channels - 1, math.ceil(round(fraction * channels, 6))))

    def readers(self, x: torch.Tensor, spec: Spec) -> frozenset[str] | None:
        """The ops that may share what ``encode(x, spec)`` stores: derivative codes decode to inputs with
        the coded derivative, not to ``x``, so only the op they were made for; anything else: any op."""
        return frozenset({spec.consumer}) if self.consumer_only(x, spec) else None

    def consumer_only(self, x: torch.Tensor, spec: Spec) -> bool:
        """Whether ``encode(x, spec)`` stores derivative codes, for ``spec.consumer``'s backward only."""
        return self.config.derivatives and self.derivative.takes(x, spec)

    def encode(self, x: torch.Tensor, spec: Spec) -> Packed:
        if self.consumer_only(x, spec):
            return self.derivative.encode(x, spec)
        dim = channel_dim(x, spec, self.config.min_channels)
        split = x if dim in (None, -1) else x.movedim(dim, -1)
        peak = None if dim is None else self._peak_if_large(split)
        if peak is None:
            return self.minmax.encode(x, spec)
        axis = self.config.axis
        index, values, coded, scale = split_channels(split, self.outlier_count(split.shape[-1]), axis,
                                                     None if self.config.above == 0 else peak)
        group = self.minmax.group_size
        if axis == "channel":
            group = _token_group(coded.shape[1], group)
        packed = encode(coded, spec.bits, group, self.minmax.rounding, spec.seed, self.minmax.backend)
        return ChannelPacked.of(packed, tuple(split.shape), axis, index, values, scale, dim)

    def _peak_if_large(self, x: torch.Tensor) -> torch.Tensor | bool | None:
        """The columns' max |x| when the largest is at least ``above`` times the median (True, not computed,
        at ``above`` 0: always split); None where there are no large channels (MinMax costs less then).
        The split reuses the magnitudes instead of computing them again."""
        if self.config.above == 0:
            return True
        peak = largest_magnitude(x.detach().reshape(-1, x.shape[-1]))
        large = peak.float()
        return peak if bool(large.max() >= self.config.above * large.median()) else None

    def decode(self, packed: Packed) -> torch.Tensor:
        if isinstance(packed, DerivativePacked):
            return self.derivative.decode(packed)
        if isinstance(packed, ChannelPacked):
            x = _decoded_and_joined(packed) if _joins_from_payload(packed) else join_channels(
                self.minmax.decode(packed.codes()), packed.outlier_index, packed.outlier_values, packed.full_shape,
                packed.axis, packed.row_scale)
            return x if packed.channel_dim == -1 else x.movedim(-1, packed.channel_dim)
        return self.minmax.decode(packed)

    def reencode(self, packed: Packed, bits: int, seed: int) -> Packed:
        """The codes at fewer ``bits``; the outlier channels stay exact; derivative codes stay as they are."""
        if isinstance(packed, DerivativePacked):
            return packed
        if not isinstance(packed, ChannelPacked):
            return self.minmax.reencode(packed, bits, seed)
        coded = encode(self.minmax.decode(packed.codes()), bits, packed.group_size, self.minmax.rounding, seed,
                       self.minmax.backend)
        return ChannelPacked.of(coded, packed.full_shape, packed.axis, packed.outlier_index, packed.outlier_values,
                                packed.row_scale, packed.channel_dim)
