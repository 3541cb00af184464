"""LayerNorm's and RMSNorm's output, saved by the next linear (a LoRA adapter reading BERT's or Llama's
layer output), is remade from the norm's stored input and saved statistics, not stored again; ``Config.floors`` sets the bits of
both; attention's reshaped operands without history are coded, not kept raw."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from tests.models import without_rule
from daf.tracing import normalized_output_of, rms_normalized_output_of



class NormThenLinear(nn.Module):
    """x -> LayerNorm(x + a(x)) -> b: the linear saves the norm's output (flattened to 2-D by F.linear)."""

    def __init__(self, width: int = 64, affine: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, 16)
        self.norm = nn.LayerNorm(width, elementwise_affine=affine)
        if affine:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 2.0)
                self.norm.bias.uniform_(-1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(x + self.a(x)))


class LlamaRMSNorm(nn.Module):
    """RMSNorm as Llama, Mistral and Qwen2 write it (elementwise ops), with a frozen or trained weight."""

    def __init__(self, width: int, trained: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width).uniform_(0.5, 2.0), requires_grad=trained)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Unweighted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


RMS_NORMS = {"llama-frozen": lambda w: LlamaRMSNorm(w, trained=False), "llama-trained": lambda w: LlamaRMSNorm(w, True),
             "torch": lambda w: nn.RMSNorm(w), "unweighted": lambda w: Unweighted()}


class RMSNormThenLinear(NormThenLinear):
    def __init__(self, norm: str, width: int = 64) -> None:
        super().__init__(width)
        self.norm = RMS_NORMS[norm](width)


def _grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    (model(x) * torch.linspace(-1, 1, 16)).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("affine", [True, False])
def test_normalized_output_of_remakes_the_output_through_views(affine):
    torch.manual_seed(0)
    norm, x = nn.LayerNorm(32, elementwise_affine=affine), torch.randn(4, 8, 32, requires_grad=True) * 3
    y = norm(x * 1.0)
    for saved in (y, y.view(32, 32), y.reshape(4, 256)):
        found = normalized_output_of(saved)
        assert found is not None and found.node is y.grad_fn.next_functions[0][0]
        torch.testing.assert_close(found.function((x * 1.0).detach()), saved.detach(), rtol=1e-5, atol=1e-5)


def test_other_tensors_are_not_normalized_outputs():
    x = torch.randn(4, 32, requires_grad=True)
    y = F.layer_norm(x * 1.0, (32,))
    assert normalized_output_of(y.t()) is None           # not order-keeping
    assert normalized_output_of(y * 2) is None
    assert normalized_output_of(F.layer_norm(torch.randn(4, 32), (32,))) is None  # no history
    assert normalized_output_of(torch.tanh(x)) is None


@pytest.mark.parametrize("norm", list(RMS_NORMS))
def test_rms_normalized_output_of_remakes_the_output_through_views(norm):
    torch.manual_seed(0)
    module, h = RMS_NORMS[norm](32), torch.randn(4, 8, 32, requires_grad=True) * 3
    y = module(h)
    for saved in (y, y.view(32, 32), y.reshape(4, 256)):
        found = rms_normalized_output_of(saved)
        assert found is not None and found.node is h.grad_fn
        torch.testing.assert_close(found.function(h.detach()), saved.detach(), rtol=0, atol=0)  # forward's order


def test_other_tensors_are_not_rms_normalized_outputs():
    x = torch.randn(4, 32, requires_grad=True)
    y = RMS_NORMS["llama-frozen"](32)(x * 1.0)
    assert rms_normalized_output_of(y.t()) is None  # not order-keeping
    assert rms_normalized_output_of(y * (x * 1.0)) is None  # times a tensor with history: not a weight
    unweighted = RMS_NORMS["unweighted"](32)(x * 1.0)
    assert rms_normalized_output_of(unweighted * torch.rand(4, 32)) is None  # a full-size factor: dropout's noise
    assert rms_normalized_output_of(x * (x * 1.0)) is None
    assert rms_normalized_output_of(RMS_NORMS["llama-frozen"](32)(torch.randn(4, 32))) is None  # no history
    assert rms_normalized_output_of(torch.tanh(x)) is None


NORMS = ["layer-affine", "layer-plain", *RMS_NORMS]


def _norm_then_linear(norm: str) -> NormThenLinear:
    if norm.startswith("layer"):
        return NormThenLinear(affine=norm == "layer-affine")
    return RMSNormThenLinear(norm)


@pytest.mark.parametrize("norm", NORMS)
def test_the_linear_after_a_norm_stores_nothing_and_keeps_its_gradient(norm, monkeypatch):
    torch.manual_seed(0)
    plain, x = _norm_then_linear(norm), torch.randn(16, 32, 64)
    reference = _grads(plain, x)
    model = daf.wrap(_norm_then_linear(norm), bits=8)
    model.load_state_dict(plain.state_dict())
    got = _grads(model, x)
    report = daf.report(model)
    derived = {r.site: (r.stored_bytes, r.raw_bytes) for r in report.rows if r.kind == "derived"}
    assert derived["b#0"] == (0, 16 * 32 * 64 * 4)  # (a trained RMSNorm weight's multiply also saves x * r: remade)
    assert F.cosine_similarity(got, reference, dim=0) > 0.9999
    without_rule(model, "activation")  # as before: codes of it
    _grads(model, x)
    assert daf.report(model).stored_bytes - report.stored_bytes >= 16 * 32 * 64  # an 8-bit copy at least


def test_a_norm_whose_input_is_not_stored_has_its_output_coded():
    """The input below min_numel is kept raw by autograd: nothing to derive from, the output gets codes."""
    model = daf.wrap(NormThenLinear(), bits=4, min_numel=2**20)
    _grads(model, torch.randn(16, 32, 64))
    assert not [r for r in daf.report(model).rows if r.kind == "derived"]


def test_in_place_change_of_the_norm_output_raises_like_autograd():
    class Changed(NormThenLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm(x + self.a(x))
            out = self.b(y)
            y.mul_(2)
            self.kept = y  # alive at backward, so DAF sees the change
            return out

    model = daf.wrap(Changed(), bits=8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(model, torch.randn(4, 8, 64))


def test_floors_raise_the_named_functions_saves_and_no_other():
    model = daf.wrap(NormThenLinear(), daf.Config(bits=2, floors={"layer_norm": 4}))
    _grads(model, torch.randn(16, 32, 64))
    assert {r.site: r.bits for r in daf.report(model).rows if r.kind == "compressed"} == {"norm#1": 4}
    # the linear's input at 8 would be finer than the norm's 2-bit input: coded, not derived
    model = daf.wrap(NormThenLinear(), daf.Config(bits=2, floors={"linear": 8}))
    _grads(model, torch.randn(16, 32, 64))
    assert {r.site: r.bits for r in daf.report(model).rows if r.kind == "compressed"} == {"norm#1": 2, "b#0": 8}
    model = daf.wrap(NormThenLinear(), daf.Config(bits=8, floors={"layer_norm": 2}))  # a floor never lowers
    _grads(model, torch.randn(16, 32, 64))
    assert {r.bits for r in daf.report(model).rows if r.kind == "compressed"} == {8}


def test_a_floor_at_the_norm_sets_the_derived_outputs_precision():
    torch.manual_seed(0)
    plain, x = NormThenLinear(), torch.randn(16, 32, 64)
    reference = _grads(plain, x)
    errors = {}
    for floors in ({}, {"layer_norm": 8}):
        model = daf.wrap(NormThenLinear(), daf.Config(bits=2, floors=floors))
        model.load_state_dict(plain.state_dict())
        grads = _grads(model, x)
        errors[bool(floors)] = ((grads - reference).norm() / reference.norm()).item()
    assert errors[True] < errors[False] / 3


class FrozenKeyAttention(nn.Module):
    """Attention whose key comes from a frozen projection of an input without history (BERT's first layer
    under LoRA on query and value); dropout on, so a CPU runs attention's math path."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.k.requires_grad_(False)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        split = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        return F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), dropout_p=0.1)


def test_attentions_reshaped_operand_without_history_is_coded_under_the_guard():
    torch.manual_seed(0)
    model = daf.wrap(FrozenKeyAttention(), bits=2).train()
    model(torch.randn(8, 64, 64)).sum().backward()
    attention = [r for r in daf.report(model).rows if r.site.startswith("<root>")]  # what attention saved
    key = [r for r in attention if r.source == "no history" and r.kind != "mask"]
    assert len(key) == 1 and (key[0].kind, key[0].bits, key[0].raw_bytes) == ("compressed", 8, 8 * 64 * 64 * 4)
    assert not [r for r in attention if r.kind == "raw"]


class NormThenTwoAdapters(nn.Module):
    """A norm whose output two linears read (a query's and a value's LoRA adapter): F.linear flattens it
    for each, so autograd holds two views of one value; between them a small linear's input is decoded."""

    def __init__(self, width: int = 64, rank: int = 4) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(width, width), nn.LayerNorm(width)
        self.q_down, self.q_up = nn.Linear(width, rank, bias=False), nn.Linear(rank, 16, bias=False)
        self.v_down, self.v_up = nn.Linear(width, rank, bias=False), nn.Linear(rank, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x + self.a(x))
        return self.q_up(torch.relu(self.q_down(y))) * self.v_up(torch.relu(self.v_down(y)))


def _counted_grads(monkeypatch, share: bool) -> tuple[torch.Tensor, int, int]:
    import daf.tracing.products as products
    from daf.runtime.remade import RemadeValues
    calls = {"normalized": 0}
    normalized = products._normalized

    def counting(*args, **kwargs):
        calls["normalized"] += 1
        return normalized(*args, **kwargs)
    monkeypatch.setattr(products, "_normalized", counting)
    if not share:
        monkeypatch.setattr(RemadeValues, "get", lambda self, remake, tensor: None)
    torch.manual_seed(0)
    model = NormThenTwoAdapters()
    x = torch.randn(4, 32, 64)
    daf.wrap(model, daf.Config(bits=8, rounding="nearest", min_numel=1, audit=daf.Audit(every=0)))
    decodes = []
    codecs = daf.session_of(model).codecs
    decode = codecs.decode

    def counting_decode(packed, *args, **kwargs):
        decodes.append(packed.numel)
        return decode(packed, *args, **kwargs)
    monkeypatch.setattr(codecs, "decode", counting_decode)
    (model(x) * torch.linspace(-1, 1, 16)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    norm_input_decodes = sum(1 for n in decodes if n == x.numel())
    monkeypatch.undo()
    return grads, calls["normalized"], norm_input_decodes


def test_two_views_of_one_remade_norm_output_are_remade_once_and_its_input_decoded_once(monkeypatch):
    shared, remakes, decodes = _counted_grads(monkeypatch, share=True)
    apart, remakes_apart, decodes_apart = _counted_grads(monkeypatch, share=False)
    assert (remakes, remakes_apart) == (1, 2)
    assert decodes == 1  # for the remake and the norm's own backward, with the adapters' small inputs between
    assert torch.equal(shared, apart)  # the same values either way


def test_a_shared_remade_norm_output_under_the_adaptive_policy():
    """The adaptive policy weighs what each call saved by site: the second view is weighed under the first
    save's site, which it watched, over steps that replan."""
    torch.manual_seed(0)
    model, plain = NormThenTwoAdapters(), NormThenTwoAdapters()
    plain.load_state_dict(model.state_dict())
    daf.wrap(model, daf.Config(policy=daf.Adaptive(average=4.0, replan_every=2), min_numel=1,
                               audit=daf.Audit(every=0)))
    for _ in range(5):
        x = torch.randn(4, 32, 64)
        for m in (model, plain):
            m.zero_grad()
            (m(x) * torch.linspace(-1, 1, 16)).sum().backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = torch.cat([p.grad.flatten() for p in plain.parameters()])
    assert F.cosine_similarity(got, want, dim=0) > 0.95
    assert daf.report(model).sections["policy"]["plans"] >= 1
