"""The CPU bit packing (numpy's packbits/unpackbits) against the plain-PyTorch slices, byte for byte,
and the mask codec across slice edges."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.codec import mask
from daf.kernels import mask_reference


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16))
def test_pack_and_unpack_match_the_reference(n, seed):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5
    packed = mask_reference.pack_slice_numpy(bits)
    assert torch.equal(packed, mask_reference.pack_slice_torch(bits))
    assert torch.equal(mask_reference.unpack_slice_numpy(packed, n), bits)
    assert torch.equal(mask_reference.unpack_slice_torch(packed, n), bits)


def test_a_relu_mask_across_slice_edges_decodes_to_its_bits(monkeypatch):
    monkeypatch.setattr(mask_reference, "CHUNK", 64)
    x = torch.randn(3, 7, 11)
    x[0, 0, :3] = torch.tensor([-0.0, float("nan"), 0.0])
    decoded = mask.decode_mask(mask.encode_relu_mask(x))
    assert torch.equal(decoded, (x <= 0).logical_not().float())
    assert torch.equal(mask.mask_bits(mask.encode_relu_mask(x)), (x <= 0).logical_not().flatten())


def test_two_values_with_a_negative_zero_keep_their_bit_patterns():
    x = torch.tensor([-0.0, 1.0, 1.0, -0.0] * 300)
    decoded = mask.decode_mask(mask.encode_mask(x, mask.two_values(x)))
    assert torch.equal(decoded.view(torch.int32), x.view(torch.int32))
