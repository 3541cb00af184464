"""The reference codec against the format's promises: error bounds, unbiasedness, exact layout."""

import math

import pytest
import torch

from daf.codec import decode, encode
from daf.codec.reference import decode_flat, encode_flat, round_down_bf16, round_up_bf16, uniform_noise
from daf.format import payload_bytes

BITS = [1, 2, 4, 8]


def steps_of(packed):
    """Per-element step (the decoded scale) of a packed float tensor, in memory order."""
    rows = packed.payload.view(-1, packed.payload.numel() // -(-packed.numel // packed.group_size))
    step = rows[:, 2:4].contiguous().view(torch.bfloat16).float()
    return step.repeat_interleave(packed.group_size)[: packed.numel]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [16, 64, 256])
@pytest.mark.parametrize("numel", [1, 15, 257, 1000, 4099])
def test_nearest_error_is_at_most_half_a_step(bits, group_size, numel):
    torch.manual_seed(bits * 100_003 + group_size * 101 + numel)
    x = torch.randn(numel) * 3 + 1
    packed = encode(x, bits, group_size, "nearest")
    assert packed.payload.numel() == payload_bytes(numel, bits, group_size)
    err = (decode(packed) - x).abs()
    # float32 rounding of q * step + lo adds up to a few ulps of |x| on top of the half step
    assert bool((err <= steps_of(packed) * 0.5 * (1 + 1e-5) + x.abs() * 2**-21).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [100, 1000, 4099])
def test_stochastic_error_is_below_one_step(bits, numel):
    torch.manual_seed(bits * 7 + numel)
    x = torch.randn(numel)
    packed = encode(x, bits, 64, "stochastic", seed=3)
    assert bool(((decode(packed) - x).abs() < steps_of(packed) * (1 + 1e-5)).all())


@pytest.mark.parametrize("bits", [1, 2])
def test_stochastic_rounding_is_unbiased(bits):
    # Values placed at 1/3 of a step: nearest rounding is biased by -1/3 step there, stochastic is not.
    torch.manual_seed(0)
    x = torch.zeros(64)
    x[0], x[1] = 0.0, 3.0
    x[2:] = 1.0  # at 2 bits step is 1 and 1.0 is exact; shift to a third of a step
    x[2:] = 1.0 / 3.0 if bits == 2 else 1.0
    trials = 400
    mean = sum(decode(encode(x, bits, 64, "stochastic", seed=s))[2:].mean() for s in range(trials)) / trials
    step = float(steps_of(encode(x, bits, 64, "nearest"))[0])
    biased = float(decode(encode(x, bits, 64, "nearest"))[2:].mean())
    # Standard error of the mean of Bernoulli draws scaled by step, over 62 * trials samples.
    stderr = step * 0.5 / math.sqrt(62 * trials)
    assert abs(float(mean) - float(x[2])) < 5 * stderr
    assert abs(biased - float(x[2])) > 20 * stderr  # the test can tell a biased rounding


def test_same_seed_same_bytes_other_seed_other_bytes():
    x = torch.randn(5000)
    a, b, c = (encode(x, 2, 256, "stochastic", seed=s).payload for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_noise_is_uniform_and_counter_based():
    u = uniform_noise(7, 0, 200_000)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.equal(uniform_noise(7, 1000, 10), u[1000:1010])


def test_layout_of_one_group_byte_for_byte():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0] * 4)  # 16 elements, range 3 -> step 1 at 2 bits
    payload = encode(x, 2, 16, "nearest").payload
    assert payload[:2].view(torch.bfloat16).item() == 0.0
    assert payload[2:4].view(torch.bfloat16).item() == 1.0
    # element j in bits (j % 4) * 2 of byte j // 4: codes 0,1,2,3 -> 0b11100100
    assert payload[4:].tolist() == [0b11100100] * 4


@pytest.mark.parametrize("numel", [1, 8, 9])
def test_rows_of_an_odd_byte_count_decode(numel):
    """1 bit in groups of 8: 5-byte rows. One such row once failed to decode (its meta bytes were
    viewed as bfloat16 with the row's stride)."""
    x = torch.linspace(-1, 1, numel)
    flat = decode_flat(*encode_flat(x, 1, 8, False, 0)[:1], numel, 1, 8, torch.float32)
    assert flat.shape == (numel,) and (flat - x).abs().max() <= 2.0 + 1e-6


def test_bf16_rounding_directions():
    x = torch.tensor([1.00001, -1.00001, 3.0, -3.0, 0.0, 1e-30, -1e-30])
    down, up = round_down_bf16(x), round_up_bf16(x.abs())
    assert bool((down <= x).all()) and bool((up >= x.abs()).all())
    assert torch.equal(down.to(torch.bfloat16).float(), down) and torch.equal(up.to(torch.bfloat16).float(), up)
    assert down[2] == 3.0 and up[2] == 3.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_round_trip(dtype):
    x = torch.randn(3000).to(dtype)
    y = decode(encode(x, 8, 256, "nearest"))
    assert y.dtype == dtype and float((y.double() - x.double()).abs().max()) < 0.05


def test_constant_and_tiny_range_groups():
    for value in (0.0, 1.0, -2.5, 1e-40, 3e38 / 4):
        x = torch.full((300,), value)
        for rounding in ("nearest", "stochastic"):
            y = decode(encode(x, 2, 256, rounding))
            # lo is x rounded down to bfloat16 (relative error 2**-8) and the step is at least 2**-126.
            assert float((y - x).abs().max()) <= abs(value) * 2**-7 + 2**-126


def test_nonfinite_values_survive_and_leave_neighbours_intact():
    x = torch.randn(1000)
    clean = x.clone()
    x[[3, 400, 999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[500] = 1e38  # above the exception limit: stored exactly too
    packed = encode(x, 4, 256, "nearest")
    y = decode(packed)
    assert math.isnan(y[3]) and y[400] == float("inf") and y[999] == -float("inf") and y[500] == 1e38
    keep = torch.ones(1000, dtype=torch.bool)
    keep[[3, 400, 500, 999]] = False
    assert float((y[keep] - clean[keep]).abs().max()) < 0.5  # 4-bit error on N(0,1), unaffected by the outliers
    assert packed.exc_index.tolist() == [3, 400, 500, 999]


def test_group_of_only_nonfinite_values():
    x = torch.full((16,), float("nan"))
    assert torch.isnan(decode(encode(x, 2, 16, "nearest"))).all()


@pytest.mark.parametrize("shape", [(0,), (0, 3), ()])
def test_empty_and_zero_dim(shape):
    x = torch.randn(shape)
    y = decode(encode(x, 2, 256))
    assert y.shape == x.shape and (x.numel() == 0 or abs(float(y) - float(x)) <= abs(float(x)) + 1e-6)


def test_channels_last_and_views_come_back_in_their_layout():
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    y = decode(encode(x, 8, 64, "nearest"))
    assert y.is_contiguous(memory_format=torch.channels_last) and float((y - x).abs().max()) < 0.05
    v = torch.randn(10, 40)[:, 5:25]
    assert float((decode(encode(v, 8, 64, "nearest")) - v).abs().max()) < 0.05


@pytest.mark.parametrize("bits", BITS)
def test_auto_rounding_is_stochastic_below_four_bits_and_nearest_from_four(bits):
    torch.manual_seed(bits)
    x = torch.randn(1000)
    chosen, other = ("stochastic", "nearest") if bits < 4 else ("nearest", "stochastic")
    auto = encode(x, bits, 64, "auto", seed=3).payload
    assert torch.equal(auto, encode(x, bits, 64, chosen, seed=3).payload)
    assert not torch.equal(auto, encode(x, bits, 64, other, seed=3).payload)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="floating-point"):
        encode(torch.arange(10), 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        encode(torch.randn(10), 3)
    with pytest.raises(ValueError, match="rounding"):
        encode(torch.randn(10), 2, rounding="floor")
    payload, _, _ = encode_flat(torch.randn(100), 2, 16, False, 0)
    with pytest.raises(ValueError, match="need"):
        decode_flat(payload[:-1], 100, 2, 16, torch.float32)


@pytest.mark.parametrize("chunk_elements", [64, 1000, 1 << 30])
def test_bytes_do_not_depend_on_the_chunk_size(monkeypatch, chunk_elements):
    # Accelerators encode in larger chunks than the CPU (kernels/reference.py chunk_groups): same bytes.
    import daf.kernels.reference as reference
    torch.manual_seed(5)
    x = torch.randn(5000) * 4
    x[[7, 3000]] = torch.tensor([float("nan"), 1e30])
    x[4096:4160] = 1e-41  # a tiny group: its elements go to the side table
    expected = [encode_flat(x, 2, 64, True, 11), decode_flat(encode_flat(x, 2, 64, True, 11)[0], 5000, 2, 64,
                                                               torch.float32)]
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk_elements)
    payload, index, value = encode_flat(x, 2, 64, True, 11)
    assert torch.equal(payload, expected[0][0])
    assert torch.equal(index, expected[0][1])
    assert torch.equal(value.nan_to_num(), expected[0][2].nan_to_num())
    assert torch.equal(decode_flat(payload, 5000, 2, 64, torch.float32), expected[1])
