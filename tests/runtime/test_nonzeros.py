"""Codes for the nonzeros of a ReLU output only, its zeros given exactly by ReLU's own 1-bit mask.

The adaptive policy takes this path (``Policy.codes_nonzeros_only``); the uniform policy stores
every element. Each test fails if the scatter, the mask check or the budget is patched out.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.config import Config
from daf.memory.store import HeapStore
from daf.policy import AdaptivePolicy, Plan, Policy, UniformPolicy, register_policy
from daf.runtime.session import Session


class ConvReluConv(nn.Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.relu(self.conv1(x)))


@dataclass(frozen=True)
class NonzerosAt:
    """Policy config: uniform ``bits``, but for the nonzeros of ReLU outputs only (what the adaptive policy does)."""

    bits: int = 8


class NonzerosAtPolicy(UniformPolicy):
    codes_nonzeros_only = True


@register_policy(NonzerosAt, kind="nonzeros-at-test")
def _nonzeros_at(config: Config) -> Policy:
    return NonzerosAtPolicy(config.policy.bits)


def _grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _wrapped(inplace: bool = False, **config) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = ConvReluConv(inplace)
    model = ConvReluConv(inplace)
    model.load_state_dict(plain.state_dict())
    daf.wrap(model, Config(min_numel=1, **config))
    return plain, model


def _conv2_row(model: nn.Module):
    return next(r for r in daf.report(model).rows if r.site.startswith("conv2#") and r.kind == "compressed")


@pytest.mark.parametrize("inplace", [False, True])
def test_stores_only_the_nonzeros_and_restores_the_zeros_exactly(inplace):
    plain, model = _wrapped(inplace, policy=NonzerosAt(8))
    x = torch.randn(4, 3, 16, 16)
    h = F.relu(plain.conv1(x))
    nonzeros = int((h > 0).sum())
    error = (_grads(model, x) - _grads(plain, x)).norm() / _grads(plain, x).norm()
    assert error < 0.02  # 8-bit codes; a misplaced value would wreck conv2's weight gradient
    row = _conv2_row(model)
    groups = -(-nonzeros // 256)
    assert row.stored_bytes == groups * (4 + 256) and row.bits == 8
    assert nonzeros < 0.7 * h.numel()


def test_unpacked_tensor_is_zero_where_relu_was_and_close_elsewhere():
    model = ConvReluConv()
    x = torch.randn(2, 3, 8, 8)
    seen = {}

    def grab(module, inputs, output):
        seen["h"] = inputs[0]

    model.conv2.register_forward_hook(grab)
    with daf.compress(model, policy=NonzerosAt(8), min_numel=1):
        out = model(x)
    h = seen["h"].detach()
    restored = out.grad_fn._saved_input  # conv2's saved input, through the session's unpack
    assert torch.equal(restored == 0, h == 0)
    assert (restored - h).abs().max() <= h.max() / 255 + 1e-6
    # a convolution's 4-D save comes back channels-last (daf.runtime.layout)
    assert restored.stride() == h.contiguous(memory_format=torch.channels_last).stride()


def test_uniform_policy_stores_every_element():
    plain, model = _wrapped(bits=8)
    x = torch.randn(4, 3, 16, 16)
    _grads(model, x)
    assert _conv2_row(model).stored_bytes == -(-4 * 8 * 16 * 16 // 256) * (4 + 256)


def test_nan_in_a_relu_output_keeps_it_whole():
    plain, model = _wrapped(policy=NonzerosAt(8))
    x = torch.randn(4, 3, 16, 16)
    x[0, :, 5, 5] = float("nan")  # conv1's output is NaN around it, ReLU keeps NaN: not where the mask says
    _grads(model, x)
    # every element has a code (the NaNs also sit in the exceptions table)
    assert _conv2_row(model).stored_bytes >= -(-4 * 8 * 16 * 16 // 256) * (4 + 256)


def test_a_mask_that_disagrees_with_the_record_is_refused():
    # white-box: a heap store, whose records this test corrupts in place
    session = Session(Config(min_numel=1, policy=NonzerosAt(8)), store=HeapStore())
    model = ConvReluConv()
    with session.hooks():
        session.begin_forward(model)
        out = model(torch.randn(2, 3, 8, 8))
        session.end_forward()
    # flip one bit of ReLU's mask in the store: conv2's record no longer fits it
    masks = [ref for ref, packed in session.store._records.items() if packed.group_size == 0]
    assert masks, "ReLU's mask record should be in the store"
    session.store._records[masks[0]].payload[0] ^= 1
    with pytest.raises(RuntimeError, match="refusing to return wrong data"):
        out.square().mean().backward()


def test_background_packing_takes_the_same_path():
    plain, model = _wrapped(policy=NonzerosAt(8), background=True)
    x = torch.randn(4, 3, 16, 16)
    error = (_grads(model, x) - _grads(plain, x)).norm() / _grads(plain, x).norm()
    assert error < 0.02
    assert _conv2_row(model).stored_bytes < -(-4 * 8 * 16 * 16 // 256) * (4 + 256)


def test_adaptive_bits_shrink_when_the_nonzeros_outgrow_the_plan():
    policy = AdaptivePolicy(2.0)
    policy.plan = Plan({"a": 4, "b": 4}, 0.0, 2.0, 2.0, True, 1, {"a": 1024, "b": 1024})
    policy.on_forward_start(5)
    assert policy.bits_for("a", torch.zeros(768)) == 4  # 256 element-bits of 4096 left over
    assert policy.bits_for("b", torch.zeros(1280)) == 4  # 5120 <= 4096 + 1024: the credit pays
    assert policy.bits_for("a", torch.zeros(2048)) == 2  # no credit left: 2 * 2048 fits 4096
    policy.on_forward_start(6)
    assert policy.bits_for("b", torch.zeros(1280)) == 2  # a fresh forward starts without credit
