"""The routing rules of one saved tensor, as a pure function: ``route(tensor, context) -> Encoding``.

In order (the first that holds decides):

1. a parameter or buffer (or a view of one): referenced, never copied; an exact cast of a parameter
   (autocast's bf16 copy of a weight, or a view of it; of a frozen weight too, found among the
   arguments of the linear, matmul or convolution saving it): derived, nothing stored, since the
   parameter lives on anyway and backward recasts it (``daf.runtime.derived``); another cast of one (a
   clone of the copy, a cast to another memory format): kept raw, since coarse codes of a weight spoil every input
   gradient;
2. ReLU's own save of its output, with masks on: an exact 1-bit mask (``relu_mask``); the save of an op
   whose backward reads only which region it is in (hardtanh and ReLU6, leaky ReLU, hardsigmoid, clamp
   with number bounds: ``daf.tracing.regions``), with masks on: the exact bit of the region, decoded to
   one value inside it (``region_mask``), for that op alone;
3. not compressible (no autograd history, not floating point, small, sparse, meta, float64
   magnitudes the codes cannot carry): an exact mask if it holds two values, else kept raw. A tensor
   without history that a submodule made in this forward (a frozen layer's output, LoRA's dropped-out
   input) and that a linear, matmul or convolution saves is compressible: their backward only
   multiplies by it;
4. an earlier save of the same tensor in this forward is stored: shared; a product of a stored
   tensor and a stored exact mask (dropout's output, ``daf.tracing.products``): derived from the two
   records, nothing stored and no error added; a save a remake rule finds (``daf.runtime.remakes``:
   SiLU's or GELU's output whose input is stored, LayerNorm's or RMSNorm's, fused attention's output
   on a CPU, the math path's probabilities, a head's log-probabilities, a CNN block's
   ``act(norm(x) [+ shortcut])``): derived, recomputed from the records, unless the policy gives it
   more bits than the remake's ``bits`` (what its records are worth through it);
5. two values only (dropout masks): an exact mask;
6. a ReLU output whose mask is stored, under a policy that codes nonzeros only: the codes of
   its nonzeros (``nonzeros``);
7. codes at the bits the policy gives (log_softmax's output, saved by an op that reads it through
   exp, as codes of its probabilities: ``daf.codec.logprob``); 0 bits keeps it raw.

Other tensors without autograd history (input data, statistics such as attention's logsumexp,
values computed under no_grad) stay raw (the session remakes the logsumexp with fused attention's
output where it remakes that output: ``daf.runtime.derived.DerivedStatistic``): backward may feed them to exp(), which turns a
quantization step into a multiplicative error, and input batches are held by the caller anyway.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from daf.codec.mask import MASK_DTYPES, two_values
from daf.codec.nonzeros import nonzeros_of
from daf.format import FLOAT_DTYPES
from daf.tracing import (REGION_RULES, OpCall, cast_of_parameter, frozen_parameter_of_cast, parameter_of_cast,
                         region_of, stored_as_probabilities)

__all__ = ["Kind", "Encoding", "Context", "Remake", "route", "derives"]


class Kind(enum.Enum):
    PARAMETER = "parameter"
    DERIVED = "derived"
    RAW = "raw"
    SHARED = "shared"
    RELU_MASK = "relu_mask"
    REGION_MASK = "region_mask"
    MASK = "mask"
    NONZEROS = "nonzeros"
    CODES = "codes"

    @property
    def stored(self) -> bool:
        """Whether DAF encodes and stores the tensor (else autograd keeps it, or an earlier record)."""
        return self in (Kind.RELU_MASK, Kind.REGION_MASK, Kind.MASK, Kind.NONZEROS, Kind.CODES)


@dataclass(frozen=True)
class Encoding:
    """How one saved tensor is kept: ``kind``, code width ``bits`` (1 for masks, None when not
    stored), the registry name of its ``codec``, and the two ``values`` of a mask. ``data`` is what
    the codec encodes when it is not the tensor itself (the nonzeros), or for a derived save the parameter it is
    derived from (or the records (x, mask) of a product); it takes no part in equality."""

    kind: Kind
    bits: int | None = None
    codec: str | None = None
    values: tuple[float, float] | None = None
    data: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Remake:
    """How a save is remade in backward: ``function(*decoded records)``. ``bits``: the coarsest code width
    among the records (32 for one kept raw), which bounds the remade tensor's error. ``with_statistic``:
    ``function`` returns the tensor and a statistic that the same op saved beside it (fused attention's
    logsumexp), remade together so that backward sees the two agree. ``rule``: the name of the remake rule
    that found it (``daf.runtime.remakes``); ``why``: the report's reason (what, from which records).
    ``made_by``: the autograd node (and output number) whose value ``function`` remakes, behind views, where
    the rule knows it: saves of one forward with the same ``made_by`` and shape are one remade tensor."""

    records: tuple[Any, ...]
    function: Callable[..., Any]
    bits: int
    with_statistic: bool = False
    rule: str = ""
    why: str = ""
    made_by: tuple[Any, int] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Context:
    """What routing knows besides the tensor. ``shared``: the record of an earlier save of this tensor,
    if one is stored (else None); ``relu_mask``: the record of ReLU's mask of this very tensor, if one is
    stored; ``input_made_here``: the tensor has no autograd history, was made in this forward by a
    submodule (a frozen layer's output) and is saved by a linear, matmul or convolution, whose backward
    only multiplies by it; ``product_of``: the records (x, mask) when the tensor is x times an exact mask,
    both stored in this forward; ``remake``: how to remake the tensor from records of this forward
    (f(x) for SiLU, GELU, a LayerNorm or an RMSNorm; attention's output from q, k and v, its
    probabilities from the scores' operands); ``bits_for(site, x, op)``: the policy. The session reuses the records it looked up here."""

    site: str
    op: OpCall | None
    is_parameter: bool
    shared: Any | None
    relu_mask: Any | None
    masks: bool
    min_numel: int
    nonzeros_only: bool
    bits_for: Callable[[str, torch.Tensor, OpCall | None], int]
    input_made_here: bool = False
    product_of: tuple[Any, Any] | None = None
    remake: Remake | None = None


PARAMETER = Encoding(Kind.PARAMETER)
RAW = Encoding(Kind.RAW)
KEPT_BY_POLICY = Encoding(Kind.RAW, 0)  # the policy gave 0 bits
SHARED = Encoding(Kind.SHARED)
RELU_MASK = Encoding(Kind.RELU_MASK, 1, "relu_mask")


def route(tensor: torch.Tensor, context: Context) -> Encoding:
    """The encoding of ``tensor`` saved at ``context.site`` (the rules in the module docstring)."""
    if context.is_parameter:
        return PARAMETER
    parameter = parameter_of_cast(tensor)
    if parameter is None and tensor.grad_fn is None and context.op is not None and context.op.weight_arguments:
        parameter = frozen_parameter_of_cast(tensor, context.op.weight_arguments)
    if parameter is not None:
        return Encoding(Kind.DERIVED, data=parameter)
    if cast_of_parameter(tensor):
        return RAW
    if context.masks and context.op is not None and context.op.is_relu and is_relu_result(tensor):
        return RELU_MASK
    region = None
    if context.masks and context.op is not None and context.op.func in REGION_RULES \
            and compressible(tensor, context.min_numel):  # the op first: compressible reads float64 saves whole
        region = region_of(tensor, context.op)
    if region is not None:
        return Encoding(Kind.REGION_MASK, 1, "mask", region[1], data=region[0])
    if not compressible(tensor, context.min_numel, context.input_made_here):
        return _mask_or(tensor, context, RAW)
    if context.shared is not None:
        return SHARED
    if context.product_of is not None:
        return Encoding(Kind.DERIVED, data=context.product_of)
    bits = None  # asked of the policy once per save: an adaptive plan keeps a running balance of bytes
    if context.remake is not None:
        bits = context.bits_for(context.site, tensor, context.op)
        if derives(bits, context):
            return Encoding(Kind.DERIVED, data=context.remake)
    mask = _mask_or(tensor, context, None)
    if mask is not None:
        return mask
    nonzeros = nonzeros_of(tensor, context.min_numel) if context.relu_mask is not None and context.nonzeros_only else None
    if bits is None or nonzeros is not None:
        bits = context.bits_for(context.site, tensor if nonzeros is None else nonzeros, context.op)
    if bits == 0:
        return KEPT_BY_POLICY
    if nonzeros is not None:
        return Encoding(Kind.NONZEROS, bits, "codes", data=nonzeros)
    return Encoding(Kind.CODES, bits, "logprobs" if stored_as_probabilities(tensor, context.op) else "codes")


def derives(bits: int, context: Context) -> bool:
    """Whether a save is remade from its input records: when the policy gives it ``bits``, no more than
    the coarsest record holds (an adaptive plan that values a linear's input above the norm's keeps codes
    of its own), and does not keep it raw (0)."""
    return bits != 0 and context.remake.bits >= bits


def _mask_or(tensor: torch.Tensor, context: Context, otherwise: Encoding | None) -> Encoding | None:
    """An exact mask when ``tensor`` holds two values (and masks are on), else ``otherwise``."""
    if not context.masks or tensor.dtype not in MASK_DTYPES or tensor.layout != torch.strided \
            or tensor.numel() < max(context.min_numel, 1) or tensor.is_meta:
        return otherwise
    values = two_values(tensor)
    return otherwise if values is None else Encoding(Kind.MASK, 1, "mask", values)


def is_relu_result(tensor: torch.Tensor) -> bool:
    return (tensor.grad_fn is not None and type(tensor.grad_fn).__name__ == "ReluBackward0"
            and tensor.dtype.is_floating_point and tensor.layout == torch.strided and not tensor.is_meta)


def compressible(tensor: torch.Tensor, min_numel: int, input_made_here: bool = False) -> bool:
    return ((tensor.grad_fn is not None or input_made_here) and tensor.dtype in FLOAT_DTYPES
            and tensor.numel() >= max(min_numel, 1) and tensor.layout == torch.strided and not tensor.is_meta
            and (tensor.dtype != torch.float64 or within_codec_range(tensor)))


# The codes carry a group's min and step in bfloat16 and compute in float32: magnitudes outside
# [2**-120, 2**120] lose every significant digit there (float64 values around 1e-60 all decoded to 0).
_SMALLEST, _LARGEST = 2.0**-120, 2.0**120


def within_codec_range(tensor: torch.Tensor) -> bool:
    """Whether every finite nonzero magnitude of ``tensor`` is in [2**-120, 2**120]. Only float64
    can hold others in practice (float32 below 2**-120 are near-denormals: their absolute error,
    under 2**-124, is what quantization allows anyway). O(numel)."""
    magnitude = tensor.detach().abs()
    inside = (magnitude == 0) | ~torch.isfinite(magnitude) | ((magnitude >= _SMALLEST) & (magnitude <= _LARGEST))
    return bool(inside.all())
