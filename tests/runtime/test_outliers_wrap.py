"""The Outliers codec through ``daf.wrap``: a small pre-LN transformer block with an outlier channel."""

import torch
from torch import nn

import daf
from tests.models import cosine, narrow_outliers as Outliers


class Block(nn.Module):
    """Pre-LN block: x + MLP(LN(x)), with GELU; the input's channel 5 is 50x the others."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h * torch.where(torch.arange(h.shape[-1]) == 5, 50.0, 1.0)
        h = h + self.down(nn.functional.gelu(self.up(self.norm(h))))
        return self.head(h).mean(1)


def _grad(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _copy(model: nn.Module, **config) -> nn.Module:
    clone = Block()
    clone.load_state_dict(model.state_dict())
    return daf.wrap(clone, backend="reference", min_numel=1, audit=daf.Audit(every=0), **config)  # widths as given


def test_wrap_stores_channel_and_derivative_records():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(8, 32, 16)
    reference = _grad(model, x)
    wrapped = _copy(model, bits=2, codec=Outliers(derivatives=True))
    got = _grad(wrapped, x)
    report = daf.report(wrapped)
    assert report.sections["codec"]["codec"].startswith("outliers/")
    assert report.stored_bytes < report.raw_bytes / 4
    assert cosine(reference, got) > 0.8


def test_outliers_beat_minmax_at_2_bits_on_an_outlier_channel():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(8, 32, 16)
    reference = _grad(model, x)
    plain = cosine(reference, _grad(_copy(model, bits=2, codec=daf.MinMax()), x))
    outliers = cosine(reference, _grad(_copy(model, bits=2, codec=Outliers()), x))
    assert outliers > plain + 0.05


def test_eight_bits_stay_close():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 16, 16)
    reference = _grad(model, x)
    for codec in (Outliers(), Outliers(axis="channel"), Outliers(derivatives=True)):
        assert cosine(reference, _grad(_copy(model, bits=8, codec=codec), x)) > 0.999


def test_background_packing_and_a_budget_give_the_same_records(tmp_path):
    """The packer's thread and the page pool (demotion, spill) take the Outliers records as they are."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(8, 32, 16)
    foreground = _grad(_copy(model, bits=4, codec=Outliers(derivatives=True)), x)
    background = _grad(_copy(model, bits=4, codec=Outliers(derivatives=True), background=True), x)
    assert torch.equal(foreground, background)
    budget = _copy(model, bits=8, codec=Outliers(), budget="64KiB", min_bits=2, spill_dir=str(tmp_path))
    assert cosine(_grad(model, x), _grad(budget, x)) > 0.9
    assert daf.report(budget).sections["store"]["demotions"] > 0


class _GeluInputReadTwice(nn.Module):
    """GELU's input is also saved by a multiplication with a parameter, whose gradient is that input
    times the incoming gradient: that op must get ``h``, not GELU's derivative codes of it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return (nn.functional.gelu(h) + h * self.scale).sum(-1)


def test_derivative_codes_are_not_shared_with_another_save_of_the_same_tensor():
    torch.manual_seed(0)
    model, x = _GeluInputReadTwice(), torch.randn(64, 32)
    model(x).square().sum().backward()
    plain = model.scale.grad.clone()
    model.zero_grad(set_to_none=True)
    # at 2 bits GELU's save of h is derivative codes; the multiplication's save of h must be h's own codes
    daf.wrap(model, bits=2, codec=Outliers(derivatives=True), backend="reference", min_numel=1)
    try:
        model(x).square().sum().backward()
        kinds = [row.kind for row in daf.report(model).rows if row.source == "AddmmBackward0"]
    finally:
        daf.unwrap(model)
    assert kinds == ["compressed", "compressed"]  # before: the second save shared GELU's derivative record
    assert cosine(plain, model.scale.grad) > 0.9
