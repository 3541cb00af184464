"""Saved-tensor hooks that ``torch.compile`` puts inside its graphs: format-1 codes at the policy's widths.

A compiled training step is one autograd function whose saves never reach DAF's eager hooks. PyTorch
2.13's AOTAutograd instead inlines saved-tensor hooks given as ``torch.fx.GraphModule`` s: when the
hooks active while it compiles are a pair of graph modules
(``torch._functorch._aot_autograd.utils.saved_tensors_hooks_are_inlineable``), it traces the pack
hook into the forward graph's epilogue on each saved intermediate and the unpack hook into the
backward graph's prologue (``graph_compile.maybe_inline_graph_saved_tensors_hooks``), and at run time
switches ambient hooks off around the compiled function. Only intermediates the graph made (its
"donated" buffers, ``torch._functorch.config.saved_tensors_hooks_filtering_mode``) are packed, never
inputs or parameters. Dynamo guards on the identity of these hooks, so one pair per wrapped model
compiles once.

The hooks encode with DAF's own ops (``torch.ops.daf.format1_encode``/``format1_decode``, whose fake
implementations let AOTAutograd trace them), so eager and compiled saves share one format. Each save's
width and form are decided while the graph is traced, from the graph (``daf.runtime.graph_rules``: the
policy's widths where op, shape and dtype say which rule applies, exact sign bits where only a ReLU's
backward reads a save, a ReLU output's nonzeros under ``Auto``, 8 bits where backward recomputes a value it
compares, booleans as 1-bit masks, fused attention's q and k raw), and recorded in
``GraphSaves``, which ``daf.report`` shows. What the eager path adds beyond that is absent: no derived
forms (remakes) or sharing, no exponent guard (q and k stay raw instead), no outlier split (plain min/max
groups whatever ``Config.codec``), no floors, nearest rounding only (a seed in a graph is a constant:
stochastic rounding would draw the same noise every step), no exceptional-value side table (a save holding NaN
or Inf raises, naming the save, rather than come back wrong: ``daf::graph_pack``). Each save is packed by
one op on the buffer as inductor laid it out, flattened in the order inductor uses (``graph_rules.memory_order``),
and restored in backward just before its first reader (``daf.runtime.graph_order``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from daf.config import Config
from daf.format import mask_bytes, payload_bytes, restore_memory_order
from daf.report import SiteRow
from daf.runtime.graph_order import restores_at_first_use
from daf.runtime.graph_rules import (Decision, GraphWidths, Readers, decide, memory_order, permuted_in_forward,
                                     producer_of, readers_of, values_of_probabilities)
from daf.tracing.threads import PerThreadStack

__all__ = ["GraphHooks", "GraphSaves", "in_graph_hooks", "in_graph_limits", "positive_floor"]


def in_graph_hooks(config: Config, saves: GraphSaves | None = None) -> GraphHooks:
    """The hooks to hold active while a compiled module compiles and runs: AOTAutograd inlines them.

    Each save is decided at trace time (``daf.runtime.graph_rules``) and, with ``saves`` given, recorded
    there. Run eagerly (a graph break inside the compiled module), the same hooks pack the eager saves:
    floating-point ones of at least ``config.min_numel`` elements as the policy's ``bits``-rule codes.
    """
    # here, not at import: ``import daf`` stays free of the kernels (tests/test_import.py)
    import daf.kernels.graph_ops  # noqa: F401  registers torch.ops.daf.graph_pack
    import daf.kernels.mask_ops  # noqa: F401  registers torch.ops.daf.mask_unpack
    import daf.kernels.ops  # noqa: F401  registers torch.ops.daf.format1_decode

    pack, unpack = _codec(config, GraphWidths.of(config), saves)
    return GraphHooks(_graph_of(pack), _graph_of(unpack))


class GraphHooks:
    """One re-entrant context per wrapped model: the pack and unpack graph modules as ambient saved-tensor
    hooks (the same pair every call: dynamo's guard on them passes), and, while a call compiles, the pass
    that restores each save in backward just before its first reader (``daf.runtime.graph_order``)."""

    def __init__(self, pack: torch.fx.GraphModule, unpack: torch.fx.GraphModule) -> None:
        self.pack_hook, self.unpack_hook = pack, unpack  # the names saved_tensors_hooks gives them
        self._entered = PerThreadStack()  # each thread's open contexts (autograd's hooks are per thread)

    def __enter__(self) -> GraphHooks:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack_hook, self.unpack_hook))
        stack.enter_context(restores_at_first_use())
        self._entered.items.append(stack)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._entered.items.pop().__exit__(*exc)


def in_graph_limits(config: Config) -> list[str]:
    """What of ``config`` compiled graphs cannot do, one phrase each (for the warning ``daf.wrap`` gives)."""
    limits = [GraphWidths.of(config).fallback] if GraphWidths.of(config).fallback else []
    if config.rounding != "nearest":
        limits.append("nearest rounding instead of stochastic (a graph's seed is a constant)")
    if type(config.codec).__name__ != "MinMax":
        limits.append(f"plain min/max groups instead of {type(config.codec).__name__}")
    if config.floors:
        limits.append("no floors (they name eager torch functions)")
    return limits


class GraphSaves:
    """What the compiled graphs of one wrapped model pack, recorded as AOTAutograd traces the pack hook.

    Rows are kept per graph; a graph compiled again with the same saves (a new batch size) replaces the
    rows of the one before, so the rows describe the graphs a step runs (one per compiled region), not
    every compile. Compiles may run on any thread: a lock guards the rows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graphs: dict[int, dict[str, SiteRow]] = {}  # id(forward graph) -> node name -> row

    def record(self, graph: Any, row: SiteRow) -> None:
        with self._lock:
            rows = self._graphs.setdefault(id(graph), {})
            rows[row.site] = row  # AOTAutograd runs the pack hook twice per save: once plain, once to trace it

    def rows(self) -> list[SiteRow]:
        """The rows of the latest graph of each kind (kinds: the same saved node names), in compile order."""
        with self._lock:
            latest: dict[tuple[str, ...], dict[str, SiteRow]] = {}
            for rows in self._graphs.values():
                key = tuple(rows)
                latest.pop(key, None)
                latest[key] = rows
        out = []
        for index, rows in enumerate(latest.values()):
            out.extend(SiteRow(**{**row.__dict__, "site": f"graph{index}/{row.site}"}) for row in rows.values())
        return out


def _codec(config: Config, widths: GraphWidths,
           saves: GraphSaves | None) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """(pack, unpack) as plain functions: AOTAutograd traces them on each saved value's fake tensor, so their
    Python branches (dtype, size, layout, who reads the save) are decided once per save at compile time.
    A packed save is ``(form, bits, payload, sign bits, shape, order, dtype)``, ``form`` a ``Decision``'s; a
    boolean's "sign bits" are its first element (``mask_encode`` marks where the others differ from it)."""
    group_size = config.group_size

    def daf_pack(x: torch.Tensor) -> Any:
        graph, node, readers = _trace_context()
        producer = producer_of(node) if node is not None else None
        order = memory_order(x, graph, producer, readers)
        decision = (decide(x, producer, readers, widths, config,
                           values=node is not None and values_of_probabilities(node),
                           permuted=node is not None and permuted_in_forward(node))
                    if order is not None else Decision("raw", None, _STRIDED))
        if saves is not None and node is not None:
            saves.record(graph, _row(node, x, decision, group_size))
        if decision.form == "raw":
            return x
        if decision.form == "nonzeros":
            payload, sign = torch.ops.daf.graph_pack_nonzeros(x, list(order), decision.bits, decision.fallback_bits,
                                                              group_size, node.name if node is not None else "")
            return "nonzeros", (decision.bits, decision.fallback_bits), payload, sign, tuple(x.shape), order, x.dtype
        codes, signs = decision.form in ("codes", "codes+sign"), decision.form in ("sign", "codes+sign")
        payload, second = torch.ops.daf.graph_pack(x, list(order), decision.bits or 0, group_size, codes, signs,
                                                   node.name if node is not None else "")
        if decision.form == "mask":  # bits where an element differs from the first, and the first
            return "mask", 1, payload, second, tuple(x.shape), order, x.dtype
        return (decision.form, decision.bits, payload if codes else None, second if signs else None,
                tuple(x.shape), order, x.dtype)

    def daf_unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        form, bits, payload, sign, shape, order, dtype = packed
        numel = 1
        for size in shape:
            numel *= size
        if form == "mask":
            flat = torch.logical_xor(torch.ops.daf.mask_unpack(payload, numel), sign)
            return restore_memory_order(flat, shape, order)
        if form == "nonzeros":
            flat = torch.ops.daf.graph_decode_nonzeros(payload, sign, numel, bits[0], bits[1], group_size)
            return restore_memory_order(flat, shape, order)
        if form == "sign":
            flat = torch.ops.daf.mask_unpack(sign, numel).to(dtype)
        elif form == "codes+sign":  # a value that rounded across 0 would flip threshold_backward's mask
            flat = torch.ops.daf.format1_decode_signed(payload, sign, numel, bits, group_size, positive_floor(dtype),
                                                       dtype)
        else:
            flat = torch.ops.daf.format1_decode(payload, numel, bits, group_size, dtype)
        return restore_memory_order(flat, shape, order)  # backward's views expect the saved strides

    return daf_pack, daf_unpack


def positive_floor(dtype: torch.dtype) -> float:
    """The value a positive element whose code rounded to 0 or below is restored as: the smallest float of
    ``dtype`` that a gradient of 2^-60 or more can multiply without a denormal product. A conv's weight
    gradient multiplies every restored input element; at ``finfo.tiny`` those products were denormals,
    which oneDNN's channels-last kernels compute in microcode (ResNet-18's stride-1 convs' backward ran 10x
    slower, the compiled step 4.6x). Any value up to half a code step is as close to the true one."""
    return max(torch.finfo(dtype).tiny, 2.0 ** -64)


# A view with gaps (one of q, k, v sliced from a fused projection) shares its storage with its siblings: coding
# it alone would free nothing, and backward's compiled code expects its strides.
_STRIDED = "in graph, raw: a strided view into a larger tensor (coding it would not free that tensor)"


def _trace_context() -> tuple[Any, Any, Readers | None]:
    """(forward graph, saved node, its backward readers) while AOTAutograd traces the hook, else Nones (the
    hook runs eagerly, or torch moved this private context: then every save is ``bits`` codes).

    AOTAutograd sets the context while it traces the hooks (``_saved_tensor_hook_context``: the forward and
    backward graphs and the saved node; "may change without backward compatibility", hence the guard)."""
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
        context = _get_saved_tensor_hook_context() or {}
        graph, node, backward = context.get("_fw_graph"), context.get("_node"), context.get("_bw_graph")
    except (ImportError, AttributeError):
        return None, None, None
    if node is None or backward is None:
        return None, None, None
    return graph, node, readers_of(node, backward)


def _row(node: Any, x: torch.Tensor, decision: Decision, group_size: int) -> SiteRow:
    shape = tuple(_hint(size) for size in x.shape)
    numel = 1
    for size in shape:
        numel *= size
    raw = numel * x.element_size()
    if decision.form == "raw":
        stored, kind = raw, "raw"
    elif decision.form in ("mask", "sign"):
        stored, kind = mask_bytes(numel), "mask"
    elif decision.form == "nonzeros":
        from daf.kernels.graph_ops import nonzeros_bytes  # loaded by in_graph_hooks already; not at import daf
        stored, kind = nonzeros_bytes(numel, decision.fallback_bits, group_size) + mask_bytes(numel), "compressed"
    else:
        stored = payload_bytes(numel, decision.bits, group_size)
        stored += mask_bytes(numel) if decision.form == "codes+sign" else 0
        kind = "compressed"
    source = producer_of(node) or node.op
    return SiteRow(site=node.name, source=source.replace("aten.", "").replace(".default", ""), shape=shape,
                   dtype=str(x.dtype).replace("torch.", ""), bits=decision.bits, raw_bytes=raw, stored_bytes=stored,
                   kind=kind, why=decision.why)


def _hint(size: Any) -> int:
    """A size as an int: a symbolic one (dynamic shapes) by its hint, without adding a guard."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else -1


def _graph_of(function: Callable[..., Any]) -> torch.fx.GraphModule:
    """A graph module of one node calling ``function`` (what ``torch.fx.wrap`` plus ``symbolic_trace`` make,
    without registering anything globally): the form AOTAutograd accepts as an inlineable hook."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(function, (graph.placeholder("x"),)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)
