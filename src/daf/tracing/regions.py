"""Ops whose backward reads only which region of the real line each saved element is in.

``hardtanh`` (and ReLU6, which is ``hardtanh(x, 0, 6)``), ``leaky_relu``, ``hardsigmoid`` and ``clamp``
with number bounds save their input (or, in place, their result) and backward reads it only through
comparisons: ``hardtanh_backward`` zeroes the gradient where ``x <= min_val or x >= max_val``,
``leaky_relu_backward`` scales it where ``not x > 0``, ``hardsigmoid_backward`` passes ``grad / 6``
where ``-3 < x < 3``, ``clamp_backward`` passes it where ``min <= x <= max``. Codes of ``x`` move
elements across those edges (2-bit codes of a MobileNetV2's ReLU6 inputs: gradient cosine 0.06), so
such a save is stored as the exact bit of the region and decoded to one value inside it
(``region_of``): the op's backward then computes bit for bit what it computes from ``x``, NaN
included (each rule's test is the op's own, negated where the op tests the outside).

A region record is for the op that saved it only: another op saving the same tensor needs its values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from daf.tracing.ops import OpCall

__all__ = ["RegionRule", "REGION_RULES", "region_of"]


@dataclass(frozen=True)
class RegionRule:
    """``inside(x, args, kwargs)``: bool, where the op's backward treats ``x`` as ``inside`` (exactly its
    test); the saved tensor decodes to ``values(args, kwargs) = (inside value, outside value)``, two numbers
    the op's test puts on the same sides. None from either: the call is not one this rule can mask."""

    name: str
    inside: Callable[[torch.Tensor, tuple, dict], torch.Tensor | None]
    values: Callable[[tuple, dict], tuple[float, float] | None]


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _between(low: float, high: float) -> tuple[float, float] | None:
    """An inside value strictly between ``low`` and ``high`` and an outside one beyond ``high`` (or below
    ``low``); None when the interval has no inside or no outside (the op is not a clip there)."""
    if not low < high:
        return None
    if low == float("-inf") and high == float("inf"):
        return None
    inside = 0.0 if low < 0.0 < high else (low + 1.0 if high == float("inf") else
                                           high - 1.0 if low == float("-inf") else (low + high) / 2)
    outside = high + 1.0 if high != float("inf") else low - 1.0
    return inside, outside


def _hardtanh_bounds(args: tuple, kwargs: dict) -> tuple[float, float] | None:
    low = _number(_argument(args, kwargs, 1, "min_val", -1.0))
    high = _number(_argument(args, kwargs, 2, "max_val", 1.0))
    return None if low is None or high is None else (low, high)


def _open_interval(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return ~((x <= low) | (x >= high))  # hardtanh_backward's test, negated: NaN inside, as in ATen


def _hardtanh_inside(x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    bounds = _hardtanh_bounds(args, kwargs)
    return None if bounds is None else _open_interval(x, *bounds)


def _hardtanh_values(args: tuple, kwargs: dict) -> tuple[float, float] | None:
    bounds = _hardtanh_bounds(args, kwargs)
    return None if bounds is None else _between(*bounds)


def _relu6_inside(x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    return _open_interval(x, 0.0, 6.0)


def _leaky_inside(x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    return x > 0 if _number(_argument(args, kwargs, 1, "negative_slope", 0.01)) is not None else None


def _hardsigmoid_inside(x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    return (x > -3.0) & (x < 3.0)


def _clamp_bounds(args: tuple, kwargs: dict) -> tuple[float, float] | None:
    low, high = _argument(args, kwargs, 1, "min", None), _argument(args, kwargs, 2, "max", None)
    if (low is not None and _number(low) is None) or (high is not None and _number(high) is None):
        return None  # tensor bounds: clamp saves them too and reads x against each element
    return (float("-inf") if low is None else float(low), float("inf") if high is None else float(high))


def _clamp_inside(x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor | None:
    bounds = _clamp_bounds(args, kwargs)
    return None if bounds is None else (x >= bounds[0]) & (x <= bounds[1])  # NaN: outside, as in ATen


def _clamp_values(args: tuple, kwargs: dict) -> tuple[float, float] | None:
    bounds = _clamp_bounds(args, kwargs)
    if bounds is None or bounds[0] > bounds[1]:
        return None
    low, high = bounds
    if low == high:
        return (low, low + 1.0) if high != float("inf") else None
    return _between(low, high)


def _rules() -> dict[Callable, RegionRule]:
    import torch.nn.functional as F
    hardtanh = RegionRule("hardtanh", _hardtanh_inside, _hardtanh_values)
    relu6 = RegionRule("relu6", _relu6_inside, lambda args, kwargs: (3.0, 7.0))
    leaky = RegionRule("leaky_relu", _leaky_inside, lambda args, kwargs: (1.0, -1.0))
    hardsigmoid = RegionRule("hardsigmoid", _hardsigmoid_inside, lambda args, kwargs: (0.0, 4.0))
    clamp = RegionRule("clamp", _clamp_inside, _clamp_values)
    return {F.hardtanh: hardtanh, F.hardtanh_: hardtanh, F.relu6: relu6, F.leaky_relu: leaky,
            F.leaky_relu_: leaky, F.hardsigmoid: hardsigmoid, torch.clamp: clamp, torch.clip: clamp,
            torch.Tensor.clamp: clamp, torch.Tensor.clip: clamp}


REGION_RULES: dict[Callable, RegionRule] = _rules()


def region_of(tensor: torch.Tensor, op: OpCall | None) -> tuple[torch.Tensor, tuple[float, float]] | None:
    """``(representative, (first, other))`` when ``op`` is a region op that may save ``tensor``:
    ``representative`` is ``tensor``'s shape, dtype and layout, holding the rule's inside value where the
    op's backward tests ``tensor`` inside and the outside value elsewhere; ``(first, other)`` are its two
    values, the one of its first element (in memory order) first, as ``daf.codec.mask.encode_mask`` takes
    them. None for any other op or call. O(numel)."""
    rule = REGION_RULES.get(op.func) if op is not None else None
    if rule is None or not tensor.dtype.is_floating_point or tensor.layout != torch.strided or tensor.is_meta:
        return None
    values = rule.values(op.args, op.kwargs)
    inside = rule.inside(tensor.detach(), op.args, op.kwargs) if values is not None else None
    if inside is None or tensor.numel() == 0:
        return None
    inside_value, outside_value = (torch.tensor(v, dtype=tensor.dtype) for v in values)
    if float(inside_value) != values[0] or float(outside_value) != values[1]:
        return None  # the dtype cannot hold the values exactly (a float8): codes as before
    representative = torch.where(inside, inside_value.to(tensor.device), outside_value.to(tensor.device))
    # torch.where's output is dense with nonnegative strides: element [0, ..., 0] comes first in memory
    first_inside = bool(inside[(0,) * inside.dim()])
    return representative, (values[0], values[1]) if first_inside else (values[1], values[0])
