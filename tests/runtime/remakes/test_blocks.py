"""The ``norm_block`` rule: a CNN block's output remade from the norm's input record, its statistics and
affine parameters, ReLU's mask and the shortcut's record; what it checks in backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.runtime.remakes import DEFAULT_RULES, Remakes
from daf.runtime.records import Kept
from daf.runtime.remakes.blocks import NormBlockRule, NormCalls
from daf.tracing import OpCall


class ResBlock(nn.Module):
    """relu(bn1(conv1 x)) -> conv2 -> bn2, plus a shortcut (bn of a 1x1 conv when ``downsample``), relu."""

    def __init__(self, channels: int = 8, downsample: bool = False, norm: str = "batch", act: str = "relu") -> None:
        super().__init__()
        make_norm = (lambda: nn.BatchNorm2d(channels)) if norm == "batch" else (lambda: nn.GroupNorm(2, channels))
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), make_norm()
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), make_norm()
        self.short = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), make_norm()) if downsample else None
        self.act = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu}[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))
        return self.act(self.bn2(self.conv2(y)) + (x if self.short is None else self.short(x)))


class Net(nn.Module):
    def __init__(self, **block) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(ResBlock(**block), ResBlock(downsample=True, **{k: v for k, v in block.items()
                                                                                  if k != "downsample"}), ResBlock(**block))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(h.mean((2, 3)))


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _remade_from_exact_enough(model: nn.Module) -> nn.Module:
    """Every block remade, from 8-bit records of the norms' inputs (the saves themselves get 2 bits)."""
    return daf.wrap(model, audit=daf.Audit(every=0), floors={"batch_norm": 8, "group_norm": 8})


@pytest.mark.parametrize("norm, act", [("batch", "relu"), ("group", "silu"), ("group", "gelu"), ("batch", "silu")])
def test_remade_blocks_keep_the_gradient_of_their_records(norm, act):
    torch.manual_seed(0)
    plain = Net(norm=norm, act=act)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    reference = _grads(plain, x, y)
    model = _remade_from_exact_enough(copy.deepcopy(plain))
    got = _grads(model, x, y)
    rows = daf.report(model).rows
    remade = [r for r in rows if r.why.startswith("norm_block: remade")]
    assert len(remade) >= 6 and all(r.kind == "derived" and r.stored_bytes == 0 for r in remade)
    assert F.cosine_similarity(got, reference, dim=0) > 0.999
    # the same net with the rule off stores each block's output as 2-bit codes: a worse gradient, more bytes
    daf.session_of(model).remakes = Remakes([r for r in DEFAULT_RULES if r.name != "norm_block"])
    coded = _grads(model, x, y)
    assert daf.report(model).stored_bytes > sum(r.stored_bytes for r in rows)
    assert F.cosine_similarity(coded, reference, dim=0) < F.cosine_similarity(got, reference, dim=0)


def test_the_residual_sum_and_the_mask_are_in_the_remake():
    torch.manual_seed(0)
    model = _remade_from_exact_enough(Net())
    _grads(model, torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    why = {r.site: r.why for r in daf.report(model).rows}
    assert why["blocks.0.conv2#0"].startswith("norm_block: remade as relu(batch_norm(x)) * mask from blocks.0.bn1#0")
    shortcut = why["blocks.1.conv1#0"]  # block 0's output: its bn2's input plus the stem's (remade) output
    assert shortcut.startswith("norm_block: remade as relu(batch_norm(x) + x) * mask from blocks.0.bn2#0, ")
    downsampled = why["blocks.2.conv1#0"]
    assert "relu(batch_norm(x) + batch_norm(x)) * mask" in downsampled


class _Record:
    def __init__(self, tensor: torch.Tensor, site: str) -> None:
        self.tensor, self.site, self.bits, self.exact = tensor, site, 32, False


class _ForwardRecords:
    """``Records`` without hooks: every tensor named in ``kept`` is a raw record of itself."""

    min_numel = 1

    def __init__(self, kept: dict[str, torch.Tensor], calls: list[OpCall]) -> None:
        self.records = {(id(t.grad_fn), t.output_nr): _Record(t, name) for name, t in kept.items()}
        self.norms, self.linears = NormCalls(), None
        for call in calls:
            self.norms.note(call)

    def record_of(self, node, output_nr, reader=None):
        return self.records.get((id(node), output_nr))

    def remade_output(self, node, output_nr):
        return None

    def record_behind(self, node, attribute):
        return Kept(getattr(node, attribute), attribute)

    def readable(self, node):
        return True

    def relu_mask(self, tensor):
        return _Record(tensor > 0, "mask")


def _norm(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, OpCall]:
    if kind == "batch":
        call = OpCall(F.batch_norm, (x, None, None, weight, bias, True), {})
    else:
        call = OpCall(F.group_norm, (x, 2, weight, bias), {})
    call.output = call.func(*call.args)
    return call.output, call


EXPRESSIONS = ["relu(bn(x))", "relu(bn(x) + s)", "relu(bn(x) + bn(s))", "silu(gn(x))", "gelu(gn(x) + s)", "bn(x)"]


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_the_remake_from_exact_records_is_the_forward(expression):
    """Asked directly (no hooks, records raw): the function of the records gives the saved tensor, to float
    rounding."""
    torch.manual_seed(0)
    x = (torch.randn(4, 8, 6, 6) * 3 + 1).requires_grad_()
    s = torch.randn(4, 8, 6, 6).requires_grad_()
    x1, s1 = x * 1, s * 1  # tensors with history, as a conv's output is
    weight, bias = torch.rand(8) + 0.5, torch.randn(8)
    kind = "group" if "gn" in expression else "batch"
    calls = []
    y, call = _norm(kind, x1, weight, bias)
    calls.append(call)
    if "+ bn(s)" in expression:
        other, call = _norm("batch", s1, weight, bias)
        calls.append(call)
        y = y + other
    elif "+ s" in expression:
        y = y + s1
    act = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu}.get(expression.split("(")[0])
    out = act(y) if act is not None else y
    records = _ForwardRecords({"x": x1, "s": s1}, calls)
    remake = NormBlockRule().find(out, None, records)
    assert remake is not None and remake.rule == "norm_block"
    leaves = [r.tensor.detach() for r in remake.records]
    torch.testing.assert_close(remake.function(*leaves), out.detach(), rtol=1e-5, atol=1e-5)
    assert remake.bits == (31 if act is not None else 32)  # a bit lost through the activation


def test_not_found_through_an_unknown_node_or_without_a_record():
    x = torch.randn(4, 8, 6, 6).requires_grad_() * 1
    records = _ForwardRecords({"x": x}, [])
    assert NormBlockRule().find(torch.tanh(x), None, records) is None
    assert NormBlockRule().find(F.relu(torch.tanh(x)), None, records) is None
    assert NormBlockRule().find(F.relu(x * 2), None, _ForwardRecords({}, [])) is None
    assert NormBlockRule().find(F.relu(x), None, records).bits == 31


def _one_block_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _remade_from_exact_enough(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                                    nn.Conv2d(8, 4, 3, padding=1)))
    return model, torch.randn(4, 3, 16, 16)


@pytest.mark.parametrize("what", ["weight", "bias"])
def test_a_norm_parameter_changed_before_backward_raises_naming_it(what):
    model, x = _one_block_model()
    loss = model(x).square().mean()
    with torch.no_grad():
        getattr(model[1], what).add_(1.0)  # an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match=f"batch norm's {what}"):
        loss.backward()


def test_a_frozen_bias_is_read_from_the_call():
    """autograd neither saves the bias nor has an edge to a frozen one: the tracked call gives it."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    with torch.no_grad():
        plain[1].bias.uniform_(-1, 1)
    plain[1].bias.requires_grad_(False)
    x = torch.randn(4, 3, 16, 16)
    reference = torch.autograd.grad(plain(x).square().mean(), plain[0].weight)[0]
    model = _remade_from_exact_enough(copy.deepcopy(plain))
    got = torch.autograd.grad(model(x).square().mean(), model[0].weight)[0]
    assert any(r.why.startswith("norm_block: remade") for r in daf.report(model).rows)
    assert F.cosine_similarity(got.flatten(), reference.flatten(), dim=0) > 0.999


def test_eval_mode_batch_norm_is_not_remade():
    """It reads running statistics, which a later training forward may update before this backward."""
    model, x = _one_block_model()
    model.eval()
    model(x).sum().backward()
    assert not [r for r in daf.report(model).rows if r.why.startswith("norm_block")]


def test_the_saved_output_changed_in_place_raises_like_autograd():
    torch.manual_seed(0)

    class Kept(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = F.relu(self.bn(self.conv(x)))
            return self.out(h), h

    model = _remade_from_exact_enough(Kept())
    y, h = model(torch.randn(4, 3, 16, 16))
    assert any(r.why.startswith("norm_block: remade") for r in daf.report(model).rows)
    h.mul_(2)  # after the conv saved it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("setting", [{"background": True}, {"channels_last": True}])
def test_remade_from_records_packed_in_the_background_or_decoded_channels_last(setting):
    torch.manual_seed(0)
    plain = Net()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    reference = _grads(plain, x, y)
    model = daf.wrap(copy.deepcopy(plain), audit=daf.Audit(every=0), floors={"batch_norm": 8}, **setting)
    got = _grads(model, x, y)
    assert sum(1 for r in daf.report(model).rows if r.why.startswith("norm_block: remade")) >= 6
    assert F.cosine_similarity(got, reference, dim=0) > 0.999


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu"])
def test_a_remake_writes_only_into_what_it_made_never_into_its_leaves(activation):
    """``_evaluate`` works in place after its first step; the leaves (decoded records, which the session may hand
    to another reader) stay as they were, and the value is the out-of-place expression's, bit for bit."""
    from daf.runtime.remakes.blocks import _Activation, _Add, _evaluate, _Leaf, _Masked, _Norm

    torch.manual_seed(0)
    x, shortcut = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    mask = (torch.randn(2, 4, 3, 3) > 0).float()
    mean, rstd, weight, bias = torch.randn(4), torch.rand(4) + 0.5, torch.randn(4), torch.randn(4)
    function = {"relu": torch.relu, "silu": F.silu, "gelu": F.gelu}[activation]
    norm = _Norm(_Leaf(0), 0, mean, rstd, weight, bias, ())
    expression = _Masked(_Add(norm, _Leaf(1), 1.0), 2) if activation == "relu" else \
        _Activation(_Add(norm, _Leaf(1), 1.0), function, activation)
    leaves = (x.clone(), shortcut.clone(), mask.clone())
    value, owned = _evaluate(expression, leaves)
    channel = (1, -1, 1, 1)
    y = (x - mean.view(channel)) * rstd.view(channel) * weight.view(channel) + bias.view(channel) + shortcut
    expected = torch.relu(y) * mask if activation == "relu" else function(y)
    assert owned and torch.equal(value, expected)
    assert all(torch.equal(a, b) for a, b in zip(leaves, (x, shortcut, mask)))
