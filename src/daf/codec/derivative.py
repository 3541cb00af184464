"""GELU and SiLU inputs stored as a 2-bit code of their derivative (Approx-BP's ReGELU2 / ReSiLU2).

The backward of ``gelu(x)`` (and ``silu(x)``) reads its saved input only to compute ``f'(x)``. So
the codec keeps which of four derivative levels ``f'(x)`` is nearest to, and decodes to the tensor of
*representatives*: inputs ``r_j`` with ``f'(r_j) = level_j`` (float32), so that PyTorch's own
``GeluBackward0`` / ``SiluBackward0`` compute ``grad * level_j``. Nothing else in backward changes.

    code  = index of the level nearest f'(x)                  (0..3)
    x'    = REPRESENTATIVES[f][code]                          in x.dtype, x's shape and stride order

The levels minimize E[(f'(x) - level)^2] (Lloyd's algorithm) for x drawn from an equal mixture of
N(0, s^2), s in {0.5, 1, 2} for GELU and {0.85, 1.7, 3.4} for SiLU (SiLU(x) ~ GELU(x / 1.7)); their
mean squared error is 4% of f'(x)'s variance. The derivative is rounded to the nearest level, not
stochastically: the gradient is biased (as in Approx-BP), not noisy.

The codes are format-1 codes of the code tensor (values 0..3) at 2 bits under nearest rounding with
the session's group size: every group's range is at most 3 codes wide, so the decoded value rounds
back to the exact code. Cost: 2 + 32 / G bits per element. NaN and Inf inputs are kept exactly in the
format-1 side table (``exc_index``, ``exc_value``) and decode to themselves, so backward computes
plain autograd's ``f'(x)`` for them (NaN). ``decode`` returns representatives, not
``x``: only GELU/SiLU's own save may use this form (``Spec.consumer`` "gelu" or "silu"; a later op
that saved the same tensor would get the representatives too: see docs/transformers.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from daf.codec.backends import Backend
from daf.codec.spec import Spec
from daf.format import FLOAT_DTYPES, Packed, flatten_memory_order, restore_memory_order

__all__ = ["DerivativeCodec", "DerivativePacked", "LEVELS", "REPRESENTATIVES", "derivative", "FUNCTIONS"]

FUNCTIONS = ("gelu", "silu")
LEVELS = {"gelu": (-0.032979, 0.324474, 0.675549, 1.032556),
          "silu": (-0.020923, 0.323299, 0.672381, 1.020685)}
# f'(r) == level in float32 (tests/codec/test_derivative.py), on the branch where f' increases
REPRESENTATIVES = {"gelu": (-0.8343684673309326, -0.22367769479751587, 0.22370831668376923, 0.833217442035675),
                   "silu": (-1.38158118724823, -0.36109817028045654, 0.35189077258110046, 1.3803164958953857)}
BITS = 2


@dataclass
class DerivativePacked(Packed):
    """Format-1 codes (2 bits, nearest) of the level index; ``function`` says which representatives."""

    function: str = "gelu"


def derivative(function: str, x: torch.Tensor) -> torch.Tensor:
    """f'(x) in float32 for f = GELU (erf form) or SiLU. O(numel)."""
    x = x.float()
    if function == "gelu":
        return 0.5 * (1 + torch.erf(x * 0.7071067811865476)) + x * torch.exp(-0.5 * x * x) * 0.3989422804014327
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def level_codes(function: str, x: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..3 of the level nearest f'(x), same shape: the number of midpoints between levels
    below f'(x), what ``torch.bucketize`` gives, counted by three comparisons (4x faster on a CPU:
    6 against 25 ms for a [32, 64, 1536] GELU input). O(numel)."""
    levels = torch.tensor(LEVELS[function])
    midpoints = ((levels[1:] + levels[:-1]) / 2).tolist()  # float32 values, compared as float32 again
    d = derivative(function, x).nan_to_num(nan=0.0)
    codes = (d > midpoints[0]).to(torch.uint8)
    for midpoint in midpoints[1:]:
        codes += d > midpoint
    return codes


def _nonfinite(flat: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(int64 flat indices, values in ``flat``'s dtype) of the NaN and Inf elements of ``flat``, the
    side table of format 1 (docs/format.md); (None, None) when there are none. A level code would turn
    them into a finite derivative, where plain autograd's f'(NaN) is NaN. O(numel)."""
    nonfinite = ~torch.isfinite(flat)
    if not bool(nonfinite.any()):
        return None, None
    index = nonfinite.nonzero().flatten()
    return index, flat[index].clone()


class DerivativeCodec:
    """Derivative codes of GELU/SiLU inputs on ``backend``, groups of ``group_size``."""

    packed_type = DerivativePacked
    name = "derivative"

    def __init__(self, backend: Backend, group_size: int = 256) -> None:
        self.backend = backend
        self.group_size = group_size

    @staticmethod
    def takes(x: torch.Tensor, spec: Spec) -> bool:
        """GELU's or SiLU's own save of a floating-point tensor at 2 bits, the width of these codes. At 4
        bits, codes of ``x`` are finer than four levels of its derivative (SmolLM2: relative error 0.235
        against 0.30); at 1 the policy asked for half the bytes."""
        return (spec.consumer in FUNCTIONS and spec.bits == BITS and x.dtype in FLOAT_DTYPES
                and x.layout == torch.strided and x.numel() > 0)

    def encode(self, x: torch.Tensor, spec: Spec) -> DerivativePacked:
        flat, order = flatten_memory_order(x.detach())
        codes = level_codes(spec.consumer, flat).float()
        payload, _, _ = self.backend.encode_flat(codes, BITS, self.group_size, False, 0)
        exc_index, exc_value = _nonfinite(flat)
        return DerivativePacked(payload, tuple(x.shape), order, x.dtype, BITS, self.group_size,
                                exc_index, exc_value, function=spec.consumer)

    def decode(self, packed: DerivativePacked) -> torch.Tensor:
        codes = self.backend.decode_flat(packed.payload, packed.numel, BITS, packed.group_size, torch.float32)
        representatives = torch.tensor(REPRESENTATIVES[packed.function], dtype=torch.float32,
                                        device=codes.device)
        flat = representatives[codes.round().long()].to(packed.dtype)
        if packed.exc_index is not None:  # NaN and Inf come back as they were: backward's f'(x) is plain's
            flat[packed.exc_index] = packed.exc_value
        return restore_memory_order(flat, packed.shape, packed.order)

    def reencode(self, packed: Packed, bits: int, seed: int) -> Packed:
        """Unchanged: 2 bits is already the floor the store demotes to."""
        return dataclasses.replace(packed)
