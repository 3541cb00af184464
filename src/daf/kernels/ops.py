"""The format-1 codec as PyTorch operators under ``torch.ops.daf``.

The op-layer pattern of bitsandbytes: each op is defined once by its schema, the
plain-PyTorch reference (``daf.kernels.reference``) is its default implementation (any
device), a fake implementation gives shapes and dtypes to FakeTensor and torch.compile,
and the C++ kernels become its CPU implementation when the extension loads
(``register_native``, called by ``daf.kernels.build.load_extension``).

- ``daf::format1_encode(Tensor x, int bits, int group_size, bool stochastic, int seed,
  int strategy=0, bool serial=False) -> (Tensor payload, Tensor ok)``
- ``daf::format1_decode(Tensor payload, SymInt numel, int bits, int group_size, ScalarType dtype,
  Tensor? exc_index=None, Tensor? exc_value=None) -> Tensor``
- ``daf::format1_decode_into(Tensor payload, int bits, int group_size, Tensor? exc_index,
  Tensor? exc_value, Tensor(a!) out) -> ()``: the values in ``out``'s logical order, whatever its
  layout (a channels-last ``out`` is filled in one pass on the kernels)
- ``daf::format1_decode_signed(Tensor payload, Tensor signs, SymInt numel, int bits, int group_size,
  float floor, ScalarType dtype) -> Tensor``: the decoded values given the sign their bit in ``signs``
  (``relu_mask_encode``'s bits) says: ``where(bit, v.clamp_min(floor), v.clamp_max(0))``, a ReLU output
  restored in a compiled graph so that no value crosses 0 (float32 on the kernels in one pass)

Every implementation returns the reference's bytes. Ops return tensors of sizes known from
their arguments only, so the exceptional values' side table (whose length depends on the
data) is not an output: ``ok`` (a bool scalar) is False when ``x`` holds NaN, ±Inf,
``|x| > 2**126`` or a nonzero group below ``2**-100`` in magnitude (docs/format.md), and
``encode_flat`` below then adds the table. This module is the one
dispatcher between kernels and reference: the CPU implementation hands to the reference
what the kernels do not take (float64, group sizes that are not powers of two >= 8) and
tensors with exceptional values; no caller needs its own fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from daf.format import ALLOWED_BITS, mask_bytes, payload_bytes
from daf.kernels import mask_reference, reference

__all__ = ["NAMESPACE", "STRATEGIES", "check_format", "encode_flat", "decode_flat", "decode_into", "native_takes",
           "register_native", "native_registered"]

NAMESPACE = "daf"
# Reduction strategies of the encode kernel (csrc/kernels.h): threads own whole groups,
# or threads split the element range and merge partial min/max per group.
STRATEGIES = {"whole_groups": 0, "split_range": 1}
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_MASK32 = 0xFFFFFFFF

_ENCODE = "daf::format1_encode"
_DECODE = "daf::format1_decode"
_DECODE_INTO = "daf::format1_decode_into"
_DECODE_SIGNED = "daf::format1_decode_signed"

torch.library.define(_ENCODE, "(Tensor x, int bits, int group_size, bool stochastic, int seed, int strategy=0, "
                              "bool serial=False) -> (Tensor payload, Tensor ok)")
torch.library.define(_DECODE, "(Tensor payload, SymInt numel, int bits, int group_size, ScalarType dtype, "
                              "Tensor? exc_index=None, Tensor? exc_value=None) -> Tensor")
torch.library.define(_DECODE_INTO, "(Tensor payload, int bits, int group_size, Tensor? exc_index, Tensor? exc_value, "
                                   "Tensor(a!) out) -> ()")
torch.library.define(_DECODE_SIGNED, "(Tensor payload, Tensor signs, SymInt numel, int bits, int group_size, "
                                     "float floor, ScalarType dtype) -> Tensor")


def check_format(bits: int, group_size: int) -> None:
    """ValueError unless ``bits`` and ``group_size`` make whole-byte rows of format 1."""
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits must be one of {ALLOWED_BITS}, got {bits}")
    if group_size < 1 or group_size * bits % 8:
        raise ValueError(f"group_size must be positive and fill whole bytes at {bits} bits, got {group_size}")


def check_payload(payload: torch.Tensor, numel: int, bits: int, group_size: int) -> None:
    """ValueError unless ``payload`` is the uint8 codes of ``numel`` values in format 1 (``check_format`` first)."""
    check_format(bits, group_size)
    expected = payload_bytes(numel, bits, group_size)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise ValueError(f"payload must be uint8 [{expected}] for {numel} values at {bits} bits, group_size "
                         f"{group_size}; got {payload.dtype} [{payload.numel()}]")


def _check_strategy(strategy: int) -> None:
    if strategy not in STRATEGIES.values():
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES.values())} ({', '.join(STRATEGIES)}), "
                         f"got {strategy}")


def native_takes(dtype: torch.dtype, on_cpu: bool, group_size: int) -> bool:
    """Whether the C++ kernels take this input; the CPU implementation hands the rest to the reference."""
    return on_cpu and dtype in _DTYPE_CODES and group_size >= 8 and group_size & (group_size - 1) == 0


# ---- default implementations: the reference, any device --------------------------------------

def _encode_reference(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int,
                      strategy: int = 0, serial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    check_format(bits, group_size)
    _check_strategy(strategy)  # the reference has no strategies, but an op refuses the same arguments everywhere
    payload, exc_index, _ = reference.encode_flat(x.reshape(-1).contiguous(), bits, group_size, stochastic, seed)
    return payload, torch.tensor(exc_index is None, device=x.device)


def _decode_reference(payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                      exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor:
    check_format(bits, group_size)
    return reference.decode_flat(payload, numel, bits, group_size, dtype, exc_index, exc_value)


def _decode_into_reference(payload: torch.Tensor, bits: int, group_size: int, exc_index: torch.Tensor | None,
                           exc_value: torch.Tensor | None, out: torch.Tensor) -> None:
    values = _decode_reference(payload, out.numel(), bits, group_size, out.dtype, exc_index, exc_value)
    out.copy_(values.view(out.shape))


def _decode_signed_reference(payload: torch.Tensor, signs: torch.Tensor, numel: int, bits: int, group_size: int,
                             floor: float, dtype: torch.dtype) -> torch.Tensor:
    values = _decode_reference(payload, numel, bits, group_size, dtype)
    positive = mask_reference.mask_unpack(signs, numel)
    return torch.where(positive, values.clamp_min(floor), values.clamp_max(0))


torch.library.register_kernel(_ENCODE, "default", _encode_reference)
torch.library.register_kernel(_DECODE, "default", _decode_reference)
torch.library.register_kernel(_DECODE_INTO, "default", _decode_into_reference)
torch.library.register_kernel(_DECODE_SIGNED, "default", _decode_signed_reference)


# ---- fake implementations: shapes and dtypes only --------------------------------------------

@torch.library.register_fake(_ENCODE)
def _encode_fake(x, bits, group_size, stochastic, seed, strategy=0, serial=False):
    check_format(bits, group_size)
    _check_strategy(strategy)
    return x.new_empty(payload_bytes(x.numel(), bits, group_size), dtype=torch.uint8), x.new_empty((), dtype=torch.bool)


@torch.library.register_fake(_DECODE)
def _decode_fake(payload, numel, bits, group_size, dtype, exc_index=None, exc_value=None):
    check_format(bits, group_size)
    torch._check(payload.numel() == payload_bytes(numel, bits, group_size),
                 lambda: f"payload has {payload.numel()} bytes; {numel} elements need "
                         f"{payload_bytes(numel, bits, group_size)}")
    return payload.new_empty(numel, dtype=dtype)


@torch.library.register_fake(_DECODE_SIGNED)
def _decode_signed_fake(payload, signs, numel, bits, group_size, floor, dtype):
    return _decode_fake(payload, numel, bits, group_size, dtype)


@torch.library.register_fake(_DECODE_INTO)
def _decode_into_fake(payload, bits, group_size, exc_index, exc_value, out):
    check_format(bits, group_size)


# ---- CPU implementations: the C++ kernels, registered when the extension loads ----------------

def _encode_native(ext: ModuleType) -> Callable:
    def encode(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, strategy: int = 0,
               serial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        check_format(bits, group_size)
        _check_strategy(strategy)
        if not native_takes(x.dtype, x.is_cpu, group_size):
            return _encode_reference(x, bits, group_size, stochastic, seed)
        x = x.reshape(-1).contiguous()
        numel = x.numel()
        payload = torch.empty(payload_bytes(numel, bits, group_size), dtype=torch.uint8)
        # The kernel's range pass flags exceptional values; the reference then encodes the whole tensor.
        if numel and not ext.encode(x.data_ptr(), numel, _DTYPE_CODES[x.dtype], payload.data_ptr(), bits, group_size,
                                    stochastic, seed & _MASK32, strategy, serial):
            return _encode_reference(x, bits, group_size, stochastic, seed)
        return payload, torch.ones((), dtype=torch.bool)
    return encode


def _decode_native(ext: ModuleType) -> Callable:
    def decode_into_channels_last(payload: torch.Tensor, bits: int, group_size: int, exc_index: torch.Tensor | None,
                                  exc_value: torch.Tensor | None, out: torch.Tensor) -> None:
        """Values in NCHW order into a channels-last ``out``: in one pass when every image starts a
        group and no value is exceptional, else a flat decode and the kernels' transposing copy."""
        n, c, h, w = out.shape
        check_payload(payload, out.numel(), bits, group_size)
        payload = payload.contiguous()
        if exc_index is None and (c * h * w) % group_size == 0:
            ext.decode_channels_last_into(payload.data_ptr(), n, c, h * w, bits, group_size, _DTYPE_CODES[out.dtype],
                                          out.data_ptr())
            return
        values = torch.empty(out.numel(), dtype=out.dtype)
        decode_into(payload, bits, group_size, exc_index, exc_value, values)
        ext.channels_last_copy(values.data_ptr(), n, c, h * w, values.element_size(), out.data_ptr())

    def decode_into(payload: torch.Tensor, bits: int, group_size: int, exc_index: torch.Tensor | None,
                    exc_value: torch.Tensor | None, out: torch.Tensor) -> None:
        check_format(bits, group_size)
        numel = out.numel()
        if not (native_takes(out.dtype, payload.is_cpu and out.is_cpu, group_size) and payload.dtype == torch.uint8):
            return _decode_into_reference(payload, bits, group_size, exc_index, exc_value, out)
        if not out.is_contiguous():
            if numel and out.dim() == 4 and out.is_contiguous(memory_format=torch.channels_last):
                return decode_into_channels_last(payload, bits, group_size, exc_index, exc_value, out)
            return _decode_into_reference(payload, bits, group_size, exc_index, exc_value, out)
        check_payload(payload, numel, bits, group_size)
        payload = payload.contiguous()
        if numel:
            ext.decode_into(payload.data_ptr(), numel, bits, group_size, _DTYPE_CODES[out.dtype], out.data_ptr())
        if exc_index is not None and exc_index.numel():
            out.view(-1)[exc_index] = exc_value.to(out.dtype)

    def decode(payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
               exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        decode_into(payload, bits, group_size, exc_index, exc_value, out)
        return out

    return decode, decode_into


def _decode_signed_native(ext: ModuleType) -> Callable:
    def decode_signed(payload: torch.Tensor, signs: torch.Tensor, numel: int, bits: int, group_size: int,
                      floor: float, dtype: torch.dtype) -> torch.Tensor:
        check_format(bits, group_size)
        takes = (dtype == torch.float32 and native_takes(dtype, payload.is_cpu and signs.is_cpu, group_size)
                 and payload.dtype == signs.dtype == torch.uint8 and signs.numel() == mask_bytes(numel))
        if not takes or not numel:
            return _decode_signed_reference(payload, signs, numel, bits, group_size, floor, dtype)
        check_payload(payload, numel, bits, group_size)
        out = torch.empty(numel, dtype=dtype)
        ext.decode_signed_into(payload.contiguous().data_ptr(), signs.contiguous().data_ptr(), numel, bits,
                               group_size, floor, out.data_ptr())
        return out

    return decode_signed


def native_registered() -> bool:
    """Whether the C++ kernels are the CPU implementation of the ops in this process."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(_ENCODE, "CPU")


def register_native(ext: ModuleType) -> None:
    """Make the kernels of ``ext`` (the loaded extension) the CPU implementation; once per process."""
    if native_registered():  # a shared library loads once per process; so does its registration
        return
    decode, decode_into = _decode_native(ext)
    torch.library.register_kernel(_ENCODE, "cpu", _encode_native(ext))
    torch.library.register_kernel(_DECODE, "cpu", decode)
    torch.library.register_kernel(_DECODE_INTO, "cpu", decode_into)
    torch.library.register_kernel(_DECODE_SIGNED, "cpu", _decode_signed_native(ext))


# ---- what a codec backend calls ----------------------------------------------------------------

def encode_flat(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int,
                strategy: str = "whole_groups", serial: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``reference.encode_flat`` through ``torch.ops.daf.format1_encode``: (payload, exc_index, exc_value).

    x float32|float16|bfloat16|float64 [numel] -> payload uint8 [num_groups * row_bytes], and the
    side table (or None, None). O(numel). ``strategy``: a key of ``STRATEGIES`` (the kernels only).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    payload, ok = torch.ops.daf.format1_encode(x, bits, group_size, stochastic, seed & _MASK32,
                                               STRATEGIES[strategy], serial)
    if ok.item():
        return payload, None, None
    return (payload, *reference.exception_table(x, group_size))


def decode_flat(payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.decode_flat`` through ``torch.ops.daf.format1_decode``: dtype [numel]. O(numel)."""
    return torch.ops.daf.format1_decode(payload, numel, bits, group_size, dtype, exc_index, exc_value)


def decode_into(payload: torch.Tensor, bits: int, group_size: int, out: torch.Tensor,
                exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor:
    """Decode into ``out`` (its numel and dtype say what) through ``torch.ops.daf.format1_decode_into``."""
    torch.ops.daf.format1_decode_into(payload, bits, group_size, exc_index, exc_value, out)
    return out
