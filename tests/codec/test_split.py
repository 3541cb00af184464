"""A norm's input split by the ReLU mask after it (``daf.codec.split``): codes where the mask is set, group
means elsewhere; the mask read from ReLU's own record; nothing returned that the record does not hold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.codec import Codecs, Spec
from daf.codec.mask import encode_relu_mask
from daf.codec.split import SplitPacked, decode_split, encode_split, split_means
from daf.config import Config
from daf.format import flatten_memory_order, restore_memory_order

GROUP = 256


def _codecs() -> Codecs:
    return Codecs(Config(rounding="nearest"))


def _reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What a split record by the mask ``x > 0`` decodes to, by its definition: nearest codes of the masked-in
    elements (as a 1-D tensor, in memory order) and the mean of each run of 256 others."""
    codecs = _codecs()
    flat, order = flatten_memory_order(x)
    mask = flat > 0
    out = torch.empty_like(flat)
    kept = flat[mask]
    out[mask] = codecs.decode(codecs.encode("codes", kept, Spec(bits))) if kept.numel() else kept
    others = flat[~mask]
    means = [others[i:i + GROUP].mean() for i in range(0, others.numel(), GROUP)]
    out[~mask] = torch.stack(means).repeat_interleave(GROUP)[:others.numel()] if means else others
    return restore_memory_order(out, tuple(x.shape), order)


def _split_round_trip(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, SplitPacked]:
    relu = encode_relu_mask(torch.relu(x))  # ReLU of x itself: the mask is x > 0
    codecs = _codecs()
    packed = codecs.encode_split(x, relu, Spec(bits))
    return codecs.decode_with_mask(packed, relu, "s"), packed


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(7,), (3, 5, 11, 13), (2, 8, 16, 16), (1000,)]),
       layout=st.sampled_from(["contiguous", "channels_last", "transposed"]),
       bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16), positive=st.floats(0.0, 1.0))
def test_the_record_decodes_to_its_definition(shape, layout, bits, seed, positive):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + (positive - 0.5) * 4
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed" and x.dim() == 4:
        x = x.transpose(2, 3)
    got, packed = _split_round_trip(x, bits)
    assert got.shape == x.shape and got.stride() == x.stride() and got.dtype == x.dtype
    torch.testing.assert_close(got, _reference(x, bits), rtol=0, atol=1e-6)
    assert packed.bits == bits and packed.numel == int((x > 0).sum()) and packed.full_shape == tuple(x.shape)


def test_codes_where_the_mask_passes_and_group_means_elsewhere():
    x = torch.cat([torch.linspace(0.1, 1.0, 300), -torch.arange(1.0, 301.0)]).view(2, 300)
    got, packed = _split_round_trip(x, 8)
    assert (got[0] - x[0]).abs().max() < 0.9 / 255  # 8-bit codes of the positives
    others = -torch.arange(1.0, 301.0)
    assert torch.equal(got[1], torch.cat([others[:256].mean().expand(256), others[256:].mean().expand(44)]))
    assert packed.negative_means.dtype == torch.float32 and packed.negative_means.numel() == 2
    assert packed.nbytes == packed.payload.nbytes + packed.negative_means.nbytes


def test_about_the_bytes_of_plain_codes_at_half_the_width():
    """With about half of the elements masked in, codes at 4 bits cost what plain 2-bit codes cost."""
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    _, packed = _split_round_trip(x, 4)
    plain = _codecs().encode("codes", x, Spec(2))
    assert 0.9 < packed.nbytes / plain.nbytes < 1.1


def test_a_mask_that_does_not_match_the_record_raises_naming_the_site():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    codecs = _codecs()
    packed = codecs.encode_split(x, encode_relu_mask(torch.relu(x)), Spec(4))
    other = encode_relu_mask(torch.relu(x + 0.5))
    with pytest.raises(RuntimeError, match="site s7 .* refusing to return wrong data"):
        codecs.decode_with_mask(packed, other, "s7")
    with pytest.raises(RuntimeError, match="refusing"):
        decode_split(packed, encode_relu_mask(torch.relu(torch.randn(10))), codecs.decode, "s7")


def test_bad_masks_and_infinite_others():
    x = torch.randn(10, 10)
    with pytest.raises(ValueError, match=r"a mask of x's shape \[10, 10\]"):
        encode_split(x, encode_relu_mask(torch.relu(x[:5])), lambda flat: None, GROUP)
    with pytest.raises(ValueError, match="memory order"):
        encode_split(x, encode_relu_mask(torch.relu(x).t().contiguous().t()), lambda flat: None, GROUP)
    x[x <= 0] = -float("inf")  # plain codes keep such a tensor (as exceptions)
    assert _codecs().encode_split(x, encode_relu_mask(torch.relu(x)), Spec(4)) is None


def test_no_masked_in_or_no_other_elements():
    for x in (-torch.rand(3, 500) - 0.1, torch.rand(3, 500) + 0.1):
        got, packed = _split_round_trip(x, 4)
        torch.testing.assert_close(got, _reference(x, 4), rtol=0, atol=1e-6)


def test_demotion_recodes_the_codes_and_keeps_the_means():
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2))
    codecs = _codecs()
    relu = encode_relu_mask(torch.relu(x))
    packed = codecs.encode_split(x, relu, Spec(4))
    demoted = codecs.reencode(packed, 2, seed=3)
    assert isinstance(demoted, SplitPacked) and demoted.bits == 2 and demoted.negative_means is packed.negative_means
    assert demoted.payload.nbytes < packed.payload.nbytes
    got = codecs.decode_with_mask(demoted, relu, "s")
    assert torch.equal(got[x <= 0], codecs.decode_with_mask(packed, relu, "s")[x <= 0])
    assert ((got - x)[x > 0]).abs().max() < 1.01 * (x.max() - 0) / 3


def test_decode_without_the_mask_is_refused():
    x = torch.randn(600)
    packed = _codecs().encode_split(x, encode_relu_mask(torch.relu(x)), Spec(4))
    with pytest.raises(TypeError, match="decode_with_mask"):
        _codecs().decode(packed)


def test_split_means_of_a_short_last_run():
    values = torch.arange(10.0)
    assert torch.equal(split_means(values, 4), torch.tensor([1.5, 5.5, 8.5]))
    assert split_means(values[:0], 4).numel() == 0


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) if isinstance(getattr(a, f), torch.Tensor)
               else getattr(a, f) == getattr(b, f)
               for f in ("payload", "shape", "order", "dtype", "bits", "group_size", "full_shape", "full_order",
                         "negative_means")) and ((a.exc_index is None) == (b.exc_index is None))


@settings(max_examples=30, deadline=None)
@given(shape=st.sampled_from([(7,), (3, 5, 11, 13), (2, 8, 16, 16), (5000,)]),
       layout=st.sampled_from(["contiguous", "channels_last"]), held_group=st.sampled_from([16, 64, 256]),
       chunk=st.sampled_from([1, 256, 1000, 1 << 20]), seed=st.integers(0, 2**16), special=st.booleans())
def test_splitting_held_codes_chunk_by_chunk_is_splitting_them_decoded_whole(shape, layout, held_group, chunk, seed,
                                                                              special):
    """``encode_split_codes`` decodes the held 8-bit codes a chunk at a time into the two halves; the record is the
    one ``encode_split`` makes from the whole tensor decoded, byte for byte (exceptions, a short last group and
    chunks of one group included)."""
    from daf.codec.split import encode_split_codes

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    if special and x.numel() > 3:
        x.view(-1)[1], x.view(-1)[2] = float("nan"), 1e38  # exceptions of the held codes
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    codecs = Codecs(Config(rounding="nearest", group_size=held_group))
    held = codecs.encode_held(x, 8)
    relu = encode_relu_mask(torch.relu(codecs.decode(held)))
    spec = Spec(4)
    whole = encode_split(codecs.decode(held), relu, lambda flat: _codecs().encode("codes", flat, spec), GROUP)
    chunked = encode_split_codes(held, relu, codecs.decode, lambda flat: _codecs().encode("codes", flat, spec), GROUP,
                                 chunk=chunk)
    assert (whole is None) == (chunked is None)
    if whole is not None:
        assert _same(whole, chunked)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1001])
def test_mask_count_counts_the_set_bits_among_the_first_n(n):
    from daf.codec.split import mask_count

    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.4
    payload = encode_relu_mask(torch.where(bits, 1.0, -1.0).relu()).payload if n else torch.zeros(1, dtype=torch.uint8)
    assert mask_count(payload, n) == int(bits.sum())
