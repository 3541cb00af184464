"""A compiled backward restores each save just before its first reader (``daf.runtime.graph_order``), not all of
them in the prologue where AOTAutograd inlines the unpack hook: the pass on hand-built graphs, its
installation around a compiled call, and once through inductor itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import daf
import daf.kernels.mask_ops  # noqa: F401  registers torch.ops.daf.mask_unpack
import daf.kernels.ops  # noqa: F401  registers torch.ops.daf.format1_encode, format1_decode
from daf.runtime import graph_order
from daf.runtime.graph_order import SinkRestores, restore_nodes, restores_at_first_use, sink_restores

daf_ops = torch.ops.daf


def _prologue_graph() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """A backward as AOTAutograd inlines it: two decodes and a sign restore first, then the ops reading them."""
    def backward(codes_a, codes_b, signs, grad):
        a = daf_ops.format1_decode(codes_a, 256, 2, 256, torch.float32)
        b = daf_ops.format1_decode(codes_b, 256, 4, 256, torch.float32)
        b_signed = torch.where(daf_ops.mask_unpack(signs, 256), b, 0.0)  # a restore too
        first = (grad * 2.0) * a  # backward's own first op reads a
        return first + b_signed, grad - a  # a read twice: it moves before its first reader

    x = torch.randn(256)
    inputs = [daf_ops.format1_encode(x, 2, 256, False, 0)[0], daf_ops.format1_encode(x, 4, 256, False, 0)[0],
              daf_ops.relu_mask_encode(x), torch.randn(256)]
    return make_fx(backward)(*inputs), inputs


def _order(graph: torch.fx.Graph) -> list[str]:
    return [node.name for node in graph.nodes if node.op == "call_function"]


def test_each_restore_moves_to_just_before_its_first_reader_and_the_values_stay():
    module, inputs = _prologue_graph()
    before = module(*inputs)
    assert [n.name for n in restore_nodes(module.graph)] == ["format1_decode", "format1_decode_1", "mask_unpack",
                                                             "where"]
    assert sink_restores(module.graph) == 4
    module.graph.lint()
    module.recompile()
    assert _order(module.graph) == ["scalar_tensor", "mul", "format1_decode", "mul_1", "mask_unpack",
                                    "format1_decode_1", "where", "add", "sub"]
    for got, expected in zip(module(*inputs), before):
        assert torch.equal(got, expected)
    assert sink_restores(module.graph) == 0  # in place already


def test_a_graph_without_daf_restores_is_left_as_it_is():
    def backward(grad: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        weight = saved.t().contiguous()  # computed from inputs alone, but not a restore of DAF's
        return (grad * 2) @ weight

    graph = torch.fx.symbolic_trace(backward).graph
    order = _order(graph)
    assert restore_nodes(graph) == [] and sink_restores(graph) == 0 and _order(graph) == order


class _Recorded:
    def __init__(self, uuid: object = "theirs") -> None:
        self.graphs, self._uuid = [], uuid

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(graph)

    def uuid(self) -> object:
        return self._uuid


def test_the_pass_runs_the_one_installed_before_it_and_keys_the_cache_on_both():
    theirs = _Recorded()
    module, _ = _prologue_graph()
    SinkRestores(theirs)(module.graph)
    assert theirs.graphs == [module.graph]
    assert SinkRestores().uuid() != SinkRestores(theirs).uuid() != SinkRestores(_Recorded("other")).uuid()
    assert SinkRestores(_Recorded(None)).uuid() is None  # theirs does not cache: neither do we
    assert SinkRestores(lambda graph: None).uuid() is None


def test_the_context_installs_the_pass_and_eager_backward_lowering_and_restores_both():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    theirs = _Recorded()
    with inductor_config.patch(post_grad_custom_post_pass=theirs):
        with restores_at_first_use():
            installed = inductor_config.post_grad_custom_post_pass
            assert isinstance(installed, SinkRestores) and installed.then is theirs
            assert functorch_config.force_non_lazy_backward_lowering
            with restores_at_first_use():  # nested: installed once
                assert inductor_config.post_grad_custom_post_pass is installed
        assert inductor_config.post_grad_custom_post_pass is theirs
        assert not functorch_config.force_non_lazy_backward_lowering


@pytest.mark.slow
def test_inductor_compiles_a_wrapped_cnns_backward_with_its_restores_at_first_use(monkeypatch):
    """Through inductor (C++ built; about 15 s): the backward is lowered during the compiled forward, under the
    pass, which moves the decodes out of the prologue; gradients equal those of the same codes restored in
    the prologue (aot_eager runs the graph as AOTAutograd inlined it)."""
    moved = []
    monkeypatch.setattr(graph_order, "sink_restores", lambda graph: moved.append(sink_restores(graph)) or moved[-1])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x))).relu().mean()

    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    grads = []
    # a cached graph would skip the pass (config.patch: monkeypatch would delete the config's alias afterwards)
    with torch._inductor.config.patch(force_disable_caches=True):
        for backend in ("inductor", "aot_eager"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = Net()
            compiled = torch.compile(daf.wrap(model, bits=8, rounding="nearest", min_numel=64,
                                              audit=daf.Audit(every=0)), backend=backend)
            compiled(x).backward()
            if backend == "inductor":
                assert len(moved) == 2 and moved[1] > 0  # forward, then backward within the same call
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            daf.unwrap(model)
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)
