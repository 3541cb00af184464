"""The lifecycle DAF owns: ``unwrap``, the end of a ``compress`` block and the garbage collection of a
wrapped model close its session. Every hook DAF put (on the model, its submodules, its parameters, on
autograd's saved-tensor hook stack) is gone and no ``daf-`` thread is left, while what was already
stored stays readable for a backward still to come.

That last part needs the store's close contract: ``close`` stops the prefetch thread and refuses new
records, those already put stay readable until released. The tests that run backward after the close
run twice: on a small store written to that contract here (what ``daf.api`` relies on), and on the
real one (strict xfail until the memory branch gives ``PagedStore.close`` that contract).
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import daf
from daf.memory import HeapStore
from daf.runtime import Session
from tests.models import SmallCNN



def adaptive(**knobs: Any) -> daf.Config:
    """The adaptive policy at 2 bits on average (one line to change when it becomes ``daf.Adaptive(average=2.0)``)."""
    return daf.Config(policy=daf.Adaptive(average=2.0), **knobs)


def uniform(**knobs: Any) -> daf.Config:
    return daf.Config(bits=2, **knobs)


POLICIES = {"uniform": uniform, "adaptive": adaptive}


class ContractStore(HeapStore):
    """``HeapStore`` with the close contract ``Session.close`` relies on: new records refused, those
    already stored readable until autograd releases them."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def put(self, packed: Any, importance: float, site: str) -> int:
        if self.closed:
            raise RuntimeError("this store is closed")
        return super().put(packed, importance, site)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(params=["contract", "paged"])
def store_kind(request, monkeypatch) -> str:
    """Sessions made by ``daf.wrap`` and ``daf.compress`` get a ``ContractStore`` or the real store."""
    if request.param == "contract":
        monkeypatch.setattr(daf.api, "_session", lambda config: Session(config, store=ContractStore()))
    return request.param


# -- what to look at -----------------------------------------------------------------------------

def hook_tables(model: nn.Module) -> dict[tuple[str, str], int]:
    """The size of every hook table of the model, its submodules and its parameters."""
    sizes = {}
    for path, module in model.named_modules():
        for name, table in vars(module).items():
            if "hook" in name and isinstance(table, dict):
                sizes[(path, name)] = len(table)
    for path, p in model.named_parameters():
        for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            sizes[(path, name)] = len(getattr(p, name, None) or {})
    return sizes


def parameter_hooks(model: nn.Module) -> int:
    return sum(n for (_, name), n in hook_tables(model).items() if name in ("_backward_hooks",
                                                                            "_post_accumulate_grad_hooks"))


def autograd_saves_tensors_as_they_are() -> bool:
    """No saved-tensor hooks entered: autograd keeps an op's input itself (docs: autograd mechanics,
    saved tensors), where DAF's unpack would return a decoded copy."""
    a = torch.randn(64, 64, requires_grad=True)
    b = torch.tanh(a)  # has autograd history: DAF would compress it
    c = b * a
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None and c.grad_fn._saved_self is b


def new_daf_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("daf-") and t not in before)


def step(model: nn.Module, x: torch.Tensor | None = None) -> torch.Tensor:
    """One forward; returns the loss, backward not run yet."""
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)) if x is None else x
    return model(x).square().mean()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# -- unwrap --------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_unwrap_removes_every_hook_daf_put(policy):
    model = SmallCNN()
    clean = hook_tables(model)
    daf.wrap(model, POLICIES[policy](min_numel=1))
    for _ in range(2):
        step(model).backward()
    assert hook_tables(model) != clean
    if policy == "adaptive":
        assert parameter_hooks(model) > 0  # the importance estimator hooks BatchNorm's weight
    session = daf.session_of(model)
    daf.unwrap(model)
    assert hook_tables(model) == clean
    with pytest.raises(ValueError, match="not wrapped"):
        daf.session_of(model)
    assert autograd_saves_tensors_as_they_are()
    forwards, records = session.forwards, len(session.store)
    step(model).backward()  # trains on, untouched by DAF
    assert session.forwards == forwards and len(session.store) == records == 0
    assert hook_tables(model) == clean


@pytest.mark.parametrize("policy", POLICIES)
def test_unwrap_between_forward_and_backward_gives_the_gradients_of_a_model_still_wrapped(policy, store_kind):
    torch.manual_seed(0)
    model = SmallCNN()
    twin = copy.deepcopy(model)
    clean = hook_tables(twin)
    for m in (model, twin):
        daf.wrap(m, POLICIES[policy](min_numel=1))
        step(m).backward()  # the adaptive policy plans its next step from this one
        m.zero_grad(set_to_none=True)
    step(model).backward()
    loss = step(twin)
    store = daf.session_of(twin).store
    daf.unwrap(twin)
    assert hook_tables(twin) == clean and autograd_saves_tensors_as_they_are()
    loss.backward()  # reads what the closed session stored
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(twin)))
    del loss
    gc.collect()
    assert len(store) == 0  # each record freed when autograd released it


@pytest.mark.parametrize("knobs", [{"background": True}, {"budget": 20_000}], ids=["packer", "prefetch"])
def test_unwrap_stops_daf_threads(knobs):
    before = set(threading.enumerate())
    model = daf.wrap(SmallCNN(), bits=2, min_numel=1, **knobs)
    step(model).backward()  # under this budget backward reads spilled records ahead on the prefetch thread
    assert new_daf_threads(before)
    daf.unwrap(model)
    assert new_daf_threads(before) == []


def test_unwrap_before_backward_under_a_budget_reads_spilled_records_and_leaves_no_thread():
    torch.manual_seed(0)
    model = SmallCNN()
    twin = copy.deepcopy(model)
    before = set(threading.enumerate())
    for m in (model, twin):
        daf.wrap(m, bits=2, min_numel=1, budget=20_000)
    step(model).backward()
    daf.unwrap(model)
    loss = step(twin)
    assert daf.report(twin).sections["store"]["spills"] > 0
    daf.unwrap(twin)
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(twin)))  # spilling is exact
    assert new_daf_threads(before) == []


def test_wrap_again_after_unwrap_and_unwrap_twice():
    model = SmallCNN()
    clean = hook_tables(model)
    daf.wrap(model, uniform(min_numel=1))
    first = daf.session_of(model)
    step(model).backward()
    daf.unwrap(model)
    daf.wrap(model, adaptive(min_numel=1))
    assert daf.session_of(model) is not first
    step(model).backward()
    assert daf.report(model).rows and daf.session_of(model).forwards == 1
    daf.unwrap(model)
    assert hook_tables(model) == clean
    with pytest.raises(ValueError, match="not wrapped by DAF"):
        daf.unwrap(model)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_garbage_collected_wrapped_model_closes_its_session(policy):
    before = set(threading.enumerate())
    model = daf.wrap(SmallCNN(), POLICIES[policy](min_numel=1, background=True))
    step(model).backward()
    weight, gone = model.bn1.weight, weakref.ref(model)
    assert new_daf_threads(before)
    del model
    gc.collect()
    assert gone() is None  # the finalizer holds the session, not the model
    assert new_daf_threads(before) == []
    assert not weight._backward_hooks  # the adaptive policy's hook on BatchNorm's weight is gone too


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return x


def refuse(module: nn.Module, args: Any) -> None:
    raise RuntimeError("refused")


@pytest.mark.parametrize("policy", POLICIES)
def test_an_exception_mid_forward_leaves_no_hook_entered(policy):
    fails = Fails()
    model = daf.wrap(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Sequential(fails), nn.Linear(64, 64)),
                     POLICIES[policy](min_numel=1))
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(8, 64))
    assert autograd_saves_tensors_as_they_are()
    assert torch._C._len_torch_function_stack() == 0  # the op tracker (a TorchFunctionMode) is off too
    fails.armed = False
    handle = model.register_forward_pre_hook(refuse)  # the user's, run after DAF's own: raises before forward
    with pytest.raises(RuntimeError, match="refused"):
        model(torch.randn(8, 64))
    assert autograd_saves_tensors_as_they_are() and torch._C._len_torch_function_stack() == 0
    handle.remove()
    model(torch.randn(8, 64)).sum().backward()  # and the next forward is compressed as usual
    assert [r.site for r in daf.report(model).rows if r.kind == "compressed"]
    daf.unwrap(model)


# -- compress ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_the_end_of_a_compress_block_closes_its_session(policy):
    model = SmallCNN()
    clean = hook_tables(model)
    before = set(threading.enumerate())
    with daf.compress(model, POLICIES[policy](min_numel=1, background=True)) as session:
        step(model).backward()
        assert hook_tables(model) != clean and new_daf_threads(before)
        if policy == "adaptive":
            assert parameter_hooks(model) > 0
    assert hook_tables(model) == clean and new_daf_threads(before) == []
    assert autograd_saves_tensors_as_they_are()
    assert daf.report(session).rows  # the figures stay


def test_an_exception_in_a_compress_block_closes_its_session():
    before = set(threading.enumerate())
    with pytest.raises(KeyError):
        with daf.compress(bits=2, min_numel=1, background=True):
            torch.tanh(torch.randn(64, 64, requires_grad=True)).sum()
            assert new_daf_threads(before)
            raise KeyError("x")
    assert new_daf_threads(before) == [] and autograd_saves_tensors_as_they_are()


def test_backward_after_a_compress_block_under_a_budget_reads_spilled_records_and_leaves_no_thread():
    torch.manual_seed(0)
    model = SmallCNN()
    twin = copy.deepcopy(model)
    before = set(threading.enumerate())
    with daf.compress(model, bits=2, min_numel=1, budget=20_000):
        step(model).backward()
    with daf.compress(twin, bits=2, min_numel=1, budget=20_000) as session:
        loss = step(twin)
    assert session.store.stats()["spills"] > 0
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(twin)))  # spilling is exact
    assert new_daf_threads(before) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_backward_after_a_compress_block_gives_the_gradients_of_backward_inside_it(policy, store_kind):
    torch.manual_seed(0)
    model = SmallCNN()
    twin = copy.deepcopy(model)
    with daf.compress(model, POLICIES[policy](min_numel=1)):
        step(model).backward()
    with daf.compress(twin, POLICIES[policy](min_numel=1)) as session:
        loss = step(twin)
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(twin)))
    del loss
    gc.collect()
    assert len(session.store) == 0


def test_a_session_is_a_context_manager_and_closes_once():
    before = set(threading.enumerate())
    a = torch.randn(64, 64, requires_grad=True)
    with Session(daf.Config(bits=2, min_numel=1, background=True)) as session:
        with session.hooks():
            loss = (torch.tanh(a) * a).sum()
        session.end_forward()
        assert new_daf_threads(before)
    assert new_daf_threads(before) == []
    session.close()  # again: nothing to do


def test_a_forward_in_eval_mode_with_grad_says_once_that_nothing_is_compressed():
    import warnings as warnings_module
    model = daf.wrap(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)), min_numel=1)
    model.eval()
    with pytest.warns(UserWarning, match="eval\\(\\) mode with grad enabled"):
        model(torch.randn(8, 64)).sum().backward()
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error")
        model(torch.randn(8, 64)).sum().backward()  # once per model
        with torch.no_grad():
            model(torch.randn(8, 64))
    assert daf.report(model).forward is None and "nothing was compressed" in str(daf.report(model))
    model.train()
    model(torch.randn(8, 64)).sum().backward()
    model(torch.randn(8, 64)).sum().backward()
    assert daf.report(model).forward == 1 and str(daf.report(model)).count("forward 1:") == 1
