"""torch.compile and DAF (issue 39): a wrapped model compiles to the graphs of the unwrapped one, in either
order and on a compiled part of the tree, with no graph break or recompile of DAF's making.

Dynamo runs with ``CompileCounter`` (graphs and ops counted, run eagerly) or ``aot_eager`` (through
AOTAutograd, as inductor gets it, without building C++): a tiny model compiles in about a second."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import daf
from daf.api import _run_while_tracing


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "cnn": (_cnn, (4, 3, 16, 16)), "transformer block": (_block, (2, 8, 32))}


def _x(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def _compiled(model: nn.Module, order: str, backend: object, fullgraph: bool = False) -> tuple[nn.Module, nn.Module]:
    """(what to call, what was wrapped) for ``order``; "plain" wraps nothing. Both have the same parameters."""
    if order == "plain":
        return torch.compile(model, backend=backend, fullgraph=fullgraph), model
    if order == "compile(wrap(m))":
        return torch.compile(daf.wrap(model, bits=8, min_numel=1), backend=backend, fullgraph=fullgraph), model
    compiled = daf.wrap(torch.compile(model, backend=backend, fullgraph=fullgraph), bits=8, min_numel=1)
    return compiled, compiled


def _graphs(make: Callable[[], nn.Module], shape: tuple[int, ...], order: str) -> tuple[int, int, int]:
    """(graphs, ops, graph breaks) over two training steps: a recompile would add a graph."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    model, _ = _compiled(make(), order, counter, fullgraph=order == "compile(wrap(m))")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            model(_x(shape)).square().mean().backward()
    return counter.frame_count, counter.op_count, sum(counters["graph_break"].values())


def test_the_trace_time_mark_is_the_one_torch_compiler_sets():
    def ours() -> None: ...
    def theirs() -> None: ...
    assert vars(_run_while_tracing(ours)) == vars(torch.compiler.assume_constant_result(theirs)) != {}


@pytest.mark.parametrize("name", MODELS)
def test_a_wrapped_model_compiles_to_the_unwrapped_graphs_in_either_order(name):
    make, shape = MODELS[name]
    plain = _graphs(make, shape, "plain")
    assert plain[0] == 1 and plain[2] == 0  # the reference itself is one graph
    assert _graphs(make, shape, "compile(wrap(m))") == plain  # fullgraph=True: a break would raise
    assert _graphs(make, shape, "wrap(compile(m))") == plain


def test_compile_of_the_wrapped_model_gives_the_unwrapped_gradients_and_one_warning_says_nothing_is_compressed():
    """The other order, daf.wrap(torch.compile(model)), compresses inside the graph: tests/runtime/test_in_graph.py."""
    make, shape = MODELS["transformer block"]
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, params = _compiled(make(), "compile(wrap(m))", "aot_eager")
        got = [_step(model, params, shape) for _ in range(2)][-1]
    ours = [w for w in caught if str(w.message).startswith("DAF:")]
    torch._dynamo.reset()  # else the plain model reuses the wrapped one's graph: dynamo does not guard on hooks
    expected = _step(*_compiled(make(), "plain", "aot_eager"), shape)
    assert len(ours) == 1 and "compresses nothing" in str(ours[0].message)
    assert "daf.wrap(torch.compile(model))" in str(ours[0].message)  # the way to compress
    assert torch.equal(got, expected)
    assert daf.report(params).stored_bytes == 0


def _step(model: nn.Module, params: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    loss = model(_x(shape)).square().mean()
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(params.parameters()))])


def test_a_compiled_part_of_an_eager_wrapped_model_is_one_graph_and_the_rest_is_compressed():
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    model = _cnn()
    model[3] = torch.compile(model[3], backend=counter, fullgraph=True)
    with pytest.warns(UserWarning, match="^DAF: 3 of this model run under torch.compile"):
        daf.wrap(model, bits=8, min_numel=1)
    for _ in range(3):
        model(_x(MODELS["cnn"][1])).square().mean().backward()
    assert (counter.frame_count, counter.op_count, sum(counters["graph_break"].values())) == (1, 1, 0)
    assert daf.report(model).ratio > 2  # the eager layers around it still compress
