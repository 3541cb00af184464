"""Values at the edges of what the codes carry come back right (or are kept as they are)."""

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
