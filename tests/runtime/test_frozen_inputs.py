"""Saves without autograd history that DAF may compress: a frozen layer's output, saved by a trained one.

Under LoRA or a frozen backbone the first trained layer gets inputs without autograd history (made by
frozen modules in forward). They used to stay raw with the input batch (33% of MiniLM + LoRA's stored
bytes). A linear, matmul or convolution only multiplies by what it saves, so these are coded; the
caller's own input stays raw: the caller holds it anyway.
"""

import torch
from torch import nn

import daf
from daf.tracing import made_in_call


class FrozenThenTrained(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.frozen = nn.Linear(64, 256)
        self.frozen.requires_grad_(False)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.adapter = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.drop(torch.tanh(self.frozen(x))))


def _rows(model: nn.Module, x: torch.Tensor) -> dict:
    model(x).square().sum().backward()
    return {row.site: row for row in daf.report(model).rows}


def test_a_frozen_layers_output_saved_by_a_trained_layer_is_compressed():
    torch.manual_seed(0)
    model = daf.wrap(FrozenThenTrained(), bits=2, min_numel=256)
    rows = _rows(model, torch.randn(128, 64))
    adapter = rows["adapter#0"]
    assert adapter.kind == "compressed" and adapter.source == "no history" and adapter.bits == 2
    assert adapter.stored_bytes < adapter.raw_bytes / 8


def test_the_callers_input_and_what_an_identity_returns_stay_raw():
    torch.manual_seed(0)
    plain = nn.Linear(64, 8)
    model = daf.wrap(plain, bits=2, min_numel=256)
    model(torch.randn(128, 64)).sum().backward()
    assert [row.kind for row in daf.report(model).rows] == ["raw"]  # the batch: held by the caller anyway

    class IdentityFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.same, self.lin = nn.Identity(), nn.Linear(64, 8)

        def forward(self, x):
            return self.lin(self.same(x))
    model = daf.wrap(IdentityFirst(), bits=2, min_numel=256)
    rows = _rows(model, torch.randn(128, 64))
    assert rows["lin#0"].kind == "raw"


def test_gradients_stay_close_and_under_no_grad_nothing_is_noted():
    torch.manual_seed(0)
    reference = FrozenThenTrained(dropout=0)
    x = torch.randn(512, 64)
    reference(x).square().sum().backward()
    expected = reference.adapter.weight.grad.clone()
    model = daf.wrap(reference, bits=4, min_numel=256)
    reference.zero_grad()
    model(x).square().sum().backward()
    cosine = torch.nn.functional.cosine_similarity(model.adapter.weight.grad.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.99
    session = daf.session_of(model)
    with torch.no_grad():
        model(x)
    assert not session.sites.made  # evaluation saves nothing, so it notes nothing


def test_made_in_call_tells_copies_made_inside_from_arguments():
    a, weight = torch.randn(4, 8), nn.Parameter(torch.randn(8, 8), requires_grad=False)
    assert not made_in_call(a, [a, weight]) and not made_in_call(a.t(), [a, weight])  # an argument, or a view
    assert made_in_call(a.t().contiguous(), [a, weight])  # a copy of an argument made inside the call
    assert not made_in_call(weight.to(torch.bfloat16), [a, weight])  # may be the weight's copy: never quantized
