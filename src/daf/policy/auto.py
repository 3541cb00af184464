"""The default bit policy (``daf.Auto``): a width per save, chosen from what backward does with it.

Measured on held-out models at random init (``benchmarks/default_safety.py``, docs/policy.md "The
default"): one width for everything is wrong for someone. 2 bits trains CNNs (ResNet-18 within half a
point of fp32 over three seeds) and leaves transformers' gradients at cosine 0.4-0.9; 4 bits keeps
transformers' linear inputs, norms and activations; what backward reads through a saturating derivative
(``1 - t**2`` of tanh's output, ``s * (1 - s)`` of sigmoid's, ``p * (g - sum(p * g))`` of softmax's
probabilities) or multiplies into the probabilities' gradient (fused attention's v) loses most there, and
keeps 8. Fused attention's q and k are the exponent guard's (``logit_bits``), whatever the policy.

The rules read the saving call and the tensor only: no statistics, no state, the same width every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from daf.config import Auto
from daf.policy.uniform import Policy
from daf.tracing import OpCall

__all__ = ["AutoPolicy", "FEATURE_MAP_FUNCTIONS", "FEATURE_MAP_PRODUCERS", "SENSITIVE_NODES", "made_as_feature_map",
           "values_of_probabilities"]

# Torch functions whose saves, 3-D and more, are a CNN's feature maps (names as OpCall.name gives them).
FEATURE_MAP_FUNCTIONS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "batch_norm",
    "instance_norm", "group_norm", "relu", "relu_", "relu6", "hardtanh", "leaky_relu", "max_pool1d",
    "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool2d", "interpolate", "upsample", "pad",
    "dropout2d", "hardswish", "hardsigmoid",
})
# Autograd nodes (name prefixes) that make a ReLU CNN's feature maps: convolutions, batch and group norms,
# ReLU-like activations, pooling, resampling, padding and concatenation. A feature map made by anything
# else (a ConvNeXt's LayerNorm, through a permute; a residual stream's add) gets ``bits``: 2 bits kept
# ResNet-style models' gradients, but ConvNeXt's at 0.86 (0.44 with large channels), 4 bits at 0.99.
FEATURE_MAP_PRODUCERS = (
    "Convolution", "CudnnConvolution", "MkldnnConvolution", "NativeBatchNorm", "CudnnBatchNorm",
    "NativeGroupNorm", "Relu", "Threshold", "Hardtanh", "LeakyRelu", "Hardswish", "Hardsigmoid", "MaxPool",
    "AvgPool", "AdaptiveAvgPool", "AdaptiveMaxPool", "Upsample", "Cat", "ConstantPadNd", "ReflectionPad",
    "ReplicationPad",
)
# Autograd nodes whose output backward reads through a derivative that vanishes where it saturates.
SENSITIVE_NODES = frozenset({"TanhBackward0", "SigmoidBackward0", "SoftmaxBackward0", "SafeSoftmaxBackward0"})


# Products whose operand may be softmax's probabilities (eager attention's ``p @ v``), as OpCall.name gives them
PRODUCT_FUNCTIONS = frozenset({"matmul", "__matmul__", "bmm", "baddbmm", "einsum"})
# Nodes between softmax's output and a product's operand that keep it the probabilities (dropout, a cast, views)
_PROBABILITIES_THROUGH = frozenset({
    "NativeDropoutBackward0", "MulBackward0", "ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "ExpandBackward0", "CloneBackward0", "ReshapeAliasBackward0"})
_SOFTMAX = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0"})
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ExpandBackward0", "CloneBackward0",
                    "ReshapeAliasBackward0", "TransposeBackward0", "PermuteBackward0"})


def _is_probabilities(t: torch.Tensor) -> bool:
    """Whether ``t`` is softmax's output, or that through dropout, a cast or a view."""
    return _walks_back_to(t.grad_fn, _PROBABILITIES_THROUGH, lambda node: type(node).__name__ in _SOFTMAX, 5)


def values_of_probabilities(x: torch.Tensor, op: OpCall | None) -> bool:
    """Whether ``x`` is attention's values outside the fused kernels: the other operand of a product with
    softmax's probabilities (eager attention's ``p @ v``), or the copy of ``value`` that the math path of
    ``scaled_dot_product_attention`` saves for its own product. Backward multiplies it into the
    probabilities' gradient (``dP = dO v^T``, then ``p * (dP - sum(p dP))``) as the fused kernels' v, and it
    gets ``sensitive_bits`` as that one does: T5 with large channels (the math path), one gradient, cosine
    0.871 with v at 4 bits, 0.927 at 8 (q and k at 8 instead: 0.869)."""
    if op is None or not x.dtype.is_floating_point or _is_probabilities(x):
        return False
    if op.name in PRODUCT_FUNCTIONS:
        return any(_is_probabilities(t) for t in op.tensor_arguments)
    value = op.attention_value
    return value is not None and value.grad_fn is not None and x.grad_fn is not value.grad_fn \
        and _descends_from(x, value.grad_fn)


def _descends_from(x: torch.Tensor, node: object) -> bool:
    """Whether ``x`` is the output of ``node`` through views, expansions and copies."""
    return _walks_back_to(x.grad_fn, _VIEWS, lambda current: current is node, 6)


def _walks_back_to(node: Any, through: frozenset[str], found: Callable[[Any], bool], depth: int) -> bool:
    """Whether ``found`` holds for ``node`` or a node behind it along first inputs, passing only ``through``."""
    for _ in range(depth):
        if node is not None and found(node):
            return True
        if node is None or type(node).__name__ not in through or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


_REASONS = {"bits": "auto: linear, norm or activation input", "feature_map_bits": "auto: feature map",
            "feature_map_after_norm": "auto: feature map made by a norm or an add, not a ReLU CNN's",
            "sensitive_bits": "auto: saturating derivative or attention values"}
_EAGER_VALUES_REASON = "auto: attention values (the other operand of softmax's probabilities)"
_LARGE_WEIGHT_REASON = "auto: batch norm input, its weight has large channels"
_NONZEROS_REASONS = {"bits": "auto: nonzeros of a ReLU output, at most half of it",
                     "feature_map_bits": "auto: nonzeros of a ReLU output, more than half of it"}
_GROUP_NORM_REASON = "auto: group norm input (its output and the activation's are remade from it)"


def _group_norm_input(x: torch.Tensor, op: OpCall | None) -> bool:
    """A group norm's input gets ``bits``, not ``feature_map_bits``: the norm's output, which SiLU or GELU
    saves at ``bits``, and the activation's output, saved by the next conv, are both remade from it
    (``daf.runtime.remakes.blocks``), where 2-bit codes of it would hold too little for either. Measured on a
    U-Net with group norms and SiLU at random init: 9.3x -> 11.2x stored, gradient error 0.94x
    (``benchmarks/block_remakes.py``)."""
    return op is not None and op.name == "group_norm" and x.grad_fn is not None and x.dim() >= 3


# A norm whose weight has channels this many times its median magnitude: its backward multiplies its input's
# error by that weight, so those channels' 2-bit noise dominates the gradients below it (the Outliers rule).
LARGE_WEIGHT = 8.0


def _norm_with_large_weight(x: torch.Tensor, op: OpCall | None) -> bool:
    """A batch norm's input, 3-D and more, whose weight has large channels: it gets ``bits``, not
    ``feature_map_bits``. A Hugging Face ResNet with two channels of every norm scaled by 60: gradient cosine
    0.53 -> 0.95, our ResNet-style one 0.93 -> 0.99, ratio 11.4x -> 11.0x; a norm's weight at init (ones) never
    has them. The check reads the weight (C numbers), not the save."""
    if op is None or op.name != "batch_norm" or x.dim() < 3:
        return False
    args, kwargs = getattr(op, "args", ()), getattr(op, "kwargs", {})
    weight = kwargs.get("weight", args[3] if len(args) > 3 else None)
    if not isinstance(weight, torch.Tensor) or weight.numel() < 2:
        return False
    magnitude = weight.detach().abs().float()
    return bool(magnitude.max() >= LARGE_WEIGHT * magnitude.median())


# The density of nonzeros under which codes of a ReLU output's nonzeros at ``bits`` (4, plus a group's
# 32 bits of min and scale per 256) cost no more than ``feature_map_bits`` (2) codes of the whole map.
_NONZEROS_BREAK_EVEN = (2 + 32 / 256) / (4 + 32 / 256)


def _nonzeros_field(x: torch.Tensor, op: OpCall | None) -> str | None:
    """For ``x`` the nonzeros of a ReLU output that a feature-map op saves (a 1-D tensor the session passes
    in place of the map, its zeros exact in ReLU's mask): ``bits`` where the map is at most
    ``_NONZEROS_BREAK_EVEN`` nonzero, else ``feature_map_bits`` (over the nonzeros, whose groups no longer
    span the zeros). Either way no more bytes than 2-bit codes of the whole map, and a finer step on every
    element (resnet18-fmnist's model, one step: cosine 0.914 -> 0.977, 12.26x -> 12.3x). None otherwise."""
    if x.dim() != 1 or op is None or op.name not in FEATURE_MAP_FUNCTIONS:
        return None
    maps = [t for t in op.tensor_arguments if t.dim() >= 3 and t.dtype == x.dtype]
    if not maps:
        return None
    return "bits" if x.numel() <= _NONZEROS_BREAK_EVEN * maps[0].numel() else "feature_map_bits"


class AutoPolicy(Policy):
    """``daf.Auto``'s rules: feature maps at ``feature_map_bits``, saturating outputs and fused attention's
    v at ``sensitive_bits``, everything else at ``bits``; a ReLU output's nonzeros (its zeros come from
    ReLU's exact mask, ``codes_nonzeros_only``) at ``bits`` where they are at most half the map."""

    codes_nonzeros_only = True

    def __init__(self, config: Auto) -> None:
        self.config = config

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        return self.bits_for_call(site, x, None)

    def bits_for_call(self, site: str, x: torch.Tensor, op: OpCall | None) -> int:
        return getattr(self.config, self.rule(x, op))

    @staticmethod
    def rule(x: torch.Tensor, op: OpCall | None) -> str:
        """The name of the ``Auto`` field that gives ``x`` its width."""
        return _choice(x, op)[0]

    def reason(self, x: torch.Tensor, op: OpCall | None) -> str:
        return _choice(x, op)[1]

    def choice(self, site: str, x: torch.Tensor, op: OpCall | None) -> tuple[int, str]:
        field, why = _choice(x, op)  # once per save: the batch norm weight check syncs a CUDA device
        return getattr(self.config, field), why

    def summary(self) -> dict[str, Any]:
        c = self.config
        return {"policy": "auto", "bits": c.bits, "feature_map_bits": c.feature_map_bits,
                "sensitive_bits": c.sensitive_bits}


def _choice(x: torch.Tensor, op: OpCall | None) -> tuple[str, str]:
    """(the ``Auto`` field that gives ``x`` its width, the report's reason), each rule's check made once."""
    nonzeros = _nonzeros_field(x, op)
    if nonzeros is not None:
        return nonzeros, _NONZEROS_REASONS[nonzeros]
    group_norm, large_weight = _group_norm_input(x, op), _norm_with_large_weight(x, op)
    feature_map = op is not None and op.name in FEATURE_MAP_FUNCTIONS and x.dim() >= 3
    node = type(x.grad_fn).__name__ if x.grad_fn is not None else None
    eager_values = values_of_probabilities(x, op)
    if node in SENSITIVE_NODES or eager_values or (op is not None and op.fused_attention_role(x) == "values"):
        field = "sensitive_bits"
    elif feature_map and made_as_feature_map(x) and not group_norm and not large_weight:
        field = "feature_map_bits"
    else:
        field = "bits"
    if eager_values:
        return field, _EAGER_VALUES_REASON
    if group_norm:
        return field, _GROUP_NORM_REASON
    if large_weight and made_as_feature_map(x):
        return field, _LARGE_WEIGHT_REASON
    if field == "bits" and feature_map:
        return field, _REASONS["feature_map_after_norm"]
    return field, _REASONS[field]


def made_as_feature_map(x: torch.Tensor) -> bool:
    """Whether ``x`` was made by an op of a ReLU CNN (``FEATURE_MAP_PRODUCERS``), or is an input (no history)."""
    return x.grad_fn is None or type(x.grad_fn).__name__.startswith(FEATURE_MAP_PRODUCERS)
