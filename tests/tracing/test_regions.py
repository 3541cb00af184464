"""Region masks (daf.tracing.regions): an op whose backward reads only which region its saved input is in gets
the exact bit of the region, and its gradient is bit for bit autograd's, NaN, infinities, signed zeros and
the region's edges included; other calls of the same functions (tensor bounds) are coded as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import daf

N = 8192  # above Config.min_numel: the saves are routed, not kept for being small

CALLS = {
    "hardtanh": lambda y: F.hardtanh(y),
    "hardtanh(-2, 0.5)": lambda y: F.hardtanh(y, -2.0, 0.5),
    "nn.ReLU6": lambda y: nn.ReLU6()(y),
    "F.relu6": lambda y: F.relu6(y),
    "hardtanh_ in place": lambda y: F.hardtanh_(y, 0.0, 6.0),
    "leaky_relu": lambda y: F.leaky_relu(y, 0.2),
    "leaky_relu in place": lambda y: F.leaky_relu(y, 0.01, inplace=True),
    "hardsigmoid": lambda y: F.hardsigmoid(y),
    "clamp(min)": lambda y: torch.clamp(y, min=0.5),
    "clamp(max)": lambda y: y.clamp(max=-0.25),
    "clamp(min, max)": lambda y: torch.clamp(y, -1.5, 2.0),
    "clip(min == max)": lambda y: torch.clip(y, 1.0, 1.0),
}

EDGES = [0.0, -0.0, 6.0, -6.0, 3.0, -3.0, 1.0, -1.0, 0.5, -0.25, 2.0, -1.5, -2.0, float("nan"), float("inf"),
         -float("inf"), 1e-30, -1e-30, 5.9999995, 6.0000005]


class OneCall(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, x):
        return self.call(x * 1.0)  # x * 1.0 has history (a mul saves nothing for a number): the call's save is routed


def _input(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, generator=generator) * 4
    x[: len(EDGES)] = torch.tensor(EDGES)
    return x.to(dtype).view(8, 32, 32)


def _gradient(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    (module(leaf) * weight).nansum().backward()
    return leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", list(CALLS))
def test_the_gradient_through_a_region_mask_is_autograds_bit_for_bit(name, dtype):
    x = _input(dtype)
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = _gradient(OneCall(CALLS[name]), x, weight)
    wrapped = daf.wrap(OneCall(CALLS[name]), bits=2, audit=daf.Audit(every=0))
    got = _gradient(wrapped, x, weight)
    assert torch.equal(got.nan_to_num(), expected.nan_to_num()) and torch.equal(got.isnan(), expected.isnan())
    kinds = [row.kind for row in daf.report(wrapped).rows if row.raw_bytes]
    assert kinds == ["mask"], kinds  # one save, 1 bit per element


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(sorted(CALLS)), scale=st.sampled_from([0.01, 1.0, 30.0]))
def test_random_inputs_any_region_op(seed, name, scale):
    x = _input(torch.float32, seed) * scale
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    expected = _gradient(OneCall(CALLS[name]), x, weight)
    got = _gradient(daf.wrap(OneCall(CALLS[name]), audit=daf.Audit(every=0)), x, weight)
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_tensor_bounds_are_not_masked_and_masks_off_codes_as_before():
    x = _input(torch.float32)
    low = torch.full(x.shape, -1.0)
    tensor_bounds = daf.wrap(OneCall(lambda y: torch.clamp(y, min=low)), audit=daf.Audit(every=0))
    _gradient(tensor_bounds, x, torch.ones(x.shape))
    # (the bound itself, one value, is an exact mask of its own)
    assert [row.kind for row in daf.report(tensor_bounds).rows if row.source == "MulBackward0"] == ["compressed"]
    off = daf.wrap(OneCall(F.relu6), masks=False, audit=daf.Audit(every=0))
    _gradient(off, x, torch.ones(x.shape))
    assert [row.kind for row in daf.report(off).rows if row.raw_bytes] == ["compressed"]


def test_the_record_is_the_ops_alone_the_next_op_gets_the_values():
    # In place ReLU6 saves its result, which the next linear saves too: the linear needs values, not regions.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU6(inplace=True), nn.Linear(256, 64))
    x = torch.randn(64, 64) * 3
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    wrapped = daf.wrap(model, bits=8, rounding="nearest", audit=daf.Audit(every=0))
    got = torch.autograd.grad(wrapped(x).square().sum(), list(wrapped.parameters()))
    cosine = F.cosine_similarity(torch.cat([g.flatten() for g in got]), torch.cat([g.flatten() for g in expected]), 0)
    assert cosine > 0.999
    kinds = sorted(row.kind for row in daf.report(wrapped).rows if row.raw_bytes and row.kind != "raw")
    assert kinds == ["compressed", "mask"], kinds  # the second linear's codes, ReLU6's region
