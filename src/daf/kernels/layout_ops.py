"""The channels-last copy of a restored activation as a PyTorch operator under ``torch.ops.daf``.

The pattern of ``daf.kernels.ops``: the op is defined once by its schema, the plain-PyTorch batched
transpose below is its default implementation (any device), a fake implementation gives shapes to
FakeTensor, and the C++ kernel (``csrc/transpose.h``) becomes its CPU implementation when the
extension loads (``register_native``). Both copy elements bitwise: the results are equal bit for bit.

- ``daf::channels_last_copy(Tensor x) -> Tensor``: the values of
  ``x.contiguous(memory_format=torch.channels_last)`` for a 4-D ``x``
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["channels_last_copy", "to_channels_last", "transposed", "register_native", "native_registered"]

_OP = "daf::channels_last_copy"
_WIDTHS = (1, 2, 4, 8)

torch.library.define(_OP, "(Tensor x) -> Tensor")


def _check(x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"channels_last_copy takes a 4-D tensor (N, C, H, W), got shape {tuple(x.shape)}")


def _empty_channels_last(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)


def _reference(x: torch.Tensor) -> torch.Tensor:
    """From contiguous NCHW through a batched transpose, which PyTorch runs 2.5x faster than its
    generic channels-last copy; any other layout through that generic copy."""
    _check(x)
    if not x.is_contiguous():
        return x.clone(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    out = _empty_channels_last(x)
    out.permute(0, 2, 3, 1).reshape(n, h * w, c).copy_(x.reshape(n, c, h * w).transpose(1, 2))
    return out


torch.library.register_kernel(_OP, "default", _reference)


@torch.library.register_fake(_OP)
def _fake(x):
    _check(x)
    return _empty_channels_last(x)


def _native_kernel(ext: ModuleType):
    def channels_last_copy(x: torch.Tensor) -> torch.Tensor:
        _check(x)
        if not (x.is_cpu and x.is_contiguous() and x.element_size() in _WIDTHS):
            return _reference(x)
        out = _empty_channels_last(x)
        n, c, h, w = x.shape
        if x.numel():
            ext.channels_last_copy(x.data_ptr(), n, c, h * w, x.element_size(), out.data_ptr())
        return out
    return channels_last_copy


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` in channels-last layout: ``x`` itself when it is already, else ``channels_last_copy(x)``
    (the values of ``x.contiguous(memory_format=torch.channels_last)``)."""
    if x.is_contiguous(memory_format=torch.channels_last):
        return x
    return channels_last_copy(x)


def transposed(m: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``m.t()`` for a 2-D ``m`` [R, C]: the channels-last copy of ``m`` seen as
    [1, R, C, 1] lays it out as [C, R], blockwise (2.4x PyTorch's ``m.t().contiguous()`` at [512, 1536])."""
    if m.dim() != 2:
        raise ValueError(f"transposed takes a 2-D tensor, got shape {tuple(m.shape)}")
    rows, columns = m.shape
    return channels_last_copy(m.reshape(1, rows, columns, 1)).permute(0, 2, 3, 1).reshape(columns, rows)


def channels_last_copy(x: torch.Tensor) -> torch.Tensor:
    """A new channels-last tensor holding ``x``'s values (4-D ``x``, any layout, any device)."""
    return torch.ops.daf.channels_last_copy(x)


def native_registered() -> bool:
    """Whether the C++ kernel is the CPU implementation of the op in this process."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "CPU")


def register_native(ext: ModuleType) -> None:
    """Make the kernel of ``ext`` (the loaded extension) the CPU implementation; once per process."""
    if not native_registered():
        torch.library.register_kernel(_OP, "cpu", _native_kernel(ext))
