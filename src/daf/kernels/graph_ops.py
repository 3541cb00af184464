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
"""

from __future__ import annotations

import torch

import daf.kernels.mask_ops  # noqa: F401  registers daf::mask_encode, relu_mask_encode
import daf.kernels.ops  # noqa: F401  registers daf::format1_encode

__all__ = ["graph_pack"]


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
