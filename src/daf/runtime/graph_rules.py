"""What a compiled graph's save gets, decided at trace time from the graph alone: op, shape, dtype.

AOTAutograd traces DAF's pack hook once per saved value (``daf.runtime.in_graph``) and says which forward
node is saved and which backward nodes read it. These rules are the graph's reading of the eager policy
(``daf.Auto``, ``daf.policy.auto``): a feature map (what convolutions, batch norms, pooling and the ReLUs
between them make or read, 3-D and more) gets ``feature_map_bits``; what backward reads through a saturating
or exponentiating function (tanh's, sigmoid's, softmax's outputs, or their inputs where the compiler
recomputes the function in backward) and fused attention's v and output get ``sensitive_bits``; everything
else ``bits``. Under ``Uniform`` every coded save gets ``Config.bits``. A policy that decides from data at
run time (``Adaptive``, registered ones) cannot: its saves get 8 bits, and the report says so.

What stays raw, and why, is in each ``Decision``: integers (pooling indices), fewer than
``Config.min_numel`` elements, overlapping or broadcast views, and fused attention's q, k and logsumexp,
whose safe width depends on the logits' magnitude (``daf.policy.exponent_guard``), which a trace does not see.
Graph nodes are read by their ``target`` names, for both backends: ``aot_eager`` keeps backward ops whole
(``aten.threshold_backward``), inductor decomposes them (a ReLU's mask saved as a bool, tanh recomputed
from its input), and both forms are in the tables below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from daf.config import Auto, Config, Uniform
from daf.format import dense_order

__all__ = ["Decision", "GraphWidths", "Readers", "decide", "memory_order", "permuted_in_forward", "producer_of",
           "readers_of", "values_of_probabilities"]

FALLBACK_BITS = 8

# Ops that give a view or an unchanged copy of their first argument: a save's producer is looked up past them.
_PASS_THROUGH = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.transpose.int",
    "aten.permute.default", "aten.t.default", "aten.detach.default", "aten.alias.default", "aten.expand.default",
    "aten.squeeze.dim", "aten.squeeze.dims", "aten.unsqueeze.default", "aten.clone.default",
    "aten.contiguous.default", "prims.convert_element_type.default", "<built-in function getitem>",
})
_ALIASES = frozenset({"aten.detach.default", "aten.alias.default"})
_FEATURE_MAP_PRODUCERS = frozenset(f"aten.{name}.default" for name in (
    "convolution", "relu", "_native_batch_norm_legit_functional", "native_batch_norm", "_native_batch_norm_legit",
    "native_group_norm", "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool2d", "avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d", "hardtanh", "leaky_relu", "relu6",
    "hardswish", "hardsigmoid", "_low_memory_max_pool_with_offsets", "upsample_nearest2d", "upsample_bilinear2d",
    "cat", "constant_pad_nd", "reflection_pad2d", "replication_pad2d", "_native_batch_norm_legit_no_training",
    "threshold")) | {"prims._low_memory_max_pool_with_offsets.default"}
_FEATURE_MAP_READERS = frozenset(f"aten.{name}.default" for name in (
    "convolution_backward", "native_batch_norm_backward", "native_group_norm_backward", "threshold_backward",
    "hardtanh_backward", "leaky_relu_backward", "max_pool2d_with_indices_backward",
    "max_pool3d_with_indices_backward", "avg_pool2d_backward", "avg_pool3d_backward",
    "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward",
    "hardswish_backward", "hardsigmoid_backward"))
# Readers that make a save a transformer's, whatever made it: eager Auto gives what these save ``bits``.
_NOT_FEATURE_MAP_READERS = frozenset(f"aten.{name}.default" for name in (
    "mm", "bmm", "addmm", "native_layer_norm_backward", "gelu_backward", "silu_backward"))
# Functions whose output backward reads through a saturating derivative, or that backward applies to the save.
_SATURATING = frozenset(f"aten.{name}.default" for name in (
    "tanh", "sigmoid", "exp", "_softmax", "_safe_softmax", "_log_softmax", "tanh_backward", "sigmoid_backward",
    "_softmax_backward_data", "_log_softmax_backward_data"))
# Elementwise steps a softmax decomposes into after its exp (inductor's ``div(exp(x - max), sum)``, ``where``).
_ELEMENTWISE = frozenset({"aten.div.Tensor", "aten.mul.Tensor", "aten.where.self", "aten.sub.Tensor",
                          "prims.convert_element_type.default", "aten.clone.default"})
_FUSED_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_LOGITS = " (its safe width needs the logits' magnitude, which a trace does not see)"
_FUSED_RAW = {"query": "fused attention's q" + _LOGITS, "key": "fused attention's k" + _LOGITS,
              "logsumexp": "fused attention's logsumexp" + _LOGITS,
              "attn_mask": "fused attention's additive mask (-inf where masked, which codes in a graph cannot keep)"}
_FUSED_SENSITIVE = frozenset({"value", "out", "output"})
# Backward ops that read a save only against their bounds (hardtanh/ReLU6, leaky ReLU, hardsigmoid): eager DAF
# stores the region's exact bit (``daf.tracing.regions``); a graph keeps such a save raw, since codes move
# elements across the bounds (MobileNetV2: gradient cosine 0.06 at 2 bits, 0.94 at 8).
_REGION_READERS = frozenset(f"aten.{name}.default" for name in (
    "hardtanh_backward", "leaky_relu_backward", "hardsigmoid_backward"))
# Readers that read nothing but x > 0: ReLU's backward whole (aot_eager), or its mask recomputed from the
# save (inductor's partitioner: ``le(x, 0)``), whose decoded value must not round across 0.
_SIGN_ONLY = {"aten.threshold_backward.default": 2, "aten.le.Scalar": 1, "aten.gt.Scalar": 1}

_VALUES_WHY = "in graph: attention values (the other operand of softmax's probabilities)"
_RELU, _CAT = "aten.relu.default", "aten.cat.default"
_COMPARISONS = frozenset(f"aten.{name}.{overload}" for name in ("le", "lt", "gt", "ge", "eq", "ne")
                         for overload in ("Scalar", "Tensor"))
# Ops that compare one argument's values (at that position): a ReLU's backward against 0, a mask's condition,
# a max (pooling recomputed in backward, argmax, sort).
_COMPARED_POSITION = {"aten.threshold_backward.default": 1, "aten.where.self": 0, "aten.where.ScalarSelf": 0,
                      "aten.where.ScalarOther": 0, "aten.where.Scalar": 0, "aten.max_pool2d_with_indices.default": 0,
                      "aten.max_pool3d_with_indices.default": 0, "aten._low_memory_max_pool_with_offsets.default": 0,
                      "aten.argmax.default": 0, "aten.argmin.default": 0, "aten.sort.default": 0,
                      "aten.topk.default": 0, "aten.sign.default": 0}
_COMPARE_DEPTH = 10
_COMPARED_WHY = ("in graph: backward compares values recomputed from it (a ReLU's mask or a pool's maximum, "
                 "recomputed by the compiler), which coarse codes would move across the comparison")
_NONZEROS_WHY = ("in graph: a ReLU output's nonzeros at {bits} bits where they fit in {fallback}-bit codes of the map "
                 "(about half nonzero or less), else at {fallback}; zeros exact")
_WHY = {"bits": "in graph: linear, norm or activation input", "feature_map_bits": "in graph: feature map",
        "sensitive_bits": "in graph: saturating derivative or attention values"}


@dataclass(frozen=True)
class GraphWidths:
    """The policy's widths as a graph can apply them: one per rule name (``Auto``'s field names)."""

    bits: int
    feature_map_bits: int
    sensitive_bits: int
    fallback: str = ""  # why the policy's own widths could not be used, or ""
    nonzeros: bool = False  # a ReLU output's nonzeros at ``bits`` where they fit in ``feature_map_bits`` codes

    @staticmethod
    def of(config: Config) -> "GraphWidths":
        policy = config.policy
        if isinstance(policy, Auto):
            return GraphWidths(policy.bits, policy.feature_map_bits, policy.sensitive_bits,
                               nonzeros=policy.bits > policy.feature_map_bits)
        if isinstance(policy, Uniform) and config.bits is not None:
            return GraphWidths(config.bits, config.bits, config.bits)
        name = type(policy).__name__
        return GraphWidths(FALLBACK_BITS, FALLBACK_BITS, FALLBACK_BITS,
                           f"the {name} policy decides from data at run time, which a graph cannot: "
                           f"{FALLBACK_BITS} bits in graphs")


@dataclass(frozen=True)
class Decision:
    """How one save is packed. ``form``: "codes", "codes+sign" (codes and the exact sign bits, when a ReLU's
    backward reads the save besides ops that read its values), "nonzeros" (a float32 ReLU output read so under
    ``Auto``: its sign bits and the codes of its nonzeros at ``bits`` where they fit in ``fallback_bits`` codes of
    the whole map, else at ``fallback_bits``; ``daf.kernels.graph_ops``), "sign" (the sign bits alone: only a ReLU's
    backward reads it), "mask" (a boolean, 1 bit per element) or "raw"; ``bits`` is the code width."""

    form: str
    bits: int | None
    why: str
    fallback_bits: int | None = None


@dataclass(frozen=True)
class Readers:
    """The backward graph's nodes that read one save (``nodes``), and the nodes that stand for the save
    there (``sources``: its placeholder, and detach/alias nodes of it)."""

    nodes: tuple[Any, ...]
    sources: frozenset[Any]


def decide(x: torch.Tensor, producer: str | None, readers: Readers | None, widths: GraphWidths,
           config: Config, values: bool = False, permuted: bool = False) -> Decision:
    """The decision for ``x`` saved from a node made by ``producer`` and read by ``readers`` (None when not
    known: the hooks run eagerly, then every float save is ``bits`` codes); ``values``: the save is attention's
    values outside a fused kernel (``values_of_probabilities``); ``permuted``: the forward graph permutes the
    save (a ConvNeXt's map, laid out channels-last for its LayerNorm and linears: ``permuted_in_forward``)."""
    if x.dtype == torch.bool and config.masks:
        return Decision("mask", 1, "in graph: boolean mask, exact")
    if not x.dtype.is_floating_point:
        return Decision("raw", None, "in graph, raw: integer or boolean (indices, masks with masks=False)")
    if x.numel() < config.min_numel:
        return Decision("raw", None, "in graph, raw: fewer than min_numel elements")
    nodes = readers.nodes if readers is not None else ()
    fused = _fused_attention_role(readers) if readers is not None else None
    if fused in _FUSED_RAW:
        return Decision("raw", None, f"in graph, raw: {_FUSED_RAW[fused]}")
    if any(str(node.target) in _REGION_READERS for node in nodes):
        return Decision("raw", None, "in graph, raw: read against its bounds by hardtanh's, leaky ReLU's or "
                                     "hardsigmoid's backward (eager DAF stores the region's bit; graphs do not yet)")
    compared = readers is not None and compared_in_backward(readers)
    rule = "sensitive_bits" if fused is not None or values or compared else _rule(x, producer, nodes, permuted)
    bits = getattr(widths, rule)
    why = _COMPARED_WHY if compared else _VALUES_WHY if values and fused is None else _WHY[rule]
    why += f" ({widths.fallback})" if widths.fallback else ""
    signs = [node for node in nodes if _reads_sign_only(node)]
    if signs and len(signs) == len(nodes):
        return Decision("sign", 1, "in graph: ReLU's sign bits only, exact")
    if signs and widths.nonzeros and rule == "feature_map_bits" and producer == _RELU and x.dtype == torch.float32:
        return Decision("nonzeros", widths.bits, _NONZEROS_WHY.format(bits=widths.bits, fallback=bits), bits)
    return Decision("codes+sign" if signs else "codes", bits, why)


def _rule(x: torch.Tensor, producer: str | None, readers: Any, permuted: bool) -> str:
    """Eager ``Auto``'s rule, read from the graph: ``feature_map_bits`` for what a ReLU CNN's op made (a
    convolution, norm, ReLU, pooling, resampling, padding or concatenation) and only such ops read; a map made by
    an add (a ConvNeXt's residual stream) or permuted for a LayerNorm and linears gets ``bits``, as eagerly (at 2
    bits a compiled ConvNeXt's gradient was at cosine 0.92, 0.63 with large channels)."""
    targets = {str(node.target) for node in readers}
    if producer in _SATURATING or targets & _SATURATING:
        return "sensitive_bits"
    if x.dim() >= 3 and producer in _FEATURE_MAP_PRODUCERS and not permuted and not targets & _NOT_FEATURE_MAP_READERS:
        return "feature_map_bits"
    return "bits"


def permuted_in_forward(node: Any) -> bool:
    """Whether the forward graph permutes the saved ``node`` (past views): a 4-D map turned channels-last for a
    LayerNorm and linears, a transformer's use of it rather than a CNN's."""
    pending, seen = [node], {node}
    while pending:
        for user in getattr(pending.pop(), "users", ()):
            target = str(user.target)
            if target == "aten.permute.default":
                return True
            if target in _PASS_THROUGH and user not in seen:
                seen.add(user)
                pending.append(user)
    return False


_CHANNELS_LAST = (0, 2, 3, 1)


def memory_order(x: torch.Tensor, graph: Any, producer: str | None, readers: Readers | None) -> tuple[int, ...] | None:
    """The order to flatten the save ``x`` of forward ``graph`` in: the order its tensor will have in memory
    when the compiled graph runs, so that flattening it and restoring it in backward are views, not copies.

    That is the trace's order (``dense_order``; None: not dense), except for a contiguous 4-D feature map on
    the CPU in a graph with a convolution: inductor lays out such graphs channels-last whenever oneDNN is
    available (``GraphLowering.decide_layout_opt``), a layout the trace does not show. Flattened in the
    trace's order, each such save cost a transposing copy in forward and another in backward (ResNet-18's
    compiled step: 20% of it). A wrong guess costs those copies and changes no value: the order is a view's.

    A concatenation's output keeps the trace's order: its channels come from different tensors, often at
    different scales (a U-Net's skip and upsampled maps), and groups across channels left the smaller ones a
    level or two (a U-Net compiled at the default: gradient cosine 0.937 -> 0.971; the copies are the price)."""
    order = dense_order(x)
    if (order != tuple(range(4)) or x.device.type != "cpu" or graph is None
            or not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled):
        return order
    targets = {str(node.target) for node in readers.nodes} if readers is not None else set()
    if not _feature_map(producer, targets) or producer == _CAT:
        return order
    convolution = torch.ops.aten.convolution.default
    return _CHANNELS_LAST if graph.find_nodes(op="call_function", target=convolution) else order


def _feature_map(producer: str | None, targets: set[str]) -> bool:
    """Made by a convolution, batch norm, pooling or ReLU-family op, or read by one's backward."""
    return producer in _FEATURE_MAP_PRODUCERS or bool(targets & _FEATURE_MAP_READERS)


_PRODUCTS = frozenset({"aten.bmm.default", "aten.mm.default", "aten.matmul.default", "aten.baddbmm.default"})


def values_of_probabilities(node: Any) -> bool:
    """Whether the saved forward ``node`` is, past views, an operand of a product with softmax's probabilities:
    eager attention's v, which eager Auto gives ``sensitive_bits`` (``daf.policy.auto.values_of_probabilities``).
    The partitioner often saves a view of the operand (its transpose, for ``p^T dO``), so the search goes back
    through views to the operand, then forward through views to the products."""
    same, current = [], node
    while hasattr(current, "op"):
        same.append(current)
        if current.op != "call_function" or str(current.target) not in _PASS_THROUGH or not current.args:
            break
        current = current.args[0]
    pending, seen = list(same), set(same)
    while pending:
        for user in pending.pop().users:
            target = str(user.target)
            if target in _PASS_THROUGH and user not in seen:
                seen.add(user)
                pending.append(user)
            elif target in _PRODUCTS and any(_probabilities(a) for a in user.args
                                             if hasattr(a, "op") and a not in seen):
                return True
    return False


def _probabilities(node: Any) -> bool:
    """Whether ``node`` is softmax's output past views (whole, or inductor's ``exp`` tail)."""
    return producer_of(node) in ("aten._softmax.default", "aten._safe_softmax.default", "aten.exp.default")


def compared_in_backward(readers: Readers, depth: int = _COMPARE_DEPTH) -> bool:
    """Whether backward compares a value computed from the save (past its direct sign-only readers): inductor's
    partitioner recomputes cheap forward ops in backward from what it saved, so a batch norm's input comes back
    as ``relu(bn(x))`` whose ``le(., 0)`` is ReLU's mask, and a pooled map's max is taken again. From decoded
    codes such a comparison flips wherever an element lies within a code step of the threshold (or of the
    pool's maximum), and the gradient passes where it should not: a ResNet-style net compiled with 2-bit codes
    of its batch norm inputs had gradient cosine 0.84, 0.27 with large channels (0.99 with those inputs raw).
    Walks the backward graph from the save through ``depth`` ops to a compared argument."""
    values = [node for node in readers.nodes if not _reads_sign_only(node)]
    if any(_compared_argument(node, source) for node in values for source in readers.sources):
        return True
    pending, seen = [(node, 1) for node in values], set(values)
    while pending:
        current, level = pending.pop()
        if level > depth:
            continue
        for user in getattr(current, "users", ()):
            if _compared_argument(user, current):
                return True
            if user not in seen:
                seen.add(user)
                pending.append((user, level + 1))
    return False


def _compared_argument(node: Any, value: Any) -> bool:
    """Whether ``node`` compares ``value`` (one of its arguments), as opposed to only computing with it."""
    target = str(node.target)
    if target in _COMPARISONS:
        return value in node.args[:2]
    position = _COMPARED_POSITION.get(target)
    return position is not None and len(node.args) > position and node.args[position] is value


def _reads_sign_only(node: Any) -> bool:
    threshold = _SIGN_ONLY.get(str(node.target))
    return threshold is not None and len(node.args) > threshold and node.args[threshold] == 0


def _fused_attention_role(readers: Readers) -> str | None:
    """The argument name a fused attention backward reads the save as ("query", "value", ...), or None."""
    for node in readers.nodes:
        target = node.target
        if not any(part in str(target) for part in _FUSED_ATTENTION) or not hasattr(target, "_schema"):
            continue
        for index, argument in enumerate(target._schema.arguments):  # attn_mask is a keyword
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if value in readers.sources:
                return argument.name
    return None


def producer_of(node: Any, depth: int = 4) -> str | None:
    """The target of the op that made ``node``, past views and copies; through a softmax's decomposed
    elementwise tail (``div``, ``where``) to its ``exp`` when there is one within ``depth`` steps."""
    while node is not None and node.op == "call_function" and str(node.target) in _PASS_THROUGH:
        node = node.args[0] if node.args else None
    if node is None or node.op != "call_function":
        return None
    target = str(node.target)
    if target in _ELEMENTWISE and depth > 0:
        for argument in node.args:
            if hasattr(argument, "op") and producer_of(argument, depth - 1) in _SATURATING:
                return "aten.exp.default"
    return target


def readers_of(node: Any, backward: Any) -> Readers:
    """Who reads the saved forward ``node`` in ``backward`` (through detach and alias)."""
    pending = [n for n in backward.find_nodes(op="placeholder") if n.name == node.name]
    sources, readers = set(pending), []
    while pending:
        for user in pending.pop().users:
            if str(user.target) in _ALIASES:
                sources.add(user)
                pending.append(user)
            else:
                readers.append(user)
    return Readers(tuple(readers), frozenset(sources))
