"""Native kernels against the reference codec: same bytes, same decoded values, either way round."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.kernels import reference
from daf.kernels.autotune import Autotuner
from daf.kernels.backend import STRATEGIES, NativeBackend

BITS = [1, 2, 4, 8]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Lengths that do not divide the group sizes, shorter than one group, and one of several blocks.
# 20001 with group 4096 makes groups longer than the kernels' 2048-element blocks and a short last one.
LENGTHS = [1, 15, 257, 4099, 20001]
GROUP_SIZES = [16, 64, 256, 4096]


def sample(numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * 3 + 1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_same_bytes_and_values_as_reference(native, dtype, bits):
    """Both roundings, both strategies; then each decodes the other's payload to the same values."""
    for numel in LENGTHS:
        x = sample(numel, dtype, numel)
        for group_size in GROUP_SIZES:
            for stochastic in (False, True):
                expected = reference.encode_flat(x, bits, group_size, stochastic, 1234)[0]
                for strategy in STRATEGIES:
                    payload, exc_index, exc_value = native.encode_flat(x, bits, group_size, stochastic, 1234, strategy)
                    assert exc_index is None and exc_value is None
                    assert torch.equal(payload, expected), (numel, group_size, stochastic, strategy)
            values = reference.decode_flat(expected, numel, bits, group_size, dtype)
            assert values.dtype == dtype
            assert torch.equal(native.decode_flat(expected, numel, bits, group_size, dtype), values)
            assert torch.equal(reference.decode_flat(payload, numel, bits, group_size, dtype), values)


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 3000), log_group=st.integers(4, 10), bits=st.sampled_from(BITS),
       stochastic=st.booleans(), seed=st.integers(0, 2**63 - 1), scale=st.floats(1e-30, 1e30))
def test_same_bytes_on_random_shapes_scales_and_seeds(extension, numel, log_group, bits, stochastic, seed, scale):
    native = NativeBackend(Autotuner(os.devnull, repeats=1))  # below the tuning size: never written
    x = torch.randn(numel) * scale
    expected = reference.encode_flat(x, bits, 2**log_group, stochastic, seed)[0]
    assert torch.equal(native.encode_flat(x, bits, 2**log_group, stochastic, seed)[0], expected)


def test_signed_zeros_and_constant_groups_give_the_reference_bytes(native):
    x = torch.zeros(4096)
    x[::3] = -0.0
    x[1000:1100] = -0.0
    x[3000:] = 2.5
    x[5] = 1e-40  # subnormal
    for stochastic in (False, True):
        assert torch.equal(native.encode_flat(x, 2, 256, stochastic, 0)[0],
                           reference.encode_flat(x, 2, 256, stochastic, 0)[0])


def test_exceptional_values_fall_back_to_the_reference_whole(native):
    x = torch.randn(5000)
    x[[17, 300, 4000, 4999]] = torch.tensor([float("nan"), float("inf"), 3e38, -float("inf")])
    got = native.encode_flat(x, 4, 256, True, 3)
    expected = reference.encode_flat(x, 4, 256, True, 3)
    assert native.fallbacks == 1
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.allclose(got[2], expected[2], equal_nan=True)
    y = native.decode_flat(got[0], 5000, 4, 256, torch.float32, got[1], got[2])
    assert math.isnan(y[17]) and y[300] == float("inf") and y[4999] == -float("inf") and y[4000] == x[4000]


@pytest.mark.parametrize("bits", [1, 2])
def test_stochastic_rounding_is_unbiased(native, bits):
    # Range [0, 2**bits - 1] gives step 1; every other value sits a third of a step above level 0,
    # where nearest rounding is biased by -1/3 and stochastic rounding is not.
    x = torch.full((4096,), 1.0 / 3.0)
    x[0], x[1] = 0.0, float(2**bits - 1)

    def decoded_mean(stochastic, seed):
        payload = native.encode_flat(x, bits, 4096, stochastic, seed)[0]
        return float(native.decode_flat(payload, 4096, bits, 4096, torch.float32)[2:].mean())

    trials = 50
    mean = sum(decoded_mean(True, s) for s in range(trials)) / trials
    stderr = 0.5 / math.sqrt(4094 * trials)  # Bernoulli draws of a unit step
    assert abs(mean - 1.0 / 3.0) < 5 * stderr
    assert abs(decoded_mean(False, 0) - 1.0 / 3.0) > 20 * stderr  # the test can tell a biased rounding


def test_stochastic_error_is_below_one_step(native):
    x = torch.randn(10000)
    for bits in BITS:
        payload = native.encode_flat(x, bits, 64, True, 11)[0]
        step = payload.view(-1, 4 + 64 * bits // 8)[:, 2:4].contiguous().view(torch.bfloat16).float()
        err = (native.decode_flat(payload, 10000, bits, 64, torch.float32) - x).abs()
        assert bool((err < step.repeat_interleave(64)[:10000] * (1 + 1e-5)).all())


def test_same_seed_same_bytes_other_seed_other_bytes(native):
    x = torch.randn(100_000)
    a, b, c = (native.encode_flat(x, 2, 256, True, s)[0] for s in (5, 5, 6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # The seed enters as its low 32 bits, as in the reference.
    assert torch.equal(native.encode_flat(x, 2, 256, True, 5 + 2**32)[0], a)


def test_inputs_the_kernels_do_not_take_go_to_the_reference(native):
    x64 = torch.randn(1000, dtype=torch.float64)
    assert torch.equal(native.encode_flat(x64, 2, 256, False, 0)[0], reference.encode_flat(x64, 2, 256, False, 0)[0])
    x = torch.randn(1000)
    assert torch.equal(native.encode_flat(x, 2, 100, False, 0)[0], reference.encode_flat(x, 2, 100, False, 0)[0])
    payload = native.encode_flat(x, 2, 256, False, 0)[0]
    assert native.decode_flat(payload, 1000, 2, 256, torch.float64).dtype == torch.float64


def test_bad_arguments_are_refused(native):
    x = torch.randn(100)
    with pytest.raises(ValueError, match="bits must be one of"):
        native.encode_flat(x, 3, 16, False, 0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        native.encode_flat(x, 2, 16, False, 0, strategy="fastest")
    payload = native.encode_flat(x, 2, 16, False, 0)[0]
    with pytest.raises(ValueError, match=r"payload must be uint8 \[56\] for 100 values.*got torch.uint8 \[55\]"):
        native.decode_flat(payload[:-1], 100, 2, 16, torch.float32)


def test_decode_into_a_given_tensor(native):
    x = torch.randn(3, 1000)
    payload = native.encode_flat(x.view(-1), 4, 256, True, 2)[0]
    out = torch.empty(3, 1000)
    assert native.decode_flat(payload, 3000, 4, 256, torch.float32, out=out) is out
    assert torch.equal(out.view(-1), reference.decode_flat(payload, 3000, 4, 256, torch.float32))
    with pytest.raises(ValueError, match="out must be a contiguous CPU torch.float32 tensor of 3000"):
        native.decode_flat(payload, 3000, 4, 256, torch.float32, out=torch.empty(3000, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        native.decode_flat(payload, 3000, 4, 256, torch.float32, out=torch.empty(1000, 3).t())


def test_empty_tensor(native):
    payload, _, _ = native.encode_flat(torch.empty(0), 2, 256, True, 0)
    assert payload.numel() == 0
    assert native.decode_flat(payload, 0, 2, 256, torch.float32).numel() == 0
