"""Saved-tensor hooks that ``torch.compile`` puts inside its graphs: format-1 codes, 8 bits, nearest.

A compiled training step is one autograd function whose saves never reach DAF's eager hooks. PyTorch
2.13's AOTAutograd instead inlines saved-tensor hooks given as ``torch.fx.GraphModule`` s: when the
hooks active while it compiles are a pair of graph modules
(``torch._functorch._aot_autograd.utils.saved_tensors_hooks_are_inlineable``), it traces the pack
hook into the forward graph's epilogue on each saved intermediate and the unpack hook into the
backward graph's prologue (``graph_compile.maybe_inline_graph_saved_tensors_hooks``), and at run time
switches ambient hooks off around the compiled function. Only intermediates the graph made (its
"donated" buffers, ``torch._functorch.config.saved_tensors_hooks_filtering_mode``) are packed, never
inputs or parameters.

The hooks here encode with DAF's own ops (``torch.ops.daf.format1_encode``/``format1_decode``, whose
fake implementations let AOTAutograd trace them), so eager and compiled saves share one format; a save
ReLU's backward reads keeps its exact sign bits (``_FORMS``). What else the eager path adds is absent:
no policy (every packed save gets 8 bits), no derived forms or sharing, no exponent guard, nearest
rounding only (a seed in a graph is a constant: stochastic rounding would draw the same noise every
step), no exceptional-value side table (a NaN or Inf saved in a compiled graph does not survive), and
``daf.report`` does not see these saves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from daf.config import Config
from daf.format import dense_order, restore_memory_order

__all__ = ["IN_GRAPH_BITS", "in_graph_hooks"]

# Lower bits need the eager path's guards (masks, derived forms, 8 bits for what backward exponentiates):
# a transformer block's gradient cosine in a graph is 0.998 at 4 bits and 0.95 at 2 (docs/integrations.md).
IN_GRAPH_BITS = 8


def in_graph_hooks(config: Config) -> torch.autograd.graph.saved_tensors_hooks:
    """The hooks to hold active while a compiled module runs (and first compiles): AOTAutograd inlines them.

    Each floating-point intermediate of at least ``config.min_numel`` elements laid out densely (any
    stride order) is saved as ``IN_GRAPH_BITS``-bit codes in groups of ``config.group_size``
    (``daf.format.payload_bytes(numel, 8, group_size)`` bytes); other saves are kept as they are. Run
    eagerly (a graph break inside the compiled module), the same hooks pack the eager saves.
    """
    # here, not at import: ``import daf`` stays free of the kernels (tests/test_import.py)
    import daf.kernels.mask_ops  # noqa: F401  registers torch.ops.daf.relu_mask_encode, mask_unpack
    import daf.kernels.ops  # noqa: F401  registers torch.ops.daf.format1_encode, format1_decode

    pack, unpack = _codec(config.group_size, config.min_numel)
    return torch.autograd.graph.saved_tensors_hooks(_graph_of(pack), _graph_of(unpack))


def _codec(group_size: int, min_numel: int) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """(pack, unpack) as plain functions: AOTAutograd traces them on each saved value's fake tensor, so their
    Python branches (dtype, size, layout, who reads the save) are decided once per save at compile time.
    A packed save is ``(form, payload, sign bits, shape, order, dtype)``, ``form`` one of ``_FORMS``."""

    def daf_pack(x: torch.Tensor) -> Any:
        order = dense_order(x)
        if not x.dtype.is_floating_point or x.numel() < min_numel or order is None:
            return x
        flat = x.permute(order).reshape(-1)
        form = _form(_backward_readers())
        payload = None if form == "sign" else torch.ops.daf.format1_encode(flat, IN_GRAPH_BITS, group_size, False, 0)[0]
        sign = None if form == "codes" else torch.ops.daf.relu_mask_encode(flat)
        return form, payload, sign, tuple(x.shape), order, x.dtype

    def daf_unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        form, payload, sign, shape, order, dtype = packed
        numel = 1
        for size in shape:
            numel *= size
        positive = None if sign is None else torch.ops.daf.mask_unpack(sign, numel)
        if form == "sign":
            flat = positive.to(dtype)
        else:
            flat = torch.ops.daf.format1_decode(payload, numel, IN_GRAPH_BITS, group_size, dtype)
        if form == "codes+sign":  # a value that rounded across 0 would flip threshold_backward's mask
            flat = torch.where(positive, flat.clamp_min(torch.finfo(dtype).tiny), flat.clamp_max(0))
        return restore_memory_order(flat, shape, order)  # backward's views expect the saved strides

    return daf_pack, daf_unpack


# How a save is packed: codes; codes and the exact sign bits x > 0 (1 bit more per element) when a
# ReLU's backward reads the save besides ops that read its values; the sign bits alone when only ReLU's
# backward (threshold_backward at 0, which reads nothing but x > 0) does.
_FORMS = ("codes", "codes+sign", "sign")
_ALIASES = frozenset({"aten.detach.default", "aten.alias.default"})


def _form(readers: list[Any] | None) -> str:
    signs = [node for node in readers or () if _reads_sign_only(node)]
    if not signs:
        return "codes"
    return "sign" if len(signs) == len(readers) else "codes+sign"


def _reads_sign_only(node: Any) -> bool:
    return str(node.target) == "aten.threshold_backward.default" and len(node.args) > 2 and node.args[2] == 0


def _backward_readers() -> list[Any] | None:
    """The backward graph's nodes that read the save being packed (through detach and alias), or None when
    not known: the hook runs eagerly, or torch moved this private context (then every save is codes).

    AOTAutograd sets the context while it traces the hooks (``_saved_tensor_hook_context``: the forward and
    backward graphs and the saved node; "may change without backward compatibility", hence the guard)."""
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
        context = _get_saved_tensor_hook_context() or {}
        node, backward = context.get("_node"), context.get("_bw_graph")
    except (ImportError, AttributeError):
        return None
    if node is None or backward is None:
        return None
    pending = [n for n in backward.find_nodes(op="placeholder") if n.name == node.name]
    readers = []
    while pending:
        for user in pending.pop().users:
            (pending if str(user.target) in _ALIASES else readers).append(user)
    return readers


def _graph_of(function: Callable[..., Any]) -> torch.fx.GraphModule:
    """A graph module of one node calling ``function`` (what ``torch.fx.wrap`` plus ``symbolic_trace`` make,
    without registering anything globally): the form AOTAutograd accepts as an inlineable hook."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(function, (graph.placeholder("x"),)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)
