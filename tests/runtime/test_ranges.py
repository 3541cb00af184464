"""Values at the edges of what the codes carry come back right (or are kept as they are)."""

import pytest
import torch
from torch import nn

import daf


def _grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(x).square().sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_float64_activations_around_1e_60_give_the_gradients_of_plain_autograd():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False)).double()
    model = daf.wrap(nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False))
                     .double(), bits=8, min_numel=1)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(128, 64, dtype=torch.float64) * 1e-60
    expected, got = _grads(plain, x), _grads(model, x)
    assert float((got - expected).norm() / expected.norm()) < 1e-3  # (cosine_similarity's eps would hide it)
    assert [r.kind for r in daf.report(model).rows] == ["raw", "raw", "raw"]  # x, and tanh's tiny output for tanh and the 2nd Linear


def _spread_to_half_max() -> torch.Tensor:
    """Every group spans float16's whole range: its step, rounded up to bfloat16, carries the top code
    past 65504 (50 of 8192 gradient entries were inf at 8 bits)."""
    values = torch.empty(8192).uniform_(-65504, 65504, generator=torch.Generator().manual_seed(0))
    values[::256], values[1::256] = 65504, -65504
    return values.half()


def _near_half_max_gradient(backend: str) -> torch.Tensor:
    big = _spread_to_half_max()
    a = torch.ones(8192, dtype=torch.float16, requires_grad=True)
    w = torch.ones(8192, dtype=torch.float16, requires_grad=True)
    with daf.compress(bits=8, min_numel=1, backend=backend, rounding="nearest"):
        h = a * big  # saved by the next mul for w's gradient, compressed
        y = (h * w).sum()
    y.backward()
    return w.grad


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_float16_activations_near_65504_do_not_come_back_as_inf(backend):
    grad = _near_half_max_gradient(backend)
    expected = _spread_to_half_max().float()
    assert bool(torch.isfinite(grad).all()), int((~torch.isfinite(grad)).sum())
    assert float((grad.float() - expected).abs().max()) < 2 * 131008 / 255  # two steps of an 8-bit group
