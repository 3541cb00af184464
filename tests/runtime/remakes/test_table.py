"""The remake rules as a table: which rule remakes which save (and the report says so), and the table's own checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.config import REMAKES
from daf.runtime.remakes import DEFAULT_RULES, Remakes
from daf.runtime.remakes.blocks import NormBlockRule


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(64, 256), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class NormThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


class Block(nn.Module):
    """conv -> norm -> activation -> conv, with a residual add when ``residual``."""

    def __init__(self, norm: str = "batch", act: str = "relu", residual: bool = False) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8) if norm == "batch" else nn.GroupNorm(2, 8)
        self.act = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu}[act]
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x)
        y = self.norm(h)
        return self.conv2(self.act(y + h if self.residual else y))


class Attention(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv, self.dropout = nn.Linear(64, 3 * 64), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout).transpose(1, 2).flatten(2)


class EagerAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) @ v written out: ``matmul`` folds the probabilities to 3-D, a view."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        return (torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v).transpose(1, 2).flatten(2)


def _lm_head() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    from tests.runtime.test_derived_head import TinyLM, _ids

    ids = _ids()
    return TinyLM(), lambda m: m(ids)


def _case(model: nn.Module, shape: tuple[int, ...]) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    x = torch.randn(*shape)
    return model, lambda m: (m(x) * torch.linspace(-1, 1, m(x).shape[-1])).sum()


FINE_NORM_INPUTS = {"floors": {"batch_norm": 4, "group_norm": 4}}  # records a bit finer than the 2-bit saves

# (case, how it is built, wrap's keywords, the rule that remakes a save of it)
TABLE = [
    ("gated mlp", lambda: _case(GatedMLP(), (8, 16, 64)), {"bits": 8}, "activation"),
    ("layer norm", lambda: _case(NormThenLinear(), (8, 16, 64)), {"bits": 8}, "activation"),
    ("fused attention", lambda: _case(Attention(), (4, 32, 64)), {"bits": 4, "min_numel": 1}, "attention_output"),
    ("attention with dropout", lambda: _case(Attention(0.1), (4, 32, 64)), {"bits": 8, "min_numel": 1}, "attention_map"),
    ("eager attention", lambda: _case(EagerAttention(), (4, 32, 64)), {"bits": 8, "min_numel": 1}, "view"),
    ("lm head", _lm_head, {"bits": 4, "min_numel": 64}, "head_log_probabilities"),  # as test_derived_head
    ("bn relu", lambda: _case(Block(), (4, 8, 16, 16)), FINE_NORM_INPUTS, "norm_block"),
    ("bn relu residual", lambda: _case(Block(residual=True), (4, 8, 16, 16)), FINE_NORM_INPUTS, "norm_block"),
    ("gn silu", lambda: _case(Block("group", "silu"), (4, 8, 16, 16)), FINE_NORM_INPUTS, "norm_block"),
    ("bn gelu", lambda: _case(Block("batch", "gelu"), (4, 8, 16, 16)), FINE_NORM_INPUTS, "norm_block"),
]


@pytest.mark.parametrize("name, build, config, rule", TABLE, ids=[row[0] for row in TABLE])
def test_each_rule_remakes_its_save_with_no_bytes_and_says_which(name, build, config, rule):
    torch.manual_seed(0)
    model, loss = build()
    daf.wrap(model, audit=daf.Audit(every=0), **config)
    loss(model).backward()
    derived = [row for row in daf.report(model).rows if row.kind == "derived"]
    assert any(row.why.startswith(f"{rule}: remade") for row in derived), [(r.site, r.why) for r in derived]
    assert all(row.stored_bytes == 0 for row in derived)


def test_without_its_rule_the_save_is_stored():
    torch.manual_seed(0)
    model, loss = _case(Block(), (4, 8, 16, 16))
    daf.wrap(model, audit=daf.Audit(every=0), **FINE_NORM_INPUTS)
    session = daf.session_of(model)
    session.remakes = Remakes([rule for rule in DEFAULT_RULES if rule.name != "norm_block"])
    loss(model).backward()
    assert not [row for row in daf.report(model).rows if row.kind == "derived"]


@pytest.mark.parametrize("name, build, config, rule", TABLE, ids=[row[0] for row in TABLE])
def test_config_remakes_without_a_rule_stores_its_save(name, build, config, rule):
    """``Config.remakes`` names the rules in use: without one, no save is remade by it, and the saves it
    would have remade are stored (their bytes counted); the other rules still apply."""
    torch.manual_seed(0)
    model, loss = build()
    daf.wrap(model, audit=daf.Audit(every=0), remakes=tuple(r for r in daf.Config().remakes if r != rule), **config)
    assert rule not in daf.session_of(model).remakes.names
    loss(model).backward()
    rows = daf.report(model).rows
    assert not [row for row in rows if row.why.startswith(f"{rule}: remade")]
    assert daf.report(model).stored_bytes > 0


def test_config_remakes_none_remakes_nothing():
    torch.manual_seed(0)
    model, loss = _lm_head()
    daf.wrap(model, audit=daf.Audit(every=0), bits=4, min_numel=64, remakes=())
    loss(model).backward()
    rows = daf.report(model).rows
    assert daf.session_of(model).remakes.names == ()
    assert not [row for row in rows if ": remade" in row.why] and not any(r.site.endswith(".head_input") for r in rows)
    coded = [row for row in rows if row.source == "LogSoftmaxBackward0" and row.kind == "compressed"]
    assert [row.bits for row in coded] == [4]  # codes of the probabilities (nll_loss shares them)


def test_the_default_keeps_codes_where_a_remake_would_be_coarser_and_says_why():
    """Under daf.wrap(model), 2-bit records of the norm's input remade through ReLU hold about 1 bit's worth:
    the conv's input keeps 2-bit codes, and its row says why it was not remade."""
    torch.manual_seed(0)
    model, loss = _case(Block(), (4, 8, 16, 16))
    daf.wrap(model, audit=daf.Audit(every=0))
    loss(model).backward()
    rows = {row.site: row for row in daf.report(model).rows}
    assert rows["conv2#0"].kind == "compressed" and rows["conv2#0"].bits in (2, 4)  # codes of its nonzeros
    assert "nonzeros of a ReLU output" in rows["conv2#0"].why and "not remade (rule norm_block)" in rows["conv2#0"].why


def test_a_split_norm_input_remakes_the_conv_input():
    """With split_norm_inputs the norm's input is coded split by the ReLU mask after it (4-bit codes where the
    mask passes, group means elsewhere: daf.runtime.held), and the conv's input is remade from it."""
    torch.manual_seed(0)
    model, loss = _case(Block(), (4, 8, 16, 16))
    daf.wrap(model, audit=daf.Audit(every=0), split_norm_inputs=True)
    loss(model).backward()
    rows = {row.site: row for row in daf.report(model).rows}
    assert rows["norm#0"].bits == 2 and rows["norm#0"].why.startswith("split by the ReLU mask of <root>#0: 4-bit codes")
    assert rows["conv2#0"].kind == "derived" and rows["conv2#0"].why.startswith("norm_block: remade")


class _ReadBetween(nn.Module):
    """conv -> norm; a sigmoid of the norm's output saved before the ReLU: the norm's input is not held."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv1(x))
        gate = torch.sigmoid(y)
        return self.conv2(F.relu(y)) * gate


def test_a_norm_input_read_before_its_relu_is_not_split():
    """With split_norm_inputs, where another op saves between the norm and its ReLU, the norm's input is
    plain 2-bit codes (held no longer): the conv's input keeps its codes, as without the split."""
    torch.manual_seed(0)
    model, loss = _case(_ReadBetween(), (4, 8, 16, 16))
    daf.wrap(model, audit=daf.Audit(every=0), split_norm_inputs=True)
    loss(model).backward()
    rows = {row.site: row for row in daf.report(model).rows}
    assert rows["norm#0"].bits == 2 and rows["norm#0"].stored_bytes > 0 and not rows["norm#0"].why.startswith("split")
    assert rows["conv2#0"].kind == "compressed" and rows["conv2#0"].bits in (2, 4)  # codes of its nonzeros
    assert "nonzeros of a ReLU output" in rows["conv2#0"].why and "not remade (rule norm_block)" in rows["conv2#0"].why


def test_a_remade_view_is_its_base_records_decode_reshaped():
    """Rule ``view``: the probabilities folded for ``p @ v`` are the softmax's record reshaped, so the gradient
    equals the one where the view is coded apart at the same width (same groups, nearest rounding), in fewer
    bytes."""
    torch.manual_seed(0)
    model, loss = _case(EagerAttention(), (4, 32, 64))
    grads, stored = [], []
    for remakes in (REMAKES, tuple(r for r in REMAKES if r != "view")):
        copy = EagerAttention()
        copy.load_state_dict(model.state_dict())
        daf.wrap(copy, audit=daf.Audit(every=0), bits=8, rounding="nearest", codec=daf.MinMax(), min_numel=1,
                 remakes=remakes)
        loss(copy).backward()
        grads.append(torch.cat([p.grad.flatten() for p in copy.parameters()]))
        stored.append(daf.report(copy).stored_bytes)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert stored[0] < stored[1]


def test_a_view_of_part_of_a_tensor_is_not_remade():
    """A view that is not the whole base in its order (a slice, a transpose) keeps codes of its own."""
    from daf.runtime.remakes.views import _reshape_of

    base = torch.randn(4, 8, 16)
    assert _reshape_of(base.view(32, 16), base)
    assert not _reshape_of(base[:2].reshape(16, 16), base)
    assert not _reshape_of(base.transpose(1, 2), base)
    assert not _reshape_of(base.view(torch.int32), base)


@pytest.mark.parametrize("rules, error", [
    ([object()], TypeError),
    ([NormBlockRule(), NormBlockRule()], ValueError),
])
def test_the_table_refuses_what_is_not_a_rule(rules, error):
    with pytest.raises(error):
        Remakes(rules)


def test_lost_bits_is_checked():
    with pytest.raises(ValueError, match="lost_bits"):
        NormBlockRule(lost_bits=-1)


def test_the_default_table_order():
    assert Remakes().names == ("activation", "attention_output", "attention_map", "head_log_probabilities", "norm_block",
                               "view")
    assert Remakes().names == daf.Config().remakes == REMAKES  # the config names every rule, in the table's order
    assert Remakes.named(("norm_block", "activation")).names == ("activation", "norm_block")
    with pytest.raises(ValueError, match="no remake rule named"):
        Remakes.named(("head",))
