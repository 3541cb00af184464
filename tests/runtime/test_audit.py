"""The gradient audit (daf.runtime.audit): a planted fault is found, raised and recovered; the audit leaves no
trace on the model, the random state or .grad; every, fraction, threshold and first are obeyed; keyword
calls returning dicts are audited; a model it cannot audit trains on with one warning."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
import daf.runtime
from daf.policy import Policy, register_policy


@dataclass(frozen=True)
class Planted:
    """Policy config: ``bits`` at ``site``, 8 bits everywhere else (one planted fault)."""

    site: str = ""
    bits: int = 1


class _PlantedPolicy(Policy):
    def __init__(self, config: Planted) -> None:
        self.config = config

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        return self.config.bits if site == self.config.site else 8


@register_policy(Planted, kind="planted-fault")
def _planted(config: daf.Config) -> Policy:
    return _PlantedPolicy(config.policy)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def _gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _batch(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 64, generator=generator), torch.randint(0, 10, (n,), generator=generator)


@pytest.mark.parametrize("threshold, raised, recovered", [(daf.Audit().threshold, 2, 0.9), (0.99, 4, 0.99)])
def test_a_planted_one_bit_save_is_reported_raised_and_the_gradient_recovers(threshold, raised, recovered):
    base, (x, y) = _mlp(), _batch()
    exact = _gradient(base, x, y)
    planted = daf.Config(policy=Planted("1#0"), min_numel=1)  # the first Tanh's output, read by Linear 2 too
    unaudited = daf.wrap(copy.deepcopy(base), planted.replace(audit=daf.Audit(every=0)))
    audited = daf.wrap(copy.deepcopy(base), planted.replace(audit=daf.Audit(threshold=threshold)))
    with pytest.warns(UserWarning, match=r"raised the widths of 1#0 1->2"):
        gradient = _gradient(audited, x, y)  # the audit runs before this very forward
    section = daf.report(audited).sections["audit"]
    assert section["audits"] == 1 and section["first_cosine"] < 0.7 and section["cosine"] >= threshold
    assert daf.session_of(audited).raised == {"1#0": raised}  # 1 -> 2 (-> 4): a round per raise
    assert [row.bits for row in daf.report(audited).rows if row.site == "1#0"] == [raised]
    before = F.cosine_similarity(_gradient(unaudited, x, y), exact, 0)
    after = F.cosine_similarity(gradient, exact, 0)
    assert before < 0.7 and after > recovered
    assert "audit: audits=1" in str(daf.report(audited))


class _DropoutCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.drop, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Dropout(0.3), \
            nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(F.relu(self.bn(self.conv(x)))).flatten(1))


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers()] + [torch.get_rng_state()]


def test_an_audit_leaves_buffers_random_state_and_grad_as_they_were():
    torch.manual_seed(0)
    base, x = _DropoutCNN(), torch.randn(16, 3, 8, 8)
    models = {every: daf.wrap(copy.deepcopy(base), min_numel=1, audit=daf.Audit(every=every, threshold=0.0))
              for every in (0, 1)}
    outcomes = {}
    for every, model in models.items():
        for p in model.parameters():
            p.grad = torch.full_like(p, 3.0)
        torch.manual_seed(5)
        output = model(x)
        assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
        state = _state(model)
        output.square().sum().backward()
        outcomes[every] = (state, [p.grad.clone() for p in model.parameters()])
    assert daf.report(models[1]).sections["audit"]["audits"] == 1 and "audit" not in daf.report(models[0]).sections
    (state_off, grads_off), (state_on, grads_on) = outcomes[0], outcomes[1]
    assert int(models[1].bn.num_batches_tracked) == 1  # the audit's passes did not count
    assert all(torch.equal(a, b) for a, b in zip(state_off, state_on))  # statistics and random state
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))  # same dropout masks, same codes


def _counted(model: nn.Module) -> list[int]:
    """Batch sizes the model's forward sees, in order (the audit's slices among them)."""
    sizes: list[int] = []
    model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    return sizes


@pytest.mark.parametrize("first, audited", [(True, [0, 3, 6]), (False, [3, 6])])
def test_every_and_first_say_which_forwards_are_audited(first, audited):
    model = daf.wrap(_mlp(), min_numel=1, audit=daf.Audit(every=3, first=first, threshold=0.0))
    x, y = _batch(16)
    seen = []
    for step in range(7):
        _gradient(model, x, y)
        seen.append(daf.report(model).sections["audit"].get("forward"))
    assert daf.report(model).sections["audit"]["audits"] == len(audited)
    assert sorted({s for s in seen if s is not None}) == audited
    with torch.no_grad():
        model(x)
    model.eval()
    with pytest.warns(UserWarning, match="eval"):
        model(x)
    assert daf.report(model).sections["audit"]["audits"] == len(audited)  # eval and no_grad are not counted


@pytest.mark.parametrize("fraction, least, batch, samples", [(0.25, 4, 16, 4), (0.01, 1, 16, 1), (1.0, 4, 16, 16),
                                                            (0.01, 4, 16, 4), (0.125, 4, 64, 8), (0.5, 4, 3, 3)])
def test_fraction_of_the_batch_is_audited_at_least_min_samples(fraction, least, batch, samples):
    model = daf.wrap(_mlp(), min_numel=1, audit=daf.Audit(fraction=fraction, min_samples=least, threshold=0.0))
    sizes = _counted(model)
    _gradient(model, *_batch(batch))
    assert sizes == [samples, samples, batch]  # exact pass, compressed pass, the step itself
    assert daf.report(model).sections["audit"]["samples"] == samples


def test_threshold_decides_whether_widths_are_raised():
    x, y = _batch(16)
    never = daf.wrap(_mlp(), bits=1, min_numel=1, audit=daf.Audit(threshold=0.0))
    always = daf.wrap(_mlp(), bits=1, min_numel=1, audit=daf.Audit(threshold=1.0))
    _gradient(never, x, y)
    with pytest.warns(UserWarning, match="gradient audit"):
        _gradient(always, x, y)
    assert daf.session_of(never).raised == {} and "raised" not in daf.report(never).sections["audit"]
    assert daf.session_of(always).raised and daf.report(always).sections["audit"]["raised"]


def test_audit_every_0_is_off():
    model = daf.wrap(_mlp(), min_numel=1, audit=daf.Audit(every=0))
    sizes = _counted(model)
    _gradient(model, *_batch(16))
    assert sizes == [16] and model._daf_attachment.audit is None and "audit" not in daf.report(model).sections


class _KeywordModel(nn.Module):
    """A Hugging Face-style model: keyword tensors in, a dict with the loss and the logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(100, 64), nn.Linear(64, 5)
        self.sizes: list[tuple[int, int]] = []

    def forward(self, input_ids=None, attention_mask=None, labels=None, scale=None):
        self.sizes.append((input_ids.shape[0], labels.shape[0]))
        h = torch.tanh(self.embed(input_ids) * attention_mask[..., None] * scale)
        logits = self.head(h.mean(1))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits, "ids": input_ids}


def test_a_keyword_call_returning_a_dict_is_audited_on_the_sliced_keywords():
    torch.manual_seed(0)
    model = daf.wrap(_KeywordModel(), bits=8, min_numel=1, audit=daf.Audit(fraction=0.5, threshold=0.0))
    ids, mask, labels = torch.randint(0, 100, (8, 12)), torch.ones(8, 12), torch.randint(0, 5, (8,))
    model(input_ids=ids, attention_mask=mask, labels=labels, scale=torch.tensor(2.0))["loss"].backward()
    assert model.sizes == [(4, 4), (4, 4), (8, 8)]
    section = daf.report(model).sections["audit"]
    assert section["audits"] == 1 and 0.99 < section["cosine"] <= 1 + 1e-9


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).detach()


class _Fussy(nn.Linear):
    """Refuses any batch but 16 (a model whose shapes are fixed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 16:
            raise RuntimeError("batch must be 16")
        return super().forward(x)


@pytest.mark.parametrize("make, why", [(_Detached, "no floating-point tensor with autograd history"),
                                       (lambda: _Fussy(64, 64), "RuntimeError: batch must be 16")])
def test_a_model_it_cannot_audit_trains_on_with_one_warning(make, why):
    model = daf.wrap(make(), min_numel=1)
    x = torch.randn(16, 64, requires_grad=True)
    with pytest.warns(UserWarning, match=why):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            model(x)
    assert daf.report(model).sections["audit"]["off"].endswith(why.split(": ")[-1])
    assert daf.report(model).forward == 2  # the model's own forwards went on under DAF


def test_raised_widths_are_floors_over_the_policy_and_a_policys_raw_stays_raw():
    session = daf.runtime.Session(daf.Config(bits=4, policy=Planted("kept", bits=0)))
    x = torch.randn(64)
    session.raise_bits("a#0", 2)  # below the policy's 8: the policy's width holds
    session.raise_bits("b#0", 0)  # raw
    session.raise_bits("kept", 8)  # the policy keeps it raw: it stays raw
    assert [session._bits_for(site, x, None) for site in ("a#0", "b#0", "kept", "c#0")] == [8, 0, 0, 8]
    with pytest.raises(ValueError, match=r"raise_bits takes bits in \(0, 1, 2, 4, 8\)"):
        session.raise_bits("a#0", 3)
    session.close()


def test_the_audit_measures_the_widths_the_step_stores_a_cnns_feature_maps_at_2_bits():
    # Auto gives a CNN's feature maps 2 bits from the saving call; an audit that asked the policy without the
    # call measured 4-bit codes there (MobileNetV2: 0.98 audited, 0.79 true) and never raised them.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    daf.wrap(model, audit=daf.Audit(threshold=1.0))
    with pytest.warns(UserWarning, match="gradient audit") as caught:
        F.cross_entropy(model(torch.randn(16, 3, 16, 16)), torch.randint(0, 10, (16,))).backward()
    text = " ".join(str(w.message) for w in caught)
    assert "2->4" in text, text
    rows = {row.site: row for row in daf.report(model).rows}
    assert any(row.why == "raised by the gradient audit" and (row.bits or 32) > 2 for row in rows.values())  # raw: None


class _Trap(nn.Module):
    """Twelve Tanh layers, whose 4-bit codes err more than ``trap``'s, and ``trap``: 16 channels, one of them
    1e7 times the others, saved by a product with ``gain``. ``gain``'s gradient is read from the small channels,
    which the large one's codes round to levels hundreds of thousands apart (a Mamba's recurrent state with
    large channels); their codes' relative error, measured against the large channel, is small."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(12))
        self.branch = nn.Linear(32, 16)
        self.gain = nn.Parameter(torch.ones(16))
        self.register_buffer("scale", torch.cat([torch.tensor([1e7]), torch.ones(15)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        trap = torch.tanh(self.branch(x)) * self.scale
        return torch.cat([h, (trap * self.gain)[:, 1:]], dim=1).sum(dim=1).pow(2).mean()


def test_when_raising_the_costliest_saves_fails_every_save_is_raised_until_the_gradient_holds():
    base, x = _Trap(), torch.randn(256, 32, generator=torch.Generator().manual_seed(2))

    def gradient(model: nn.Module) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        model(x).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    exact = gradient(base)
    config = daf.Config(bits=4, min_numel=1, codec=daf.MinMax(), rounding="nearest")
    unaudited = gradient(daf.wrap(copy.deepcopy(base), config.replace(audit=daf.Audit(every=0))))
    audited = daf.wrap(copy.deepcopy(base), config.replace(audit=daf.Audit(fraction=1.0)))
    with pytest.warns(UserWarning, match="so every stored save was raised") as caught:
        recovered = gradient(audited)
    section = daf.report(audited).sections["audit"]
    assert F.cosine_similarity(unaudited, exact, 0) < 0.5
    assert section["first_cosine"] < 0.5 and section["cosine"] >= daf.Audit().threshold, section
    assert F.cosine_similarity(recovered, exact, 0) > 0.99
    trap = [row for row in daf.report(audited).rows if row.source == "MulBackward0" and row.shape == (256, 16)]
    assert trap and all(row.kind == "raw" for row in trap), trap
    assert " and " in str(caught[0].message) and "more" in str(caught[0].message)  # the list is cut


def test_the_slice_codes_the_saves_the_step_codes_though_each_is_below_min_numel_in_the_slice():
    # One sample's Tanh output (256 elements) is under min_numel (4096), the batch's (16384) is not: the slice
    # must code it as the step does, or it never sees the planted fault (a MobileNetV2: slice 0.997, step 0.82).
    base, (x, y) = _mlp(), _batch()
    exact = _gradient(base, x, y)
    audited = daf.wrap(copy.deepcopy(base), daf.Config(policy=Planted("1#0"), audit=daf.Audit(fraction=1 / 64, min_samples=1)))
    with pytest.warns(UserWarning, match=r"raised the widths of 1#0 1->2"):
        gradient = _gradient(audited, x, y)
    assert daf.report(audited).sections["audit"]["samples"] == 1
    assert F.cosine_similarity(gradient, exact, 0) > 0.9


@pytest.mark.parametrize("min_numel, samples, batch, expected", [(4096, 1, 64, 64), (4096, 8, 64, 512), (0, 1, 8, 0),
                                                                 (1, 1, 64, 1), (4096, 64, 64, 4096)])
def test_min_numel_is_scaled_to_the_slice(min_numel, samples, batch, expected):
    from daf.runtime.audit import _slice_min_numel
    assert _slice_min_numel(min_numel, samples, batch) == expected


class _ReturnsLossAndLogits(nn.Module):
    """A model that, given labels, returns its loss beside the logits (as Hugging Face models do)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.body(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def test_the_audit_differentiates_the_loss_a_model_returns_and_sees_the_steps_cosine():
    """With a loss among the outputs the audit takes the loss's gradient, the one the step takes: on a slice that
    is the whole batch, with nearest codes (no random draw), its cosine is the step's."""
    torch.manual_seed(0)
    base, (x, y) = _ReturnsLossAndLogits(), _batch(4)
    base(x, y)["loss"].backward()
    exact = torch.cat([p.grad.flatten() for p in base.parameters()])
    model = daf.wrap(copy.deepcopy(base), bits=2, rounding="nearest", min_numel=1,
                     audit=daf.Audit(threshold=0.0, nearest_threshold=0.0))
    for p in model.parameters():
        p.grad = None
    model(x, labels=y)["loss"].backward()
    step = F.cosine_similarity(torch.cat([p.grad.flatten() for p in model.parameters()]), exact, 0)
    section = daf.report(model).sections["audit"]
    assert section["samples"] == 4 and step < 0.999
    assert section["first_cosine"] == pytest.approx(float(step), abs=1e-6)


def test_the_objective_is_the_scalars_among_the_outputs_where_there_are_any():
    from daf.runtime.audit import _objective

    loss, logits = torch.tensor(1.0), torch.ones(2, 3)
    assert _objective([logits, loss]) == [loss]
    assert _objective([logits]) == [logits]
    assert _objective([]) == []


@pytest.mark.parametrize("saves, rounding, threshold", [
    ({"a": (4, 0.1), "b": (8, 0.1)}, "auto", "nearest_threshold"),  # a transformer's: every code rounded to nearest
    ({"a": (2, 0.1), "b": (4, 0.1)}, "auto", "threshold"),  # a CNN's 2-bit maps are stochastic
    ({"a": (4, 0.1)}, "stochastic", "threshold"),
    ({"a": (2, 0.1)}, "nearest", "nearest_threshold"),
    ({}, "auto", "threshold"),  # nothing coded
])
def test_nearest_threshold_holds_where_every_coded_save_is_rounded_to_nearest(saves, rounding, threshold):
    config = daf.Audit(threshold=0.7, nearest_threshold=0.95)
    audit = daf.runtime.audit.GradientAudit(daf.session_of(daf.wrap(_mlp(), audit=config)), config)
    assert audit._threshold(saves, rounding) == getattr(config, threshold)


@pytest.mark.parametrize("widths, suspects, raised, left", [
    ({"a": 4, "b": 8, "c": 4}, {"b"}, ["a", "c"], {"b"}),  # the narrowest first, up to the widest's width
    ({"a": 8, "b": 8}, {"b"}, ["b"], set()),  # all at one width: the targeted rounds' suspects first
    ({"a": 8, "b": 8}, set(), ["a", "b"], set()),  # then every save
    ({"a": 8}, {"gone"}, ["a"], {"gone"}),  # a suspect no longer coded is no suspect
    ({}, {"b"}, [], {"b"}),
])
def test_a_broad_round_raises_the_narrowest_then_the_suspects_then_all(widths, suspects, raised, left):
    from daf.runtime.audit import _broad

    chosen, remaining = _broad({site: (bits, 0.1) for site, bits in widths.items()}, suspects)
    assert sorted(site for site, _ in chosen) == raised and remaining == left
    assert all(bits == widths[site] for site, bits in chosen)
