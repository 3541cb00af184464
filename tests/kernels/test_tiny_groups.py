"""Groups of tiny values (float32 denormals): their nonzeros go to the side table, in the reference and the
kernels alike (docs/format.md, "Exceptional elements"); zero groups and ordinary data stay exception-free."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.format import TINY_LIMIT
from daf.kernels import ops, reference
from daf.kernels.backend import STRATEGIES

BITS = [1, 2, 4, 8]


def tiny_mix(numel: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """Ordinary groups, zero groups, denormal groups, denormals beside zeros and a NaN, -0.0, a short last group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    groups = x.split(group_size)
    for k, group in enumerate(groups):
        kind = k % 5
        if kind == 1:
            group.zero_()
        elif kind == 2:
            group.mul_(1e-40)  # denormals
        elif kind == 3:
            group.mul_(1e-33).clamp_(min=0)  # normal but below TINY_LIMIT, with zeros (a ReLU output)
        elif kind == 4:
            group.mul_(1e-40)
            group[0] = float("nan")  # NaN beside denormals: all of them are exceptional
    if numel > 1:
        x[1] = -0.0
    return x


def in_tiny_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [numel]: the element's group has no regular element of magnitude >= TINY_LIMIT."""
    magnitude = x.float().abs().nan_to_num(0.0)
    pad = (-x.numel()) % group_size
    largest = torch.cat([magnitude, magnitude.new_zeros(pad)]).view(-1, group_size).amax(dim=1)
    return (largest < TINY_LIMIT).repeat_interleave(group_size)[:x.numel()]


def _decoded(x: torch.Tensor, bits: int, group_size: int, stochastic: bool) -> torch.Tensor:
    payload, index, value = reference.encode_flat(x, bits, group_size, stochastic, 7)
    return reference.decode_flat(payload, x.numel(), bits, group_size, x.dtype, index, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_denormal_groups_round_trip_exactly(dtype, bits):
    x = (torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) * 1e-40).to(dtype).view(-1)
    assert bool((x.abs() < 2.0**-126).any())  # really denormals
    for stochastic in (False, True):
        y = _decoded(x, bits, 16, stochastic)
        assert torch.equal(y, x)  # every value back, not the group's minimum everywhere


def test_a_group_just_below_the_limit_is_exact_and_one_at_the_limit_is_quantized():
    below = torch.linspace(0, TINY_LIMIT, 64)[:-1]  # largest magnitude just under 2**-100
    payload, index, value = reference.encode_flat(below, 2, 64, False, 0)
    assert index.tolist() == list(range(1, 63)) and torch.equal(value, below[1:])  # the zero stays a code
    at = torch.linspace(0, TINY_LIMIT, 64)
    assert reference.encode_flat(at, 2, 64, False, 0)[1] is None


@pytest.mark.parametrize("x", [
    torch.zeros(5000), -torch.zeros(5000), torch.randn(5000), torch.randn(5000).relu(),
    torch.cat([torch.full((100,), 1.0), torch.full((156,), 1e-40)]),  # denormals beside a normal value
], ids=["zeros", "negative-zeros", "randn", "relu", "denormals-beside-1"])
def test_zero_groups_and_ordinary_data_make_no_exceptions(x):
    for bits in BITS:
        assert reference.encode_flat(x, bits, 256, True, 0)[1] is None
        assert reference.exception_table(x, 256) == (None, None)
        payload, ok = torch.ops.daf.format1_encode(x, bits, 256, True, 0)
        assert bool(ok)


def test_the_exception_table_is_the_encoders_side_table():
    x = tiny_mix(5000, 64)
    _, index, value = reference.encode_flat(x, 2, 64, False, 0)
    table_index, table_value = reference.exception_table(x, 64)
    assert torch.equal(index, table_index) and torch.allclose(value, table_value, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_native_gives_the_reference_bytes_and_table_for_tiny_groups(native, dtype, bits):
    for numel, group_size in ((4099, 64), (20001, 4096), (70000, 256)):
        x = tiny_mix(numel, group_size, numel).to(dtype)
        for stochastic in (False, True):
            expected = reference.encode_flat(x, bits, group_size, stochastic, 99)
            for strategy in STRATEGIES:
                got = native.encode_flat(x, bits, group_size, stochastic, 99, strategy)
                assert torch.equal(got[0], expected[0]), (numel, group_size, stochastic, strategy)
                if dtype == torch.float16:  # 1e-40 is 0 in float16: nothing tiny, only the NaN
                    continue
                assert torch.equal(got[1], expected[1])
                assert torch.allclose(got[2], expected[2], equal_nan=True)
        decoded = native.decode_flat(*expected[:1], numel, bits, group_size, dtype, *expected[1:])
        tiny = in_tiny_groups(x, group_size) & (x != 0) & ~torch.isnan(x)
        assert int(tiny.sum()) > 0 or dtype == torch.float16
        assert torch.equal(decoded[tiny], x[tiny])  # denormals and tiny ones come back exactly


def test_the_op_reports_tiny_groups_as_not_ok(extension):
    x = torch.randn(4096) * 1e-40
    payload, ok = torch.ops.daf.format1_encode(x, 2, 256, False, 0)
    assert not bool(ok)
    got = ops.encode_flat(x, 2, 256, False, 0)
    assert torch.equal(got[1], torch.nonzero(x).view(-1)) and torch.equal(got[2], x[x != 0])


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 3000), log_group=st.integers(4, 9), bits=st.sampled_from(BITS),
       stochastic=st.booleans(), exponent=st.integers(-149, -60), seed=st.integers(0, 2**16))
def test_native_matches_the_reference_around_the_limit(extension, numel, log_group, bits, stochastic, exponent,
                                                       seed):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 2.0**exponent
    x[::7] = 0.0
    expected = reference.encode_flat(x, bits, 2**log_group, stochastic, seed)
    got = ops.encode_flat(x, bits, 2**log_group, stochastic, seed)
    assert torch.equal(got[0], expected[0])
    assert (got[1] is None) == (expected[1] is None)
    if got[1] is not None:
        assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
    if exponent < -110:  # every nonzero group is tiny: exact round trip
        assert torch.equal(ops.decode_flat(got[0], numel, bits, 2**log_group, x.dtype, got[1], got[2]), x)
