"""Saved tensors that are a function of another saved tensor: another tensor times a mask, as dropout
makes them on a CPU; an activation's output (SiLU, GELU) whose input the activation itself saved.

``F.dropout`` on a CPU computes ``x * noise`` (``noise``: no autograd history, two values, 0 and
``1 / (1 - p)``); the multiply saves ``noise`` and the next op (attention's ``p @ v``, a linear)
saves the product. When ``x`` is itself saved (attention's probabilities, saved by the softmax),
the product holds nothing that ``x`` and the mask do not: the session derives it from their records
instead of storing a third copy (``daf.runtime.derived.DerivedProduct``).

A LayerNorm's output saved by the next linear (BERT's layer output, read by the LoRA adapters of the
next layer's query and value) holds nothing the norm's own saves do not: its input, mean and
reciprocal standard deviation, weight and bias. It is remade as ``(x - mean) * rstd * w + b`` from
the input's record.

A gated MLP (Llama, SmolLM2, Mistral: ``silu(gate) * up``) saves ``gate`` (for SiLU's backward) and
``silu(gate)`` (for the multiply's); a full fine-tune's MLP saves GELU's input and, for the next
linear, its output. The output holds nothing the input's record does not: the session remakes it as
``silu(decoded gate)`` in backward (``daf.runtime.derived.DerivedActivation``) instead of storing it.

An RMSNorm written as elementwise ops (Llama, Mistral, Qwen2, T5, and ``torch.nn.RMSNorm`` on a CPU:
``w * (x * rsqrt(mean(x**2) + eps))``) is the same case: its output, saved by the next layer's LoRA
adapters, is remade as ``(x * r) * w`` from the input's record and the saved ``r``.

Fused attention on a CPU saves q, k, v and its output. The output is remade from the records of q, k and
v by running the kernel again in backward: nothing of it stored, and backward's
``rowsum(dO * out)`` then matches ``dO v^T`` computed from the same decoded v, where separately coded
copies of ``out`` and ``v`` cancel badly under sharp attention.

The math path of ``scaled_dot_product_attention`` (on a CPU whenever dropout is on: BERT fine-tuning)
saves the probabilities ``softmax(q' @ k'^T + bias)``, as large as batch x heads x tokens x tokens,
beside the two products' operands ``q'`` and ``k'^T`` (scaled by the square root of the scale). The
probabilities are remade in backward from those two records and an exact copy of the call's mask
taken in forward, bit for bit the forward's when the records are kept raw: nothing of them stored (the dropped map, the probabilities
times dropout's noise, is derived from them as before).

This module only reads the autograd graph: which node multiplied, which of its inputs had history.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["nodes_made_by", "MaskedProduct", "masked_product_of", "ActivationOutput", "activation_output_of", "normalized_output_of",
           "rms_normalized_output_of", "AttentionOutput", "attention_output_of",
           "AttentionMap", "attention_map_of", "exact_copy", "over_last_dimension"]

# Nodes whose output holds its input's elements in the same row-major order (an expand to the same
# number of elements is the identity): the product can be remade as ``(x * mask).reshape(shape)``.
_ORDER_KEEPING = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0"})


@dataclass(frozen=True)
class MaskedProduct:
    """``tensor == (x * mask).reshape(tensor.shape)``: ``x`` is output ``output_nr`` of autograd node
    ``node``; the mask is the tensor that the multiply's node ``multiply`` saved as ``mask_attribute``."""

    node: Any
    output_nr: int
    multiply: Any
    mask_attribute: str


def _behind_views(tensor: torch.Tensor) -> tuple[Any, int]:
    """The autograd node (and its output's number) that made ``tensor`` before any order-keeping views;
    (None, 0) when there is none or ``tensor`` is not contiguous (what is remade is)."""
    node, output_nr = tensor.grad_fn, tensor.output_nr
    if node is None or not tensor.is_contiguous():
        return None, 0
    while type(node).__name__ in _ORDER_KEEPING:
        node, output_nr = node.next_functions[0]
        if node is None:
            return None, 0
    return node, output_nr


def nodes_made_by(tensors: list[torch.Tensor], stop: set[int], most: int = 16) -> list[Any]:
    """The autograd nodes a call made: from its output ``tensors``' nodes back to the nodes whose ids are
    ``stop`` (its arguments'; ``OpCall.argument_nodes``), at most ``most`` of them, which no single torch
    function nears."""
    made: list[Any] = []
    pending = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: set[int] = set()
    while pending and len(made) < most:
        node = pending.pop()
        if node is None or id(node) in stop or id(node) in seen:
            continue
        seen.add(id(node))
        made.append(node)
        pending.extend(next_node for next_node, _ in node.next_functions)
    return made


def masked_product_of(tensor: torch.Tensor) -> MaskedProduct | None:
    """Whether ``tensor`` is, through order-keeping views, ``x * m`` with ``x`` from the graph and ``m``
    without history (dropout's noise; whether ``m`` is an exact mask, the caller checks).
    Contiguous tensors only: the remade product is contiguous."""
    node, _ = _behind_views(tensor)
    if type(node).__name__ != "MulBackward0":
        return None
    (left, left_nr), (right, right_nr) = node.next_functions
    if left is not None and right is None:
        return MaskedProduct(left, left_nr, node, "_saved_other")
    if left is None and right is not None:
        return MaskedProduct(right, right_nr, node, "_saved_self")
    return None


@dataclass(frozen=True)
class ActivationOutput:
    """``tensor == function(x)``: ``x`` is output ``output_nr`` of autograd node ``node`` (the activation's
    input, which its own node saved). ``made_by``: the node (and output number) that made the tensor
    ``function`` remakes, behind views: two saves with one ``made_by`` are views of one value (the same
    norm output saved by a query's and a value's LoRA)."""

    node: Any
    output_nr: int
    function: Callable[[torch.Tensor], torch.Tensor]
    made_by: tuple[Any, int] | None = None


def activation_output_of(tensor: torch.Tensor) -> ActivationOutput | None:
    """Whether ``tensor`` is the output of SiLU or GELU (either approximation) applied to a tensor with
    history, and the function that remakes it from that input."""
    node = tensor.grad_fn
    name = type(node).__name__ if node is not None else None
    if name == "SiluBackward0":
        function = F.silu
    elif name == "GeluBackward0":
        function = functools.partial(F.gelu, approximate=node._saved_approximate)
    else:
        return None
    source, output_nr = node.next_functions[0]
    return None if source is None else ActivationOutput(source, output_nr, function, (node, tensor.output_nr))


def _always(node: Any) -> bool:
    return True


def normalized_output_of(tensor: torch.Tensor, readable: Callable[[Any], bool] = _always) -> ActivationOutput | None:
    """Whether ``tensor`` is, through order-keeping views (a linear's flattening of its input), the
    output of ``layer_norm`` applied to a tensor with history, and the function that remakes it from
    that input with the norm's saved mean, reciprocal standard deviation, weight and bias. Reading
    those goes through the hooks that saved them, so only nodes that ``readable`` accepts are read
    (another hook's unpack may do anything: checkpointing's recomputes the whole block)."""
    node, output_nr = _behind_views(tensor)
    if type(node).__name__ != "NativeLayerNormBackward0" or output_nr != 0:
        return None
    source, source_nr = node.next_functions[0]
    if source is None or not readable(node):
        return None
    try:
        function = functools.partial(_normalized, mean=node._saved_result1, rstd=node._saved_result2,
                                     weight=node._saved_weight, bias=node._saved_bias, shape=tuple(tensor.shape))
    except RuntimeError:  # its saves already freed (a graph backward has run through): nothing to remake from
        return None
    return ActivationOutput(source, source_nr, function, (node, output_nr))


def _normalized(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """``layer_norm``'s output from its input and saved statistics, in float32 as the CPU kernel computes."""
    y = (x.float() - mean.float()) * rstd.float()
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(shape)


def rms_normalized_output_of(tensor: torch.Tensor, readable: Callable[[Any], bool] = _always) -> ActivationOutput | None:
    """Whether ``tensor`` is, through order-keeping views, ``x * r`` with ``r`` made by ``rsqrt`` (an
    RMSNorm without weight), or that times a weight (a tensor without history, or a leaf: the norm's
    frozen or trained scale), and the function that remakes it from ``x`` with the saved ``r`` and weight.
    Only nodes that ``readable`` accepts have their saved tensors read (see ``normalized_output_of``)."""
    node, node_nr = _behind_views(tensor)
    if type(node).__name__ != "MulBackward0" or not readable(node):
        return None
    weight = None
    scaled = _rsqrt_scaling(node)
    if scaled is None:
        inner, weight_attribute = _weighted(node)
        scaled = _rsqrt_scaling(inner) if inner is not None and readable(inner) else None
        if scaled is None:
            return None
        try:
            weight = getattr(node, weight_attribute)
        except RuntimeError:  # its saves already freed
            return None
        if weight.numel() >= tensor.numel():  # not a per-channel scale: a full-size factor (dropout's noise)
            return None
    source, source_nr, rstd = scaled
    return ActivationOutput(source, source_nr,
                            functools.partial(_rms_normalized, rstd=rstd, weight=weight, shape=tuple(tensor.shape)),
                            (node, node_nr))


def _rsqrt_scaling(node: Any) -> tuple[Any, int, torch.Tensor] | None:
    """(x's node, its output number, r) when ``node`` multiplied ``x`` (with history) by ``r = rsqrt(...)``."""
    if type(node).__name__ != "MulBackward0":
        return None
    (left, left_nr), (right, right_nr) = node.next_functions
    for (x, x_nr), (r, _), r_attribute in (((left, left_nr), (right, right_nr), "_saved_other"),
                                            ((right, right_nr), (left, left_nr), "_saved_self")):
        if x is not None and type(r).__name__ == "RsqrtBackward0":
            try:
                return x, x_nr, getattr(node, r_attribute)
            except RuntimeError:
                return None
    return None


def _weighted(node: Any) -> tuple[Any, str | None]:
    """(the other factor's node, the attribute holding the weight) when ``node`` multiplied a tensor with
    history by a weight: a tensor without history or a leaf (``AccumulateGrad``)."""
    (left, _), (right, _) = node.next_functions
    if left is not None and (right is None or type(right).__name__ == "AccumulateGrad"):
        return left, "_saved_other"
    if right is not None and (left is None or type(left).__name__ == "AccumulateGrad"):
        return right, "_saved_self"
    return None, None


def _rms_normalized(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
                    shape: tuple[int, ...]) -> torch.Tensor:
    """The RMSNorm's output from its input, in the order forward multiplied."""
    y = x * rstd
    return (y if weight is None else y * weight).reshape(shape)


@dataclass(frozen=True)
class AttentionOutput:
    """``tensor == function(q, k, v[, attn_mask])``, where q, k, v and the mask (if there is one) are what
    attention node ``node`` saved as ``attributes`` and ``mask_attribute``."""

    node: Any
    attributes: tuple[str, str, str]
    mask_attribute: str
    function: Callable[..., torch.Tensor]


_CPU_FLASH = "ScaledDotProductFlashAttentionForCpuBackward0"


def attention_output_of(tensor: torch.Tensor) -> AttentionOutput | None:
    """Whether ``tensor`` is the output of the CPU fused-attention kernel without dropout, and the
    function that runs the kernel again (same causality and scale; the mask is read, like q, k and v,
    from its record in backward: a decoded copy held from now on would cost its full size). The function
    returns the output and its logsumexp."""
    node = tensor.grad_fn
    if type(node).__name__ != _CPU_FLASH or tensor.output_nr != 0:
        return None
    try:
        if node._saved_dropout_p != 0.0:
            return None  # its random mask is not saved
        function = functools.partial(_cpu_flash_attention, is_causal=node._saved_is_causal, scale=node._saved_scale)
    except RuntimeError:
        return None
    return AttentionOutput(node, ("_saved_query", "_saved_key", "_saved_value"), "_saved_attn_mask", function)


def _cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                         *, is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and its logsumexp, both from the same (decoded) q and k: backward recomputes the
    probabilities as exp(q k^T - logsumexp), which sum to one only when the two agree."""
    output, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    return output, logsumexp


@dataclass(frozen=True)
class AttentionMap:
    """``tensor == function(q', k'^T)``, the softmax of the scores plus the call's bias, where ``q'`` and
    ``k'^T`` are what the scores' matrix product ``node`` saved as ``attributes``."""

    node: Any
    attributes: tuple[str, str]
    function: Callable[..., torch.Tensor]


_SOFTMAX_FUNCTIONS = {"SafeSoftmaxBackward0": torch.ops.aten._safe_softmax, "SoftmaxBackward0": torch.softmax}
_PRODUCTS = frozenset({"BmmBackward0", "MmBackward0"})


def over_last_dimension(node: Any, tensor: torch.Tensor) -> bool:
    """Whether softmax's or log_softmax's node ``node``, which made ``tensor``, ran over its last dimension."""
    try:
        return node._saved_dim in (-1, tensor.dim() - 1, 2**64 - 1)  # -1 reads back unsigned
    except RuntimeError:  # its saves already freed
        return False


def exact_copy(mask: torch.Tensor) -> torch.Tensor:
    """A copy of ``mask`` that no later write to it reaches, as ``mask`` (same shape and values); a
    broadcast dimension (stride 0, HF's ``expand`` of a [B, 1, 1, T] padding mask) is copied once, not
    materialized. O(elements actually stored)."""
    compact = mask
    for dim, stride in enumerate(mask.stride()):
        if stride == 0 and mask.shape[dim] > 1:
            compact = compact.narrow(dim, 0, 1)
    return compact.clone().expand(mask.shape)


def attention_map_of(tensor: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                     hold: Callable[[torch.Tensor], torch.Tensor] = exact_copy) -> AttentionMap | None:
    """Whether ``tensor`` is the probabilities of attention's math path, called with ``attn_mask`` and
    ``is_causal``: softmax over the last dimension of a matrix product's output viewed as ``tensor``,
    plus the bias made from the mask (the mask without history: it is held, not remade), and the
    function that remakes it from the product's two operands.

    The function holds ``hold(attn_mask)``, an exact copy, never the caller's mask: a mask can change
    before backward where no version counter sees it (``torch.from_numpy`` over a reused buffer, a
    write through ``.data``) or where one does (a second forward refreshing the buffer in place before
    one backward over both), and plain autograd, which saved the probabilities, is unaffected by either."""
    node = tensor.grad_fn
    softmax = _SOFTMAX_FUNCTIONS.get(type(node).__name__) if node is not None else None
    if softmax is None or tensor.output_nr != 0 or not tensor.is_contiguous():
        return None
    if not over_last_dimension(node, tensor):
        return None
    scores, _ = node.next_functions[0]
    biased = attn_mask is not None or is_causal
    if biased != (type(scores).__name__ == "AddBackward0"):
        return None
    if biased:
        (scores, _), (bias_node, _) = scores.next_functions
        if bias_node is not None:  # a bias with history (a learned position bias): not held here
            return None
    while type(scores).__name__ in _ORDER_KEEPING:
        scores, _ = scores.next_functions[0]
    if type(scores).__name__ not in _PRODUCTS:
        return None
    mask = None if attn_mask is None else hold(attn_mask)
    function = functools.partial(_attention_map, softmax=softmax, mask=mask, is_causal=is_causal,
                                 shape=tuple(tensor.shape))
    return AttentionMap(scores, ("_saved_self", "_saved_mat2"), function)


def _bias(attn_mask: torch.Tensor | None, is_causal: bool, scores: torch.Tensor) -> torch.Tensor | None:
    """What the math path adds to the scores: a float mask as given; a boolean one, or the causal
    triangle, as 0 where attended and -inf elsewhere, in the scores' dtype. Made in backward, so that
    forward holds only the caller's mask."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        return attn_mask
    if attn_mask is None:
        if not is_causal:
            return None
        rows, columns = scores.shape[-2:]
        attn_mask = torch.ones(rows, columns, dtype=torch.bool, device=scores.device).tril()
    return torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(scores.dtype)


def _attention_map(q: torch.Tensor, k_t: torch.Tensor, *, softmax: Callable[..., torch.Tensor],
                   mask: torch.Tensor | None, is_causal: bool, shape: tuple[int, ...]) -> torch.Tensor:
    """The probabilities from the decoded operands and the mask's copy, in the order the math path
    computed them."""
    scores = (torch.bmm(q, k_t) if q.dim() == 3 else torch.mm(q, k_t)).view(shape)
    bias = _bias(mask, is_causal, scores)
    if bias is not None:
        scores = scores + bias
    return softmax(scores, -1)
