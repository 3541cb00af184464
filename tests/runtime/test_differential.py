"""Differential property test: DAF's gradients against plain autograd on random small models (issue 13).

Hypothesis draws a model (``tests/runtime/differential_models.py``: Linear, Conv1d/Conv2d,
LayerNorm/BatchNorm/GroupNorm, activations, attention through ``F.scaled_dot_product_attention`` and
written out, residual adds, in-place ops on tensors and on views of them, views, transposes and
slices, dropout), a dtype, shapes, an input and optionally an in-place change made after forward.
The same weights and input run twice: plainly, and under ``daf.wrap`` at 8 bits with
``rounding="nearest"`` and ``min_numel=1`` (every saved tensor with history is compressed). Then
either

- both runs succeed: the forward outputs are identical (DAF never changes forward), and the gradients
  agree: cosine > 0.999 for the input and for every parameter whose gradient is not negligible
  (``NEGLIGIBLE``). Where 8-bit codes cannot reach 0.999 at all (a peaked softmax, whose small
  gradient is made of cancelling terms) DAF must be within ``IDEAL_FACTOR`` of ideal 8-bit codes of
  the same saved tensors (``_ideal_codes``, independent of DAF); or
- plain autograd raises: DAF raises the same type of error at the same stage (forward or backward),
  and where plain autograd reports a tensor modified by an in-place operation DAF does too (one
  known gap, ``MISSED_INPLACE_IS_KNOWN``: there DAF's gradients must be plain autograd's on the values
  of pack time).

``test_adaptive_...`` does the same under ``policy=daf.Adaptive(average=8.0)`` (stochastic rounding),
for the first forward only until the planner bug pinned below is fixed (``ADAPTIVE_STEPS``).

Known limits, kept out of the property by construction (the explicit tests at the end pin them, as
strict xfails):

- float32 denormals lose their scale: the codec computes in float32 with a step of at least 2^-126
  (float16 near 65504 and float64 around 1e-60 are handled now and pinned as passing tests);
- ``F.scaled_dot_product_attention`` with logits spread over a unit or more was one (its backward
  recomputed softmax from decoded q and k against the forward's exact logsumexp); the logsumexp is now
  remade with the output, and the large-logits test below passes; the QK-norm case the property found
  has two channels per head, where even ideal 8-bit codes give 0.87 (pinned below against their bound).
  The property still draws attention with QK-norm;
- an in-place change through an alias of a saved tensor whose own Python object is gone is missed.

So inputs are ``randn * scale`` with ``scale`` in [0.5, 2], weights are torch's default
initialisation, and models are a few blocks deep: activations stay far from both ends of every
dtype's range.

Deterministic and bounded for CI: ``derandomize=True`` (the same examples on every run, no example
database) and a fixed ``max_examples``. ``DAF_DIFFERENTIAL_EXAMPLES=2000`` runs more, to hunt.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

import daf
from tests.runtime.differential_models import ACTIVATIONS, ModelSpec, build

EXAMPLES = int(os.environ.get("DAF_DIFFERENTIAL_EXAMPLES", "0")) or None
COSINE = 0.999
# Whether "plain autograd raises for an in-place change, DAF does not" is tolerated (when DAF's gradients
# are those of the values at pack time): the known gap pinned by an xfail test below. False once fixed.
MISSED_INPLACE_IS_KNOWN = True
INPLACE = "modified by an inplace operation"
UNIFORM = daf.Config(bits=8, rounding="nearest", min_numel=1)
ADAPTIVE = daf.Config(policy=daf.Adaptive(average=8.0, replan_every=1, window=1), min_numel=1)

# A parameter's gradient is compared by cosine when its norm is above this fraction of the largest
# gradient norm of the run (parameters and input). Below, it is rounding noise of a gradient that
# is zero or nearly so analytically (e.g. the bias of a layer followed by BatchNorm) and its
# direction means nothing; there only the difference is bounded (by ``NEGLIGIBLE_DIFFERENCE``). In float16
# the bias before a BatchNorm had 2% of the largest norm in plain autograd (and a cosine of -0.9 to DAF's).
NEGLIGIBLE = {"float64": 1e-6, "float32": 1e-4, "bfloat16": 5e-2, "float16": 3e-2}
NEGLIGIBLE_DIFFERENCE = 2e-2
# A cosine below COSINE passes when DAF's 1 - cosine is at most this multiple of the worst of ideal 8-bit
# codes' (``_ideal_codes``: float64, nearest, at each of ``IDEAL_OFFSETS``) on the same run; twice this
# multiple under stochastic rounding. The same for the difference of a negligible gradient.
IDEAL_FACTOR = 3.0


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors of a few thousand elements gain nothing from intra-op threads; on busy shared cores
    OpenMP's spinning threads made the file 3 to 5 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- strategies ---------------------------------------------------------------------------------

def _leaf_blocks(channels: int) -> st.SearchStrategy[tuple]:
    """Blocks without nested blocks."""
    booleans = st.booleans()
    # At least 4 channels per head: with 2, QK-norm leaves q and k at +-1 and the logits tie, where the
    # gradient is ill-conditioned (ideal 8-bit codes gave cosine 0.77 on one such model).
    heads = st.sampled_from([h for h in (1, 2, 4) if channels % h == 0 and channels // h >= 4])
    return st.one_of(
        st.tuples(st.just("linear"), booleans),
        st.tuples(st.just("mlp"), st.sampled_from([1, 2]), st.sampled_from(ACTIVATIONS), booleans),
        st.tuples(st.just("act"), st.sampled_from(ACTIVATIONS)),
        st.tuples(st.just("norm"), st.sampled_from(["layer", "batch1d", "batch2d", "group"]),
                  st.sampled_from([g for g in (1, 2, 4) if channels % g == 0])),
        st.tuples(st.just("conv1d"), st.sampled_from([1, 3]), booleans, booleans),
        st.tuples(st.just("conv2d"), st.sampled_from([1, 3]), booleans, booleans),
        # SDPA only with QK-norm (logits within a few units): its backward recomputes softmax from the decoded
        # q and k and the exact logsumexp, so the codes' error in the logits comes back through exp() (the
        # known limit pinned by test_sdpa_at_8_bits_... below; even with QK-norm it can take the fallback to
        # the ideal codes' bound). Eager attention saves softmax's output instead and is drawn at every scale.
        st.tuples(st.just("attention"), heads, st.just("sdpa"), booleans, st.sampled_from([0.0, 0.0, 0.25]),
                  st.just(True), st.sampled_from(["default", "small"])),
        st.tuples(st.just("attention"), heads, st.just("eager"), booleans, st.sampled_from([0.0, 0.0, 0.25]),
                  booleans, st.sampled_from(["default", "small"])),
        st.tuples(st.just("inplace"),
                  st.sampled_from(["add", "mul", "relu_", "sigmoid_", "tanh_", "mul_param", "add_param"]),
                  st.sampled_from(["whole", "slice", "transpose", "strided"])),
        st.tuples(st.just("view"), st.sampled_from(["heads", "transpose", "slice", "strided"]),
                  st.sampled_from(ACTIVATIONS)),
        st.tuples(st.just("dropout"), st.sampled_from([0.25, 0.5]),
                  st.sampled_from(["module", "module_eval", "functional", "inplace"])),
        st.tuples(st.just("square")),
        st.tuples(st.just("gate")),
        st.tuples(st.just("pool")),
    )


def _blocks(channels: int) -> st.SearchStrategy[tuple]:
    leaf = _leaf_blocks(channels)
    residual = st.tuples(st.just("residual"), st.sampled_from(["add", "add", "add_", "iadd"]),
                         st.lists(leaf, min_size=1, max_size=2).map(tuple))
    return st.one_of(leaf, residual)


@st.composite
def model_specs(draw: st.DrawFn, dtypes: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16")) -> ModelSpec:
    channels = draw(st.sampled_from([8, 12, 16, 24, 32]))
    height, width = draw(st.integers(2, 4)), draw(st.integers(2, 4))
    blocks = tuple(draw(st.lists(_blocks(channels), min_size=1, max_size=5)))
    mutate = draw(st.one_of(
        st.none(), st.none(), st.none(),
        st.tuples(st.one_of(st.just("input"), st.integers(0, len(blocks) - 1)),
                  st.sampled_from(["whole", "dropped", "view", "detach"]))))
    return ModelSpec(batch=draw(st.integers(2, 4)), height=height, width=width, channels=channels,
                     dtype=draw(st.sampled_from(dtypes)), blocks=blocks,
                     input_scale=draw(st.sampled_from([0.5, 1.0, 2.0])),
                     head=draw(st.sampled_from(["project", "project", "cross_entropy"])),
                     seed=draw(st.integers(0, 2**16)), mutate=mutate)


# -- one run ------------------------------------------------------------------------------------

class Outcome:
    """What one run gave: the error and where it was raised, or the output and the gradients."""

    def __init__(self, error: BaseException | None = None, stage: str | None = None,
                 output: torch.Tensor | None = None, grads: dict | None = None) -> None:
        self.error, self.stage, self.output, self.grads = error, stage, output, grads

    def __repr__(self) -> str:
        if self.error is not None:
            return f"<{self.stage} raised {type(self.error).__name__}: {self.error}>"
        return "<gradients>"


def _inputs(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and what the loss needs (projection weights or class targets), from the spec's seed."""
    generator = torch.Generator().manual_seed(spec.seed + 1)
    shape = (spec.batch, spec.tokens, spec.channels)
    x = (torch.randn(shape, generator=generator, dtype=torch.float64) * spec.input_scale).to(spec.torch_dtype)
    if spec.head == "cross_entropy":
        target = torch.randint(0, spec.channels, (spec.batch * spec.tokens,), generator=generator)
    else:
        target = torch.randn(shape, generator=generator)
    return x, target


def _loss(out: torch.Tensor, spec: ModelSpec, target: torch.Tensor) -> torch.Tensor:
    if spec.head == "cross_entropy":
        return F.cross_entropy(out.reshape(-1, spec.channels), target).float()
    return (out.float() * target).sum()


def snapshot() -> contextlib.AbstractContextManager:
    """Plain autograd on the values of pack time: each saved tensor copied when it is saved, as DAF's
    records are (without the rounding). The reference where DAF misses an in-place change."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)


def run(model: torch.nn.Module, spec: ModelSpec, steps: int = 1,
        hooks: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> list[Outcome]:
    """``steps`` forward and backward passes of ``model`` on the spec's input, the global generator
    (dropout's) seeded the same way before each; forward under ``hooks()``."""
    x0, target = _inputs(spec)
    outcomes = []
    for step in range(steps):
        torch.manual_seed(spec.seed + 2 + step)
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        try:
            with hooks():
                out = model(x)
            loss = _loss(out, spec, target)
        except Exception as error:  # noqa: BLE001 - compared with the other run's
            outcomes.append(Outcome(error, "forward"))
            break
        model.mutate(x)
        try:
            loss.backward()
        except Exception as error:  # noqa: BLE001
            outcomes.append(Outcome(error, "backward"))
            break
        grads = {name: p.grad for name, p in model.named_parameters()}
        grads["<input>"] = x.grad
        outcomes.append(Outcome(output=out.detach(), grads=grads))
    return outcomes


# -- comparison ---------------------------------------------------------------------------------

def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    denominator = a.norm() * b.norm()
    return float(a @ b / denominator) if denominator > 0 else (1.0 if a.norm() == b.norm() else 0.0)


def _ideal_codes(t: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """``t`` through an ideal 8-bit min/max quantizer: nearest rounding in float64 on groups of 256
    consecutive elements (logical order), the grid starting ``offset`` steps below the group's minimum.
    What 8-bit codes can do, independently of DAF's codec, store and routing."""
    flat = t.detach().double().flatten()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % 256)).view(-1, 256)
    lo, hi = padded.min(1, keepdim=True).values, padded.max(1, keepdim=True).values
    lo = lo - offset * (hi - lo) / 255
    step = ((hi - lo) / 255).clamp_min(1e-300)
    decoded = (lo + torch.round((padded - lo) / step) * step).flatten()[: flat.numel()]
    return decoded.view_as(t).to(t.dtype)


def ideal_8_bits(offset: float = 0.0) -> Callable[[], contextlib.AbstractContextManager]:
    """Hooks for plain autograd with every saved tensor that has history through ``_ideal_codes``
    (parameters, the input and tensors without history as they are)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t if t.grad_fn is None or not t.dtype.is_floating_point else _ideal_codes(t, offset)
    return lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


# Where the ideal codes' grid starts, in steps below the minimum. Where each value falls on the grid
# decides its rounding error, and a sensitive gradient (F.scaled_dot_product_attention's, through exp()
# of the logits) changes with it: on one model the input gradient's cosine went from 0.96 to 0.87 between
# offsets 0 and 0.7. DAF's grid starts at the minimum rounded down to bfloat16, one more such choice; the
# bound is the worst of these.
IDEAL_OFFSETS = (0.0, 0.25, 0.5, 0.75)


def compare(plain: Outcome, wrapped: Outcome, spec: ModelSpec, label: str = "",
            ideal: Callable[[], list[Outcome]] | None = None, factor: float = IDEAL_FACTOR) -> None:
    where = f"{label}{spec}"
    if plain.error is not None or wrapped.error is not None:
        assert plain.error is not None, f"DAF raised where plain autograd did not: {wrapped!r}\n{where}"
        assert wrapped.error is not None, f"plain autograd raised, DAF did not: {plain!r}\n{where}"
        assert (type(wrapped.error), wrapped.stage) == (type(plain.error), plain.stage), \
            f"plain {plain!r}, DAF {wrapped!r}\n{where}"
        if INPLACE in str(plain.error):
            assert INPLACE in str(wrapped.error) and "DAF" in str(wrapped.error), f"DAF {wrapped!r}\n{where}"
        kind = "in-place change" if INPLACE in str(plain.error) else type(plain.error).__name__
        _event(f"both raised in {plain.stage} - {kind}")
        return
    assert torch.equal(torch.nan_to_num(plain.output), torch.nan_to_num(wrapped.output)) \
        and torch.equal(plain.output.isnan(), wrapped.output.isnan()), f"DAF changed the forward output\n{where}"
    norms = {name: g.double().norm().item() for name, g in plain.grads.items() if g is not None}
    assert all(math.isfinite(n) for n in norms.values()), f"plain gradients not finite: {norms}\n{where}"
    scale = max(norms.values())
    bad = []
    for name, g in plain.grads.items():
        d = wrapped.grads[name]
        if g is None or d is None:
            assert g is None and d is None, f"{name}: plain {g is None and 'no' or 'a'} gradient, DAF " \
                                            f"{d is None and 'no' or 'a'} gradient\n{where}"
            continue
        assert torch.isfinite(d).all(), f"{name}: DAF's gradient is not finite\n{where}"
        if name == "<input>" or norms[name] > NEGLIGIBLE[spec.dtype] * scale:
            cosine = _cosine(g, d)
            if cosine > COSINE:
                continue
            # Where 8-bit codes cannot reach the bound (a peaked softmax: its gradient is small and made
            # of cancelling terms), DAF must do as well as ideal 8-bit codes of the same saved tensors.
            references = ideal() if ideal is not None else []
            bound = min((_cosine(g, r.grads[name]) for r in references if r.error is None), default=None)
            if bound is not None and 1 - cosine <= factor * (1 - bound):
                _event("cosine below 0.999, within the ideal 8-bit codes' error")
                continue
            bad.append(f"{name}: cosine {cosine:.6f} (norm {norms[name]:.3g}, largest {scale:.3g}); "
                       f"ideal 8-bit codes {bound if bound is None else round(bound, 6)}")
        else:
            difference = (g.double() - d.double()).norm().item()
            if difference <= NEGLIGIBLE_DIFFERENCE * scale:
                continue
            # An analytically zero gradient that the codes make non-zero: the bias before a BatchNorm, whose
            # backward uses the exact saved mean with the decoded input (their mean no longer matches).
            references = ideal() if ideal is not None else []
            bound = max(((g.double() - r.grads[name].double()).norm().item() for r in references
                         if r.error is None), default=None)
            if bound is not None and difference <= factor * bound:
                _event("negligible gradient off by more than 2%, within the ideal 8-bit codes' error")
                continue
            bad.append(f"{name}: negligible gradient (norm {norms[name]:.3g}, largest {scale:.3g}) off by "
                       f"{difference:.3g}; ideal 8-bit codes by {bound if bound is None else float(f'{bound:.3g}')}")
    assert not bad, "DAF's gradients differ from plain autograd's:\n  " + "\n  ".join(bad) + f"\n{where}"


def _event(text: str) -> None:
    """A line of ``--hypothesis-show-statistics``: how often each outcome came up."""
    if currently_in_test_context():
        event(text)


def _missed_inplace(plain: Outcome, wrapped: Outcome) -> bool:
    return plain.error is not None and INPLACE in str(plain.error) and wrapped.error is None


def check(spec: ModelSpec, config: daf.Config, steps: int = 1) -> None:
    # Stochastic rounding's error has twice the variance of nearest rounding's (step^2 / 6 against / 12).
    # One realization can still be far worse on an ill-conditioned gradient: eager attention into GroupNorm
    # (spec in the commit message of this line) gave proj.weight cosines from -0.97 to 0.997 over twelve
    # Config.seed values, 0.966 at nearest; a longer hunt (DAF_DIFFERENTIAL_EXAMPLES=2500) can meet such a model.
    factor = IDEAL_FACTOR * (2 if config.rounding == "stochastic" else 1)
    model = build(spec)
    wrapped = daf.wrap(copy.deepcopy(model), config)
    try:
        plain_outcomes = run(model, spec, steps)
        daf_outcomes = run(wrapped, spec, steps)
    finally:
        daf.unwrap(wrapped)
    ideal_outcomes: list[list[Outcome]] = []

    def ideal(step: int) -> list[Outcome]:
        if not ideal_outcomes:
            ideal_outcomes.extend(run(build(spec), spec, steps, ideal_8_bits(offset)) for offset in IDEAL_OFFSETS)
        return [outcomes[step] for outcomes in ideal_outcomes if step < len(outcomes)]

    for step, (plain, outcome) in enumerate(zip(plain_outcomes, daf_outcomes)):
        label = f"step {step}: " if steps > 1 else ""
        if MISSED_INPLACE_IS_KNOWN and _missed_inplace(plain, outcome):
            # Known gap (test_an_in_place_change_through_an_alias_of_a_dead_saved_tensor_raises): DAF checks
            # a compressed save's version through a weak reference to the saved tensor object, so a change
            # made through a view or a detached alias after that object is gone goes unseen. DAF then uses
            # the values of pack time: its gradients must still be those of plain autograd on them.
            _event("in-place change DAF missed (known gap), gradients of pack-time values")
            reference = run(build(spec), spec, steps, snapshot)[step]
            compare(reference, outcome, spec, label + "in-place change DAF missed; against pack-time values: ",
                    lambda step=step: ideal(step), factor)
            return
        compare(plain, outcome, spec, label, lambda step=step: ideal(step), factor)
    assert len(plain_outcomes) == len(daf_outcomes)


# -- the properties -----------------------------------------------------------------------------

@settings(max_examples=EXAMPLES or 400, deadline=None, derandomize=True, database=None)
@given(spec=model_specs())
def test_daf_gradients_match_plain_autograd_or_both_raise(spec):
    check(spec, UNIFORM)


# The first forward only (8 bits everywhere, stochastic rounding): after a plan the gradients are wrong
# (test_adaptive_plan_at_an_average_of_8_bits_... below). Set to 2 once that is fixed: the second forward then
# runs on a plan (``replan_every=1``).
ADAPTIVE_STEPS = 1


@settings(max_examples=EXAMPLES or 100, deadline=None, derandomize=True, database=None)
@given(spec=model_specs(dtypes=("float32", "bfloat16")))
def test_adaptive_gradients_match_plain_autograd_or_both_raise(spec):
    check(spec, ADAPTIVE, steps=ADAPTIVE_STEPS)


# Issue 42: what a remake reads that autograd's version counter does not watch. Attention masks held by the
# model and rewritten for the next batch after forward (numpy buffer, .data, in place), and logits barred in
# place under no_grad before the loss; drawn apart so that the examples of the properties above stay the same.
@st.composite
def held_mask_specs(draw: st.DrawFn) -> ModelSpec:
    channels = draw(st.sampled_from([8, 16, 24]))
    heads = draw(st.sampled_from([h for h in (1, 2) if channels // h >= 4]))
    kind = draw(st.sampled_from(["bool_numpy", "float_numpy", "float_tensor"]))
    before = tuple(draw(st.lists(_leaf_blocks(channels), max_size=2)))
    after = draw(st.sampled_from([(), (("linear", True),), (("linear", False), ("edit_logits",))]))
    dtypes = ["float32", "bfloat16"] if kind == "bool_numpy" else ["float32"]
    return ModelSpec(batch=draw(st.integers(2, 3)), height=draw(st.integers(2, 4)), width=draw(st.integers(2, 4)),
                     channels=channels, dtype=draw(st.sampled_from(dtypes)),
                     blocks=(*before, ("masked_attention", heads, kind), *after),
                     input_scale=1.0, head=draw(st.sampled_from(["project", "cross_entropy"])),
                     seed=draw(st.integers(0, 2**16)),
                     mutate=("mask", draw(st.sampled_from(["rewrite", "data", "in_place"]))))


@settings(max_examples=EXAMPLES or 60, deadline=None, derandomize=True, database=None)
@given(spec=held_mask_specs())
def test_held_masks_and_edited_logits_give_plain_autograds_gradients(spec):
    check(spec, UNIFORM)


# -- what the property leaves out, pinned explicitly ------------------------------------------------

def _both(make: Callable[[], torch.nn.Module], x: torch.Tensor, config: daf.Config = UNIFORM,
          loss: Callable[[torch.Tensor], torch.Tensor] = lambda y: y.float().square().sum()) -> list[Outcome]:
    """Plain and DAF outcomes of ``loss(model(x))`` for two models from ``make`` (same seed)."""
    outcomes = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = make()
        if wrap:
            daf.wrap(model, config)
        leaf = x.clone().requires_grad_()
        try:
            loss(model(leaf)).backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            outcomes.append(Outcome(output=None, grads={**grads, "<input>": leaf.grad}))
        except RuntimeError as error:
            outcomes.append(Outcome(error, "backward"))
        finally:
            if wrap:
                daf.unwrap(model)
    return outcomes


class _TanhThenChangeThroughAView(torch.nn.Module):
    """Tanh saves its output; the output object is dropped, a view of it outlives it and is changed."""

    def forward(self, x):
        t = torch.tanh(x * 1.0)
        v = t.view(-1)
        del t
        return v.add_(1.0)


class _ReluOnASliceThenChangeTheBase(torch.nn.Module):
    """ReLU (in place, on a slice) saves its result, a view that is gone after forward; the base changes."""

    def forward(self, x):
        h = x * 1.0
        h[:, :4].relu_()
        return h.add_(0.5)


@pytest.mark.xfail(strict=True, reason="DAF checks a compressed save's version through weak references to the "
                   "saved tensor object and, for a view, its base: once both are gone (here the base is saved by "
                   "the loss, which DAF compresses too, so autograd does not hold it), a change through another "
                   "alias that shares their version counter is not seen (plain autograd raises; DAF trains on "
                   "the values of pack time)")
@pytest.mark.parametrize("make", [_TanhThenChangeThroughAView, _ReluOnASliceThenChangeTheBase])
def test_an_in_place_change_through_an_alias_of_a_dead_saved_tensor_raises(make):
    plain, wrapped = _both(make, torch.randn(4, 8))
    assert plain.error is not None and INPLACE in str(plain.error)
    assert wrapped.error is not None and INPLACE in str(wrapped.error)


def test_an_in_place_change_of_the_base_of_a_saved_view_raises_while_the_base_lives():
    model = daf.wrap(_ReluOnASliceThenChangeTheBase(), UNIFORM)
    try:
        leaf = torch.randn(4, 8).requires_grad_()
        out = model(leaf)  # out is the base of the saved slice; the slice object itself is gone
        with pytest.raises(RuntimeError, match=INPLACE):
            out.square().sum().backward()
    finally:
        daf.unwrap(model)


class _Attention(torch.nn.Module):
    def forward(self, qkv):
        q, k, v = qkv.unbind(0)
        return F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0)


# F.scaled_dot_product_attention's backward (CPU flash kernel) recomputes softmax from the decoded q and k
# and the saved logsumexp: with the forward's exact one the codes' error in the logits came back through
# exp() (cosine 0.87-0.995 at 8 bits once the logits spread over a unit). The logsumexp is now remade with
# the output from the same decoded q and k, and q and k whose codes would shift the logits too far stay raw.


def test_sdpa_at_8_bits_with_large_logits():
    qkv = torch.randn(3, 2, 2, 16, 16, generator=torch.Generator().manual_seed(0)) * 3.0  # logits' std ~9
    plain, wrapped = _both(_Attention, qkv)
    assert _cosine(plain.grads["<input>"], wrapped.grads["<input>"]) > COSINE


def _qk_norm_attention(channels: int, heads: int, seed: int) -> ModelSpec:
    return ModelSpec(batch=3, height=3, width=3, channels=channels, dtype="float32",
                     blocks=(("pool",), ("attention", heads, "sdpa", False, 0.0, True, "default")), input_scale=0.5,
                     head="cross_entropy", seed=seed)


def test_sdpa_with_qk_norm_over_two_channels_per_head_is_as_good_as_ideal_8_bit_codes():
    # Found by the property (input gradient cosine 0.86). Two channels per head: LayerNorm over two elements
    # gives +-1 (times its weight), the logits of a head tie, and the gradient is ill-conditioned: ideal
    # 8-bit codes of the same saved tensors give 0.87 to 0.96 depending on where their grid starts. DAF's
    # error is held to the ideal codes' (the property's fallback bound); with 4 or more channels per head
    # the same model passes the strict bound (next test).
    spec = _qk_norm_attention(channels=8, heads=4, seed=1)
    model = build(spec)
    wrapped = daf.wrap(copy.deepcopy(model), UNIFORM)
    plain, outcome = run(model, spec)[0], run(wrapped, spec)[0]
    daf.unwrap(wrapped)
    ideal = [run(build(spec), spec, 1, ideal_8_bits(offset))[0] for offset in IDEAL_OFFSETS]
    assert min(_cosine(plain.grads["<input>"], r.grads["<input>"]) for r in ideal) < COSINE  # ill-conditioned
    compare(plain, outcome, spec, ideal=lambda: ideal)


@pytest.mark.parametrize("channels,heads,seed", [(8, 2, 1), (16, 4, 1), (16, 4, 2), (32, 4, 3)])
def test_sdpa_with_qk_norm_over_four_or_more_channels_per_head_keeps_the_gradient_at_8_bits(channels, heads, seed):
    spec = _qk_norm_attention(channels, heads, seed)
    model = build(spec)
    wrapped = daf.wrap(copy.deepcopy(model), UNIFORM)
    plain, outcome = run(model, spec)[0], run(wrapped, spec)[0]
    daf.unwrap(wrapped)
    compare(plain, outcome, spec)


def test_sdpa_with_moderate_logits_and_eager_attention_with_large_ones_are_within_bounds():
    qkv = torch.randn(3, 2, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    plain, wrapped = _both(_Attention, qkv)  # logits' std ~1
    assert _cosine(plain.grads["<input>"], wrapped.grads["<input>"]) > COSINE

    class Eager(torch.nn.Module):
        def forward(self, qkv):
            q, k, v = (qkv * 1.0).unbind(0)
            return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
    plain, wrapped = _both(Eager, qkv * 3.0)
    assert _cosine(plain.grads["<input>"], wrapped.grads["<input>"]) > COSINE


class _Scale(torch.nn.Module):
    """``x * 1`` saved by a multiplication with a parameter: its gradient reads the decoded activation."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return (x * 1.0) * self.w


def test_float16_activations_near_the_top_of_the_range():
    x = torch.linspace(-65504, 65504, 256).half().view(16, 16)
    plain, wrapped = _both(lambda: _Scale(16).half(), x, loss=lambda y: y.float().sum() * 1e-4)  # grads ~ 1
    assert torch.isfinite(plain.grads["w"]).all()
    assert torch.isfinite(wrapped.grads["w"]).all()


@pytest.mark.parametrize("dtype, magnitude", [
    (torch.float64, 1e-60),  # kept raw: outside what the codes carry
    (torch.float32, 1e-40),  # a group below 2**-100 keeps its nonzeros exactly (docs/format.md)
])
def test_tiny_magnitudes(dtype, magnitude):
    x = torch.randn(16, 16, dtype=dtype, generator=torch.Generator().manual_seed(0)) * magnitude
    plain, wrapped = _both(lambda: _Scale(16).to(dtype), x, loss=lambda y: y.sum() * magnitude ** -0.75)
    assert _cosine(plain.grads["w"], wrapped.grads["w"]) > COSINE


class _Gate(torch.nn.Module):
    def forward(self, x):
        h = x * 1.0
        return h * torch.sigmoid(h)


@pytest.mark.xfail(strict=True, reason="a group's largest value does not decode exactly (lo is rounded down and the "
                   "step up to bfloat16), so a saturated sigmoid output 1.0 comes back as 1 - step/2 at worst and "
                   "sigmoid's backward s * (1 - s) is no longer 0 there; multiplied by a huge upstream gradient "
                   "(x * sigmoid(x) with x ~ 5e4) the input gradient's cosine falls to 0.996 here, 0.93 in the model "
                   "the property found (ideal 8-bit codes, whose top code is the maximum, give 0.99999)")
def test_a_saturated_sigmoid_under_a_huge_gate():
    # Found by the property (square, square, gate at input scale 2): x is (2 * randn) ** 4, up to ~5e4.
    x = (torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0)) * 2) ** 4
    plain, wrapped = _both(_Gate, x, loss=lambda y: y.sum())
    assert _cosine(plain.grads["<input>"], wrapped.grads["<input>"]) > COSINE


# Issue 13, fixed: the estimator costed only parameter gradients, so these sites (whose error reaches only the
# input's gradient) cost 0 at every width; the plan put them at 1 bit and kept the linear's input raw (mean 7.2
# bits), cosine 0.96 and 0.62. The input's own gradient now counts (daf.policy.importance, input leaves).
@pytest.mark.parametrize("blocks", [
    (("act", "tanh"),) * 4 + (("linear", False),),  # four tanh and a linear: input gradient cosine 0.96
    (("square",), ("square",), ("gate",), ("linear", False)),  # found by the property: cosine 0.62
], ids=["tanh4-linear", "square-square-gate-linear"])
def test_adaptive_plan_at_an_average_of_8_bits_keeps_the_gradients(blocks):
    spec = ModelSpec(batch=2, height=2, width=2, channels=8, dtype="float32", blocks=blocks, input_scale=0.5,
                     head="project", seed=0)
    check(spec, ADAPTIVE, steps=2)
