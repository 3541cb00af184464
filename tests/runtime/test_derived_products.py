"""Dropout's output is derived from the stored probabilities and the stored mask, not stored again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.tracing import masked_product_of
from tests.models import node_named


class DroppedAttention(nn.Module):
    """softmax(q k^T) -> dropout -> @ v, in 2-D (one mm saves the dropped map itself) or batched (through views)."""

    def __init__(self, width: int = 32, p: float = 0.2) -> None:
        super().__init__()
        self.q, self.v, self.p = nn.Linear(width, width), nn.Linear(width, width), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = (self.q(x) @ x.transpose(-1, -2)).softmax(-1)
        return F.dropout(probabilities, self.p, self.training) @ self.v(x)


def _rows(model: nn.Module, kind: str) -> list[daf.report.SiteRow]:
    return [row for row in daf.report(model).rows if row.kind == kind]


def test_the_dropped_map_is_derived_and_costs_no_bytes() -> None:
    torch.manual_seed(0)
    model = daf.wrap(DroppedAttention(), daf.Config(bits=2))
    model(torch.randn(96, 32)).sum().backward()
    derived = _rows(model, "derived")
    assert [row.source for row in derived] == ["MulBackward0"]
    assert derived[0].shape == (96, 96) and derived[0].stored_bytes == 0
    assert len(_rows(model, "mask")) == 1  # the noise, stored once, exactly


def test_the_derived_map_is_the_decoded_probabilities_times_the_mask_exactly() -> None:
    torch.manual_seed(0)
    plain = DroppedAttention()
    model = daf.wrap(DroppedAttention(), daf.Config(bits=2))
    model.load_state_dict(plain.state_dict())
    x = torch.randn(96, 32)
    torch.manual_seed(1)
    y = model(x)
    torch.manual_seed(1)
    true_dropped = F.dropout((plain.q(x) @ x.T).softmax(-1), plain.p, True)
    dropped = node_named(y, "MmBackward0")._saved_self  # the save of `dropped @ v`: goes through DAF's unpack
    probabilities = node_named(y, "SoftmaxBackward0")._saved_result
    noise = node_named(y, "MulBackward0")._saved_other
    assert torch.equal(dropped, probabilities * noise)
    assert torch.equal(dropped == 0, true_dropped == 0)  # the mask is exact: zeros where dropout dropped
    assert (dropped - true_dropped).abs().max() < 0.5 * true_dropped.abs().max()  # and 2-bit codes elsewhere
    assert not torch.equal(dropped, true_dropped)


def test_through_views_as_attention_batches_it() -> None:
    torch.manual_seed(0)
    model = daf.wrap(DroppedAttention(), daf.Config(bits=8))
    reference = DroppedAttention()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 2, 64, 32)
    torch.manual_seed(1)
    model(x).pow(2).sum().backward()
    torch.manual_seed(1)
    reference(x).pow(2).sum().backward()
    derived = _rows(model, "derived")
    assert len(derived) == 1 and derived[0].source == "ViewBackward0" and derived[0].stored_bytes == 0
    for name, parameter in reference.named_parameters():
        got = dict(model.named_parameters())[name].grad
        assert torch.linalg.vector_norm(got - parameter.grad) < 0.05 * torch.linalg.vector_norm(parameter.grad), name


def test_fused_attention_with_dropout_derives_its_dropped_map() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 48, 16, requires_grad=True) for _ in range(3))
    scores = torch.nn.Linear(16, 16)
    with daf.compress(config=daf.Config(bits=2)) as block:
        out = F.scaled_dot_product_attention(scores(q), k, v, dropout_p=0.2)
    out.sum().backward()
    kinds = [row.kind for row in block.report().rows]
    assert "derived" in kinds
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_without_masks_the_product_is_coded() -> None:
    torch.manual_seed(0)
    model = daf.wrap(DroppedAttention(), daf.Config(bits=2, masks=False))
    model(torch.randn(96, 32)).sum().backward()
    assert not _rows(model, "derived")


def test_a_product_whose_input_is_not_stored_is_coded() -> None:
    class DroppedLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(F.dropout(self.a(x), 0.2, self.training))  # a's output: saved by nobody

    model = daf.wrap(DroppedLinear(), daf.Config(bits=2))
    model(torch.randn(512, 32)).sum().backward()
    assert not _rows(model, "derived")
    assert any(row.source == "MulBackward0" and row.kind == "compressed" for row in daf.report(model).rows)


def test_a_product_of_two_tensors_with_history_is_coded() -> None:
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.a(x).sigmoid() * self.b(x))

    model = daf.wrap(Gated(), daf.Config(bits=2))
    model(torch.randn(96, 32)).sum().backward()
    assert not _rows(model, "derived")


def test_the_derived_map_changed_in_place_raises_as_autograd_does() -> None:
    class Changed(DroppedAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dropped = F.dropout((self.q(x) @ x.T).softmax(-1), self.p, self.training)
            out = dropped @ self.v(x)
            dropped.mul_(2)
            return out, dropped  # DAF checks the versions of saved tensors that are still alive

    model = daf.wrap(Changed(), daf.Config(bits=2))
    out, _ = model(torch.randn(96, 32))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_background_packing_derives_alike() -> None:
    torch.manual_seed(0)
    model = daf.wrap(DroppedAttention(), daf.Config(bits=2, background=True))
    model(torch.randn(96, 32)).sum().backward()
    assert len(_rows(model, "derived")) == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("remake, expected", [
    (lambda d: d.view(-1), True),
    (lambda d: d.reshape(4, -1), True),
    (lambda d: d.expand(8, 8), True),
    (lambda d: d.t(), False),  # not contiguous
    (lambda d: d.t().contiguous(), False),  # another order: a copy, not a view
    (lambda d: d + 1, False),
])
def test_masked_product_of_follows_order_keeping_views_only(remake, expected) -> None:
    x = torch.randn(8, 8, requires_grad=True).exp()
    dropped = x * torch.bernoulli(torch.full((8, 8), 0.5))
    found = masked_product_of(remake(dropped))
    assert (found is not None) is expected
    if expected:
        assert found.node is x.grad_fn and found.mask_attribute == "_saved_other"


def test_masked_product_of_the_mask_on_the_left() -> None:
    x = torch.randn(8, 8, requires_grad=True).exp()
    found = masked_product_of(torch.bernoulli(torch.full((8, 8), 0.5)) * x)
    assert found is not None and found.mask_attribute == "_saved_self"
    assert masked_product_of(x * x) is None  # both with history
    assert masked_product_of(x.detach() * 2) is None  # no history


def test_the_report_gives_the_mean_bits_of_the_codes_without_the_derived_map() -> None:
    torch.manual_seed(0)
    model = daf.wrap(DroppedAttention(), daf.Config(bits=2, min_numel=1))
    model(torch.randn(96, 32)).sum().backward()
    report = daf.report(model)
    coded = {r.shape: r.bits for r in report.rows if r.kind == "compressed"}
    # the probabilities at 4 bits (a rule above the policy), v's output at 2 (x has no history: q's output
    # is not saved, x is kept raw)
    assert sorted(coded.items()) == [((96, 32), 2), ((96, 96), 4)] and len(_rows(model, "compressed")) == 2
    assert report.mean_code_bits == pytest.approx((96 * 96 * 4 + 96 * 32 * 2) / (96 * 96 + 96 * 32))
    assert report.totals()["mean_code_bits"] == report.mean_code_bits
    assert f"{report.mean_code_bits:.2f} bits per coded element" in str(report)
