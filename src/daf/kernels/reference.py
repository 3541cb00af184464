"""Reference codec in plain PyTorch: the executable statement of ``docs/format.md``.

Runs on any device. It sits beside the native kernels on purpose (``daf.kernels.ops``
registers it as the default implementation of the ``daf::format1_*`` ops, the C++ kernels
as the CPU one): the kernels must produce the same bytes under nearest rounding, and
because stochastic rounding draws from a counter-based hash that both implement, the
same bytes under stochastic rounding too.

All functions take and return flat tensors; shapes and memory formats are the
codec front end's business (``daf.codec.api``).
"""

from __future__ import annotations

import torch

from daf.format import EXCEPTION_LIMIT, MIN_STEP, META_BYTES, TINY_LIMIT, num_groups, row_bytes

__all__ = ["encode_flat", "decode_flat", "exception_table", "uniform_noise", "mix32"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on int64 tensors holding uint32 values. O(numel).

    >>> int(mix32(torch.tensor([1])))
    1753845952
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    return int(mix32(torch.tensor([x & _MASK32], dtype=torch.int64))[0])


def uniform_noise(seed: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Counter-based uniform numbers in [0, 1): element ``i`` gets ``u(seed, i)``.

    ``u = (mix32(lo32(i) ^ key(hi32(i))) >> 8) * 2**-24`` with
    ``key(h) = mix32(seed32 ^ mix32(h + 0x9E3779B9))``. float32 [count]; O(count).
    """
    index = torch.arange(start, start + count, dtype=torch.int64, device=device)
    high = index >> 32
    if start + count <= 2**32:
        key = torch.full_like(index, _mix32_int((seed & _MASK32) ^ _mix32_int(_GOLDEN)))
    else:
        key = mix32((seed & _MASK32) ^ mix32((high + _GOLDEN) & _MASK32))
    bits = mix32((index & _MASK32) ^ key)
    return (bits >> 8).to(torch.float32) * 2.0**-24


def round_down_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the largest bfloat16 value <= x (finite inputs). Exact bit arithmetic."""
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    truncated = bits & 0xFFFF0000
    negative_inexact = ((bits & 0x80000000) != 0) & ((bits & 0xFFFF) != 0)
    rounded = torch.where(negative_inexact, truncated + 0x10000, truncated)
    return _int_bits_to_float(rounded)


def round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 >= 0 -> the smallest bfloat16 value >= x. Exact bit arithmetic."""
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    truncated = bits & 0xFFFF0000
    rounded = torch.where((bits & 0xFFFF) != 0, truncated + 0x10000, truncated)
    return _int_bits_to_float(rounded)


def _int_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    return signed.to(torch.int32).view(torch.float32)


# Elements per chunk: keeps the temporaries of the reference small (a few MiB), so that they
# are reused from the allocator's free lists instead of growing the heap under long-lived codes.
CHUNK_ELEMENTS = 1 << 18
# On an accelerator each chunk costs a dozen kernel launches of host time (ResNet-18's saves on an
# H200: 12 chunks each, 0.9 s per step against fp32's 11 ms), and its caching allocator reuses the
# temporaries whatever their size: one chunk of up to 64 MiB of float32.
DEVICE_CHUNK_ELEMENTS = 1 << 24


def chunk_groups(device: torch.device, group_size: int) -> int:
    """Whole groups per chunk of the reference's loops on ``device``: the bytes never depend on it
    (the noise and the rows are indexed by absolute position)."""
    elements = CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    return max(1, elements // group_size)


def encode_flat(
    x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantize and pack a flat tensor into format-1 rows.

    x: float32|float16|bfloat16|float64 [numel], contiguous ->
    (payload uint8 [num_groups * row_bytes], exc_index int64 [n] or None, exc_value x.dtype [n] or None).
    O(numel) time; temporaries of one chunk's bytes (``chunk_groups``).
    """
    numel = x.numel()
    groups = num_groups(numel, group_size)
    payload = torch.empty(groups * row_bytes(bits, group_size), dtype=torch.uint8, device=x.device)
    rows = payload.view(groups, row_bytes(bits, group_size))
    exceptions = []
    step = chunk_groups(x.device, group_size) * group_size
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        found = _encode_rows(x[start:stop], rows[start // group_size: -(-stop // group_size)], bits,
                             group_size, stochastic, seed, start)
        if found is not None:
            exceptions.append(found + start)
    if not exceptions:
        return payload, None, None
    index = torch.cat(exceptions)
    return payload, index, x[index].clone()


def exception_table(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The side table ``encode_flat`` returns with a payload: (index int64 [n], value x.dtype [n]), or (None, None).

    Exceptional means NaN, ±Inf or ``|x| > EXCEPTION_LIMIT`` after the cast to float32, or a nonzero
    element of a *tiny* group (docs/format.md), as in the encoding. O(numel), temporaries of
    O(min(numel, CHUNK_ELEMENTS)). For the op layer, whose ops return payloads of fixed size only.
    """
    flat = x.reshape(-1)
    found = []
    step = chunk_groups(flat.device, group_size) * group_size
    for start in range(0, flat.numel(), step):
        part = flat[start:start + step]
        exceptional, _, _ = _exceptions(_padded_groups(part, group_size))
        if exceptional is not None:
            found.append(torch.nonzero(exceptional.view(-1)[:part.numel()]).view(-1) + start)
    if not found:
        return None, None
    index = torch.cat(found)
    return index, flat[index].clone()


def _exceptions(values: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(exceptional bool [groups, G] or None, low, high float32 [groups]) of float32 groups [groups, G].

    Exceptional: NaN, ±Inf, ``|x| > EXCEPTION_LIMIT``, and the nonzero elements of a group whose
    regular elements are all below ``TINY_LIMIT`` in magnitude (float32 cannot quantize those:
    docs/format.md). ``low``/``high``: min and max of the other elements, 0 for a group with none.
    """
    low, high = values.amin(dim=1), values.amax(dim=1)
    regular = (low.abs() <= EXCEPTION_LIMIT) & (high.abs() <= EXCEPTION_LIMIT)
    if bool(regular.all()) and not bool(_tiny(low, high).any()):
        return None, low, high
    exceptional = ~(values.abs() <= EXCEPTION_LIMIT)
    low = torch.where(exceptional, torch.inf, values).amin(dim=1)
    high = torch.where(exceptional, -torch.inf, values).amax(dim=1)
    tiny = _tiny(low, high)  # from the regular elements only: NaN or Inf beside denormals leaves them tiny
    exceptional |= tiny[:, None] & (values != 0)
    empty = torch.isinf(low) | tiny  # what a tiny group keeps is its zeros: lo = 0
    return exceptional, torch.where(empty, 0.0, low), torch.where(empty, 0.0, high)


def _tiny(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Groups whose range [low, high] is nonzero but within (-TINY_LIMIT, TINY_LIMIT): bool [groups]."""
    return (low.abs() < TINY_LIMIT) & (high.abs() < TINY_LIMIT) & ((low != 0) | (high != 0))


def _encode_rows(x: torch.Tensor, rows: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                 seed: int, start: int) -> torch.Tensor | None:
    """Encode whole groups of ``x`` (elements ``start`` onwards of the tensor) into ``rows``.

    Returns the chunk-local indices of exceptional elements, or None.
    """
    numel = x.numel()
    values = _padded_groups(x, group_size)
    exceptional, low, high = _exceptions(values)
    levels = (1 << bits) - 1
    # + 0.0 turns a -0.0 minimum into +0.0: which zero amin returns depends on its reduction
    # order, and the bytes must not (format.md step 2).
    lo = round_down_bf16(low + 0.0)
    # Divide by a tensor, not a Python number: CUDA turns division by a scalar into a
    # multiplication by its reciprocal, which rounds differently and changed bytes on the GPU.
    step = torch.clamp(round_up_bf16((high - lo) / torch.full_like(lo, levels)), min=MIN_STEP)
    inverse = 1.0 / step
    if exceptional is not None:
        # Exceptional elements encode as code 0; their true values go to the side table.
        values = torch.where(exceptional, lo[:, None], values)
    scaled = (values - lo[:, None]) * inverse[:, None]
    offset = uniform_noise(seed, start, values.numel(), x.device).view_as(values) if stochastic else 0.5
    codes = torch.clamp(torch.floor(scaled + offset), 0, levels).to(torch.uint8)
    codes.view(-1)[numel:] = 0
    groups = rows.shape[0]
    rows[:, 0:2] = lo.to(torch.bfloat16).view(torch.uint8).view(groups, 2)
    rows[:, 2:4] = step.to(torch.bfloat16).view(torch.uint8).view(groups, 2)
    rows[:, META_BYTES:] = _pack_codes(codes, bits)
    if exceptional is None:
        return None
    return torch.nonzero(exceptional.view(-1)[:numel]).view(-1)


def decode_flat(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    exc_index: torch.Tensor | None = None,
    exc_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack and dequantize format-1 rows: ``value = code * step + lo`` in float32, then cast (for float16,
    after clamping to its finite range: see docs/format.md).

    payload uint8 [num_groups * row_bytes] -> dtype [numel]. O(numel).
    """
    groups = num_groups(numel, group_size)
    expected = groups * row_bytes(bits, group_size)
    if payload.numel() != expected:
        raise ValueError(f"payload has {payload.numel()} bytes; {numel} elements at {bits} bits, "
                         f"group_size {group_size} need {expected}")
    out = torch.empty(numel, dtype=dtype, device=payload.device)
    rows = payload.view(groups, row_bytes(bits, group_size))
    step = chunk_groups(payload.device, group_size)
    for first in range(0, groups, step):
        chunk = rows[first:first + step]
        start = first * group_size
        stop = min(numel, start + chunk.shape[0] * group_size)
        values = _decode_rows(chunk, bits)[: stop - start]
        if dtype == torch.float16:
            values = values.clamp_(-_HALF_MAX, _HALF_MAX)
        out[start:stop] = values
    if exc_index is not None and exc_index.numel():
        out[exc_index] = exc_value.to(dtype)
    return out


# The original elements were finite halves (the others are exceptions, restored exactly), but
# lo + code * step with a step rounded up to bfloat16 can pass 65504 by a fraction of a step.
_HALF_MAX = 65504.0


def _decode_rows(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 [groups * group_size] values of format-1 rows."""
    # reshape, not contiguous(): one row of odd length is "contiguous" with its row stride, which view refuses
    lo = rows[:, 0:2].reshape(-1).view(torch.bfloat16).to(torch.float32).unsqueeze(1)
    step = rows[:, 2:4].reshape(-1).view(torch.bfloat16).to(torch.float32).unsqueeze(1)
    codes = _unpack_codes(rows[:, META_BYTES:], bits).to(torch.float32)
    return (codes * step + lo).view(-1)


def _padded_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [groups, group_size]; the short last group is padded with its own last element."""
    flat = x.to(torch.float32).reshape(-1)
    pad = (-flat.numel()) % group_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, group_size)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [groups, group_size] codes < 2**bits -> uint8 [groups, group_size * bits / 8]."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    parts = codes.view(codes.shape[0], -1, per_byte) << _shifts(bits, codes.device)
    packed = parts[..., 0]
    for k in range(1, per_byte):
        packed = packed | parts[..., k]
    return packed


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [groups, nbytes] -> uint8 [groups, nbytes * 8 / bits]."""
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> _shifts(bits, packed.device)) & mask
    return codes.view(packed.shape[0], -1)
