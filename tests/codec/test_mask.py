"""1-bit masks: lossless for two-valued tensors, ReLU's saves stored as masks, gradients exact."""

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import daf
from daf.codec.mask import decode_mask, decode_relu_mask, encode_mask, encode_relu_mask, mask_bytes, two_values


def _bits(t):
    return t if t.dtype == torch.bool else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool])
@pytest.mark.parametrize("numel", [1, 7, 8, 4095, 10001])
def test_two_valued_round_trip_is_bit_exact(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    keep = torch.rand(numel, generator=g) > 0.3
    x = keep if dtype == torch.bool else (keep.to(dtype) / 0.9).to(dtype)
    values = two_values(x)
    assert values is not None
    packed = encode_mask(x, values)
    assert packed.payload.numel() == mask_bytes(numel) and packed.bits == 1
    y = decode_mask(packed)
    assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(_bits(y), _bits(x))


def test_signed_zero_nan_constant_and_channels_last():
    for x in (torch.tensor([-0.0, 0.0, 0.0, -0.0]), torch.tensor([1.0, float("nan"), 1.0]), torch.full((9,), 3.0)):
        y = decode_mask(encode_mask(x, two_values(x)))
        assert torch.equal(torch.signbit(y), torch.signbit(x)) and torch.equal(torch.isnan(y), torch.isnan(x))
    x = (torch.rand(2, 3, 5, 5) > 0.5).float().to(memory_format=torch.channels_last)
    y = decode_mask(encode_mask(x, two_values(x)))
    assert torch.equal(y, x) and y.stride() == x.stride()


@pytest.mark.parametrize("shape", [(2, 8, 5, 5), (3, 3, 5, 5), (2, 3, 4)])
@pytest.mark.parametrize("saved", [torch.contiguous_format, torch.channels_last])
def test_decoded_channels_last_when_asked(shape, saved):
    """A 4-D mask saved NCHW comes back channels-last (the layout backward restores); other ranks, and
    a mask saved channels-last, come back as saved."""
    x = torch.randn(shape)
    if len(shape) == 4:
        x = x.contiguous(memory_format=saved)
    relu = x.relu()
    two = (relu > 0) * 2.5
    for y, want in ((decode_relu_mask(encode_relu_mask(relu), channels_last=True), (relu > 0).to(relu.dtype)),
                    (decode_mask(encode_mask(two, two_values(two)), channels_last=True), two)):
        assert torch.equal(y, want)
        if len(shape) == 4:
            assert y.is_contiguous(memory_format=torch.channels_last)
        else:
            assert y.stride() == want.stride()


def test_more_than_two_values_is_refused():
    assert two_values(torch.randn(100)) is None
    x = torch.zeros(10000)
    x[-1] = 2.0
    x[-2] = 3.0  # the third value is past the first 4096 elements
    assert two_values(x) is None
    assert two_values(torch.arange(10)) is None  # integers are not masks
    with pytest.raises(ValueError, match="two values"):
        encode_mask(torch.randn(4), None)
    with pytest.raises(ValueError, match="floating-point"):
        encode_relu_mask(torch.ones(4, dtype=torch.int32))


def _patterns(x):
    """The distinct bit patterns of ``x``, by definition."""
    return set(_bits(x.resolve_neg().contiguous()).reshape(-1).tolist())


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.bool]),
       st.sampled_from(["contiguous", "transposed", "channels_last", "sliced", "expanded", "negative_view"]),
       st.integers(1, 3))
def test_two_values_is_its_definition_on_every_kind_of_view(seed, dtype, view, kinds):
    """The first elements are read as raw bytes where the tensor is dense: a transpose or channels-last
    (memory order), a slice and an expand (not dense: flattened first) and a negative view (its bytes
    are not its values) must all give what the values say."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, kinds, (2, 3, 6, 5), generator=g)
    x = base.bool() if dtype == torch.bool else (base.to(dtype) * 1.5).to(dtype)
    if view == "transposed":
        x = x.transpose(1, 3)
    elif view == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif view == "sliced":  # a third value between the view's first elements in memory
        x = x.clone()
        x[..., 2:] = True if dtype == torch.bool else 7.0
        x = x[..., :2]
    elif view == "expanded":
        x = x.clone()
        x[..., 1:] = True if dtype == torch.bool else 7.0
        x = x[..., :1].expand(2, 3, 6, 4)
    elif view == "negative_view" and dtype != torch.bool:
        x = torch._neg_view(x)
    values = two_values(x)
    assert (values is not None) == (len(_patterns(x)) <= 2)
    if values is not None:
        assert torch.equal(_bits(decode_mask(encode_mask(x, values))), _bits(x.resolve_neg().contiguous()))


def test_relu_mask_keeps_only_the_sign():
    x = torch.tensor([0.0, 0.5, 0.0, 2.0])
    assert torch.equal(decode_mask(encode_relu_mask(x)), torch.tensor([0.0, 1.0, 0.0, 1.0]))


def test_relu_mask_is_threshold_backwards_bit_nan_included():
    """``threshold_backward`` zeroes the gradient only where ``result <= 0``: a NaN output passes it,
    so its bit is set (``result > 0`` would be false there and drop that gradient)."""
    import daf.codec.mask as mask
    x = torch.tensor([float("nan"), 0.0, -0.0, 1.5, float("inf"), 0.0, float("nan"), 2.0, 0.0])
    passes = torch.tensor([True, False, False, True, True, False, True, True, False])
    packed = encode_relu_mask(x)
    assert torch.equal(mask.mask_bits(packed), passes)
    assert torch.equal(decode_mask(packed), passes.float())
    grad = torch.arange(1.0, 10.0)
    assert torch.equal(torch.ops.aten.threshold_backward(grad, decode_mask(packed), 0),
                       torch.ops.aten.threshold_backward(grad, x, 0))


class ReluNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 10)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = F.relu(self.a(x))           # relu saves h (mask), self.b saves h (values)
        h = self.drop(h)                # dropout saves its two-valued noise (mask)
        return self.b(F.relu(h) * 1.0)  # this relu's output is only read by its backward and a mul


def test_masks_are_exact_where_backward_reads_only_a_mask():
    torch.manual_seed(0)
    model, x = ReluNet(), torch.randn(32, 64)
    torch.manual_seed(1)
    model(x).square().sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # 8-bit values everywhere; masks are exact, so the gradient differs only by the 8-bit rounding
    daf.wrap(model, bits=8, min_numel=1)
    torch.manual_seed(1)
    model(x).square().sum().backward()
    rows = daf.report(model).rows
    masks = [r for r in rows if r.kind == "mask"]
    assert len(masks) >= 3 and all(r.stored_bytes == -(-r.raw_bytes // 4 // 8) for r in masks)
    for p, ref in zip(model.parameters(), reference):
        assert float((p.grad - ref).norm() / ref.norm()) < 0.02


def test_masks_off_keeps_the_old_rows():
    model = daf.wrap(ReluNet(), bits=2, min_numel=1, masks=False)
    model(torch.randn(8, 64)).sum().backward()
    assert all(r.kind != "mask" for r in daf.report(model).rows)


def test_relu_mask_not_used_for_an_outside_relu_output():
    """A ReLU output made before the hooks and saved inside by a linear layer needs its values."""
    lin = nn.Linear(16, 16)
    h = torch.relu(torch.randn(64, 16, requires_grad=True))
    with daf.compress(lin, min_numel=1, bits=8) as session:
        out = lin(h)
    assert [r.kind for r in daf.report(session).rows if r.shape == (64, 16)] == ["compressed"]
    out.sum().backward()


def test_masks_with_checkpointing_and_nested_compress():
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return checkpoint(lambda t: self.b(F.relu(self.a(t))), x, use_reentrant=False) + x

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Block(), nn.ReLU(), nn.Linear(32, 4)), torch.randn(64, 16)
    model(x).square().sum().backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    daf.wrap(model, bits=8, min_numel=1)
    model(x).square().sum().backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float((got - reference).norm() / reference.norm()) < 0.02
    assert any(r.kind == "mask" for r in daf.report(model).rows)


def _whole_tensor_pack(bits):
    """The encoders' bytes, computed over the whole tensor at once (the oracle of the sliced passes)."""
    padded = torch.zeros(mask_bytes(bits.numel()) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits
    return (padded.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


@pytest.mark.parametrize("numel", [1, 7, 64, 65, 130, 1000, 4099])
def test_sliced_passes_give_the_whole_tensor_bytes_across_slice_edges(monkeypatch, numel):
    import daf.codec.mask as mask
    import daf.kernels.mask_reference as reference
    monkeypatch.setattr(reference, "CHUNK", 64)
    monkeypatch.setattr(reference, "SAMPLE", 16)
    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator)
    relu = x.clamp(min=0)
    packed = encode_relu_mask(relu)
    assert torch.equal(packed.payload, _whole_tensor_pack(relu > 0))
    assert torch.equal(decode_mask(packed), (relu > 0).float())
    assert torch.equal(mask.mask_bits(packed), relu > 0)
    dropout = (torch.rand(numel, generator=generator) > 0.5).float() * 2.0
    values = two_values(dropout)
    assert values is not None and set(values) <= {0.0, 2.0}
    assert torch.equal(decode_mask(encode_mask(dropout, values)), dropout)
    if numel > 20:  # a third value beyond the sample and past the first slice is found
        third = dropout.clone()
        third[-1] = 3.0
        assert two_values(third) is None


def test_two_values_of_a_constant_tensor_longer_than_a_slice(monkeypatch):
    import daf.kernels.mask_reference as reference
    monkeypatch.setattr(reference, "CHUNK", 64)
    x = torch.full((1000,), -0.0)
    assert two_values(x) == (-0.0, -0.0)
    x[999] = 0.0  # +0.0 differs from -0.0 bit for bit
    low, high = two_values(x)
    assert str(low) == "-0.0" and str(high) == "0.0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_relu_mask_comes_back_as_0_1_in_the_outputs_dtype_and_threshold_backward_reads_it_like_the_output(dtype):
    x = torch.randn(4, 6, 5, 5, dtype=dtype, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0, 0] = float("nan")
    result = torch.relu(x).contiguous(memory_format=torch.channels_last)
    restored = daf.codec.Codecs(daf.Config()).decode(encode_relu_mask(result))
    # the output's dtype: threshold_backward would cast a bool mask to it, a full-size copy in the call
    assert restored.dtype == dtype and set(restored.unique().tolist()) <= {0.0, 1.0}
    assert restored.shape == result.shape and restored.stride() == result.stride()
    grad = torch.randn_like(result)
    assert torch.equal(torch.ops.aten.threshold_backward(grad, restored, 0),
                       torch.ops.aten.threshold_backward(grad, result, 0))


def test_relu_mask_trains_and_double_backward_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    x = torch.randn(64, 64, requires_grad=True)
    (plain,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    daf.wrap(model, bits=8, min_numel=1)
    try:
        (wrapped,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        assert F.cosine_similarity(plain.flatten(), wrapped.flatten(), dim=0) > 0.999
        wrapped.square().sum().backward()  # backward through ReLU's backward, whose mask is restored 0/1
        assert torch.isfinite(x.grad).all()
    finally:
        daf.unwrap(model)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, 2.0, float("nan"), float("inf")]), min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_two_values_agrees_with_the_set_of_bit_patterns(values, dtype):
    """Wherever a third bit pattern sits (in the first 16 elements, which refuse without the sample's
    scan, or after them), two_values says None exactly when the tensor has more than two."""
    x = torch.tensor(values, dtype=dtype)
    patterns = set(x.view({torch.float32: torch.int32, torch.float16: torch.int16,
                           torch.bfloat16: torch.int16}[dtype]).tolist())
    found = two_values(x)
    assert (found is None) == (len(patterns) > 2)
    if found is not None:
        assert torch.equal(decode_mask(encode_mask(x, found)).view(torch.uint8), x.view(torch.uint8))
