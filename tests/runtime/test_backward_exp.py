"""Saves that backward exponentiates keep 8 bits: fused attention's q and k (softmax recomputed from them
and an exact logsumexp; its output is remade from q, k and v on a CPU, so v keeps 4 bits);
log_softmax's output (cross-entropy's backward is grad - exp(output) * sum(grad)) is
stored as its probabilities instead, at 4 bits."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import daf
from tests.models import without_rule
from daf.policy import exponent_guard as guard_module
from daf.policy.exponent_guard import (ATTENTION_VALUE_BITS, LOGIT_ERROR, LOGIT_WIDTHS, PROBABILITY_BITS,
                                       SOFTMAX_RECOMPUTE_BITS, logit_bits)
route_module = importlib.import_module("daf.runtime.route")


class Attention(torch.nn.Module):
    """One causal attention head block; ``sharpness`` scales the logits (trained LMs reach ~10-30)."""

    def __init__(self, dim: int = 64, heads: int = 4, sharpness: float = 1.0) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.heads, self.sharpness = heads, sharpness

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (part.reshape(b, t, self.heads, -1).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q * self.sharpness, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def _grads(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(x).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _fused_attention_saves_inputs() -> bool:
    q = torch.randn(1, 1, 8, 8, requires_grad=True) * 1
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        F.scaled_dot_product_attention(q, q * 1, q * 1, is_causal=True)
    return any(t is q for t in seen)


needs_fused = pytest.mark.skipif(not _fused_attention_saves_inputs(),
                                 reason="this build runs attention through its math path here")


@needs_fused
@pytest.mark.parametrize("masks", [True, False])
@pytest.mark.parametrize("policy,bits", [(daf.Uniform(), 2), (daf.Uniform(), 1), (daf.Adaptive(average=2.0), 2)],
                         ids=["uniform-2", "uniform-1", "adaptive-2.0"])
def test_fused_attention_bounds_q_and_k_and_remakes_its_output_with_the_logsumexp(policy, bits, masks):
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(4, 64, 64)
    daf.wrap(model, bits=bits, policy=policy, masks=masks, min_numel=1)
    model(x).sum().backward()
    rows = daf.report(model).rows
    attention = [r for r in rows if r.shape == (4, 4, 64, 16)]  # q (scaled), k, v, output
    assert [r.kind for r in attention[:2]] == ["compressed"] * 2
    assert all(r.bits in LOGIT_WIDTHS and r.bits > bits for r in attention[:2])  # the bound's width, not the policy's
    assert (attention[2].kind, attention[2].bits) == ("compressed", ATTENTION_VALUE_BITS)  # v
    assert attention[3].kind == "derived" and attention[3].stored_bytes == 0  # the output
    logsumexp = [r for r in rows if r.shape == (4, 4, 64)]
    assert [(r.kind, r.stored_bytes) for r in logsumexp] == [("derived", 0)]  # remade with the output
    others = [r for r in rows if r.shape != (4, 4, 64, 16) and r.kind == "compressed"]  # the linear layers' inputs
    assert others and all(r.bits < SOFTMAX_RECOMPUTE_BITS for r in others)


@needs_fused
def test_the_remade_attention_output_is_the_kernels():
    from daf.tracing import attention_output_of
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) * 1 for _ in range(3))
    mask = torch.randn(32, 32)
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        found = attention_output_of(out)
        given = (mask,) if "attn_mask" in kwargs else ()
        remade, logsumexp = found.function(q.detach(), k.detach(), v.detach(), *given)
        assert found is not None and torch.equal(remade, out.detach())
        assert logsumexp.shape == q.shape[:-1] and torch.isfinite(logsumexp).all()
    assert attention_output_of(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)) is None
    assert attention_output_of(q * 2) is None


def test_v_keeps_eight_bits_where_the_output_is_not_remade():
    """With dropout (its mask is not saved) or off a CPU there is no output to remake: v and a stored
    output must agree at 8 bits, as q and k always do."""
    from daf.policy.exponent_guard import backward_exponentiates
    from daf.tracing import OpCall
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) * 1 for _ in range(3))
    plain = OpCall(F.scaled_dot_product_attention, (q, k, v), {})
    dropped = OpCall(F.scaled_dot_product_attention, (q, k), {"value": v, "dropout_p": 0.1})
    assert [backward_exponentiates(plain, t) for t in (q, k, v)] == [True, True, False]
    assert [backward_exponentiates(dropped, t) for t in (q, k, v)] == [True, True, True]
    assert not backward_exponentiates(OpCall(F.linear, (q, k), {}), q)


@needs_fused
@pytest.mark.parametrize("masked", [False, True])
def test_the_output_is_remade_with_the_saved_mask(masked):
    """A float mask given to attention is read from its record in backward (here: kept raw, no history)."""
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(4, 64, 64)
    mask = torch.randn(64, 64) * 3 if masked else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p.reshape(b, t, 4, -1).transpose(1, 2) for p in model.qkv(x).chunk(3, dim=-1))
        return model.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d))

    model.forward = forward
    reference = _grads(model, x)
    daf.wrap(model, bits=8, min_numel=1)
    got = _grads(model, x)
    assert [r.kind for r in daf.report(model).rows if r.shape == (4, 4, 64, 16)][-1] == "derived"
    assert F.cosine_similarity(got, reference, dim=0) > 0.9999


@needs_fused
def test_a_remade_output_keeps_sharp_attention_where_separate_codes_of_v_and_the_output_do_not(monkeypatch):
    torch.manual_seed(0)
    model, x = Attention(sharpness=30.0), torch.randn(4, 64, 64)
    reference = _grads(model, x)
    daf.wrap(model, bits=4, min_numel=1)
    remade = F.cosine_similarity(_grads(model, x), reference, dim=0)
    without_rule(model, "attention_output")  # the output coded at 4 bits, v at the 4 a remade output allows
    session_module = importlib.import_module("daf.runtime.session")
    monkeypatch.setattr(session_module, "guarded_choice",
                        lambda *args, **kwargs: guard_module.guarded_choice(*args, **{**kwargs, "attention_remade": True}))
    stored = F.cosine_similarity(_grads(model, x), reference, dim=0)
    assert remade > 0.98 and stored < remade - 0.05  # 0.99 and 0.85 when measured


def test_without_the_attention_output_rule_v_and_the_output_keep_8_bits():
    """``Config.remakes`` without "attention_output": the output is stored, so the guard gives it and v the
    8 bits a stored pair needs (their difference is what backward takes), not the 4 a remade output allows."""
    torch.manual_seed(0)
    model, x = Attention(sharpness=30.0), torch.randn(4, 64, 64)
    reference = _grads(model, x)
    remakes = tuple(name for name in daf.Config().remakes if name != "attention_output")
    daf.wrap(model, bits=4, min_numel=1, remakes=remakes)
    stored = F.cosine_similarity(_grads(model, x), reference, dim=0)
    rows = daf.report(model).rows
    assert all(row.kind != "derived" for row in rows)
    values = [row for row in rows if row.why == "exponentiated in backward"]  # v and the output
    assert [row.bits for row in values] == [8, 8]
    assert stored > 0.999  # 0.9997 when measured


@needs_fused
@pytest.mark.parametrize("sharpness", [4.0, 30.0])
def test_sharp_attention_at_two_bits_needs_the_rule(monkeypatch, sharpness):
    torch.manual_seed(0)
    model, x = Attention(sharpness=sharpness), torch.randn(4, 64, 64)
    reference = _grads(model, x)
    daf.wrap(model, bits=2, min_numel=1)
    kept = _grads(model, x)
    assert torch.isfinite(kept).all() and F.cosine_similarity(kept, reference, dim=0) > 0.97
    monkeypatch.setattr(guard_module, "floor_rule", lambda *args: (1, ""))
    broken = _grads(model, x)  # the same codes for q, k, v and the output as for everything else
    assert not torch.isfinite(broken).all() or F.cosine_similarity(broken, reference, dim=0) < 0.9


class SharpClassifier(torch.nn.Module):
    """A classifier over 4096 classes whose loss is computed inside forward, as language models do,
    with confident predictions (logits span ~+-40, like a trained LM's): log-probabilities near 0 and -40."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
        self.head = torch.nn.Linear(64, 4096)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * 20

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), y)


def _sharp_case() -> tuple[SharpClassifier, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, x = SharpClassifier(), torch.randn(256, 64)
    with torch.no_grad():  # mostly right and confident, like a trained model
        y = torch.where(torch.rand(256) < 0.7, model.logits(x).argmax(1), torch.randint(0, 4096, (256,)))
    return model, x, y


def _classifier_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(x, y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _log_softmax_rows(model: torch.nn.Module) -> list:
    return [r for r in daf.report(model).rows if r.source == "LogSoftmaxBackward0"]


def test_log_softmax_output_is_stored_as_4_bit_probabilities(monkeypatch):
    model, x, y = _sharp_case()
    reference = _classifier_grads(model, x, y)
    daf.wrap(model, bits=2, min_numel=1)
    kept = _classifier_grads(model, x, y)
    rows = _log_softmax_rows(model)
    # cross_entropy saves it twice (log_softmax, then nll_loss): one record, shared
    assert [(r.kind, r.bits) for r in rows] == [("compressed", PROBABILITY_BITS), ("shared", None)]
    assert rows[0].stored_bytes < rows[0].raw_bytes / 6  # half the bytes of the 8-bit codes it replaces
    error = ((kept - reference).norm() / reference.norm()).item()
    assert error < 0.7  # 0.43 when measured: the 2-bit tanh output's share
    monkeypatch.setattr(route_module, "stored_as_probabilities", lambda tensor, op: False)  # codes of the logarithm
    monkeypatch.setattr(guard_module, "stored_as_probabilities", lambda tensor, op: False)  # at the policy's 2 bits
    broken = _classifier_grads(model, x, y)
    assert ((broken - reference).norm() / reference.norm()).item() > 2 * error  # 2.1 when measured


class NllAndEntropy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(self.head(x) * 30, -1)
        return F.nll_loss(logp, torch.zeros(len(x), dtype=torch.long)) + (logp * logp.exp()).sum()


def test_log_probabilities_shared_only_with_ops_that_read_them_through_exp():
    """An op that reads the values (the entropy's ``logp * p``) gets its own record: a probability coded
    to 0 decodes to log 0 = -inf, which it must not see."""
    torch.manual_seed(0)
    model, x = NllAndEntropy(), torch.randn(64, 16)
    reference = _grads(model, x)
    daf.wrap(model, bits=2, min_numel=1, audit=daf.Audit(every=0))  # the widths routing gives, not the audit's
    got = _grads(model, x)
    assert torch.isfinite(got).all() and torch.isfinite(reference).all()
    rows = [(r.kind, r.bits) for r in _log_softmax_rows(model)]
    # log_softmax's probabilities at 4 (nll_loss shares them), then mul's own codes at the policy's 2
    assert rows == [("compressed", PROBABILITY_BITS), ("shared", None), ("compressed", 2)]


class EagerAttention(torch.nn.Module):
    """Attention written out: the softmax saves its probabilities, the matmul saves them again."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.q, self.v = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.q(x) @ x.transpose(-1, -2)).softmax(-1) @ self.v(x)


@pytest.mark.parametrize("bits, expected", [(1, 4), (2, 4), (4, 4), (8, 8)])
def test_softmax_probabilities_keep_4_bits_at_least(bits, expected):
    model = daf.wrap(EagerAttention(), bits=bits, audit=daf.Audit(every=0))  # the guard's widths, not the audit's
    model(torch.randn(4, 64, 32)).sum().backward()
    rows = [r for r in daf.report(model).rows if r.source == "SoftmaxBackward0"]
    assert [(r.kind, r.bits) for r in rows] == [("compressed", expected)]
    others = [r for r in daf.report(model).rows if r.kind == "compressed" and r.source != "SoftmaxBackward0"]
    assert others and all(r.bits == bits for r in others)


def test_the_probability_floor_cuts_the_gradient_error(monkeypatch):
    torch.manual_seed(0)
    model, x = EagerAttention(), 3 * torch.randn(8, 64, 32)  # sharp attention, as pretrained models have
    reference = _grads(model, x)
    daf.wrap(model, bits=2)
    floor = _grads(model, x)
    monkeypatch.setattr(guard_module, "PROBABILITY_BITS", 2)
    without = _grads(model, x)
    error = lambda g: ((g - reference).norm() / reference.norm()).item()  # noqa: E731
    assert error(floor) < 0.5 * error(without)


def test_a_raw_choice_of_the_policy_stays_raw_for_probabilities():
    from daf.policy.exponent_guard import guarded_bits

    class KeepRaw(daf.policy.Policy):
        def bits_for(self, site, x):
            return 0

    probabilities = torch.randn(64, 64, requires_grad=True).softmax(-1)
    assert guarded_bits(KeepRaw(), "s", probabilities) == 0


@pytest.mark.parametrize("magnitude, expected", [(0.3, 4), (1.5, 8), (5.0, 0)])
def test_logit_bits_is_the_fewest_width_whose_predicted_shift_is_small(magnitude, expected):
    """q and k get the fewest width whose predicted logit shift is under LOGIT_ERROR; none: kept raw (0)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 64, 64, generator=g) * magnitude for _ in range(2))
    assert logit_bits(q, (q, k, 64 ** -0.5), "nearest", 256) == expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_logit_bits_takes_every_float_dtype_and_layout_the_same_way(dtype, layout):
    """The guard's statistics in every float dtype (float64 raised once) and for a transposed q (read in
    memory order without a copy): the width of the same values does not depend on either."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 4, 64, 64, generator=g) * 1.5 for _ in range(2))
    expected = logit_bits(q, (q, k, 64 ** -0.5), "nearest", 256)
    q, k = q.to(dtype), k.to(dtype)
    if layout == "transposed":  # the same memory order, seen as (batch, heads, tokens, dim) of a transpose
        q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    assert logit_bits(q, (q, k, 64 ** -0.5), "nearest", 256) == expected == 8


@pytest.mark.parametrize("magnitude", [0.3, 1.5, 5.0])
def test_auto_rounding_bounds_the_shift_of_q_and_k_as_nearest_codes(magnitude):
    """Under ``rounding="auto"`` q and k's widths (4, 8) are rounded to nearest: the guard predicts as for
    nearest rounding, and admits coarser codes than under stochastic rounding where the two differ."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 4, 64, 64, generator=g) * magnitude for _ in range(2))
    widths = {r: logit_bits(q, (q, k, 64 ** -0.5), r, 256) for r in ("auto", "nearest", "stochastic")}
    assert widths["auto"] == widths["nearest"]


def test_the_predicted_shift_bounds_the_measured_one():
    """Codes at the width ``logit_bits`` picks shift the logits by less than ``LOGIT_ERROR`` (root mean square)."""
    from daf.codec.minmax import MinMaxCodec
    from daf.codec.spec import Spec
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 64, 64, generator=g) * 1.5 for _ in range(2))
    bits = logit_bits(q, (q, k, 64 ** -0.5), "nearest", 256)
    codec = MinMaxCodec(daf.Config(bits=bits, rounding="nearest", backend="reference"))
    decoded = codec.decode(codec.encode(q, Spec(bits, 0)))
    measured = float(((decoded - q) @ k.transpose(-1, -2) * 64 ** -0.5).square().mean().sqrt())
    assert bits == 8 and LOGIT_ERROR / 10 < measured <= LOGIT_ERROR


@needs_fused
def test_q_and_k_whose_codes_would_shift_the_logits_too_far_stay_raw():
    torch.manual_seed(0)
    model, x = Attention(sharpness=100.0), torch.randn(2, 64, 64) * 10
    daf.wrap(model, min_numel=1)
    model(x).sum().backward()
    q = [r for r in daf.report(model).rows if r.shape == (2, 4, 64, 16)][0]  # the scaled query
    assert q.kind == "raw"
