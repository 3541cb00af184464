"""Exact 1-bit masks and a ReLU output's nonzeros as PyTorch operators under ``torch.ops.daf``.

The pattern of ``daf.kernels.ops``: each op is defined once by its schema, the plain-PyTorch
``daf.kernels.mask_reference`` is its default implementation (any device), a fake implementation
gives shapes to FakeTensor and torch.compile, and the C++ kernels (``csrc/masks.h``) become its CPU
implementation when the extension loads (``register_native``). Every implementation returns the
same bytes. All tensors are flat and contiguous, in memory order.

- ``daf::relu_mask_encode(Tensor x) -> Tensor``: uint8 [ceil(n / 8)], bit ``not (x <= 0)``
- ``daf::mask_encode(Tensor x) -> Tensor``: bit set where ``x`` differs bitwise from ``x[0]``
- ``daf::mask_second(Tensor x) -> Tensor``: int64 [], where the second bit pattern of ``x`` is (the first
  element that differs from ``x[0]``; 0 when none does), -1 when ``x`` holds three or more: whether
  ``x`` can be a mask at all, in one pass without temporaries
- ``daf::mask_unpack(Tensor bits, SymInt numel) -> Tensor``: bool [numel]
- ``daf::mask_count(Tensor bits, SymInt numel) -> Tensor``: int64 [], the set bits among the first ``numel``
- ``daf::mask_select(Tensor bits, SymInt numel, Tensor values) -> Tensor``: ``values[bit]``, bitwise
- ``daf::mask_select_channels_last(Tensor bits, SymInt[] shape, Tensor values) -> Tensor``: ``mask_select``
  of a 4-D [n, c, h, w] record whose bits are in NCHW order, returned channels-last (a restored ReLU
  mask in the layout backward uses, without a second pass to transpose it)
- ``daf::relu_nonzeros(Tensor x) -> (Tensor values, Tensor ok)``: the elements > 0 (empty and
  ``ok`` False when one is negative or NaN); the size depends on the data
- ``daf::mask_scatter(Tensor values, Tensor bits, SymInt numel) -> Tensor``: ``values`` where the bit
  is set, +0 elsewhere; ValueError when the count of set bits is not ``values.numel()``
- ``daf::nonzeros_decode_scatter(Tensor payload, SymInt count, int bits, int group_size, Tensor mask,
  SymInt numel) -> Tensor``: ``mask_scatter`` of the float32 ``format1_decode`` of ``count`` values,
  in one pass on the kernels (no compact tensor between the two)
- ``daf::split_by_mask(Tensor x, Tensor bits) -> (Tensor kept, Tensor others)``: the elements whose bit is
  set, then the others, each in memory order (a norm's input split by its ReLU mask, ``daf.codec.split``)
- ``daf::split_decode(Tensor payload, SymInt count, int bits, int group_size, Tensor means, Tensor mask,
  SymInt numel) -> Tensor``: float32 [numel], ``nonzeros_decode_scatter``'s values where the bit is set and
  elsewhere the float32 mean of each run of ``group_size`` others: a split record back, one pass
"""

from __future__ import annotations

from types import ModuleType

import torch

from daf.kernels import mask_reference as reference
from daf.kernels import reference as format_reference
from daf.kernels.ops import check_payload
from daf.kernels.mask_reference import INT_VIEW, check_count, mask_bytes

__all__ = ["register_native", "native_registered", "MASK_OPS"]

MASK_OPS = ("relu_mask_encode", "mask_encode", "mask_second", "mask_unpack", "mask_count", "mask_select", "mask_select_channels_last",
            "relu_nonzeros", "mask_scatter", "nonzeros_decode_scatter", "split_by_mask", "split_decode")
_SCHEMAS = {
    "relu_mask_encode": "(Tensor x) -> Tensor",
    "mask_encode": "(Tensor x) -> Tensor",
    "mask_second": "(Tensor x) -> Tensor",
    "mask_unpack": "(Tensor bits, SymInt numel) -> Tensor",
    "mask_count": "(Tensor bits, SymInt numel) -> Tensor",
    "mask_select": "(Tensor bits, SymInt numel, Tensor values) -> Tensor",
    "mask_select_channels_last": "(Tensor bits, SymInt[] shape, Tensor values) -> Tensor",
    "relu_nonzeros": "(Tensor x) -> (Tensor values, Tensor ok)",
    "mask_scatter": "(Tensor values, Tensor bits, SymInt numel) -> Tensor",
    "nonzeros_decode_scatter": "(Tensor payload, SymInt count, int bits, int group_size, Tensor mask, "
                               "SymInt numel) -> Tensor",
    "split_by_mask": "(Tensor x, Tensor bits) -> (Tensor kept, Tensor others)",
    "split_decode": "(Tensor payload, SymInt count, int bits, int group_size, Tensor means, Tensor mask, "
                    "SymInt numel) -> Tensor",
}
# The kernels' dtype codes for float tests on bit patterns (bindings.cpp, MaskDType).
_FLOAT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}

for _name, _schema in _SCHEMAS.items():
    torch.library.define(f"daf::{_name}", _schema)


def _flat(x: torch.Tensor, what: str) -> None:
    if x.dim() != 1:
        raise ValueError(f"{what} must be a flat (1-D) tensor in memory order, got shape {tuple(x.shape)}")


def _check_bits(bits: torch.Tensor, numel: int) -> None:
    _flat(bits, "bits")
    if bits.dtype != torch.uint8 or bits.numel() != mask_bytes(numel):
        raise ValueError(f"bits must be uint8 [{mask_bytes(numel)}] for {numel} elements, "
                         f"got {bits.dtype} [{bits.numel()}]")


def _check_float(x: torch.Tensor, what: str) -> None:
    _flat(x, what)
    if not x.dtype.is_floating_point:
        raise ValueError(f"{what} must be floating point, got {x.dtype}")


def _check_values(values: torch.Tensor) -> None:
    if values.shape != (2,) or values.dtype not in INT_VIEW:
        raise ValueError(f"values must be (low, high): 2 elements of one of {tuple(INT_VIEW)}, "
                         f"got {values.dtype} {tuple(values.shape)}")


# ---- default implementations: the reference, any device --------------------------------------

def _relu_mask_encode(x: torch.Tensor) -> torch.Tensor:
    _check_float(x, "x")
    return reference.relu_mask_encode(x.contiguous())


def _mask_encode(x: torch.Tensor) -> torch.Tensor:
    _flat(x, "x")
    if x.dtype not in INT_VIEW:
        raise ValueError(f"mask_encode takes one of {tuple(INT_VIEW)}, got {x.dtype}")
    return reference.mask_encode(x.contiguous())


def _check_second(x: torch.Tensor) -> None:
    _flat(x, "x")
    if x.dtype not in INT_VIEW or x.numel() == 0:
        raise ValueError(f"mask_second takes a non-empty tensor of one of {tuple(INT_VIEW)}, got {x.dtype} "
                         f"[{x.numel()}]")


def _mask_second(x: torch.Tensor) -> torch.Tensor:
    _check_second(x)
    return reference.mask_second(x.contiguous())


def _mask_unpack(bits: torch.Tensor, numel: int) -> torch.Tensor:
    _check_bits(bits, numel)
    return reference.mask_unpack(bits, numel)


def _mask_count(bits: torch.Tensor, numel: int) -> torch.Tensor:
    _check_bits(bits, numel)
    return reference.mask_count(bits, numel)


def _mask_select(bits: torch.Tensor, numel: int, values: torch.Tensor) -> torch.Tensor:
    _check_bits(bits, numel)
    _check_values(values)
    return reference.mask_select(bits, numel, values)


def _check_image_shape(shape: list[int]) -> int:
    """The element count of a 4-D [n, c, h, w] shape."""
    if len(shape) != 4 or any(size < 0 for size in shape):
        raise ValueError(f"shape must be 4-D [n, c, h, w] with sizes >= 0, got {list(shape)}")
    n, c, h, w = shape
    return n * c * h * w


def _mask_select_channels_last(bits: torch.Tensor, shape: list[int], values: torch.Tensor) -> torch.Tensor:
    numel = _check_image_shape(shape)
    flat = _mask_select(bits, numel, values)
    return flat.view(list(shape)).contiguous(memory_format=torch.channels_last)


def _relu_nonzeros(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float(x, "x")
    return reference.relu_nonzeros(x)


def _mask_scatter(values: torch.Tensor, bits: torch.Tensor, numel: int) -> torch.Tensor:
    _flat(values, "values")
    _check_bits(bits, numel)
    return reference.mask_scatter(values, bits, numel)


def _check_payload(payload: torch.Tensor, count: int, bits: int, group_size: int) -> None:
    _flat(payload, "payload")
    check_payload(payload, count, bits, group_size)


def _nonzeros_decode_scatter(payload: torch.Tensor, count: int, bits: int, group_size: int, mask: torch.Tensor,
                             numel: int) -> torch.Tensor:
    _check_payload(payload, count, bits, group_size)
    _check_bits(mask, numel)
    values = format_reference.decode_flat(payload, count, bits, group_size, torch.float32, None, None)
    return reference.mask_scatter(values, mask, numel)


def _split_by_mask(x: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _flat(x, "x")
    _check_bits(bits, x.numel())
    return reference.split_by_mask(x, bits)


def _check_split_decode(payload: torch.Tensor, count: int, bits: int, group_size: int, means: torch.Tensor,
                        mask: torch.Tensor, numel: int) -> None:
    _check_payload(payload, count, bits, group_size)
    _check_bits(mask, numel)
    _flat(means, "means")
    others = max(numel - count, 0)
    if means.dtype != torch.float32 or means.numel() != -(-others // group_size):
        raise ValueError(f"means must be float32 [{-(-others // group_size)}] ({others} others in runs of "
                         f"{group_size}), got {means.dtype} [{means.numel()}]")


def _split_decode(payload: torch.Tensor, count: int, bits: int, group_size: int, means: torch.Tensor,
                  mask: torch.Tensor, numel: int) -> torch.Tensor:
    _check_split_decode(payload, count, bits, group_size, means, mask, numel)
    values = format_reference.decode_flat(payload, count, bits, group_size, torch.float32, None, None)
    return reference.split_join(values, means, group_size, mask, numel)


_DEFAULTS = {"relu_mask_encode": _relu_mask_encode, "mask_encode": _mask_encode, "mask_second": _mask_second,
             "mask_unpack": _mask_unpack, "mask_count": _mask_count,
             "mask_select": _mask_select, "mask_select_channels_last": _mask_select_channels_last,
             "relu_nonzeros": _relu_nonzeros, "mask_scatter": _mask_scatter,
             "nonzeros_decode_scatter": _nonzeros_decode_scatter, "split_by_mask": _split_by_mask,
             "split_decode": _split_decode}
for _name, _kernel in _DEFAULTS.items():
    torch.library.register_kernel(f"daf::{_name}", "default", _kernel)


# ---- fake implementations: shapes and dtypes only --------------------------------------------

@torch.library.register_fake("daf::relu_mask_encode")
def _relu_mask_encode_fake(x):
    return x.new_empty(mask_bytes(x.numel()), dtype=torch.uint8)


@torch.library.register_fake("daf::mask_encode")
def _mask_encode_fake(x):
    return x.new_empty(mask_bytes(x.numel()), dtype=torch.uint8)


@torch.library.register_fake("daf::mask_second")
def _mask_second_fake(x):
    return x.new_empty((), dtype=torch.int64)


@torch.library.register_fake("daf::mask_unpack")
def _mask_unpack_fake(bits, numel):
    return bits.new_empty(numel, dtype=torch.bool)


@torch.library.register_fake("daf::mask_count")
def _mask_count_fake(bits, numel):
    return bits.new_empty((), dtype=torch.int64)


@torch.library.register_fake("daf::mask_select")
def _mask_select_fake(bits, numel, values):
    return bits.new_empty(numel, dtype=values.dtype)


@torch.library.register_fake("daf::mask_select_channels_last")
def _mask_select_channels_last_fake(bits, shape, values):
    return bits.new_empty(list(shape), dtype=values.dtype).contiguous(memory_format=torch.channels_last)


@torch.library.register_fake("daf::relu_nonzeros")
def _relu_nonzeros_fake(x):
    count = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(count), x.new_empty((), dtype=torch.bool)


@torch.library.register_fake("daf::mask_scatter")
def _mask_scatter_fake(values, bits, numel):
    return values.new_empty(numel)


@torch.library.register_fake("daf::split_by_mask")
def _split_by_mask_fake(x, bits):
    ctx = torch.library.get_ctx()
    return x.new_empty(ctx.new_dynamic_size()), x.new_empty(ctx.new_dynamic_size())


@torch.library.register_fake("daf::split_decode")
def _split_decode_fake(payload, count, bits, group_size, means, mask, numel):
    return payload.new_empty(numel, dtype=torch.float32)


@torch.library.register_fake("daf::nonzeros_decode_scatter")
def _nonzeros_decode_scatter_fake(payload, count, bits, group_size, mask, numel):
    return payload.new_empty(numel, dtype=torch.float32)


# ---- CPU implementations: the C++ kernels, registered when the extension loads ----------------

def _native_kernels(ext: ModuleType) -> dict:
    unit = ext.mask_unit()

    def relu_mask_encode(x: torch.Tensor) -> torch.Tensor:
        _check_float(x, "x")
        if not x.is_cpu:
            return _relu_mask_encode(x)
        x = x.contiguous()
        out = torch.empty(mask_bytes(x.numel()), dtype=torch.uint8)
        if x.numel():
            ext.relu_mask_encode(x.data_ptr(), x.numel(), _FLOAT_CODES[x.dtype], out.data_ptr())
        return out

    def mask_encode(x: torch.Tensor) -> torch.Tensor:
        _flat(x, "x")
        if x.dtype not in INT_VIEW or not x.is_cpu:
            return _mask_encode(x)
        x = x.contiguous()
        out = torch.empty(mask_bytes(x.numel()), dtype=torch.uint8)
        if x.numel():
            ext.mask_encode(x.data_ptr(), x.numel(), x.element_size(), out.data_ptr())
        return out

    def mask_second(x: torch.Tensor) -> torch.Tensor:
        _check_second(x)
        if not x.is_cpu:
            return _mask_second(x)
        x = x.contiguous()
        return torch.tensor(ext.mask_second(x.data_ptr(), x.numel(), x.element_size()))

    def mask_unpack(bits: torch.Tensor, numel: int) -> torch.Tensor:
        _check_bits(bits, numel)
        if not bits.is_cpu:
            return _mask_unpack(bits, numel)
        out = torch.empty(numel, dtype=torch.bool)
        one_zero = torch.tensor([False, True])
        if numel:
            ext.mask_select(bits.contiguous().data_ptr(), numel, 1, one_zero.data_ptr(), out.data_ptr())
        return out

    def mask_select(bits: torch.Tensor, numel: int, values: torch.Tensor) -> torch.Tensor:
        _check_bits(bits, numel)
        _check_values(values)
        if not bits.is_cpu:
            return _mask_select(bits, numel, values)
        values = values.cpu().contiguous()
        out = torch.empty(numel, dtype=values.dtype)
        if numel:
            ext.mask_select(bits.contiguous().data_ptr(), numel, values.element_size(), values.data_ptr(),
                            out.data_ptr())
        return out

    def mask_select_channels_last(bits: torch.Tensor, shape: list[int], values: torch.Tensor) -> torch.Tensor:
        numel = _check_image_shape(shape)
        _check_bits(bits, numel)
        _check_values(values)
        n, c, h, w = shape
        if not bits.is_cpu or (c * h * w) % 8:  # the kernel wants every image's bits to start on a byte
            return _mask_select_channels_last(bits, shape, values)
        values = values.cpu().contiguous()
        out = torch.empty(list(shape), dtype=values.dtype, memory_format=torch.channels_last)
        if numel:
            ext.mask_select_channels_last(bits.contiguous().data_ptr(), n, c, h * w, values.element_size(),
                                          values.data_ptr(), out.data_ptr())
        return out

    def relu_nonzeros(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_float(x, "x")
        if not x.is_cpu:
            return _relu_nonzeros(x)
        x = x.contiguous()
        counts = torch.empty(-(-x.numel() // unit), dtype=torch.int64)
        total = ext.nonzeros_count(x.data_ptr(), x.numel(), _FLOAT_CODES[x.dtype], counts.data_ptr()) if x.numel() else 0
        if total < 0:
            return x.new_empty(0), torch.zeros((), dtype=torch.bool)
        out = torch.empty(total, dtype=x.dtype)
        if total:
            ext.nonzeros_compact(x.data_ptr(), x.numel(), _FLOAT_CODES[x.dtype], counts.data_ptr(), out.data_ptr())
        return out, torch.ones((), dtype=torch.bool)

    def mask_scatter(values: torch.Tensor, bits: torch.Tensor, numel: int) -> torch.Tensor:
        _flat(values, "values")
        _check_bits(bits, numel)
        if not (values.is_cpu and bits.is_cpu) or values.dtype not in INT_VIEW:
            return _mask_scatter(values, bits, numel)
        values = values.contiguous()
        out = torch.empty(numel, dtype=values.dtype)
        if numel:
            set_bits = ext.mask_scatter(values.data_ptr(), values.numel(), bits.contiguous().data_ptr(), numel,
                                        values.element_size(), out.data_ptr())
            check_count(set_bits, values.numel())
        else:
            check_count(0, values.numel())
        return out

    def nonzeros_decode_scatter(payload: torch.Tensor, count: int, bits: int, group_size: int, mask: torch.Tensor,
                                numel: int) -> torch.Tensor:
        _check_payload(payload, count, bits, group_size)
        _check_bits(mask, numel)
        if not (payload.is_cpu and mask.is_cpu):
            return _nonzeros_decode_scatter(payload, count, bits, group_size, mask, numel)
        out = torch.empty(numel, dtype=torch.float32)
        set_bits = ext.nonzeros_decode_scatter(payload.contiguous().data_ptr(), count, bits, group_size,
                                               mask.contiguous().data_ptr(), numel, out.data_ptr()) if numel else 0
        check_count(set_bits, count)
        return out

    def mask_count(bits: torch.Tensor, numel: int) -> torch.Tensor:
        _check_bits(bits, numel)
        if not bits.is_cpu:
            return reference.mask_count(bits, numel)
        return torch.tensor(ext.mask_count(bits.contiguous().data_ptr(), numel) if numel else 0, dtype=torch.int64)

    def split_by_mask(x: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _flat(x, "x")
        _check_bits(bits, x.numel())
        if not (x.is_cpu and bits.is_cpu) or x.dtype not in INT_VIEW:
            return _split_by_mask(x, bits)
        x, bits, n = x.contiguous(), bits.contiguous(), x.numel()
        count = ext.mask_count(bits.data_ptr(), n) if n else 0
        kept, others = torch.empty(count, dtype=x.dtype), torch.empty(n - count, dtype=x.dtype)
        if n:
            set_bits = ext.split_by_mask(x.data_ptr(), bits.data_ptr(), n, x.element_size(), count, kept.data_ptr(),
                                         others.data_ptr())
            check_count(set_bits, count)
        return kept, others

    def split_decode(payload: torch.Tensor, count: int, bits: int, group_size: int, means: torch.Tensor,
                     mask: torch.Tensor, numel: int) -> torch.Tensor:
        _check_split_decode(payload, count, bits, group_size, means, mask, numel)
        if not (payload.is_cpu and mask.is_cpu and means.is_cpu):
            return _split_decode(payload, count, bits, group_size, means, mask, numel)
        out = torch.empty(numel, dtype=torch.float32)
        means = means.contiguous()
        set_bits = ext.split_decode(payload.contiguous().data_ptr(), count, bits, group_size, means.data_ptr(),
                                    mask.contiguous().data_ptr(), numel, out.data_ptr()) if numel else 0
        check_count(set_bits, count)
        return out

    return {"relu_mask_encode": relu_mask_encode, "mask_encode": mask_encode, "mask_second": mask_second,
            "mask_unpack": mask_unpack, "mask_count": mask_count,
            "mask_select": mask_select, "mask_select_channels_last": mask_select_channels_last,
            "relu_nonzeros": relu_nonzeros, "mask_scatter": mask_scatter,
            "nonzeros_decode_scatter": nonzeros_decode_scatter, "split_by_mask": split_by_mask,
            "split_decode": split_decode}


def native_registered() -> bool:
    """Whether the C++ mask kernels are the CPU implementation of the mask ops in this process."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("daf::relu_mask_encode", "CPU")


def register_native(ext: ModuleType) -> None:
    """Make the mask kernels of ``ext`` (the loaded extension) the CPU implementation; once per process."""
    if native_registered():
        return
    for name, kernel in _native_kernels(ext).items():
        torch.library.register_kernel(f"daf::{name}", "cpu", kernel)
