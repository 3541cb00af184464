"""Under autocast, the bf16/fp16 copies of the weights are derived in backward, not kept.

Autocast casts each weight to bfloat16 (or float16) before a matmul or convolution and autograd saves
that copy (a ``ToCopyBackward0`` of the parameter, often then a transpose). It is a weight, not an
activation: its codes would multiply every input gradient of the layer, so it is never quantized. And
autograd keeps the fp32 parameter anyway, so DAF keeps nothing of the copy and recasts the parameter
when backward needs it (``daf.runtime.derived``): the same bits, none of the bytes.
"""

import contextlib
import copy

import pytest
import torch
from torch import nn

import daf
from daf.config import Config
from daf.policy import UniformPolicy
from daf.runtime import Session

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="needs a CUDA device"))]


class Transposed(nn.Module):
    """Weights used through a transpose and a permute taken before autocast's cast (``x @ w.t()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(96, 64) / 8)
        self.v = nn.Parameter(torch.randn(4, 24, 96) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w.t())  # [4, 24, 96]
        return torch.bmm(h, self.v.permute(0, 2, 1))


class Twice(nn.Module):
    """One weight used twice in a forward: autocast's weight cache gives both uses one copy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


MODELS = {  # name -> (model, input, weight copies saved for backward)
    "linear": (lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.LayerNorm(128),
                                     nn.Linear(128, 10)), lambda: torch.randn(32, 64), 3),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(), nn.Linear(16 * 8 * 8, 10)),
               lambda: torch.randn(8, 3, 8, 8), 3),
    "transposed": (Transposed, lambda: torch.randn(4, 24, 64), 2),
    "twice": (Twice, lambda: torch.randn(32, 64), 2),
}


@contextlib.contextmanager
def _through(session: Session, model: nn.Module):
    session.begin_forward(model)
    try:
        with session.hooks():
            yield
    finally:
        session.end_forward()


def _gradients(model: nn.Module, x: torch.Tensor, dtype: torch.dtype, hooks=contextlib.nullcontext):
    model.zero_grad()
    x = x.detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype), hooks(model):
        y = model(x)
    y.float().square().sum().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()] + [x.grad]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_derived_copies_give_plain_autograds_gradients_bit_for_bit(name, dtype, device):
    make_model, make_x, copies = MODELS[name]
    torch.manual_seed(0)
    model, x = make_model().to(device), make_x().to(device)
    plain = _gradients(model, x, dtype)
    # DAF with a policy that keeps every save raw (masks are exact too): only derivation is left to differ
    # (restoring channels-last would change the convolution's summation order: bit-identical only without it)
    with Session(Config(channels_last=False), policy=UniformPolicy(0)) as session:
        derived = _gradients(model, x, dtype, lambda m: _through(session, m))
    assert all(torch.equal(a, b) for a, b in zip(plain, derived))
    rows = [r for r in session.report().rows if r.kind == "derived"]
    # the weights' copies, and the input's: a leaf that requires grad, which autograd keeps too
    assert len(rows) == copies + 1 and all(r.dtype == str(dtype).removeprefix("torch.") for r in rows)
    assert all(r.stored_bytes == 0 and r.raw_bytes > 0 for r in rows)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.LayerNorm(512),
                         nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))


def _grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().square().sum().backward()
    return torch.cat([p.grad.flatten().float() for p in model.parameters()])


def test_weight_copies_cost_no_bytes_and_the_gradient_stays_close():
    plain = _mlp()
    x = torch.randn(256, 256)
    model = daf.wrap(copy.deepcopy(plain), bits=2)
    cosine = torch.nn.functional.cosine_similarity(_grads(model, x), _grads(plain, x), dim=0)
    assert cosine > 0.93  # 0.88 when the weight copies were quantized at 2 bits
    report = daf.report(model)
    copies = [r for r in report.rows if r.source == "TBackward0"]
    assert len(copies) == 3 and all(r.kind == "derived" and r.dtype == "bfloat16" for r in copies)
    # the three copies (1.01 MiB) were kept raw before: now only the activations' codes are stored
    assert sum(r.stored_bytes for r in copies) == 0 and report.stored_bytes < 400 * 1024
    # and the two GELU outputs and the LayerNorm output the next linear saves, remade from their inputs
    # (daf.runtime.derived)
    assert [r.source for r in report.rows if r.kind == "derived" and r.source != "TBackward0"] == \
        ["GeluBackward0", "NativeLayerNormBackward0", "GeluBackward0"]
    assert report.totals()["sites"]["derived"] == 6
    assert "derived in backward, not kept (casts of parameters, dropout outputs, SiLU/GELU/LayerNorm outputs): 6" \
        in str(report)


@pytest.mark.parametrize("change", ["optimizer step", "add_ under no_grad", "new data"])
def test_a_parameter_changed_between_forward_and_backward_raises_naming_the_site(change):
    model = daf.wrap(_mlp(), bits=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(64, 256)).float().square().sum()
    weight = model[2].weight
    if change == "optimizer step":
        weight.grad = torch.ones_like(weight)
        torch.optim.SGD([weight], lr=0.1).step()
    elif change == "add_ under no_grad":
        with torch.no_grad():
            weight.add_(1)
    else:
        weight.data = torch.zeros_like(weight)
    expected = "given new data" if change == "new data" else "modified in place"
    with pytest.raises(RuntimeError, match=rf"DAF \(site 2#1\): the parameter .*{expected}.*after backward"):
        loss.backward()


def test_a_changed_parameter_of_the_weight_cache_raises_too():
    # Inside the autocast block the cached copy is alive, but the parameter is what backward would recast.
    model = daf.wrap(Twice(), bits=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(32, 64)).float().sum()
        with torch.no_grad():
            model.lin.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_a_copy_that_is_not_an_exact_cast_stays_raw():
    # A clone of the copy is a cast of the weight (never quantized), but not what recasting gives
    # the layout of: it is kept as it is.
    class Cloned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.to(torch.bfloat16).clone().t()

    model = daf.wrap(Cloned(), bits=2)
    model(torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
    rows = daf.report(model).rows
    assert [r.kind for r in rows if r.source == "TBackward0"] == ["raw"]


def test_derived_copies_with_background_packing_and_retain_graph():
    plain, model = _mlp(), daf.wrap(_mlp(), bits=8, background=True)
    x = torch.randn(64, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x).float().square().sum()
    y.backward(retain_graph=True)
    assert daf.report(model).totals()["sites"]["derived"] == 6  # three weight copies, two GELU outputs, a norm's
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y.backward()  # the copies are derived again
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))
    assert torch.nn.functional.cosine_similarity(_grads(model, x), _grads(plain, x), dim=0) > 0.999


def test_views_of_a_parameter_are_still_referenced_without_autocast():
    model = daf.wrap(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)), bits=2)
    model(torch.randn(128, 64)).sum().backward()
    report = daf.report(model)
    assert report.parameters_referenced == 1 and not any(r.source == "TBackward0" for r in report.rows)
    assert report.totals()["sites"]["derived"] == 0


def test_double_backward_through_derived_copies_is_exact():
    # The recast copy is unpacked with the copy's autograd history (saved at pack time): a gradient of a
    # gradient flows through it as through the copy plain autograd keeps.
    def run(model: nn.Module) -> list[torch.Tensor]:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x).float().square().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.square().sum().backward()
        return [p.grad for p in model.parameters()]

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model = daf.wrap(copy.deepcopy(plain), bits=8, min_numel=10**9)  # everything else too small: raw
    assert all(torch.equal(a, b) for a, b in zip(run(plain), run(model)))
    assert daf.report(model).totals()["sites"]["derived"] == 3


def _leaf(*shape: int, offset: int = 0, channels_last: bool = False) -> torch.Tensor:
    """A leaf that requires grad, with values that round (and inf, nan, a denormal, a value past fp16)."""
    values = torch.randn(offset + torch.Size(shape).numel(), generator=torch.Generator().manual_seed(0))
    values[offset:offset + 4] = torch.tensor([float("inf"), float("nan"), 1e-40, 1e6])
    leaf = values[offset:].view(shape)
    if channels_last:
        leaf = leaf.contiguous(memory_format=torch.channels_last)
    return leaf.detach().requires_grad_()


RECASTS = {  # name -> the saved tensor, made as autocast or a module makes it
    "transposed copy": lambda: _leaf(64, 32).to(torch.bfloat16).t(),
    "transposed before the cast": lambda: _leaf(4, 8, 16).transpose(-1, 0).to(torch.bfloat16),
    "permuted, then transposed after": lambda: _leaf(4, 8, 16).permute(2, 0, 1).to(torch.float16).transpose(0, 1),
    "channels_last parameter, sliced copy": lambda: _leaf(8, 4, 3, 3, channels_last=True).to(torch.bfloat16)[:, 1:3],
    "parameter at a storage offset": lambda: _leaf(8, 8, offset=10).to(torch.float16).t(),
}


@pytest.mark.parametrize("name", list(RECASTS))
def test_the_recast_equals_the_saved_copy_bit_for_bit(name):
    from daf.runtime.derived import Derived
    from daf.tracing import parameter_of_cast

    saved = RECASTS[name]()
    parameter = parameter_of_cast(saved)
    assert parameter is not None
    recast = Derived(saved, parameter, "m#0", source=type("Unchecked", (), {"check": lambda self, site: None})()).unpack()
    assert (recast.shape, recast.stride(), recast.dtype) == (saved.shape, saved.stride(), saved.dtype)
    assert torch.equal(recast.detach().view(torch.int16), saved.detach().view(torch.int16))  # NaN included


# -- frozen weights (LoRA's base, a frozen backbone): their copies have no autograd history ------

class FrozenBase(nn.Module):
    """A LoRA-like layer: a frozen base Linear plus a trainable low-rank adapter; a frozen conv before it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.base = nn.Linear(8 * 6 * 6, 96)
        self.a, self.b = nn.Linear(8 * 6 * 6, 4, bias=False), nn.Linear(4, 96, bias=False)
        self.head = nn.Linear(96, 10)
        for p in [*self.conv.parameters(), *self.base.parameters(), self.head.weight]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.head(torch.tanh(self.base(h) + self.b(self.a(h))))


def _trainable(gradients: list) -> list:
    return [g for g in gradients if g is not None]  # frozen parameters have none


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_frozen_weights_copies_are_derived_bit_for_bit(dtype, device):
    torch.manual_seed(0)
    model, x = FrozenBase().to(device), torch.randn(16, 3, 6, 6, device=device)
    plain = _trainable(_gradients(model, x, dtype))
    with Session(Config(), policy=UniformPolicy(0)) as session:
        derived = _trainable(_gradients(model, x, dtype, lambda m: _through(session, m)))
    assert len(plain) == 4 and all(torch.equal(a, b) for a, b in zip(plain, derived, strict=True))  # a, b, head bias, x
    rows = session.report().rows
    frozen = [r for r in rows if r.kind == "derived" and r.source == "no history"]
    # conv, base and head weights: each a cast without history, none kept
    assert len(frozen) == 3 and all(r.stored_bytes == 0 and r.raw_bytes > 0 for r in frozen)
    assert not [r for r in rows if r.kind == "raw" and r.dtype == str(dtype).removeprefix("torch.")
                and r.source == "no history" and r.raw_bytes >= 96 * 8 * 6 * 6 * 2]


def test_a_frozen_weight_changed_before_backward_raises():
    model = daf.wrap(FrozenBase(), bits=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(16, 3, 6, 6, requires_grad=True)).float().square().sum()
    with torch.no_grad():
        model.base.weight.mul_(2)  # plain autograd would use the old copy: DAF cannot, and says so
    with pytest.raises(RuntimeError, match="the parameter .* modified in place"):
        loss.backward()


def test_frozen_cast_is_recognised_only_when_it_is_one():
    from daf.tracing import frozen_parameter_of_cast
    weight = nn.Parameter(torch.randn(96, 64), requires_grad=False)
    x = torch.randn(32, 64)
    copy_ = weight.to(torch.bfloat16)
    assert frozen_parameter_of_cast(copy_.t(), [x, weight]) is weight  # a view of the copy, as addmm saves it
    assert frozen_parameter_of_cast(copy_, [x, weight]) is weight
    other = copy_.clone()
    other.view(-1)[0] += 1  # one element off: caught by the samples (the first is always one of them)
    assert frozen_parameter_of_cast(other, [x, weight]) is None
    assert frozen_parameter_of_cast(weight.to(torch.float16), [x, weight]) is weight
    same_layout = torch.randn(96, 64)  # an input of the weight's layout: which copy is which is unsure
    assert frozen_parameter_of_cast(copy_, [same_layout, weight]) is None
    trained = nn.Parameter(weight.detach().clone())  # requires grad: its copy has history (parameter_of_cast)
    assert frozen_parameter_of_cast(trained.detach().to(torch.bfloat16), [x, trained]) is None
    assert frozen_parameter_of_cast(copy_[:, :32], [x, weight]) is weight  # a slice is still a view of it
    assert frozen_parameter_of_cast(copy_[:48].clone(), [x, weight]) is None  # a copy of part of it is not
    plain = torch.randn(96, 64)  # not a parameter
    assert frozen_parameter_of_cast(plain.to(torch.bfloat16), [x, plain]) is None
    changed = weight.to(torch.bfloat16)
    changed.mul_(1)  # changed in place since the cast
    assert frozen_parameter_of_cast(changed, [x, weight]) is None
