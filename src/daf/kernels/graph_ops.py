"""One operator that packs a compiled graph's save: ``daf::graph_pack``, what ``daf.runtime.in_graph``'s pack
hook puts in the forward graph.

``daf::graph_pack(Tensor x, int[] order, int bits, int group_size, bool codes, bool sign, str site="")
-> (Tensor, Tensor)``: ``x`` flattened in dimension order ``order``; a boolean's bits where an element differs
from the first (``mask_encode``) and its first element; else the float's ``format1_encode`` codes at ``bits``
nearest (``codes``; empty uint8 when False) and its sign bits (``relu_mask_encode``; empty when ``sign`` is
False). Where ``format1_encode`` says the values need a side table (NaN, +-Inf, huge or tiny magnitudes),
which a graph's fixed-size saves cannot carry, it raises, naming ``site`` (``torch._assert_async``): a causal
mask of -inf coded at 8 bits had turned SmolLM2's compiled gradient to cosine -0.002, silently.

Why one op, taking ``x`` whole, with ``torch.Tag.flexible_layout``: inductor makes a custom op's input
the layout the trace gave it (contiguous, before its own channels-last choice for convolutions), and it
materialized a flattened view once per consuming op: a ReLU output packed as codes and sign bits was
written twice beside its own buffer, in the trace's layout. Here inductor hands over the buffer as it
laid it out, once; the op flattens it (a view when it is laid out in ``order``, as
``daf.runtime.graph_rules.memory_order`` predicts; a copy, same values, when not). The composed ops are
this package's own, so its bytes are theirs: no kernel of its own to hold to a reference.

A ReLU output that later ops read by value (the next convolution) gets two more ops, the graph's form of eager
``daf.Auto``'s nonzeros rule (``daf.codec.nonzeros``): a graph's saves have fixed sizes, but how many elements
are nonzero is known only when the graph runs. ``daf::graph_pack_nonzeros(Tensor x, int[] order, int bits,
int fallback_bits, int group_size, str site="") -> (Tensor, Tensor)`` writes, into a buffer of the size of
``fallback_bits`` codes of the whole map (``nonzeros_bytes``), the codes of the nonzeros at ``bits`` when they
fit there (about half the map nonzero or less, at 4 and 2 bits) and at ``fallback_bits`` when not, and the sign
bits (``relu_mask_encode``), which say where the nonzeros go and how many there are;
``daf::graph_decode_nonzeros(Tensor payload, Tensor sign, SymInt numel, int bits, int fallback_bits,
int group_size) -> Tensor`` counts the sign bits, takes the same width and scatters the decoded nonzeros
(float32 [numel], zeros exact). ReLU's gradient reads the zeros exactly; the convolution reads every nonzero
at 16 levels of its group instead of four (one gradient of our ResNet-style net, compiled: see
docs/integrations.md).
"""

from __future__ import annotations

import torch

import daf.kernels.mask_ops  # noqa: F401  registers daf::mask_encode, relu_mask_encode
import daf.kernels.ops  # noqa: F401  registers daf::format1_encode
from daf.format import mask_bytes, payload_bytes

__all__ = ["graph_pack", "graph_pack_nonzeros", "graph_decode_nonzeros", "nonzeros_bytes", "nonzeros_width"]


_GRAPH_PACK = "daf::graph_pack"

# define, not custom_op: the latter's Python wrapper cost about 0.1 ms per call, a save's whole pack on small maps
torch.library.define(_GRAPH_PACK, "(Tensor x, int[] order, int bits, int group_size, bool codes, bool sign, "
                                  "str site='') -> (Tensor, Tensor)", tags=(torch.Tag.flexible_layout,))


def graph_pack(x: torch.Tensor, order: list[int], bits: int, group_size: int, codes: bool, sign: bool,
               site: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.daf.graph_pack``: see the module's text."""
    return torch.ops.daf.graph_pack(x, order, bits, group_size, codes, sign, site)


def _pack(x: torch.Tensor, order: list[int], bits: int, group_size: int, codes: bool, sign: bool,
          site: str = "", check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.permute(order).reshape(-1)
    if x.dtype == torch.bool:
        return torch.ops.daf.mask_encode(flat), flat[:1].clone()
    none = flat.new_empty(0, dtype=torch.uint8)
    payload = none
    if codes:
        payload, ok = torch.ops.daf.format1_encode(flat, bits, group_size, False, 0)
        if check:  # a graph's saves have fixed sizes: no side table, and a wrong code is never handed back
            torch._assert_async(ok, _EXCEPTIONAL.format(site=site or "a save", shape=tuple(x.shape)))
    signs = torch.ops.daf.relu_mask_encode(flat) if sign else none.clone()
    return payload, signs


def _pack_checked(x: torch.Tensor, order: list[int], bits: int, group_size: int, codes: bool, sign: bool,
                  site: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    return _pack(x, order, bits, group_size, codes, sign, site, check=True)


_EXCEPTIONAL = ("DAF: {site} of a compiled graph, shape {shape}, holds NaN, +-Inf, a magnitude above 2^126 or a "
                "nonzero group below 2^-100, which codes inside a graph cannot keep (eager DAF keeps them in a side "
                "table). Its gradient would be wrong, so DAF stops here. Train this model eagerly with DAF, or "
                "find where the model makes such values (docs/integrations.md, 'torch.compile').")


torch.library.register_kernel(_GRAPH_PACK, "default", _pack_checked)
torch.library.register_fake(_GRAPH_PACK)(_pack)  # the composed ops' fakes give the shapes


_PACK_NONZEROS, _DECODE_NONZEROS = "daf::graph_pack_nonzeros", "daf::graph_decode_nonzeros"
torch.library.define(_PACK_NONZEROS, "(Tensor x, int[] order, int bits, int fallback_bits, int group_size, "
                                     "str site='') -> (Tensor, Tensor)", tags=(torch.Tag.flexible_layout,))
torch.library.define(_DECODE_NONZEROS, "(Tensor payload, Tensor sign, SymInt numel, int bits, int fallback_bits, "
                                       "int group_size) -> Tensor")


def nonzeros_bytes(numel: int, fallback_bits: int, group_size: int) -> int:
    """The fixed payload size of a graph's nonzeros save: ``fallback_bits`` codes of all ``numel`` elements."""
    return payload_bytes(numel, fallback_bits, group_size)


def nonzeros_width(count: int, numel: int, bits: int, fallback_bits: int, group_size: int) -> int:
    """The width ``count`` nonzeros of ``numel`` elements are coded at: ``bits`` where their codes fit in
    ``nonzeros_bytes``, else ``fallback_bits`` (whose codes of fewer than ``numel`` elements always fit).

    >>> nonzeros_width(500, 1000, 4, 2, 256), nonzeros_width(600, 1000, 4, 2, 256)
    (4, 2)
    """
    return bits if payload_bytes(count, bits, group_size) <= nonzeros_bytes(numel, fallback_bits, group_size) \
        else fallback_bits


def graph_pack_nonzeros(x: torch.Tensor, order: list[int], bits: int, fallback_bits: int, group_size: int,
                        site: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.daf.graph_pack_nonzeros``: see the module's text."""
    return torch.ops.daf.graph_pack_nonzeros(x, order, bits, fallback_bits, group_size, site)


def graph_decode_nonzeros(payload: torch.Tensor, sign: torch.Tensor, numel: int, bits: int, fallback_bits: int,
                          group_size: int) -> torch.Tensor:
    """``torch.ops.daf.graph_decode_nonzeros``: see the module's text."""
    return torch.ops.daf.graph_decode_nonzeros(payload, sign, numel, bits, fallback_bits, group_size)


def _pack_nonzeros(x: torch.Tensor, order: list[int], bits: int, fallback_bits: int, group_size: int,
                   site: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype != torch.float32:
        raise ValueError(f"daf::graph_pack_nonzeros takes a float32 ReLU output, got {x.dtype} (site {site!r})")
    flat = x.permute(order).reshape(-1)
    payload = flat.new_zeros(nonzeros_bytes(flat.numel(), fallback_bits, group_size), dtype=torch.uint8)
    signs = torch.ops.daf.relu_mask_encode(flat)
    values, ok = torch.ops.daf.relu_nonzeros(flat)
    torch._assert_async(ok, _NOT_RELU.format(site=site or "a save", shape=tuple(x.shape)))
    if values.numel():
        width = nonzeros_width(values.numel(), flat.numel(), bits, fallback_bits, group_size)
        codes, ok = torch.ops.daf.format1_encode(values, width, group_size, False, 0)
        torch._assert_async(ok, _EXCEPTIONAL.format(site=site or "a save", shape=tuple(x.shape)))
        payload[:codes.numel()] = codes
    return payload, signs


def _pack_nonzeros_fake(x: torch.Tensor, order: list[int], bits: int, fallback_bits: int, group_size: int,
                        site: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    numel = x.numel()
    return (x.new_empty(nonzeros_bytes(numel, fallback_bits, group_size), dtype=torch.uint8),
            x.new_empty(mask_bytes(numel), dtype=torch.uint8))


def _decode_nonzeros(payload: torch.Tensor, sign: torch.Tensor, numel: int, bits: int, fallback_bits: int,
                     group_size: int) -> torch.Tensor:
    count = int(torch.ops.daf.mask_count(sign, numel))
    width = nonzeros_width(count, numel, bits, fallback_bits, group_size)
    codes = payload[:payload_bytes(count, width, group_size)]
    return torch.ops.daf.nonzeros_decode_scatter(codes, count, width, group_size, sign, numel)


def _decode_nonzeros_fake(payload: torch.Tensor, sign: torch.Tensor, numel: int, bits: int, fallback_bits: int,
                          group_size: int) -> torch.Tensor:
    return payload.new_empty(numel, dtype=torch.float32)


_NOT_RELU = ("DAF: {site} of a compiled graph, shape {shape}, was packed as a ReLU output's nonzeros but holds a "
             "negative value or NaN. Its gradient would be wrong, so DAF stops here (docs/integrations.md, "
             "'torch.compile').")

torch.library.register_kernel(_PACK_NONZEROS, "default", _pack_nonzeros)
torch.library.register_fake(_PACK_NONZEROS)(_pack_nonzeros_fake)
torch.library.register_kernel(_DECODE_NONZEROS, "default", _decode_nonzeros)
torch.library.register_fake(_DECODE_NONZEROS)(_decode_nonzeros_fake)
