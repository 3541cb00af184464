"""The Outliers codec's split and join along axis "channel" as PyTorch operators under ``torch.ops.daf``.

The pattern of ``daf.kernels.ops``: each op is defined once by its schema, the plain-PyTorch statement
below is its default implementation (any device, any floating dtype), a fake implementation gives shapes
to FakeTensor, and the C++ kernel (``csrc/channels.h``) becomes its CPU implementation for float32,
float16 and bfloat16 when the extension loads (``register_native``). Both give the same bits.

- ``daf::channel_split(Tensor m, Tensor inliers) -> (Tensor coded, Tensor scale)``: for ``m`` [R, C] and
  ``inliers`` int64 [n] (ascending channel numbers), ``scale`` float32 [R] = the largest |m[r, inliers]|
  per row (1 where that is NaN, infinite or 0) and ``coded`` float32 [n, R] = ``m[:, inliers].T / scale``
- ``daf::channel_join(Tensor coded, Tensor scale, Tensor inliers, Tensor outliers, Tensor values) -> Tensor``:
  the inverse, [R, n + k] in ``values.dtype``: inlier columns ``coded.T * scale``, outlier columns
  ``values`` [R, k] (through float32, as the codec has always restored them)
- ``daf::channel_decode_join(Tensor payload, int bits, int group_size, Tensor scale, Tensor inliers, Tensor outliers,
  Tensor values) -> Tensor``: ``channel_join`` of the coded [n, R] float32 matrix whose format-1 payload (no
  side table) is given, R = ``scale``'s length: the decode and the join in one pass where R is a multiple of
  8 (the kernel decodes a block of tokens at a time into a buffer that stays in cache), bit for bit
  ``channel_join(format1_decode(payload, ...).view(n, R), ...)``, its statement

Why kernels: the statements are four to five full passes over a save each (docs/kernels.md, "Outlier
channels"); the kernels read the save once and write the result once.
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["channel_split", "channel_join", "channel_decode_join", "register_native", "native_registered"]

_SPLIT = "daf::channel_split"
_JOIN = "daf::channel_join"
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

torch.library.define(_SPLIT, "(Tensor m, Tensor inliers) -> (Tensor coded, Tensor scale)")
torch.library.define(_JOIN, "(Tensor coded, Tensor scale, Tensor inliers, Tensor outliers, Tensor values) -> Tensor")
_DECODE_JOIN = "daf::channel_decode_join"
torch.library.define(_DECODE_JOIN, "(Tensor payload, int bits, int group_size, Tensor scale, Tensor inliers, "
                                   "Tensor outliers, Tensor values) -> Tensor")


def _check_split(m: torch.Tensor, inliers: torch.Tensor) -> None:
    if m.dim() != 2 or not m.dtype.is_floating_point:
        raise ValueError(f"channel_split takes a 2-D floating-point m [tokens, channels], got {m.dtype} of shape "
                         f"{tuple(m.shape)}")
    if inliers.dim() != 1 or inliers.dtype != torch.int64 or inliers.numel() > m.shape[1]:
        raise ValueError(f"channel_split takes int64 inliers [n <= {m.shape[1]}], got {inliers.dtype} of shape "
                         f"{tuple(inliers.shape)}")


def _check_join(coded: torch.Tensor, scale: torch.Tensor, inliers: torch.Tensor, outliers: torch.Tensor,
                values: torch.Tensor) -> None:
    rows = scale.shape[0] if scale.dim() == 1 else -1
    ok = (coded.dim() == 2 and coded.dtype == torch.float32 and scale.dtype == torch.float32 and rows == coded.shape[1]
          and inliers.dim() == 1 and inliers.numel() == coded.shape[0] and outliers.dim() == 1
          and inliers.dtype == torch.int64 and outliers.dtype == torch.int64 and values.dim() == 2
          and tuple(values.shape) == (rows, outliers.numel()) and values.dtype.is_floating_point)
    if not ok:
        raise ValueError("channel_join takes float32 coded [n, R] and scale [R], int64 inliers [n] and outliers [k], "
                         f"floating values [R, k]; got coded {coded.dtype} {tuple(coded.shape)}, scale {scale.dtype} "
                         f"{tuple(scale.shape)}, inliers {tuple(inliers.shape)}, outliers {tuple(outliers.shape)}, "
                         f"values {values.dtype} {tuple(values.shape)}")


def _transposed(m: torch.Tensor) -> torch.Tensor:
    """``daf.kernels.layout_ops.transposed`` (a bitwise copy of ``m.t()``), imported when first needed."""
    from daf.kernels.layout_ops import transposed
    return transposed(m)


def _split_reference(m: torch.Tensor, inliers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transposed first, then whole rows picked: a column gather and a strided transpose are what
    PyTorch does slowly (3.5 -> 1.7 ms at [512, 1536], the same values)."""
    from daf.kernels.reduce_ops import column_absmax
    _check_split(m, inliers)
    coded = _transposed(m).index_select(0, inliers).float()
    scale = column_absmax(coded) if coded.shape[0] else torch.ones(m.shape[0], device=m.device)
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    return coded.div_(scale), scale


def _join_reference(coded: torch.Tensor, scale: torch.Tensor, inliers: torch.Tensor, outliers: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
    """Rows put in place, then one transpose; float32 holds any float16 or bfloat16 outlier exactly."""
    _check_join(coded, scale, inliers, outliers, values)
    rows = torch.empty(inliers.numel() + outliers.numel(), coded.shape[1], dtype=torch.float32, device=coded.device)
    rows.index_copy_(0, inliers, coded * scale)
    rows.index_copy_(0, outliers, values.t().float())
    return _transposed(rows).to(values.dtype)


def _decode_join_reference(payload: torch.Tensor, bits: int, group_size: int, scale: torch.Tensor,
                           inliers: torch.Tensor, outliers: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The decode (``daf::format1_decode``, whichever implementation it has), then the join."""
    rows = scale.shape[0] if scale.dim() == 1 else 0
    coded = torch.ops.daf.format1_decode(payload, inliers.numel() * rows, bits, group_size, torch.float32)
    return torch.ops.daf.channel_join(coded.view(inliers.numel(), rows), scale, inliers, outliers, values)


torch.library.register_kernel(_SPLIT, "default", _split_reference)
torch.library.register_kernel(_JOIN, "default", _join_reference)
torch.library.register_kernel(_DECODE_JOIN, "default", _decode_join_reference)


@torch.library.register_fake(_SPLIT)
def _split_fake(m, inliers):
    _check_split(m, inliers)
    return m.new_empty((inliers.shape[0], m.shape[0]), dtype=torch.float32), m.new_empty(m.shape[0], dtype=torch.float32)


@torch.library.register_fake(_JOIN)
def _join_fake(coded, scale, inliers, outliers, values):
    _check_join(coded, scale, inliers, outliers, values)
    return values.new_empty((coded.shape[1], inliers.shape[0] + outliers.shape[0]))


@torch.library.register_fake(_DECODE_JOIN)
def _decode_join_fake(payload, bits, group_size, scale, inliers, outliers, values):
    return values.new_empty((scale.shape[0], inliers.shape[0] + outliers.shape[0]))


def _every_channel_once(inliers: torch.Tensor, outliers: torch.Tensor, op: str) -> int:
    """The channel count; ValueError unless inliers and outliers name each channel exactly once (else some
    element of a kernel's output would be left unwritten)."""
    channels = inliers.numel() + outliers.numel()
    channel = torch.cat((inliers, outliers))
    if channels and not torch.equal(torch.bincount(channel, minlength=channels), torch.ones_like(channel)):
        raise ValueError(f"{op}: inliers and outliers together must name each of {channels} channels once")
    return channels


def _native_split(ext: ModuleType):
    def split(m: torch.Tensor, inliers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_split(m, inliers)
        if not (m.is_cpu and inliers.is_cpu and m.dtype in _DTYPE_CODES):
            return _split_reference(m, inliers)
        m, inliers = m.contiguous(), inliers.contiguous()
        if inliers.numel() and bool(((inliers < 0) | (inliers >= m.shape[1])).any()):
            raise ValueError(f"channel_split: inliers must be channel numbers in [0, {m.shape[1]})")
        rows = m.shape[0]
        coded = torch.empty(inliers.numel(), rows, dtype=torch.float32)
        scale = torch.empty(rows, dtype=torch.float32)
        nan = ext.channel_split(m.data_ptr(), rows, m.shape[1], _DTYPE_CODES[m.dtype], inliers.data_ptr(),
                                inliers.numel(), coded.data_ptr(), scale.data_ptr())
        if nan and m.dtype != torch.float32:  # which NaN a narrow NaN widens to is PyTorch's cast's choice
            return _split_reference(m, inliers)
        return coded, scale
    return split


def _native_join(ext: ModuleType):
    def join(coded: torch.Tensor, scale: torch.Tensor, inliers: torch.Tensor, outliers: torch.Tensor,
             values: torch.Tensor) -> torch.Tensor:
        _check_join(coded, scale, inliers, outliers, values)
        tensors = (coded, scale, inliers, outliers, values)
        if not (all(t.is_cpu for t in tensors) and values.dtype in _DTYPE_CODES):
            return _join_reference(*tensors)
        if values.dtype != torch.float32 and bool(values.isnan().any()):  # as in split: PyTorch's casts choose NaNs
            return _join_reference(*tensors)
        rows, channels = coded.shape[1], _every_channel_once(inliers, outliers, "channel_join")
        coded, scale, inliers, outliers = (t.contiguous() for t in (coded, scale, inliers, outliers))
        wide = values.float().contiguous()  # float32 holds float16 and bfloat16 exactly
        out = torch.empty(rows, channels, dtype=torch.float32)
        ext.channel_join(coded.data_ptr(), scale.data_ptr(), rows, channels, inliers.data_ptr(), inliers.numel(),
                         outliers.data_ptr(), wide.data_ptr(), outliers.numel(), out.data_ptr())
        # The narrowing cast is torch's own, as in the statement (NaN and rounding as PyTorch does them).
        return out if values.dtype == torch.float32 else out.to(values.dtype)
    return join


def _native_decode_join(ext: ModuleType):
    from daf.kernels.ops import check_payload, native_takes

    def decode_join(payload: torch.Tensor, bits: int, group_size: int, scale: torch.Tensor, inliers: torch.Tensor,
                    outliers: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        rows = scale.shape[0] if scale.dim() == 1 else -1
        tensors = (payload, scale, inliers, outliers, values)
        takes = (all(t.is_cpu for t in tensors) and values.dtype == torch.float32 and scale.dtype == torch.float32
                 and payload.dtype == torch.uint8 and rows >= 0 and rows % 8 == 0
                 and native_takes(torch.float32, True, group_size))
        if not takes:  # other shapes and dtypes: the statement, which checks them
            return _decode_join_reference(*tensors[:1], bits, group_size, *tensors[1:])
        _check_join(torch.empty(inliers.numel(), rows, device="meta"), scale, inliers, outliers, values)
        check_payload(payload, inliers.numel() * rows, bits, group_size)
        channels = _every_channel_once(inliers, outliers, "channel_decode_join")
        payload, scale, inliers, outliers, values = (t.contiguous() for t in tensors)
        out = torch.empty(rows, channels, dtype=torch.float32)
        ext.channel_decode_join(payload.data_ptr(), bits, group_size, scale.data_ptr(), rows, channels,
                                inliers.data_ptr(), inliers.numel(), outliers.data_ptr(), values.data_ptr(),
                                outliers.numel(), out.data_ptr())
        return out
    return decode_join


def channel_split(m: torch.Tensor, inliers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(coded float32 [n, R], scale float32 [R]) of ``m`` [R, C] and its inlier channels (module docstring)."""
    return torch.ops.daf.channel_split(m, inliers)


def channel_join(coded: torch.Tensor, scale: torch.Tensor, inliers: torch.Tensor, outliers: torch.Tensor,
                 values: torch.Tensor) -> torch.Tensor:
    """The [R, n + k] tensor ``channel_split`` and the outlier columns came from, in ``values.dtype``."""
    return torch.ops.daf.channel_join(coded, scale, inliers, outliers, values)


def channel_decode_join(payload: torch.Tensor, bits: int, group_size: int, scale: torch.Tensor, inliers: torch.Tensor,
                        outliers: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``channel_join`` of the coded matrix in the format-1 ``payload`` (module docstring)."""
    return torch.ops.daf.channel_decode_join(payload, bits, group_size, scale, inliers, outliers, values)


def native_registered() -> bool:
    """Whether the C++ kernels are the CPU implementation of the ops in this process."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(_SPLIT, "CPU")


def register_native(ext: ModuleType) -> None:
    """Make the kernels of ``ext`` (the loaded extension) the CPU implementation; once per process."""
    if not native_registered():
        torch.library.register_kernel(_SPLIT, "cpu", _native_split(ext))
        torch.library.register_kernel(_JOIN, "cpu", _native_join(ext))
        torch.library.register_kernel(_DECODE_JOIN, "cpu", _native_decode_join(ext))
