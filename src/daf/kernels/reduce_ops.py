"""The largest magnitude of each column as a PyTorch operator under ``torch.ops.daf``.

The pattern of ``daf.kernels.ops``: the op is defined once by its schema, the plain-PyTorch statement
below is its default implementation (any device, any floating dtype), a fake implementation gives
shapes to FakeTensor, and the C++ kernel (``csrc/columns.h``) becomes its CPU implementation for
contiguous float32 when the extension loads (``register_native``). Both give equal values.

- ``daf::column_absmax(Tensor m) -> Tensor``: ``max |m|`` over the rows of a 2-D ``m`` [R >= 1, C],
  [C] in ``m.dtype``, NaN where a column holds a NaN (the Outliers codec's channel magnitudes and
  token scales, ``daf.codec.channel``)
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["column_absmax", "register_native", "native_registered"]

_OP = "daf::column_absmax"

torch.library.define(_OP, "(Tensor m) -> Tensor")


def _check(m: torch.Tensor) -> None:
    if m.dim() != 2 or m.shape[0] < 1 or not m.dtype.is_floating_point:
        raise ValueError(f"column_absmax takes a 2-D floating-point tensor with at least one row, got "
                         f"{m.dtype} of shape {tuple(m.shape)}")


def _reference(m: torch.Tensor) -> torch.Tensor:
    """Two reductions that write nothing of ``m``'s size: ``m.abs().amax(0)`` writes a full-size
    temporary first (2.7x the time at [512, 1536])."""
    _check(m)
    return torch.maximum(m.amax(0), m.amin(0).neg())


torch.library.register_kernel(_OP, "default", _reference)


@torch.library.register_fake(_OP)
def _fake(m):
    _check(m)
    return m.new_empty(m.shape[1])


def _native_kernel(ext: ModuleType):
    def column_absmax(m: torch.Tensor) -> torch.Tensor:
        _check(m)
        if not (m.is_cpu and m.dtype == torch.float32 and m.is_contiguous()):
            return _reference(m)
        out = torch.empty(m.shape[1], dtype=torch.float32)
        ext.column_absmax(m.data_ptr(), m.shape[0], m.shape[1], out.data_ptr())
        return out
    return column_absmax


def column_absmax(m: torch.Tensor) -> torch.Tensor:
    """``max |m|`` over the rows of ``m`` [R >= 1, C]: [C] in ``m.dtype``, NaN where a column holds one."""
    return torch.ops.daf.column_absmax(m)


def native_registered() -> bool:
    """Whether the C++ kernel is the CPU implementation of the op in this process."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(_OP, "CPU")


def register_native(ext: ModuleType) -> None:
    """Make the kernel of ``ext`` (the loaded extension) the CPU implementation; once per process."""
    if not native_registered():
        torch.library.register_kernel(_OP, "cpu", _native_kernel(ext))
