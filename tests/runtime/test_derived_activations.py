"""SiLU's and GELU's output, saved by the next op, is recomputed from the stored input, not stored again."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from tests.models import without_rule
from daf.config import Outliers
from daf.tracing import activation_output_of


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu-tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    """Llama's MLP: down(act(gate(x)) * up(x)); the multiply saves act's output and up's."""

    def __init__(self, activation: str = "silu", width: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(width, hidden), nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.gate(x)) * self.up(x))


def _grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(x).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_output_of_gives_the_function_that_remakes_it(name):
    x = torch.randn(8, 32, requires_grad=True) * 3
    found = activation_output_of(ACTIVATIONS[name](x))
    assert found is not None and found.node is x.grad_fn
    assert torch.equal(found.function(x.detach()), ACTIVATIONS[name](x).detach())


def test_other_outputs_and_inputs_without_history_are_not_activation_outputs():
    x = torch.randn(8, 32, requires_grad=True) * 1
    assert activation_output_of(torch.relu(x)) is None and activation_output_of(torch.tanh(x)) is None
    assert activation_output_of(F.silu(torch.randn(8, 32))) is None


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_gated_mlp_stores_one_tensor_less_and_keeps_its_gradient(name, monkeypatch):
    torch.manual_seed(0)
    plain, x = GatedMLP(name), torch.randn(16, 32, 64)
    reference = _grads(plain, x)
    model = daf.wrap(GatedMLP(name), bits=8)
    model.load_state_dict(plain.state_dict())
    got = _grads(model, x)
    derived = [r for r in daf.report(model).rows if r.kind == "derived"]
    assert [r.source for r in derived] == ["SiluBackward0" if name == "silu" else "GeluBackward0"]
    assert derived[0].stored_bytes == 0 and derived[0].raw_bytes == 16 * 32 * 256 * 4
    stored = daf.report(model).stored_bytes
    assert F.cosine_similarity(got, reference, dim=0) > 0.9999
    without_rule(model, "activation")  # as before: codes of it
    stored_again = _grads(model, x) is not None and daf.report(model).stored_bytes
    assert stored_again - stored >= 16 * 32 * 256  # one 8-bit copy of the hidden activation


def test_derivative_codes_are_not_a_source():
    """GELU's input as 2-bit derivative codes decodes to representatives, not to the input: its output is coded."""
    model = daf.wrap(GatedMLP("gelu"), bits=2, codec=Outliers(derivatives=True))
    _grads(model, torch.randn(16, 32, 64))
    rows = [r for r in daf.report(model).rows if r.source == "GeluBackward0"]
    assert [r.kind for r in rows] == ["compressed"]


def test_in_place_change_of_the_output_raises_like_autograd():
    model = daf.wrap(GatedMLP("silu"), bits=8)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = F.silu(self.mlp.gate(x))
            out = hidden * self.mlp.up(x)
            hidden.mul_(2)  # the saved output changed after the multiply saved it
            self.kept = hidden  # alive at backward, so DAF sees the change (as for any record)
            return out

    wrapped = daf.wrap(Scaled(), bits=8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        wrapped(torch.randn(4, 8, 64)).sum().backward()
