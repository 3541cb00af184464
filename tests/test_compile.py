"""torch.compile and DAF (issue 39): a wrapped model compiles to the graphs of the unwrapped one, in either
order and on a compiled part of the tree, with no graph break or recompile of DAF's making; in both orders the
graphs store DAF's codes (``torch.compile(daf.wrap(m))`` through ``api._CompileEntry``).

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
from tests.runtime.test_in_graph import _saved_by_graphs


class Own(nn.Module):
    """A model whose forward is the user's (torch.compile enters it through ``model.__call__``)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return Own(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)))


def _block(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return Own(nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True))


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


def test_a_torch_nn_container_compiled_whole_is_traced_without_the_entry_and_one_warning_says_so():
    """torch.compile enters torch.nn's own modules through an inlined wrapper, never ``model.__call__``."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _cnn().body
        compiled = torch.compile(daf.wrap(model, bits=8, min_numel=1), backend="aot_eager", fullgraph=True)
        got = [_step(compiled, model, MODELS["cnn"][1]) for _ in range(2)][-1]
    ours = [w for w in caught if str(w.message).startswith("DAF:")]
    torch._dynamo.reset()  # else the plain model reuses the wrapped one's graph: the hooks were not ambient
    expected = _step(*_compiled(_cnn().body, "plain", "aot_eager"), MODELS["cnn"][1])
    assert len(ours) == 1 and "compresses nothing" in str(ours[0].message)
    assert "nn.Sequential" in str(ours[0].message) and "daf.wrap(torch.compile(model))" in str(ours[0].message)
    assert torch.equal(got, expected)
    assert daf.report(model).stored_bytes == 0


@pytest.mark.parametrize("order", ["compile(wrap(m))", "wrap(compile(m))"])
def test_both_orders_store_codes_in_one_graph_and_keep_compiled_fp32s_gradients_at_8_bits_nearest(order):
    """A block with dropout (its mask saved as 1 bit) and ReLU (its sign bits): cosine >= 0.999 to compiled fp32."""
    shape = (4, 16, 32)
    torch._dynamo.reset()
    plain = _block(dropout=0.1)
    compiled_plain = torch.compile(plain, backend="aot_eager")
    raw, expected = _held_and_grads(compiled_plain, plain, shape)
    torch._dynamo.reset()
    counters.clear()
    model = _block(dropout=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if order == "compile(wrap(m))":
            compiled = torch.compile(daf.wrap(model, bits=8, rounding="nearest", min_numel=1024), backend="aot_eager")
            wrapped = model
        else:
            compiled = wrapped = daf.wrap(torch.compile(model, backend="aot_eager"), bits=8, rounding="nearest",
                                          min_numel=1024)
        for _ in range(2):  # a second step at the same shapes compiles nothing
            packed, got = _held_and_grads(compiled, model, shape)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"] and not counters["recompiles"]
    assert float(nn.functional.cosine_similarity(got, expected, dim=0)) > 0.999
    assert raw / packed > 2  # 8-bit codes, 1-bit masks; parameters, inputs and small saves as they are
    kinds = {row.kind for row in daf.report(wrapped).rows}
    assert {"compressed", "mask"} <= kinds


def _held_and_grads(model: nn.Module, params: nn.Module, shape: tuple[int, ...]) -> tuple[int, torch.Tensor]:
    torch.manual_seed(1)  # the same dropout masks
    loss = model(_x(shape)).square().mean()
    held = _saved_by_graphs(loss)
    return held, torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(params.parameters()))]).double()


def test_compile_of_the_wrapped_model_packs_only_training_forwards_and_survives_a_dynamo_reset():
    shape = MODELS["cnn"][1]
    torch._dynamo.reset()
    model = _cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        daf.wrap(model, bits=8, min_numel=1)
        torch._dynamo.reset()  # forgets what dynamo was told about DAF's entry frames
        counters.clear()
        compiled = torch.compile(model, backend="aot_eager")
        held = [_saved_by_graphs(compiled(_x(shape)).square().mean()) for _ in range(3)]
        model.eval()
        with torch.no_grad():
            evaluated = compiled(_x(shape))
    assert not counters["graph_break"]
    torch._dynamo.reset()
    plain = _cnn()
    reference = _saved_by_graphs(torch.compile(plain, backend="aot_eager")(_x(shape)).square().mean())
    assert held[-1] < reference / 2
    with torch.no_grad():
        assert torch.equal(evaluated, model(_x(shape)))  # eagerly, in eval: nothing of DAF's


def test_evaluating_a_compiled_wrapped_container_says_nothing():
    """Nothing is compressed in eval either way: no warning that nothing is (only training is traced so)."""
    torch._dynamo.reset()
    model = daf.wrap(_cnn().body, bits=8).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            torch.compile(model, backend="aot_eager")(_x(MODELS["cnn"][1]))
    assert not [w for w in caught if str(w.message).startswith("DAF:")]


def test_copies_of_a_wrapped_model_call_themselves_and_unwrap_removes_the_entry():
    import copy
    model = daf.wrap(_cnn(), bits=8)
    assert "__call__" in vars(model)
    for duplicate in (copy.deepcopy(model), _reloaded(model)):
        assert duplicate.__call__.__self__._module() is duplicate
        assert torch.equal(duplicate.__call__(_x(MODELS["cnn"][1])), duplicate(_x(MODELS["cnn"][1])))
    daf.unwrap(model)
    assert "__call__" not in vars(model)


def test_the_entry_holds_its_model_weakly_so_a_dropped_model_goes_without_the_garbage_collector():
    import gc
    import weakref
    gc.disable()
    try:
        model = daf.wrap(_cnn(), bits=8)
        gone = weakref.ref(model)
        del model
        assert gone() is None
    finally:
        gc.enable()


def _reloaded(model: nn.Module) -> nn.Module:
    import io
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _step(model: nn.Module, params: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    loss = model(_x(shape)).square().mean()
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(params.parameters()))])


def test_a_compiled_part_of_an_eager_wrapped_model_is_one_graph_and_the_rest_is_compressed():
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    model = _cnn()
    model.body[3] = torch.compile(model.body[3], backend=counter, fullgraph=True)
    with pytest.warns(UserWarning, match="^DAF: body.3 of this model run under torch.compile"):
        daf.wrap(model, bits=8, min_numel=1)
    for _ in range(3):
        model(_x(MODELS["cnn"][1])).square().mean().backward()
    assert (counter.frame_count, counter.op_count, sum(counters["graph_break"].values())) == (1, 1, 0)
    assert daf.report(model).ratio > 2  # the eager layers around it still compress
