"""GELU/SiLU inputs as 2-bit derivative codes: representatives, exact codes, backward through DAF."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import daf
from daf.codec import Codecs, DerivativePacked, Spec
from daf.codec.backends import REFERENCE
from daf.codec.derivative import FUNCTIONS, LEVELS, REPRESENTATIVES, DerivativeCodec, derivative, level_codes
from daf.config import Outliers

_TORCH = {"gelu": F.gelu, "silu": F.silu}


def _autograd_derivative(function, x):
    x = x.detach().clone().requires_grad_(True)
    _TORCH[function](x).sum().backward()
    return x.grad


@pytest.mark.parametrize("function", FUNCTIONS)
def test_representatives_have_the_level_as_derivative(function):
    """What GeluBackward0 / SiluBackward0 compute at a representative is the level, in float32."""
    got = _autograd_derivative(function, torch.tensor(REPRESENTATIVES[function]))
    assert torch.allclose(got, torch.tensor(LEVELS[function]), atol=2e-6, rtol=0)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_closed_form_matches_autograd(function):
    x = torch.linspace(-8, 8, 4001)
    assert torch.allclose(derivative(function, x), _autograd_derivative(function, x), atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 3000), function=st.sampled_from(FUNCTIONS), scale=st.floats(0.1, 10),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), transpose=st.booleans(),
       group=st.sampled_from([16, 256]))
def test_round_trip_is_the_representative_of_the_nearest_level(n, function, scale, dtype, transpose, group):
    x = (torch.randn(n, 3) * scale).to(dtype)
    x = x.t() if transpose else x
    codec = DerivativeCodec(REFERENCE, group)
    p = codec.encode(x, Spec(2, 0, function))
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype and (n == 1 or y.stride() == x.stride())
    expected = torch.tensor(REPRESENTATIVES[function])[level_codes(function, x.contiguous()).long()].to(dtype)
    assert torch.equal(y, expected)
    assert p.nbytes == -(-x.numel() // group) * (4 + group // 4)


def test_native_and_reference_agree():
    codecs = Codecs(daf.Config(codec=Outliers(derivatives=True), backend="auto"))
    if codecs.backend.name == "reference":
        pytest.skip("native kernels unavailable: " + daf.native_status())
    x = torch.randn(37, 300) * 3
    native, reference = DerivativeCodec(codecs.backend), DerivativeCodec(REFERENCE)
    a, b = native.encode(x, Spec(2, 0, "gelu")), reference.encode(x, Spec(2, 0, "gelu"))
    assert torch.equal(a.payload, b.payload) and torch.equal(native.decode(a), reference.decode(b))


def test_only_gelu_and_silu_saves_at_2_bits():
    codecs = Codecs(daf.Config(codec=Outliers(derivatives=True), backend="reference"))
    x = torch.randn(64, 64)
    assert isinstance(codecs.encode("codes", x, Spec(2, 0, "gelu")), DerivativePacked)
    assert isinstance(codecs.encode("codes", x, Spec(2, 0, "silu")), DerivativePacked)
    for bits in (1, 4, 8):
        assert not isinstance(codecs.encode("codes", x, Spec(bits, 0, "gelu")), DerivativePacked)
    assert not isinstance(codecs.encode("codes", x, Spec(2, 0, "linear")), DerivativePacked)
    off = Codecs(daf.Config(codec=Outliers(), backend="reference"))
    assert not isinstance(off.encode("codes", x, Spec(2, 0, "gelu")), DerivativePacked)
    p = codecs.encode("codes", x, Spec(2, 0, "gelu"))
    assert codecs.reencode(p, 1, 0).bits == 2


@pytest.mark.parametrize("function", FUNCTIONS)
def test_backward_through_daf_uses_the_levels(function):
    """The input gradient of f(x) is exactly grad * level[code(x)]."""
    torch.manual_seed(0)
    x = (torch.randn(64, 128) * 2).requires_grad_(True)
    with daf.compress(codec=Outliers(derivatives=True), bits=2, backend="reference", min_numel=1) as session:
        y = _TORCH[function](x * 1.0)
    y.backward(torch.ones_like(y))
    levels = torch.tensor(LEVELS[function])[level_codes(function, x).long()]
    assert torch.allclose(x.grad, levels, atol=2e-6, rtol=0)
    assert any(r.bits == 2 and r.kind == "compressed" for r in daf.report(session).rows)


def test_derivative_codes_beat_2_bit_codes_of_the_input():
    """For the input gradient of GELU, four derivative levels are closer than 2-bit codes of x."""
    torch.manual_seed(0)
    x = torch.randn(256, 1024) * 2
    exact = derivative("gelu", x)
    codec = DerivativeCodec(REFERENCE)
    coded = derivative("gelu", codec.decode(codec.encode(x, Spec(2, 0, "gelu"))))
    minmax = Codecs(daf.Config(backend="reference"))
    plain = derivative("gelu", minmax.decode(minmax.encode("codes", x, Spec(2, 1))))
    assert (coded - exact).square().mean() < (plain - exact).square().mean() / 2


@pytest.mark.parametrize("function", ["gelu", "silu"])
def test_level_codes_are_bucketize_of_the_derivative_even_at_the_midpoints(function):
    levels = torch.tensor(LEVELS[function])
    midpoints = (levels[1:] + levels[:-1]) / 2
    x = torch.cat([torch.randn(100_000) * 3, torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])])
    expected = torch.bucketize(derivative(function, x).nan_to_num(nan=0.0), midpoints).to(torch.uint8)
    assert torch.equal(level_codes(function, x), expected)
    # a derivative exactly at a midpoint goes below it, as bucketize (right=False) puts it
    d = torch.cat([midpoints, torch.nextafter(midpoints, torch.full_like(midpoints, 2.0))])
    counted = sum((d > m).to(torch.uint8) for m in midpoints.tolist())
    assert torch.equal(counted, torch.bucketize(d, midpoints).to(torch.uint8))


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_nan_and_inf_inputs_give_plain_autograds_gradient(function, backend):
    """Issue 42: NaN and Inf were coded as a level, so backward saw a finite derivative where plain
    autograd's is NaN. They are kept exactly (format 1's side table); the other elements keep their codes,
    and a channels-last input too."""
    torch.manual_seed(0)
    base = torch.randn(4, 8, 6, 6) * 2
    base.view(-1)[[3, 77, 500]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for x0 in (base, base.contiguous(memory_format=torch.channels_last)):
        grads = []
        for compressed in (True, False):
            x = x0.clone().requires_grad_(True)
            with (daf.compress(codec=Outliers(derivatives=True), bits=2, backend=backend, min_numel=1)
                  if compressed else contextlib.nullcontext()):
                y = _TORCH[function](x * 1.0)
            y.backward(torch.ones_like(y))
            grads.append(x.grad)
        mine, plain = grads
        finite = torch.isfinite(x0)
        assert torch.equal(mine.isnan(), plain.isnan()) and torch.equal(mine.isinf(), plain.isinf())
        assert torch.equal(mine[~finite].nan_to_num(), plain[~finite].nan_to_num())
        levels = torch.tensor(LEVELS[function])[level_codes(function, x0).long()]
        assert torch.allclose(mine[finite], levels[finite], atol=2e-6, rtol=0)


def test_the_side_table_survives_reencode_and_counts_its_bytes():
    codec = DerivativeCodec(REFERENCE)
    x = torch.randn(1000)
    x[[5, 6]] = float("nan")
    packed = codec.encode(x, Spec(2, 0, "gelu"))
    assert packed.exc_index.tolist() == [5, 6] and packed.nbytes > codec.encode(torch.randn(1000), Spec(2, 0, "gelu")).nbytes
    assert codec.decode(codec.reencode(packed, 1, 0))[[5, 6]].isnan().all()
